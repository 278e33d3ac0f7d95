"""`sandbox mount` over the host's /dev/fuse: real programs on the mount, undone exactly.

Each test starts the real command (``python -m sandbox mount``) on a fresh folder, waits
for its "mounted" line, runs real programs on the mount (``cp -a``, ``tar``, ``git``,
Python, ``rm -rf``, ``mkfifo``), stops it with SIGTERM (which must unmount), undoes every
step with ``sandbox undo`` and compares the folder with its snapshot from before
(:mod:`sandbox_sim.oracle`: kinds, modes, mtimes, bytes, xattrs, owners).

Also: a program blocked by a safeguard hold freed by a signal (INTERRUPT), SIGKILL of the
server mid-write and the recovery after it, and the unprivileged path through fusermount3
(as uid 65534, in a private mount namespace).

Fast (a few seconds each) and in the default tier where it can run: skipped, saying why,
without /dev/fuse, without root (mount(2); switching to an unprivileged user), without
fusermount3/setpriv/unshare for the unprivileged test, or when mounting fails (e.g. a
container without CAP_SYS_ADMIN).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
import textwrap

import pytest

from sandbox_sim.budget import scale
from sandbox_sim.oracle import assert_same, snapshot_dir

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: seconds to wait for the mount to come up, and for the server to exit after SIGTERM
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 30


def _sandbox(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120, **kw)


def _mounted(point: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == point for line in f)


@pytest.fixture
def folders(tmp_path):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    if os.geteuid() != 0:
        pytest.skip("not root: these tests mount with mount(2)")
    work, point, state = tmp_path / "work", tmp_path / "mnt", tmp_path / "state"
    for d in (work, point, state):
        d.mkdir()
    (work / "README.md").write_text("# project\n")
    (work / "src").mkdir()
    (work / "src" / "main.py").write_text("print('hi')\n")
    os.chmod(work / "src" / "main.py", 0o755)
    os.symlink("src/main.py", work / "link")
    return str(work), str(point), str(state)


@contextlib.contextmanager
def mount(work: str, point: str, state: str, *extra: str):
    """The running ``sandbox mount``; on exit SIGTERM, and the mount must be gone."""
    if "--on-hold" not in extra:
        extra = ("--on-hold", "allow", *extra)
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "mount", "--workdir", work, "--state-dir", state,
                             point, *extra], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        line = _first_line(proc)
        if "mounted at" not in line:
            proc.kill()
            rest = proc.stderr.read()
            proc.wait()
            if "cannot mount" in line + rest:
                pytest.skip(f"mounting a FUSE filesystem failed here: {(line + rest).strip()}")
            raise AssertionError(f"sandbox mount did not come up: {line}{rest}")
        assert _mounted(point)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError("sandbox mount did not stop on SIGTERM") from None
        proc.stderr.close()
    assert not _mounted(point), "SIGTERM left the mount behind"


def _first_line(proc: subprocess.Popen) -> str:
    import threading

    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(proc.stderr.readline()), daemon=True)
    t.start()
    t.join(START_TIMEOUT_S)
    return out[0] if out else ""


def _undo_all(work: str, state: str) -> None:
    hist = _sandbox("history", "--workdir", work, "--state-dir", state, "--json")
    assert hist.returncode == 0, hist.stderr
    steps = json.loads(hist.stdout)
    steps = steps.get("steps", steps) if isinstance(steps, dict) else steps
    assert steps, "the mount recorded no step"
    r = _sandbox("undo", "--workdir", work, "--state-dir", state, "-n", str(len(steps)))
    assert r.returncode == 0, r.stdout + r.stderr


def _run(argv, **kw) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)
    assert r.returncode == 0, f"{argv}: {r.stdout}{r.stderr}"


def test_real_programs_on_the_mount_are_undone_exactly(folders, tmp_path):
    work, point, state = folders
    before = snapshot_dir(work)
    source = os.path.join(REPO, "sandbox", "fuse")
    with mount(work, point, state) as proc:
        _run(["cp", "-a", source, os.path.join(point, "copied")])
        for name in os.listdir(source):
            if not os.path.isfile(os.path.join(source, name)):  # __pycache__ (copied too, checked by tar below)
                continue
            with open(os.path.join(source, name), "rb") as a, open(os.path.join(point, "copied", name), "rb") as b:
                assert a.read() == b.read()
        assert os.stat(os.path.join(point, "copied")).st_mode & 0o777 == os.stat(source).st_mode & 0o777
        _run(["tar", "-cf", str(tmp_path / "t.tar"), "-C", point, "."])
        _run(["tar", "-xf", str(tmp_path / "t.tar"), "-C", os.path.join(point, "src")])
        if shutil.which("git"):
            env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e", GIT_COMMITTER_NAME="t",
                       GIT_COMMITTER_EMAIL="t@e", HOME=str(tmp_path))
            _run(["git", "init", "-q"], cwd=point, env=env)
            _run(["git", "add", "-A"], cwd=point, env=env)
            _run(["git", "commit", "-qm", "x"], cwd=point, env=env)
            _run(["git", "status", "--porcelain"], cwd=point, env=env)
        with open(os.path.join(point, "README.md"), "a") as f:
            f.write("more\n")
        tmp = os.path.join(point, "src", ".main.py.tmp")
        with open(tmp, "w") as f:  # an editor's atomic save
            f.write("print('bye')\n")
        os.replace(tmp, os.path.join(point, "src", "main.py"))
        with open(os.path.join(work, "README.md")) as f:
            assert f.read() == "# project\nmore\n"  # through the mount, onto the folder
        _run(["rm", "-rf", os.path.join(point, "copied"), os.path.join(point, "link")])
        assert not os.path.exists(os.path.join(work, "copied"))
        assert proc.poll() is None
    _undo_all(work, state)
    assert_same(before, snapshot_dir(work), "the folder after undoing the mount's steps")


def test_fifo_and_chown_through_the_mount_as_root(folders):
    work, point, state = folders
    before = snapshot_dir(work)
    with mount(work, point, state):
        fifo = os.path.join(point, "pipe")
        os.mkfifo(fifo, 0o640)
        assert os.path.exists(os.path.join(work, "pipe"))
        st = os.lstat(fifo)
        assert (st.st_mode & 0o170000, st.st_mode & 0o777) == (0o010000, 0o640)
        dev = os.path.join(point, "null")
        os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # emulated: a placeholder on the host
        assert os.stat(dev).st_rdev == os.makedev(1, 3)
        assert stat.S_ISREG(os.lstat(os.path.join(work, "null")).st_mode)
        with pytest.raises(PermissionError):
            open(dev, "rb")  # nodev: the host never opens a device through the mount
        target = os.path.join(point, "README.md")
        os.chown(target, 4321, 8765)
        st = os.stat(target)
        assert (st.st_uid, st.st_gid) == (4321, 8765)  # the mount shows the new owner ...
        host = os.stat(os.path.join(work, "README.md"))
        assert (host.st_uid, host.st_gid) == (os.getuid(), os.getgid())  # ... the host file keeps its own
        os.chmod(target, 0o4755)
        assert os.stat(target).st_mode & 0o7777 == 0o4755
        assert not os.stat(os.path.join(work, "README.md")).st_mode & 0o4000  # set-id never applied on the host
    _undo_all(work, state)
    assert_same(before, snapshot_dir(work), "the folder after undo")


def test_read_only_mount_refuses_changes(folders):
    work, point, state = folders
    before = snapshot_dir(work)
    with mount(work, point, state, "--read-only"):
        with open(os.path.join(point, "README.md")) as f:
            assert f.read() == "# project\n"
        with pytest.raises(OSError) as e:
            open(os.path.join(point, "new"), "w")
        assert e.value.errno == 30  # EROFS
    assert_same(before, snapshot_dir(work), "the folder after a read-only mount")


def test_mount_point_inside_the_folder_is_refused(folders):
    work, _point, state = folders
    inner = os.path.join(work, "src")
    r = _sandbox("mount", "--workdir", work, "--state-dir", state, inner)
    assert r.returncode == 2 and "contain each other" in r.stderr


def test_sigterm_with_a_file_open_on_the_mount_still_unmounts(folders):
    """The mount is detached at once; the server stops after the grace period even though a
    file stays open there, and the step it made is saved."""
    work, point, state = folders
    with mount(work, point, state) as proc:
        f = open(os.path.join(point, "held-open"), "w")
        try:
            f.write("data")
            f.flush()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(STOP_TIMEOUT_S) == 0
            assert not _mounted(point)
        finally:
            with contextlib.suppress(OSError):
                f.close()  # ENOTCONN: the connection is gone
    with open(os.path.join(work, "held-open")) as g:
        assert g.read() == "data"
    _undo_all(work, state)
    assert not os.path.exists(os.path.join(work, "held-open"))


@pytest.mark.parametrize("answer", ["allow", "deny"])
def test_a_safeguard_hold_blocks_the_program_then_allow_or_deny(folders, answer):
    """`rm -rf` past --delete-threshold blocks mid-syscall until decided: allow lets it finish;
    deny rolls the step back (the deletes made so far come back) and the program sees EIO."""
    work, point, state = folders
    for i in range(6):
        with open(os.path.join(work, "src", f"f{i}"), "w") as f:
            f.write(str(i))
    before = snapshot_dir(work)
    with mount(work, point, state, "--delete-threshold", "3", "--on-hold", answer):
        r = subprocess.run(["rm", "-rf", os.path.join(point, "src")], capture_output=True, text=True, timeout=120)
        if answer == "allow":
            assert r.returncode == 0, r.stderr
            assert not os.path.exists(os.path.join(work, "src"))
        else:
            assert r.returncode != 0 and "Input/output error" in r.stderr
    if answer == "deny":
        assert_same(before, snapshot_dir(work), "the folder after a denied step")
    else:
        _undo_all(work, state)
        assert_same(before, snapshot_dir(work), "the folder after undo")


_EXCHANGE = textwrap.dedent("""
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    if libc.renameat2(AT_FDCWD, os.fsencode(sys.argv[1]), AT_FDCWD, os.fsencode(sys.argv[2]), RENAME_EXCHANGE):
        e = ctypes.get_errno()
        sys.exit(f"renameat2: {os.strerror(e)}")
