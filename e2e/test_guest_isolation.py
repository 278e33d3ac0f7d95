"""Inside a real guest: the host's data is not there, and real agents' tools still work.

The guest root is the ``host-usr`` kind (sandbox.vm.guestroot): the host's /usr read-only
plus a skeleton synthesized per session. Probes run in the guest as the session's command
user (root before commands run as an unprivileged user, the guest user after): the host's
secrets, users' homes, this checkout, the undo store and the rest of the host's root are
absent; the mount table holds only the shares, the guest root and pseudo filesystems. The
tool mix (git, python venv + pip from a local wheel, make + gcc) runs without network.
"""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile

import pytest

from sandbox.session.runtime import Folder, Session
from sandbox.vm import guestroot
from sandbox.vm.guest import virtiofs_tag

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: filesystem types a guest may mount besides the shares and its root's overlays
PSEUDO_FS = {"proc", "sysfs", "devtmpfs", "devpts", "tmpfs", "mqueue", "cgroup", "cgroup2", "securityfs",
             "debugfs", "tracefs", "pstore", "bpf", "hugetlbfs", "configfs", "fusectl", "binfmt_misc"}
SHARE_SOURCE = "10.0.2.100"  # the 9P shares: QEMU guestfwd to the session's server
#: guest paths made at boot or by commands, beside the host-made skeleton
RUNTIME_PREFIXES = ("/run/", "/tmp/", "/home/agent", "/mnt/working", "/etc/resolv.conf", "/root/", "/var/tmp/")


def _session(tmp_path_factory, as_root: bool):
    base = tmp_path_factory.mktemp("iso")
    project = base / "project"
    project.mkdir()
    (project / "hello.txt").write_text("hi\n")
    state = base / "undo-store"
    return Session([Folder(str(project), state_dir=str(state))], as_root=as_root), project, state


@pytest.fixture(scope="module")
def guest(vm_guest, tmp_path_factory):
    """One session VM for the probes, commands as the agent's user; its project folder, undo
    store and XDG state are known."""
    s, project, state = _session(tmp_path_factory, as_root=False)
    with s:
        yield s, project, state


@pytest.fixture(scope="module")
def root_guest(vm_guest, tmp_path_factory):
    """The same with commands as guest root (``as_root``): the strongest prober."""
    s, project, state = _session(tmp_path_factory, as_root=True)
    with s:
        yield s, project, state


@pytest.fixture(params=["agent", "root"])
def prober(request):
    """The probes run as the agent's user and as guest root."""
    return request.getfixturevalue("guest" if request.param == "agent" else "root_guest")


def sh(s: Session, command: str) -> tuple[int, str]:
    out: list[str] = []
    r = s.run(command, lambda stream, text: out.append(text), cwd=s.guest_path(0))
    return r.exit_code, "".join(out)


def test_host_secrets_homes_checkout_and_undo_store_are_absent(prober):
    s, project, state = prober
    assert state.is_dir() and os.listdir(state), "the undo store exists on the host"
    probes = ["/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/ssh", "/etc/ssl/private", "/etc/pip.conf",
              "/etc/gitconfig", CHECKOUT, str(state), str(project), os.path.expanduser("~/.ssh"),
              os.path.expanduser("~/.cache/sandbox")]
    probes += [f"/home/{n}" for n in os.listdir("/home") if n != guestroot.USER_NAME]
    probes += [f"/{d}/{n}" for d in ("opt", "srv", "mnt", "media", "var") for n in os.listdir(f"/{d}")
               if f"/{d}/{n}" not in ("/mnt/working", "/var/tmp", "/var/lib", "/var/cache", "/var/log", "/var/mail")]
    probes = sorted(set(probes))
    script = "; ".join(f"if [ -e '{p}' ] || [ -L '{p}' ]; then echo 'PRESENT {p}'; fi" for p in probes)
    script += "; echo ROOT:$(ls -A /root 2>&1 | tr '\\n' ' '); ls /etc/ssh/*key* 2>/dev/null; echo END"
    code, out = sh(s, script)
    assert code == 0 and "END" in out, out
    assert "PRESENT" not in out, out
    root_line = next(ln for ln in out.splitlines() if ln.startswith("ROOT:"))
    assert root_line.strip() in ("ROOT:", ) or "Permission denied" in root_line, root_line


def test_shadow_reads_fail_in_the_guest(prober):
    s, _project, _state = prober
    code, out = sh(s, "cat /etc/shadow /etc/ssh/ssh_host_ed25519_key 2>&1; echo rc=$?")
    assert "rc=1" in out and "No such file" in out, out
    assert "root:$" not in out and "PRIVATE KEY" not in out, out


