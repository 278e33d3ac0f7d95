"""A racer in the working folder: someone else who can write there swaps what we just made.

A local process with write access to the folder can replace a directory or file the
server (or a rollback) has just created — by a symlink to a file of its choice, a hard
link to one, or a directory of its own — before our next call reaches it. Every follow-up
on something just created must go through its descriptor, never its name again, so the
racer gets at most an error (SPEC: metadata calls on something just created go through
its descriptor). Run as root (as CI does), a chmod that followed the swapped-in symlink
would change any file of the host.

Deterministic tests perform the swap exactly in the window (``os.mkdir`` / ``os.open``
wrapped for the duration of the test, the swap right after the real call); a bounded
stress test runs a racer thread against mkdirs over 9P and against rollbacks that
recreate directories. Nothing outside the working folder may change.
"""

from __future__ import annotations

import base64
import errno
import os
import stat
import threading
from pathlib import Path

import pytest

from sandbox.core import preimage
from sandbox.core.workspace import Workspace
from sandbox.hostfs.real import RealHostFS
from sandbox.mounts import Provider
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox.ninep.wirefs import WireFS, serve

pytestmark = pytest.mark.timeout(120)

T1 = 1_234_567_890_123_456_789


@pytest.fixture
def outside(tmp_path) -> Path:
    """Files beside the working folder, on the same filesystem (so hard links work)."""
    o = tmp_path / "outside"
    o.mkdir()
    (o / "victim").write_bytes(b"precious outside data")
    os.chmod(o / "victim", 0o640)
    os.setxattr(o / "victim", "user.keep", b"outside")
    os.utime(o / "victim", ns=(T1, T1))
    (o / "vdir").mkdir()
    os.chmod(o / "vdir", 0o700)
    (o / "full").mkdir()
    (o / "full" / "inner").write_bytes(b"inner")
    os.chmod(o / "full", 0o750)
    return o