""")

_COPY_AND_SEEK = textwrap.dedent("""
    import os, sys
    src, dst = sys.argv[1:]
    with open(src, "rb") as s, open(dst, "r+b") as d:
        print(os.copy_file_range(s.fileno(), d.fileno(), 1 << 20, 0, 4))
    fd = os.open(src, os.O_RDONLY)
    print(os.lseek(fd, 0, os.SEEK_HOLE), os.lseek(fd, 4096, os.SEEK_DATA))
    try:
        os.lseek(fd, os.fstat(fd).st_size, os.SEEK_DATA)
    except OSError as e:
        print(e.errno)
""")


def test_fallocate_copy_file_range_lseek_and_exchange_on_the_mount_are_undone(folders):
    """fallocate(1) plain / punch / zero, os.copy_file_range, SEEK_HOLE/SEEK_DATA and a
    renameat2(RENAME_EXCHANGE) of a file with a directory, all on the mount — then undo."""
    work, point, state = folders
    with open(os.path.join(work, "data.bin"), "wb") as f:
        f.write(bytes(range(1, 256)) * 4096)  # ~1 MiB, no zeros
    before = snapshot_dir(work)
    p = lambda *parts: os.path.join(point, *parts)  # noqa: E731
    with mount(work, point, state) as proc:
        _run(["fallocate", "-l", "2MiB", p("prealloc")])
        assert os.path.getsize(os.path.join(work, "prealloc")) == 2 << 20
        _run(["fallocate", "-p", "-o", "4096", "-l", "65536", p("data.bin")])
        _run(["fallocate", "-z", "-o", "200000", "-l", "8192", p("data.bin")])
        with open(os.path.join(work, "data.bin"), "rb") as f:
            got = f.read()
        assert len(got) == 255 * 4096
        assert got[4096:69632] == b"\0" * 65536 and got[200000:208192] == b"\0" * 8192 and got[4095] != 0
        r = subprocess.run([sys.executable, "-c", _COPY_AND_SEEK, p("data.bin"), p("README.md")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        copied, seeks, enxio = r.stdout.splitlines()
        assert int(copied) == 255 * 4096  # clamped to the source's end
        with open(os.path.join(work, "README.md"), "rb") as f:
            assert f.read(8) == b"# pr" + bytes(range(1, 5))
        fd = os.open(os.path.join(work, "data.bin"), os.O_RDONLY)
        try:  # the mount answers as the host does for the same file (the punched hole, where it knows it)
            assert tuple(map(int, seeks.split())) == (os.lseek(fd, 0, os.SEEK_HOLE), os.lseek(fd, 4096, os.SEEK_DATA))
        finally:
            os.close(fd)
        assert int(enxio) == errno.ENXIO
        _run([sys.executable, "-c", _EXCHANGE, p("src"), p("data.bin")])
        assert os.path.isdir(os.path.join(work, "data.bin")) and os.path.isfile(os.path.join(work, "src"))
        with open(p("data.bin", "main.py")) as f:
            assert f.read() == "print('hi')\n"
        assert proc.poll() is None
    _undo_all(work, state)
    assert_same(before, snapshot_dir(work), "the folder after undoing fallocate, copy, exchange")


@contextlib.contextmanager
def mount_with_terminal(work: str, point: str, state: str, *extra: str):
    """``sandbox mount --on-hold ask`` with a pseudo-terminal as its controlling terminal:
    yields ``(proc, master_fd)``; the hold prompt is read from, and answered on, the master."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()

    def become_terminal_owner() -> None:
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "mount", "--workdir", work, "--state-dir", state,
                             point, "--on-hold", "ask", *extra], cwd=REPO, stdin=slave, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=become_terminal_owner)
    os.close(slave)
    try:
        line = _first_line(proc)
        assert "mounted at" in line, line
        yield proc, master
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError("sandbox mount did not stop on SIGTERM") from None
        proc.stderr.close()
        os.close(master)
    assert not _mounted(point), "SIGTERM left the mount behind"