def test_the_guest_root_outside_usr_is_the_skeleton(root_guest, tmp_path):
    """Every path of the guest root outside /usr and the pseudo filesystems was made by
    the host's skeleton builder or at run time — nothing else of the host's (found as guest
    root, who can read every directory)."""
    s, _project, _state = root_guest
    guest = root_guest
    skel = tmp_path / "skel"
    uid, gid = guestroot.user_ids(str(guest[1]))
    guestroot.build_skeleton(str(skel), uid=uid, gid=gid)
    expected = {"/" + os.path.relpath(os.path.join(d, n), skel) for d, ds, fs in os.walk(skel) for n in ds + fs}
    code, out = sh(s, "find / -xdev \\( -path /usr -o -path /proc -o -path /sys -o -path /dev -o -path /run "
                      "-o -path /tmp -o -path /mnt/working \\) -prune -o -print 2>&1; echo END")
    assert code == 0 and out.rstrip().endswith("END"), out[-2000:]
    seen = {ln for ln in out.splitlines()[:-1] if ln and ln != "/"}
    extra = sorted(p for p in seen - expected if not p.startswith(RUNTIME_PREFIXES)
                   and p not in {"/usr", "/proc", "/sys", "/dev", "/run", "/tmp", "/mnt/working"})
    assert not extra, extra[:40]


def test_mounts_are_the_shares_the_root_and_pseudo_filesystems(guest):
    s, _project, _state = guest
    code, out = sh(s, "cat /proc/mounts")
    assert code == 0, out
    shares = {m.target: m.name for m in s.table.mounts}
    bad, seen = [], set()
    for line in out.splitlines():
        source, target, fstype = line.split()[:3]
        if fstype in PSEUDO_FS:
            continue
        if fstype == "overlay" and target in ("/", "/usr"):
            continue
        if target in shares and ((fstype == "9p" and source == SHARE_SOURCE)  # through guestfwd
                                 or (fstype == "virtiofs" and source == virtiofs_tag(shares[target]))):  # issue 17
            seen.add(target)
            continue
        bad.append(line)
    assert not bad, bad
    assert seen == set(shares)


# --------------------------------------------------------------------------- the tool mix


def _wheel(path: str) -> None:
    """A pure-Python wheel ``sbxdemo-1.0`` with module ``sbxdemo`` (built here, no network)."""
    files = {"sbxdemo/__init__.py": b"ANSWER = 42\n",
             "sbxdemo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: sbxdemo\nVersion: 1.0\n",
             "sbxdemo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    record += "sbxdemo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("sbxdemo-1.0.dist-info/RECORD", record)


def test_git_clone_of_a_local_bare_repo_into_the_share(guest):
    s, project, _state = guest
    code, out = sh(s, "set -e; export GIT_CONFIG_GLOBAL=/tmp/gitconfig; git config --global safe.directory '*'; "
                      "git init -q src && cd src && echo one > a.txt && git add a.txt && "
                      "git -c user.name=a -c user.email=a@example.invalid commit -qm first && cd .. && "
                      "git clone -q --bare src origin.git && git clone -q origin.git clone && cat clone/a.txt && "
                      "git -C clone log --format=%s")
    assert code == 0, out
    assert out.split() == ["one", "first"], out
    assert (project / "clone" / "a.txt").read_text() == "one\n"


def test_python_venv_and_pip_install_of_a_local_wheel(guest):
    s, project, _state = guest
    _wheel(str(project / "sbxdemo-1.0-py3-none-any.whl"))
    code, out = sh(s, "set -e; python3 -m venv venv && venv/bin/pip install -q --no-index --disable-pip-version-check "
                      "./sbxdemo-1.0-py3-none-any.whl && venv/bin/python -c 'import sbxdemo; print(sbxdemo.ANSWER)'")
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "42", out
    assert (project / "venv" / "bin" / "python").is_symlink()


def test_make_with_gcc(guest):
    s, project, _state = guest
    (project / "hello.c").write_text('#include <stdio.h>\nint main(void) { puts("hello from gcc"); return 0; }\n')
    (project / "Makefile").write_text("hello: hello.c\n\tgcc -O1 -o $@ $<\n")
    code, out = sh(s, "make -s && ./hello")
    assert code == 0, out
    assert out.strip().splitlines()[-1] == "hello from gcc", out
    assert (project / "hello").stat().st_mode & 0o111