def snapshot_of(top: Path) -> dict:
    """Everything observable about a tree outside the folder: mode, size, times, inode,
    link count, xattrs, bytes, listing."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in [""] + sorted(dirnames) + sorted(filenames):
            p = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(p)
            xattrs = {n: os.getxattr(p, n, follow_symlinks=False) for n in sorted(os.listxattr(p, follow_symlinks=False))}
            content = Path(p).read_bytes() if stat.S_ISREG(st.st_mode) else None
            snap[p] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_nlink, xattrs, content)
    return snap


def swap_after(monkeypatch, fn_name: str, name: str, swap, when=lambda *a, **k: True) -> list:
    """Wrap ``os.<fn_name>`` so that right after the real call for ``name`` (once),
    ``swap(dir_fd)`` replaces what it made. Returns a list that records the swap."""
    real = getattr(os, fn_name)
    done: list = []

    def wrapped(path, *args, **kwargs):
        result = real(path, *args, **kwargs)
        if path == name and not done and when(*args, **kwargs):
            done.append(path)
            swap(kwargs.get("dir_fd"))
        return result

    monkeypatch.setattr(os, fn_name, wrapped)
    return done


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --------------------------------------------------------------------------- mkdir


@pytest.mark.parametrize("target", ["victim", "vdir", "dangling", "../outside/victim"])
def test_mkdir_swapped_for_a_symlink_right_after_creation_changes_nothing_outside(tmp_path, outside, monkeypatch, target):
    root = tmp_path / "root"
    root.mkdir()
    link_to = target if target.startswith("..") else str(outside / target)
    fs = RealHostFS(str(root))
    before = snapshot_of(outside)

    def swap(dir_fd):
        os.rmdir("d", dir_fd=dir_fd)  # the racer: our new directory goes ...
        os.symlink(link_to, "d", dir_fd=dir_fd)  # ... and a symlink of theirs takes its name

    done = swap_after(monkeypatch, "mkdir", "d", swap)
    with pytest.raises(OSError):
        fs.mkdir("d", 0o777)  # a chmod that followed the link would make the victim 0777
    monkeypatch.undo()
    assert done, "the swap did not happen"
    assert snapshot_of(outside) == before
    assert os.readlink(root / "d") == link_to  # the racer's link, as they left it
    fs.close()


def test_mkdir_swapped_for_someone_elses_directory_leaves_it_alone(tmp_path, outside, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "aside").mkdir()
    fs = RealHostFS(str(root))

    def swap(dir_fd):
        os.rename("d", str(tmp_path / "aside" / "ours"), src_dir_fd=dir_fd)
        os.rename(str(outside / "full"), "d", dst_dir_fd=dir_fd)  # a directory of theirs, moved in

    swap_after(monkeypatch, "mkdir", "d", swap)
    with pytest.raises(FileExistsError):
        fs.mkdir("d", 0o777)
    monkeypatch.undo()
    assert stat.S_IMODE(os.lstat(root / "d").st_mode) == 0o750  # not chmod'ed
    assert (root / "d" / "inner").read_bytes() == b"inner"
    fs.close()


def test_mkdir_asks_a_directory_swapped_in_for_one_entry_not_its_listing(tmp_path, monkeypatch):
    """Whether the directory found after mkdir is the new one is answered by its first entry:
    a racer's directory of thousands of names costs one name read (entries drawn from the
    directory reads, counted at ``os``: no ``os.listdir``, one ``os.scandir`` entry)."""
    root = tmp_path / "root"
    root.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for i in range(2000):
        (theirs / f"f{i:04d}").touch()
    fs = RealHostFS(str(root))
    drawn, listed = [], []
    real_scandir, real_listdir = os.scandir, os.listdir

    class Counted:
        def __init__(self, it):
            self.it = it

        def __enter__(self):
            self.it.__enter__()
            return self

        def __exit__(self, *exc):
            return self.it.__exit__(*exc)

        def __iter__(self):
            return self

        def __next__(self):
            e = next(self.it)
            drawn.append(e.name)
            return e

    def swap(dir_fd):
        os.rmdir("d", dir_fd=dir_fd)
        os.rename(str(theirs), "d", dst_dir_fd=dir_fd)
        monkeypatch.setattr(os, "scandir", lambda *a: Counted(real_scandir(*a)))
        monkeypatch.setattr(os, "listdir", lambda *a: listed.append(a) or real_listdir(*a))

    swap_after(monkeypatch, "mkdir", "d", swap)
    with pytest.raises(FileExistsError):
        fs.mkdir("d", 0o777)
    monkeypatch.undo()
    assert len(drawn) == 1 and not listed
    assert len(os.listdir(root / "d")) == 2000
    fs.close()


def test_mkdir_without_a_racer_sets_the_mode_through_the_new_directory(tmp_path):
    fs = RealHostFS(str(tmp_path))
    fs.mkdir("d", 0o7751 if os.geteuid() == 0 else 0o751)
    assert stat.S_IMODE(os.lstat(tmp_path / "d").st_mode) == (0o7751 if os.geteuid() == 0 else 0o751)
    fs.close()


def test_mkdir_that_cannot_open_the_new_directory_leaves_nothing(tmp_path):
    """No descriptor left for the new directory (EMFILE): the mkdir fails whole — no
    stray directory the undo log never heard of."""
    fs = RealHostFS(str(tmp_path))
    fs.mkdir("probe", 0o755)  # warm up: nothing below allocates a descriptor but the call itself
    fds = []
    try:
        while True:
            try:
                fds.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as e:
                assert e.errno == errno.EMFILE
                break
        os.close(fds.pop())  # one left: for the parent's fd, none for the new directory's
        with pytest.raises(OSError) as info:
            fs.mkdir("d", 0o755)
        assert info.value.errno == errno.EMFILE
    finally:
        for fd in fds:
            os.close(fd)
    assert sorted(os.listdir(tmp_path)) == ["probe"]
    fs.close()


# --------------------------------------------------------------------------- create


def test_file_created_over_9p_then_swapped_for_a_hard_link_writes_only_the_new_file(tmp_path, outside, monkeypatch):
    """Tlcreate: the fid's handle is the created inode, not a second lookup of the name."""
    work = tmp_path / "work"
    work.mkdir()
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    before = snapshot_of(outside)

    def swap(dir_fd):
        os.unlink("x", dir_fd=dir_fd)
        os.link(str(outside / "victim"), "x", dst_dir_fd=dir_fd)  # a hard link to their file

    done = swap_after(monkeypatch, "open", "x", swap, when=lambda flags, *a, **k: bool(flags & os.O_CREAT))
    with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
        c.attach()
        fid = c.walk_path("")
        c.lcreate(fid, "x", m.DOTL_RDWR | m.DOTL_CREATE, 0o777)
        c.write_all(fid, 0, b"guest bytes")
        c.setattr(fid, m.SETATTR_MODE, mode=0o4777)
        c.setxattr(fid, "user.keep", b"guest")
        c.clunk(fid)
    monkeypatch.undo()
    assert done
    os.unlink(work / "x")  # the racer's link, so the outside tree compares whole
    after = snapshot_of(outside)
    assert {p: v[:3] + v[4:5] + v[6:] for p, v in after.items()} == {p: v[:3] + v[4:5] + v[6:] for p, v in before.items()}
    ws.close()