def _read_until(fd: int, marker: bytes, timeout_s: float = START_TIMEOUT_S) -> bytes:
    """What the terminal shows until ``marker`` (a condition wait on the prompt, bounded)."""
    import select

    seen = b""
    while marker not in seen:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        assert ready, f"no {marker!r} on the terminal; it shows {seen!r}"
        seen += os.read(fd, 4096)
    return seen


#: a program deleting src/f0..f5 one by one; it reports the errno (or the interrupt) it stops on
DELETER = """
import os, sys
try:
    for i in range(6):
        os.unlink(os.path.join(sys.argv[1], f"f{i}"))
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    sys.exit(3)
print("done", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_signal_frees_a_program_blocked_by_a_hold_and_the_mount_keeps_serving(folders, sig):
    """A program blocked mid-``unlink`` by a safeguard hold is interrupted by a signal (the
    kernel sends INTERRUPT, the server answers EINTR): it ends while the hold is still being
    asked about; the mount keeps serving; the hold, answered afterwards (deny), still rolls
    the step back."""
    work, point, state = folders
    for i in range(6):
        with open(os.path.join(work, "src", f"f{i}"), "w") as f:
            f.write(str(i))
    before = snapshot_dir(work)
    with mount_with_terminal(work, point, state, "--delete-threshold", "3") as (proc, tty):
        child = subprocess.Popen([sys.executable, "-c", DELETER, os.path.join(point, "src")],
                                 stdout=subprocess.PIPE, text=True)
        try:
            _read_until(tty, b"allow it?")  # the third unlink is held: the program blocks in it
            assert child.poll() is None
            child.send_signal(sig)
            code = child.wait(STOP_TIMEOUT_S)  # without INTERRUPT it would wait for the answer
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        out = child.stdout.read()
        child.stdout.close()
        if sig == signal.SIGINT:
            assert (code, out.strip()) == (3, "KeyboardInterrupt")
        else:
            assert code == -signal.SIGKILL
        assert sorted(os.listdir(os.path.join(point, "src"))) == ["f2", "f3", "f4", "f5", "main.py"]
        with open(os.path.join(point, "README.md")) as f:  # the mount still serves
            assert f.read() == "# project\n"
        assert proc.poll() is None
        os.write(tty, b"n\n")  # deny: the step (two deletes) is rolled back
        _wait_for(lambda: os.path.exists(os.path.join(work, "src", "f0")), "the denied step's rollback")
    assert_same(before, snapshot_dir(work), "the folder after the interrupted hold was denied")


def _wait_for(cond, what: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """A condition wait, polled (the condition is in another process), with a deadline."""
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


#: a program writing on the mount until it fails; it says when it has written, then the errno it stopped on
WRITER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
chunk = b"w" * 65536
try:
    os.write(fd, chunk)
    print("writing", flush=True)
    while True:
        if os.write(fd, chunk) and os.lseek(fd, 0, os.SEEK_CUR) > (8 << 20):
            os.lseek(fd, 0, os.SEEK_SET)  # rewrite the first 8 MiB: the step stays small
except OSError as e:
    print(e.errno, flush=True)
"""


