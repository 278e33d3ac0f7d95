"""VM sessions whose working folders are virtio-fs devices (``share="virtiofs"``, issue 17).

The same session as ``test_vm_session.py`` (Debian's kernel under QEMU 7.2, TCG here; the
session's guest root; commands as ``agent``), but each working folder reaches the guest as a
``vhost-user-fs-pci`` device served from the folder's export — by its confined share-server
child (the default for VM guests) or on the session's own loop (thread share servers) — mounted
``-t virtiofs``: a real program's step undone exactly (tree oracle), a safeguard hold allowed
or denied (the VM paused over QMP meanwhile), a read-only folder refusing writes, and the
guest's ``/proc/mounts`` naming virtiofs for the folders and 9p for an in-memory tree.
Skipped with the reason where QEMU or the guest image cannot be had.
"""

from __future__ import annotations

import os

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.guest import control as proto
from sandbox.session.runtime import Folder, MemoryMount, Session
from sandbox_sim import oracle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600), pytest.mark.usefixtures("vm_guest")]


def run(s: Session, cmd: str) -> tuple[int, str]:
    out: list[str] = []
    r = s.run(cmd, lambda stream, text: out.append(text))
    return r.exit_code, "".join(out)


@pytest.mark.parametrize("share_servers", ["process", "thread"])
def test_folders_over_virtiofs_rm_undone_read_only_refused_and_mounts_seen(sample_project, tmp_path, share_servers):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "keep").write_bytes(b"k")
    before = oracle.snapshot_dir(str(sample_project))
    with Session([Folder(str(sample_project)), Folder(str(ro), read_only=True)], share="virtiofs",
                 mounts=[MemoryMount("/mnt/mem", {"a.txt": b"in memory"})], share_servers=share_servers) as s:
        st = s.status()
        assert st["share"] == "virtiofs" and len(st["share_server_pids"]) == (2 if share_servers == "process" else 0)
        code, mounts = run(s, "cat /proc/mounts")
        assert code == 0
        kinds = {f[1]: (f[2], f[3].split(",")[0]) for f in (ln.split() for ln in mounts.splitlines()) if len(f) > 3}
        assert kinds["/mnt/working/0"] == ("virtiofs", "rw"), mounts
        assert kinds["/mnt/working/1"] == ("virtiofs", "ro"), mounts
        assert kinds["/mnt/mem"][0] == "virtiofs", mounts  # in-memory trees too, served by the agent's own loop
        # every virtio-fs mount reads ahead one full request (init.sh; Linux's default is 128 KiB)
        code, out = run(s, "for m in /mnt/working/0 /mnt/working/1 /mnt/mem; do "
                           "cat /sys/class/bdi/$(mountpoint -d $m)/read_ahead_kb; done")
        assert code == 0 and out.split() == [str(proto.VIRTIOFS_READ_AHEAD_KB)] * 3, out
        code, out = run(s, "cat /mnt/mem/a.txt; ls -l")
        assert code == 0 and "in memory" in out and "agent" in out, out  # the folder owner's files are the guest user's
        code, out = run(s, "rm -rf src && echo gone > README.md && ls")
        assert code == 0 and not (sample_project / "src").exists()
        s.undo(1)
        oracle.assert_same(before, oracle.snapshot_dir(str(sample_project)), "undo of rm -rf over virtio-fs")
        code, out = run(s, "ls src >/dev/null && echo seen")  # the guest sees the restored tree
        assert code == 0 and "seen" in out, out
        code, out = run(s, "echo x > /mnt/working/1/new; cat /mnt/working/1/keep")
        assert "Read-only file system" in out and "k" in out, out
        assert sorted(os.listdir(ro)) == ["keep"]


@pytest.mark.parametrize("answer", ["deny", "allow"])
def test_a_safeguard_hold_over_virtiofs(sample_project, answer):
    victims = sample_project / "victims"
    victims.mkdir()
    for i in range(80):
        (victims / f"v{i:03d}").write_bytes(b"v")
    before = oracle.snapshot_dir(str(sample_project))
    seen = []

    def decide(hold):
        seen.append((hold.kind, 80 - len(os.listdir(victims))))
        return answer

    with Session([Folder(str(sample_project))], share="virtiofs", safeguard=SafeguardConfig(delete_threshold=20),
                 decide=decide) as s:
        r = s.run("rm -rf victims")
        assert s.status()["vm"] == "running"  # resumed after the answer
    assert seen and seen[0] == ("delete", 19)  # no more than 19 deletions reached the host
    if answer == "deny":
        assert r.exit_code != 0
        oracle.assert_same(before, oracle.snapshot_dir(str(sample_project)), "denied rm -rf over virtio-fs")
    else:
        assert r.exit_code == 0 and not victims.exists()