# --------------------------------------------------------------------------- rollback


def test_rollback_restoring_a_file_swapped_for_a_hard_link_writes_only_the_restored_file(tmp_path, outside, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "x").write_bytes(b"the user's file")
    os.chmod(work / "x", 0o755)
    os.setxattr(work / "x", "user.mine", b"1")
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    with ws.step("rm x"):
        ws.fs.unlink("x")
    before = snapshot_of(outside)

    def swap(dir_fd):
        os.unlink("x", dir_fd=dir_fd)
        os.link(str(outside / "victim"), "x", dst_dir_fd=dir_fd)

    done = swap_after(monkeypatch, "open", "x", swap, when=lambda flags, *a, **k: bool(flags & os.O_CREAT))
    try:
        ws.rollback(1)
    except Exception:
        pass  # refusing is fine; writing into the victim is not
    monkeypatch.undo()
    assert done
    after = snapshot_of(outside)
    # the racer's extra link moved the victim's link count and ctime; nothing else may differ
    strip = lambda snap: {p: (v[0], v[1], v[2], v[4], v[6], v[7]) for p, v in snap.items()}  # noqa: E731
    assert strip(after) == strip(before)
    ws.close()


def test_restore_of_a_file_applies_bytes_and_metadata_through_one_handle(tmp_path, outside, monkeypatch):
    """The cause, one level down: preimage.restore never reopens a file it created."""
    root = tmp_path / "root"
    root.mkdir()
    fs = RealHostFS(str(root))
    rec = {"op": "pre", "path": "x", "kind": "reg", "mode": 0o4755 if os.geteuid() == 0 else 0o755, "mtime_ns": T1 + 1,
           "xattrs": {"user.a": b64(b"restored")}}

    def swap(dir_fd):
        os.rename("x", str(tmp_path / "ours"), src_dir_fd=dir_fd)
        os.link(str(outside / "victim"), "x", dst_dir_fd=dir_fd)

    swap_after(monkeypatch, "open", "x", swap, when=lambda flags, *a, **k: bool(flags & os.O_CREAT))
    preimage.restore(fs, rec, lambda r: iter([b"restored ", b"bytes"]))
    monkeypatch.undo()
    ours = tmp_path / "ours"
    assert ours.read_bytes() == b"restored bytes"
    st = os.lstat(ours)
    assert (stat.S_IMODE(st.st_mode), st.st_mtime_ns, os.getxattr(ours, "user.a")) == (rec["mode"], T1 + 1, b"restored")
    v = outside / "victim"
    assert v.read_bytes() == b"precious outside data" and stat.S_IMODE(os.lstat(v).st_mode) == 0o640
    assert os.listxattr(v) == ["user.keep"] and os.lstat(v).st_mtime_ns == T1
    fs.close()