def test_sigkill_of_the_server_mid_write_then_unmount_and_recovery(folders):
    """`sandbox mount` SIGKILLed while a program writes on the mount: the program's write
    fails (ECONNABORTED if it was in flight, else ENOTCONN), anything else on the mount gets
    ENOTCONN; `umount` works; the next `sandbox history`
    recovers the interrupted ambient step (rolled back, as after a SIGKILL of the 9P
    server) and the folder is as before; the next `sandbox mount` serves again."""
    import errno as _errno

    work, point, state = folders
    with open(os.path.join(work, "README.md"), "a") as f:
        f.write("kept\n")
    before = snapshot_dir(work)
    proc = subprocess.Popen([sys.executable, "-m", "sandbox", "mount", "--workdir", work, "--state-dir", state,
                             point], cwd=REPO, stderr=subprocess.PIPE, text=True)
    writer = None
    try:
        line = _first_line(proc)
        if "mounted at" not in line:
            proc.kill()
            pytest.skip(f"mounting a FUSE filesystem failed here: {line}")
        os.unlink(os.path.join(point, "link"))  # part of the step too
        writer = subprocess.Popen([sys.executable, "-c", WRITER, os.path.join(point, "big.bin")],
                                  stdout=subprocess.PIPE, text=True)
        assert writer.stdout.readline().strip() == "writing"
        proc.kill()  # SIGKILL, mid-write
        assert proc.wait(STOP_TIMEOUT_S) == -signal.SIGKILL
        assert writer.wait(STOP_TIMEOUT_S) == 0
        # the write in flight when the server died is aborted (ECONNABORTED); one after: ENOTCONN
        assert int(writer.stdout.read().strip()) in (_errno.ECONNABORTED, _errno.ENOTCONN)
        with pytest.raises(OSError) as e:
            os.stat(os.path.join(point, "README.md"))
        assert e.value.errno == _errno.ENOTCONN
        assert _mounted(point)  # the dead mount stays until unmounted
        _run(["umount", point])
        assert not _mounted(point)
    finally:
        if writer is not None:
            if writer.poll() is None:
                writer.kill()
                writer.wait()
            writer.stdout.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
        if _mounted(point):
            subprocess.run(["umount", "-l", point], capture_output=True)
    hist = _sandbox("history", "--workdir", work, "--state-dir", state)
    assert hist.returncode == 0, hist.stderr
    assert "recovered: an interrupted step" in hist.stderr and "rolled back" in hist.stderr, hist.stderr
    assert_same(before, snapshot_dir(work), "the folder after recovering from the SIGKILL")
    with mount(work, point, state):  # serves again, and records again
        with open(os.path.join(point, "after"), "w") as f:
            f.write("x")
    _undo_all(work, state)
    assert_same(before, snapshot_dir(work), "the folder after undoing the next mount's step")