MMAP_SHARED = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    mm = mmap.mmap(fd, 0)  # MAP_SHARED, read-write
except OSError as e:
    print("mmap", os.strerror(e.errno))
    raise SystemExit(0)
os.close(fd)  # the map keeps the file open (its RELEASE comes at munmap)
print("mapped", mm[:].decode())
mm[:1] = mm[:1].upper()
mm.flush()
mm.close()
"""


def test_shared_mmap_beside_write_only_opens_over_virtiofs(sample_project):
    """A write-only open of a file open nowhere else is direct I/O over virtio-fs: ``dd`` writes
    it, and a program that maps a file shared afterwards (Python's ``mmap.mmap(fd, 0)``) still
    can — its open is not direct once the writer closed (the shell's RELEASE reached the server
    before the next OPEN). While a write-only writer is open the map is refused (``ENODEV``,
    Linux 6.1's rule for direct-I/O opens; docs/virtiofs.md "Caching"). Undone exactly."""
    (sample_project / ".mm.py").write_text(MMAP_SHARED)
    before = oracle.snapshot_dir(str(sample_project))
    with Session([Folder(str(sample_project))], share="virtiofs") as s:
        code, out = run(s, "dd if=/dev/zero of=zeros bs=1M count=8 2>/dev/null && printf hello > m.bin && "
                           "python3 .mm.py m.bin && cat m.bin && echo && wc -c < zeros")
        assert code == 0, out
        assert out.split() == ["mapped", "hello", "Hello", str(8 << 20)], out
        code, out = run(s, "exec 3>w.bin; printf abc >&3; python3 .mm.py w.bin; exec 3>&-; python3 .mm.py w.bin")
        assert code == 0, out
        assert out.split("\n")[:2] == ["mmap No such device", "mapped abc"], out
        assert (sample_project / "m.bin").read_bytes() == b"Hello" and (sample_project / "w.bin").read_bytes() == b"Abc"
        s.undo(2)
    oracle.assert_same(before, oracle.snapshot_dir(str(sample_project)), "undo of dd and mmap over virtio-fs")


MMAP_PRIVATE = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
mm = mmap.mmap(fd, 0, mmap.MAP_PRIVATE, mmap.PROT_READ)
print("private", mm[:5].decode())
"""


def test_direct_io_all_reads_through_and_refuses_shared_maps_as_documented(sample_project):
    """``virtiofs_direct_io="all"`` (C virtiofsd ``cache=none``'s trade, docs/virtiofs.md): a
    program reads and writes files whose every open is direct I/O (no guest page cache), a
    private map still works, a shared map fails
    with ``ENODEV`` (Linux 6.1), ``fallocate`` works; everything is undone exactly."""
    (sample_project / ".mm.py").write_text(MMAP_SHARED)
    (sample_project / ".mp.py").write_text(MMAP_PRIVATE)
    before = oracle.snapshot_dir(str(sample_project))
    with Session([Folder(str(sample_project))], share="virtiofs", virtiofs_direct_io="all") as s:
        assert s.status()["virtiofs_direct_io"] == "all"
        code, out = run(s, "head -c 3000000 /dev/urandom > r.bin && md5sum < r.bin && "
                           "dd if=r.bin bs=1M 2>/dev/null | md5sum && printf hello > m.bin && "
                           "python3 .mm.py m.bin && python3 .mp.py m.bin && fallocate -l 1M f.bin && wc -c < f.bin")
        assert code == 0, out
        lines = out.split("\n")
        assert lines[0] == lines[1] and lines[2:6] == ["mmap No such device", "private hello", str(1 << 20), ""], out
        assert (sample_project / "m.bin").read_bytes() == b"hello"
        assert os.path.getsize(sample_project / "r.bin") == 3000000
        s.undo(1)
    oracle.assert_same(before, oracle.snapshot_dir(str(sample_project)), "undo over direct-I/O virtio-fs")