def test_rollback_recreating_a_directory_swapped_for_a_symlink_changes_nothing_outside(tmp_path, outside, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "d").mkdir()
    os.chmod(work / "d", 0o777)
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    with ws.step("rmdir d"):
        ws.fs.rmdir("d")
    before = snapshot_of(outside)

    def swap(dir_fd):
        os.rmdir("d", dir_fd=dir_fd)
        os.symlink(str(outside / "victim"), "d", dir_fd=dir_fd)

    done = swap_after(monkeypatch, "mkdir", "d", swap)
    try:
        ws.rollback(1)
    except Exception:
        pass  # the rollback may fail or be refused; it must not reach outside
    monkeypatch.undo()
    assert done
    assert snapshot_of(outside) == before
    ws.close()


# --------------------------------------------------------------------------- a racer thread

ROUNDS = 30
NAMES_PER_ROUND = 8


class Racer:
    """A thread that, for each path it is given, moves whatever appears there aside and
    puts a symlink to an outside victim in its place — once per path, as fast as it can."""

    def __init__(self, aside: Path, victims: list[Path]):
        self.aside, self.victims = aside, victims
        self.paths: list[Path] = []
        self.swapped = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="racer", daemon=True)

    def arm(self, paths: list[Path]) -> None:
        with self._lock:
            self.paths = list(paths)

    def _run(self) -> None:
        k = 0
        while not self._stop.is_set():
            with self._lock:
                paths = list(self.paths)
            for p in paths:
                try:
                    os.rename(p, self.aside / str(k))
                except OSError:
                    continue  # not made yet
                k += 1
                try:
                    os.symlink(self.victims[k % len(self.victims)], p)
                except OSError:
                    continue
                with self._lock:
                    if p in self.paths:
                        self.paths.remove(p)
                    self.swapped += 1

    def __enter__(self) -> "Racer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


def test_racer_swapping_new_directories_for_symlinks_changes_nothing_outside(tmp_path, outside):
    """mkdirs over 9P and rollbacks that recreate directories, against a racer thread."""
    aside = tmp_path / "aside"
    aside.mkdir()
    before = snapshot_of(outside)
    attempts = 0
    with Racer(aside, [outside / "victim", outside / "vdir"]) as racer:
        work = tmp_path / "work"
        work.mkdir()
        ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
        with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
            wire = WireFS(c)
            for r in range(ROUNDS):
                names = [f"m{r}_{i}" for i in range(NAMES_PER_ROUND)]
                racer.arm([work / n for n in names])
                for name in names:
                    attempts += 1
                    try:
                        wire.mkdir(name, 0o777)  # as root, a followed chmod would make a victim 0777
                    except OSError:
                        pass
        ws.close()
        for r in range(ROUNDS):  # a workspace each: a rollback the racer broke is not this test's business
            work = tmp_path / f"rwork{r}"
            work.mkdir()
            names = [f"d{i}" for i in range(NAMES_PER_ROUND)]
            for name in names:
                os.mkdir(work / name)
                os.chmod(work / name, 0o777)
            ws = Workspace.open(str(work), state_dir=str(tmp_path / f"rstate{r}"))
            with ws.step("rmdir"):
                for name in names:
                    ws.fs.rmdir(name)
            racer.arm([work / n for n in names])
            attempts += len(names)
            try:
                ws.rollback(1, force=True)  # recreates every directory (mkdir, then its mode)
            except Exception:
                pass  # a racer's link in the way may stop it; it must never reach outside
            try:
                ws.close()
            except Exception:
                pass
    assert attempts == 2 * ROUNDS * NAMES_PER_ROUND
    assert racer.swapped > 0, "the racer never got in: the test proves nothing"
    assert snapshot_of(outside) == before