#: run as root in a private mount namespace (``unshare -m``): a world-usable /dev/fuse there (as
#: distributions ship it; bound over this machine's 0600 one, in that namespace only), then
#: ``sandbox mount`` as uid/gid 65534 — through fusermount3 — a program writing on the mount as
#: that user, SIGTERM; prints what it saw as JSON
UNPRIVILEGED_DRIVER = r"""
import json, os, signal, stat, subprocess, sys
devs, work, state, point = sys.argv[1:5]
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=755", "sandbox-devs", devs], check=True)
node = os.path.join(devs, "fuse")
os.mknod(node, 0o666 | stat.S_IFCHR, os.stat("/dev/fuse").st_rdev)
os.chmod(node, 0o666)
subprocess.run(["mount", "--bind", node, "/dev/fuse"], check=True)
nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]

def mounts():
    with open("/proc/self/mountinfo") as f:
        return [line.split() for line in f if line.split()[4] == point]

proc = subprocess.Popen(nobody + [sys.executable, "-m", "sandbox", "mount", "--workdir", work, "--state-dir", state,
                                  point], stderr=subprocess.PIPE, text=True)
out = {"first": proc.stderr.readline(), "mounts": mounts()}
if out["mounts"]:
    program = ("import os, sys; p = sys.argv[1]; open(os.path.join(p, 'new.txt'), 'w').write('made by nobody\\n'); "
               "os.unlink(os.path.join(p, 'README.md')); print(open(os.path.join(p, 'src', 'main.py')).read())")
    r = subprocess.run(nobody + [sys.executable, "-c", program, point], capture_output=True, text=True, timeout=60)
    out["program"] = [r.returncode, r.stdout, r.stderr]
    out["host_new"] = open(os.path.join(work, "new.txt")).read() if os.path.exists(os.path.join(work, "new.txt")) else None
proc.send_signal(signal.SIGTERM)
try:
    out["rc"] = proc.wait(30)
except subprocess.TimeoutExpired:
    proc.kill()
    out["rc"] = "timeout"
out["rest"] = proc.stderr.read()
out["mounts_after"] = mounts()
print(json.dumps(out))
"""


def test_unprivileged_mount_through_fusermount3(tmp_path):
    """`sandbox mount` run as an unprivileged user (uid/gid 65534) on a folder and mount point
    it owns mounts through fusermount3 (no allow_other), serves writes that `sandbox undo`
    then undoes exactly, and unmounts cleanly on SIGTERM."""
    import tempfile

    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    if os.geteuid() != 0:
        pytest.skip("not root: cannot switch to an unprivileged user (setpriv) or make /dev/fuse usable by it")
    for tool in ("fusermount3", "setpriv", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (./dev installs fuse3 and util-linux)")
    base = tempfile.mkdtemp(prefix="sandbox-fusermount-")  # /tmp: traversable by uid 65534, unlike tmp_path
    try:
        os.chmod(base, 0o755)
        work, point, state, devs = (os.path.join(base, n) for n in ("work", "mnt", "state", "devs"))
        for d in (work, point, state, devs):
            os.mkdir(d)
        os.makedirs(os.path.join(work, "src"))
        with open(os.path.join(work, "README.md"), "w") as f:
            f.write("# project\n")
        with open(os.path.join(work, "src", "main.py"), "w") as f:
            f.write("print('hi')\n")
        for d in (work, point, state):
            subprocess.run(["chown", "-R", "65534:65534", d], check=True)
        before = snapshot_dir(work)
        r = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", UNPRIVILEGED_DRIVER,
                            devs, work, state, point], capture_output=True, text=True, cwd=REPO, timeout=120)
        if r.returncode != 0 and "unshare" in r.stderr and "Operation not permitted" in r.stderr:
            pytest.skip(f"no private mount namespace here: {r.stderr.strip()}")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        if not out["mounts"] and "fusermount3 failed" in out["first"] + out["rest"]:
            pytest.skip(f"fusermount3 cannot mount here: {(out['first'] + out['rest']).strip()}")
        assert "mounted at" in out["first"], out
        (fields,) = out["mounts"]
        assert fields[fields.index("-") + 1] == "fuse.sandbox"
        options = fields[fields.index("-") + 3]
        assert "user_id=65534" in options and "allow_other" not in options, options  # fusermount3's mount
        assert "nosuid" in fields[5] and "nodev" in fields[5]
        assert out["program"][0] == 0, out["program"]
        assert out["program"][1] == "print('hi')\n\n"
        assert out["host_new"] == "made by nobody\n"
        assert not os.path.exists(os.path.join(work, "README.md"))
        assert (out["rc"], out["mounts_after"]) == (0, []), out
        st = os.stat(os.path.join(work, "new.txt"))
        assert (st.st_uid, st.st_gid) == (65534, 65534)
        nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        hist = subprocess.run(nobody + [sys.executable, "-m", "sandbox", "history", "--workdir", work, "--state-dir",
                                        state, "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert hist.returncode == 0, hist.stderr
        steps = json.loads(hist.stdout)
        steps = steps.get("steps", steps) if isinstance(steps, dict) else steps
        undo = subprocess.run(nobody + [sys.executable, "-m", "sandbox", "undo", "--workdir", work, "--state-dir", state,
                                        "-n", str(len(steps))], capture_output=True, text=True, cwd=REPO, timeout=120)
        assert undo.returncode == 0, undo.stdout + undo.stderr
        assert_same(before, snapshot_dir(work), "the folder after undoing the unprivileged mount's step")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_sigterm_while_a_program_is_held_ends_it_and_the_mount(folders):
    """SIGTERM while a program is blocked by a hold nobody has answered: the server detaches
    the mount, answers the held request EIO when it stops (the program is not left hanging),
    exits 0; the unanswered hold is denied as the workspace closes, so the step is rolled back."""
    work, point, state = folders
    for i in range(6):
        with open(os.path.join(work, "src", f"f{i}"), "w") as f:
            f.write(str(i))
    before = snapshot_dir(work)
    with mount_with_terminal(work, point, state, "--delete-threshold", "3") as (proc, tty):
        child = subprocess.Popen([sys.executable, "-c", DELETER, os.path.join(point, "src")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _read_until(tty, b"allow it?")
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(STOP_TIMEOUT_S)
            assert child.wait(STOP_TIMEOUT_S) != 0  # its unlink failed (EIO), not left hanging
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            err = child.stderr.read()
            child.stdout.close()
            child.stderr.close()
        assert "Errno 5" in err or "Errno 107" in err, err  # EIO from the server, or ENOTCONN once it is gone
        assert code == 0, proc.stderr.read()
    assert_same(before, snapshot_dir(work), "the folder after a stop with a hold unanswered (denied: rolled back)")
def test_venv_git_clone_and_sed_in_place_on_the_mount_are_undone_exactly(folders, tmp_path):
    """More real programs: ``python -m venv`` (with pip: thousands of files, .pyc writes,
    symlinks), ``git clone`` of a local repository (packs, hooks, checkout), ``git mv`` and a
    commit, ``sed -i`` (an in-place edit: temp file + rename, keeping the mode). Undoing every
    step gives the folder back exactly."""
    work, point, state = folders
    if not shutil.which("git"):
        pytest.skip("git is not installed")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@e", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@e", HOME=str(tmp_path))
    origin = tmp_path / "origin"
    _run(["git", "init", "-q", str(origin)], env=env)
    for i in range(20):
        (origin / f"m{i}.txt").write_text(f"module {i}\n" * (i + 1))
    _run(["git", "add", "-A"], cwd=origin, env=env)
    _run(["git", "commit", "-qm", "origin"], cwd=origin, env=env)
    before = snapshot_dir(work)
    with mount(work, point, state):
        _run([sys.executable, "-m", "venv", os.path.join(point, ".venv")])
        _run([os.path.join(point, ".venv", "bin", "python"), "-c",
              "import sys; open(sys.argv[1], 'w').write(sys.prefix)", os.path.join(point, "prefix.txt")])
        with open(os.path.join(work, "prefix.txt")) as f:
            assert f.read() == os.path.join(point, ".venv")
        _run(["git", "clone", "-q", str(origin), os.path.join(point, "clone")], env=env)
        clone = os.path.join(point, "clone")
        _run(["git", "mv", "m0.txt", "renamed.txt"], cwd=clone, env=env)
        _run(["git", "commit", "-qm", "rename"], cwd=clone, env=env)
        _run(["git", "fsck", "--no-progress"], cwd=clone, env=env)
        _run(["sed", "-i", "s/hi/bye/", os.path.join(point, "src", "main.py")])
        with open(os.path.join(work, "src", "main.py")) as f:
            assert f.read() == "print('bye')\n"
        assert os.stat(os.path.join(work, "src", "main.py")).st_mode & 0o777 == 0o755
    _undo_all(work, state)
    assert_same(before, snapshot_dir(work), "the folder after undoing venv, git clone and sed -i")


#: the file never grows past this (fsx's "maxfilelen")
FILE_BYTES_MAX = 200_000
#: fsx operations per seed
FSX_OPS = scale(400, 4000)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE = 0x01, 0x02, 0x10
FALLOCATE_MODES = (0, FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, FALLOC_FL_ZERO_RANGE)

_libc_fsx = ctypes.CDLL(None, use_errno=True)
_libc_fsx.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc_fsx.fallocate(fd, mode, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class Side:
    """One file and its descriptor (the mount's or the oracle's)."""

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)

    def reopen(self) -> None:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def content(self) -> bytes:
        return os.pread(self.fd, FILE_BYTES_MAX + 1, 0)

    def mapped(self, fn):
        """``fn(map)`` over the whole file mapped MAP_SHARED (nothing to map when empty)."""
        size = self.size()
        if size == 0:
            return None
        mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            return fn(mm)
        finally:
            mm.close()


def _op(rng: random.Random, size: int) -> tuple:
    """One random operation, as data (applied alike to both sides)."""
    kind = rng.choice(("write", "write", "read", "truncate", "mapread", "mapwrite", "mapwrite", "fallocate",
                       "fsync", "reopen"))
    off = rng.randint(0, max(0, min(FILE_BYTES_MAX - 1, size + 4096)))
    n = rng.randint(1, min(20_000, FILE_BYTES_MAX - off))
    if kind == "write":
        return kind, off, rng.randbytes(n)
    if kind == "truncate":
        return kind, rng.randint(0, FILE_BYTES_MAX)
    if kind in ("mapread", "mapwrite"):
        if size == 0:
            return "read", 0, 10
        off = rng.randint(0, size - 1)
        n = rng.randint(1, size - off)
        return (kind, off, rng.randbytes(n)) if kind == "mapwrite" else (kind, off, n)
    if kind == "fallocate":
        return kind, rng.choice(FALLOCATE_MODES), off, n
    return (kind, off, n) if kind == "read" else (kind,)


def _apply(side: Side, op: tuple):
    kind = op[0]
    if kind == "write":
        return os.pwrite(side.fd, op[2], op[1])
    if kind == "read":
        return os.pread(side.fd, op[2], op[1])
    if kind == "truncate":
        return os.ftruncate(side.fd, op[1])
    if kind == "mapread":
        return side.mapped(lambda mm: mm[op[1]:op[1] + op[2]])

    def mapwrite(mm):
        mm[op[1]:op[1] + len(op[2])] = op[2]
        mm.flush()  # msync(MS_SYNC): the dirty pages are written back (WRITE requests) now

    if kind == "mapwrite":
        return side.mapped(mapwrite)
    if kind == "fallocate":
        return _fallocate(side.fd, op[1], op[2], op[3])
    if kind == "fsync":
        return os.fsync(side.fd)
    return side.reopen()


def _outcome(side: Side, op: tuple):
    try:
        return "ok", _apply(side, op)
    except OSError as e:
        return "err", e.errno


def _show(op: tuple) -> str:
    return repr(tuple(f"<{len(a)} bytes>" if isinstance(a, bytes) else a for a in op))


@pytest.mark.parametrize("seed", range(scale(3, 20)))
def test_fsx_random_io_with_mmap_matches_a_plain_file(folders, tmp_path, seed):
    """fsx-style: one file on the mount and one plain file get the same seeded random
    operations — ``pwrite``, ``pread``, ``ftruncate``, reads and writes through a
    ``MAP_SHARED`` mapping (written pages pushed with ``msync``), ``fallocate`` (plain,
    ``KEEP_SIZE``, ``PUNCH_HOLE``, ``ZERO_RANGE``), ``fsync``, close and reopen; after each,
    the outcome (bytes read, or the errno), the size and every byte must agree. Then the
    folder holds those bytes, and undoing every step gives it back exactly.

    FALLOCATE is served (each of those modes through the undo core): its outcome is compared
    like any other operation's. The server runs in its own process (``sandbox mount``):
    a mapping served by the same Python process would deadlock on the GIL (a page fault in
    a memcpy that holds it, waiting for a READ that needs it)."""
    work, point, state = folders
    plain = tmp_path / "plain"
    plain.mkdir()
    for d in (work, str(plain)):
        with open(os.path.join(d, "f"), "wb") as f:
            f.write(bytes(range(256)) * 40)
    before = snapshot_dir(work)
    rng = random.Random(seed)
    done: list[str] = []
    with mount(work, point, state):
        ours, oracle = Side(os.path.join(point, "f")), Side(str(plain / "f"))
        for _ in range(FSX_OPS):
            op = _op(rng, oracle.size())
            o = _outcome(ours, op)
            k = _outcome(oracle, op)
            done.append(_show(op))
            where = f"seed {seed}, op {len(done)}: {done[-1]} (before it: {done[-6:-1]})"
            assert o == k, f"{where}: the mount {o!r}, a plain file {k!r}"
            assert ours.size() == oracle.size(), f"{where}: size {ours.size()} != {oracle.size()}"
            assert ours.content() == oracle.content(), f"{where}: the bytes differ"
        expected = oracle.content()
        os.close(ours.fd)
        os.close(oracle.fd)
    with open(os.path.join(work, "f"), "rb") as f:
        assert f.read() == expected, "the working folder does not hold what was written through the mount"
    assert any(d.startswith("('fallocate'") for d in done), "no fallocate was compared"
    _undo_all(work, state)
    assert_same(before, snapshot_dir(work), "the folder after undoing the random I/O")


def test_no_undo_mount_for_benchmarks_writes_through_without_a_store(folders):
    """The hidden ``--no-undo`` (bench/fuse_local.py's "interception off" side): the same
    mount and dispatcher on a plain read-write Provider — changes land in the folder and no
    undo store is made."""
    work, point, state = folders
    with mount(work, point, state, "--no-undo"):
        with open(os.path.join(point, "new"), "w") as f:
            f.write("plain")
        os.rename(os.path.join(point, "new"), os.path.join(point, "renamed"))
        os.unlink(os.path.join(point, "README.md"))
    with open(os.path.join(work, "renamed")) as f:
        assert f.read() == "plain"
    assert not os.path.exists(os.path.join(work, "README.md"))
    assert os.listdir(state) == [], "--no-undo made an undo store"


def test_op_counts_for_benchmarks_dump_the_requests_on_sigusr1(folders, tmp_path):
    """The hidden ``--op-counts FILE`` (bench/fuse_local.py --counts): each SIGUSR1 appends one
    JSON line with the requests read so far, by opcode, and the invalidations written."""
    import json

    work, point, state = folders
    counts = str(tmp_path / "counts.jsonl")
    with mount(work, point, state, "--op-counts", counts) as proc:
        for _ in range(2):
            assert not os.path.exists(os.path.join(point, "missing"))  # a LOOKUP, then a cached negative entry
        for _ in range(3):
            with open(os.path.join(point, "README.md"), "rb") as f:
                f.read()
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while not (os.path.exists(counts) and open(counts).read().endswith("\n")):  # a condition wait
            assert time.monotonic() < deadline, "no counts were written"
            time.sleep(0.01)
        line = json.loads(open(counts).read().splitlines()[-1])
    assert line["ops"]["INIT"] == 1 and line["ops"]["LOOKUP"] >= 2, line
    # no-open (the watcher runs): the first OPEN is answered ENOSYS, and so is the one FLUSH of
    # that file's close; the kernel then sends neither again, nor any RELEASE
    assert line["ops"]["OPEN"] == 1 and line["ops"].get("FLUSH", 0) == 1, line
    assert "RELEASE" not in line["ops"], line
    assert isinstance(line["notified"], int)


def test_no_open_unlinked_open_files_o_trunc_o_append_and_many_open_files(folders):
    """The mount runs no-open (the watcher runs; docs/fuse.md "No-open"): the kernel sends no
    OPEN/RELEASE and READ/WRITE carry no handle. What that must not break, on the real
    kernel: a file unlinked while open (a temporary file) stays readable and writable; an
    ``O_TRUNC`` open is intercepted (undone exactly); ``O_APPEND`` appends after a host
    append made beside the mount; more files open at once than the server keeps
    descriptors for; a file the host removes after a program on the mount read it."""
    import tempfile

    from sandbox.fuse.dispatcher import NODE_DESCRIPTORS_MAX
    from sandbox.limits import DescriptorBudget, ServerLimits

    # the mount's bound (Dispatcher.node_descriptors_max): it inherits this process's RLIMIT_NOFILE
    share = int(DescriptorBudget().capacity * ServerLimits().open_files_per_connection_share_max)
    node_descriptors_max = max(1, min(NODE_DESCRIPTORS_MAX, share // 2))
    work, point, state = folders
    with open(os.path.join(work, "keep.txt"), "w") as f:
        f.write("precious\n")
    with open(os.path.join(work, "log"), "w") as f:
        f.write("one\n")
    many = node_descriptors_max + 20
    os.mkdir(os.path.join(work, "many"))
    for i in range(many):
        with open(os.path.join(work, "many", str(i)), "w") as f:
            f.write(f"file {i}\n")
    before = snapshot_dir(work)
    with mount(work, point, state) as proc:
        with open(os.path.join(point, "scratch"), "w+b") as t:
            t.write(b"abc")
            os.unlink(os.path.join(point, "scratch"))
            t.write(b"def")
            t.flush()
            t.seek(0)
            assert t.read() == b"abcdef" and os.fstat(t.fileno()).st_size == 6
        with open(os.path.join(point, "README.md"), "r+b") as t:  # an existing file: no I/O before the unlink
            os.unlink(os.path.join(point, "README.md"))
            assert t.read() == b"# project\n"
            t.write(b"gone\n")
            t.seek(0)
            assert t.read() == b"# project\ngone\n"
        with tempfile.TemporaryFile(dir=point) as t:  # create, unlink, then use
            t.write(b"x" * 10000)
            t.seek(9998)
            assert t.read() == b"xx"
        with open(os.path.join(point, "keep.txt"), "w") as f:  # O_TRUNC
            f.write("new\n")
        assert open(os.path.join(work, "keep.txt")).read() == "new\n"
        with open(os.path.join(work, "log"), "a") as f:  # beside the mount
            f.write("host\n")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while os.stat(os.path.join(point, "log")).st_size != 9:  # a condition wait: the watcher's invalidation
            assert time.monotonic() < deadline, "the host's append never showed through the mount"
            time.sleep(0.01)
        with open(os.path.join(point, "log"), "a") as f:
            f.write("two\n")
        assert open(os.path.join(work, "log")).read() == "one\nhost\ntwo\n"
        files = [open(os.path.join(point, "many", str(i)), "rb") for i in range(many)]
        try:
            for i, f in enumerate(files):
                assert f.read() == f"file {i}\n".encode()
            fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
            assert fds < node_descriptors_max * 2 + 64, f"the server holds {fds} descriptors"
            victim = files[-1]
            os.unlink(os.path.join(work, "many", str(many - 1)))  # beside the mount, after it was read
            victim.seek(0)
            assert victim.read() == f"file {many - 1}\n".encode()
        finally:
            for f in files:
                f.close()
        with open(os.path.join(work, "many", str(many - 1)), "w") as f:
            f.write(f"file {many - 1}\n")  # put back beside the mount (not a step of the mount)
        assert proc.poll() is None
    _undo_all(work, state)
    assert open(os.path.join(work, "log")).read() == "one\nhost\n"  # the mount's append undone, the host's kept
    after = snapshot_dir(work)
    for changed_beside in ("log", "many", os.path.join("many", str(many - 1))):
        after.pop(changed_beside)
        before.pop(changed_beside)
    assert_same(before, after, "the folder after undoing the mount's steps")
