"""The POSIX semantics model: our share over the 9P wire against the real kernel (issue 15).

A Hypothesis state machine applies each operation to (a) our share — a real
:class:`~sandbox.ninep.server.NinePServer` on a workspace over a real folder, driven by our
9P client the way a Linux v9fs client drives it — and (b) a plain local directory through
``os.*`` calls (the oracle: the real kernel). It compares the outcome (success or errno)
and, after every rule, both trees: type, mode (set-id and sticky bits included), owner,
size, link count, mtime where it was set explicitly (nanoseconds), content, symlink
targets, listings and ``user.*`` xattrs. Each run ends with an undo of every step and an
oracle-exact comparison with the starting tree.

It runs over three transports. **9P**: our share as above. **FUSE**: the same folder mounted
through ``/dev/fuse`` (an in-process :class:`~sandbox_sim.fuse_mount.ServedMount`), and each
operation is the same ``os.*`` call the oracle makes, on the mount instead of the plain
directory, by the same uid — so over FUSE the host kernel's permission checks
(``default_permissions``, against the attributes we report) are compared too, refusals
included; the tree is read through the mount as root. Differences that only FUSE has are
listed in :data:`FUSE_DIFFERENCES` (and in ``docs/fuse.md``). **FUSE no-open**: the same mount
served coherent, as ``sandbox mount`` with its watcher is (long caches; no OPEN/RELEASE, READ and
WRITE through the nodes' own descriptors, ``O_TRUNC`` as a truncating SETATTR).

Each transport runs twice: as root (attach uid 0, the oracle as root) and as an unprivileged uid
(attach ``n_uname`` 65534; the oracle performs each operation in a forked helper that did
``setresgid``/``setresuid(65534)``). Over raw 9P the permission checks belong to the guest
kernel, so as 65534 only operations the real kernel permits that uid are compared (one it
refuses with ``EACCES``/``EPERM`` is not sent to our share); their resulting ownership and
set-id clearing are.

The namespace is small so that operations collide: directory names (``DIRS``) only ever hold
directories and the other names (``FILES``, two of them 255 bytes long) never do, so no
symlink is ever in the middle of a path (the guest kernel would follow it; this model
checks the server, not the client's path walk).

Where our share differs from the kernel ON PURPOSE, or a fix is still being made on another
branch, the difference is listed in :data:`DIFFERENCES` — the one table, with the reason;
nothing else is skipped.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import stat
import struct
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from sandbox.core.workspace import Workspace
from sandbox.hostfs import NAME_LEN_MAX, join, parent_of
from sandbox.mounts import Provider
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox.ninep.wirefs import WireFS, serve
from sandbox_sim import oracle
from sandbox_sim.budget import scale
from sandbox_sim.fuse_mount import ServedMount, fuse_unavailable

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="the model compares root and uid 65534 behaviour: run as root"),
]

NOBODY = 65534

#: Where our share differs from the real kernel, and why. A key here switches one comparison
#: or one class of rules off; everything else is compared. "pending: <branch>" marks a class
#: another branch of issue 15 is fixing: merge it, then delete the line and see what fails.
DIFFERENCES = {
    "special-owner": "by design: a symlink's, fifo's or socket's owner is the host's (the host never chowns one "
                     "for the guest, and none can carry user xattrs: docs/identity.md, Owners)",
    "special-setid": "by design: a chmod of a fifo or socket drops set-id bits (never applied on the host, no "
                     "user xattr to keep them in: docs/identity.md, Special files)",
}

#: Where the FUSE mount differs from the real kernel and 9P does not; same rules as DIFFERENCES.
FUSE_DIFFERENCES = {
    "special-owner-checks": "by design: follows from special-owner. The host kernel checks ownership on the mount "
                            "against the owner we report, the host's, so a non-root uid that made a symlink, fifo "
                            "or socket there does not own it: chmod, chown, utime, link, unlink and rename of it "
                            "are EPERM/EACCES where the kernel lets its maker (docs/fuse.md). Not compared.",
}
#: the operations whose permission check depends on owning a path they name (see "special-owner-checks")
OWNER_CHECKED_OPS = ("chmod", "chown", "utime", "link", "unlink", "rename")

#: the types whose owner cannot be kept (see "special-owner")
SPECIAL_FMTS = (stat.S_IFLNK, stat.S_IFIFO, stat.S_IFSOCK)
DIRS = ["d", "e", "d/s"]
LONG = "n" * NAME_LEN_MAX
LONG2 = "é" * 127 + "m"  # 255 bytes of UTF-8
FILES = ["f", "g", LONG, "d/f", "d/" + LONG2, "d/s/h"]
MODES = [0o644, 0o600, 0o755, 0o777, 0o4755, 0o2755, 0o6711, 0o1777, 0o2775, 0o000]
DIR_MODES = [0o755, 0o700, 0o777, 0o1777, 0o2775, 0o3777]
UIDS = [0, NOBODY, 1000, -1]
TIMES = [0, 1, 999_999_999, 1_234_567_890_123_456_789, 1_600_000_000_000_000_001]
UTIME_NOW, UTIME_OMIT = "now", "omit"
CLASSES_REFUSED = (errno.EACCES, errno.EPERM)


def run_as(uid: int | None, fn, *args):
    """``fn(*args)`` in this process (uid None) or in a forked child that dropped to ``uid``;
    returns ``("ok", value)`` or ``("err", errno)``."""
    if uid is None:
        try:
            return "ok", fn(*args)
        except OSError as e:
            return "err", e.errno
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            try:
                out = ("ok", fn(*args))
            except OSError as e:
                out = ("err", e.errno)
            except Exception as e:  # a bug in the model: reported, not a silent EOF
                out = ("bug", repr(e))
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return pickle.loads(data)


class Oracle:
    """The real kernel on a plain directory: each operation as one ``os.*`` call."""

    def __init__(self, root: str):
        self.root = root

    def p(self, path: str) -> str:
        return os.path.join(self.root, path) if path else self.root

    def create(self, path, mode):
        os.close(os.open(self.p(path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode))

    def write(self, path, offset, data):
        fd = os.open(self.p(path), os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)

    def truncate(self, path, size):
        fd = os.open(self.p(path), os.O_WRONLY | os.O_NOFOLLOW)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def mkdir(self, path, mode):
        os.mkdir(self.p(path), mode)

    def rmdir(self, path):
        os.rmdir(self.p(path))

    def unlink(self, path):
        os.unlink(self.p(path))

    def rename(self, src, dst):
        os.rename(self.p(src), self.p(dst))

    def link(self, src, dst):
        os.link(self.p(src), self.p(dst), follow_symlinks=False)

    def symlink(self, target, path):
        os.symlink(target, self.p(path))

    def readlink(self, path):
        return os.readlink(self.p(path))

    def chmod(self, path, mode):
        if stat.S_ISLNK(os.lstat(self.p(path)).st_mode):  # fchmodat(AT_SYMLINK_NOFOLLOW) on a symlink
            raise OSError(errno.EOPNOTSUPP, "a symlink's mode cannot be changed", path)
        os.chmod(self.p(path), mode)

    def chown(self, path, uid, gid):
        os.chown(self.p(path), uid, gid, follow_symlinks=False)

    def utime(self, path, atime, mtime):
        _utimensat(self.p(path), atime, mtime)

    def setxattr(self, path, name, value):
        os.setxattr(self.p(path), name, value, follow_symlinks=False)

    def removexattr(self, path, name):
        os.removexattr(self.p(path), name, follow_symlinks=False)

    def mkfifo(self, path, mode):
        os.mkfifo(self.p(path), mode)

    def mksock(self, path, mode):
        os.mknod(self.p(path), stat.S_IFSOCK | mode)

    def tree(self) -> dict:
        out = {}

        def walk(path):
            st_ = os.lstat(self.p(path))
            out[path] = _entry(st_, lambda: open(self.p(path), "rb").read(), lambda: os.readlink(self.p(path)),
                               lambda: {n: os.getxattr(self.p(path), n, follow_symlinks=False)
                                        for n in os.listxattr(self.p(path), follow_symlinks=False)})
            if stat.S_ISDIR(st_.st_mode):
                for name in sorted(os.listdir(self.p(path))):
                    walk(join(path, name))

        walk("")
        return out


_UTIME_NOW_NS, _UTIME_OMIT_NS = (1 << 30) - 1, (1 << 30) - 2


def _utimensat(path: str, atime, mtime) -> None:
    """utimensat(2) with UTIME_NOW / UTIME_OMIT (os.utime cannot say them)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def ts(t):
        if t == UTIME_NOW:
            return (0, _UTIME_NOW_NS)
        if t == UTIME_OMIT:
            return (0, _UTIME_OMIT_NS)
        return divmod(t, 10**9)

    buf = struct.pack("qqqq", *ts(atime), *ts(mtime))
    arr = ctypes.create_string_buffer(buf, len(buf))
    AT_FDCWD, AT_SYMLINK_NOFOLLOW = -100, 0x100
    if libc.utimensat(AT_FDCWD, os.fsencode(path), arr, AT_SYMLINK_NOFOLLOW) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)


def _entry(st_, content, target, xattrs) -> dict:
    mode = st_.st_mode
    e = {"fmt": stat.S_IFMT(mode), "mode": stat.S_IMODE(mode), "uid": st_.st_uid, "gid": st_.st_gid,
         "nlink": st_.st_nlink, "mtime": st_.st_mtime_ns}
    if stat.S_ISREG(mode):
        e["size"], e["content"] = st_.st_size, content()
    if stat.S_ISLNK(mode):
        e["target"] = target()
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        e["xattrs"] = {n: v for n, v in xattrs().items() if n.startswith("user.")}
    return e


class _Attr:
    """An Rgetattr seen as an os.stat_result (the fields :func:`_entry` reads)."""

    def __init__(self, r: m.Rgetattr):
        self.st_mode, self.st_uid, self.st_gid, self.st_nlink = r.mode, r.uid, r.gid, r.nlink
        self.st_size, self.st_mtime_ns = r.size, r.mtime_sec * 10**9 + r.mtime_nsec


class _Attached(WireFS):
    """A WireFS on a client already attached (as the uid under test)."""

    def __init__(self, client: Client):
        self.c, self.host, self.root_fid, self.decide = client, None, client.root_fid, None


class Share:
    """Our share over the wire: each operation as the messages a v9fs client sends."""

    def __init__(self, fs: WireFS, gid: int):
        self.fs, self.c, self.gid = fs, fs.c, gid

    def _new(self, path: str, make) -> None:
        """Create in the parent's fid with the gid a v9fs client sends: its fsgid, or the
        parent's gid when the parent is set-gid (v9fs_get_fsgid_for_create)."""
        parent, name = self.fs._parent(path)
        with self.fs._fid(parent) as fid:
            a = self.c.getattr(fid)
            make(fid, name, a.gid if a.mode & stat.S_ISGID else self.gid)

    def create(self, path, mode):
        self._new(path, lambda fid, name, gid: self.c.lcreate(
            fid, name, m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_EXCL, mode, gid))

    def write(self, path, offset, data):
        self.fs.write(path, offset, data)

    def truncate(self, path, size):
        self.fs.truncate(path, size)

    def mkdir(self, path, mode):
        # the guest's VFS strips S_ISGID from mkdir's mode (vfs_prepare_mode); v9fs adds it back
        # under a set-gid parent (v9fs_vfs_mkdir_dotl), with that parent's gid
        def make(fid, name, gid):
            setgid = self.c.getattr(fid).mode & stat.S_ISGID
            self.c.mkdir(fid, name, (mode & 0o1777) | setgid, gid)

        self._new(path, make)

    def rmdir(self, path):
        self.fs.rmdir(path)

    def unlink(self, path):
        self.fs.unlink(path)

    def rename(self, src, dst):
        self.fs.rename(src, dst)

    def link(self, src, dst):
        self.fs.link(src, dst)

    def symlink(self, target, path):
        self._new(path, lambda fid, name, gid: self.c.symlink(fid, name, target, gid))

    def readlink(self, path):
        return self.fs.readlink(path)

    def chmod(self, path, mode):
        with self.fs._fid(path) as fid:
            self.c.setattr(fid, m.SETATTR_MODE, mode=mode)

    def chown(self, path, uid, gid):
        valid = (m.SETATTR_UID if uid != -1 else 0) | (m.SETATTR_GID if gid != -1 else 0) | m.SETATTR_CTIME
        with self.fs._fid(path) as fid:
            self.c.setattr(fid, valid, uid=max(uid, 0), gid=max(gid, 0))

    def utime(self, path, atime, mtime):
        if atime == mtime == UTIME_OMIT:
            return  # the guest's utimensat returns 0 before any lookup: nothing is sent
        valid = m.SETATTR_CTIME
        a = m_ = (0, 0)
        if atime != UTIME_OMIT:
            valid |= m.SETATTR_ATIME | (0 if atime == UTIME_NOW else m.SETATTR_ATIME_SET)
            a = (0, 0) if atime == UTIME_NOW else divmod(atime, 10**9)
        if mtime != UTIME_OMIT:
            valid |= m.SETATTR_MTIME | (0 if mtime == UTIME_NOW else m.SETATTR_MTIME_SET)
            m_ = (0, 0) if mtime == UTIME_NOW else divmod(mtime, 10**9)
        with self.fs._fid(path) as fid:
            self.c.setattr(fid, valid, atime=a, mtime=m_)

    def setxattr(self, path, name, value):
        self.fs.setxattr(path, name, value)

    def removexattr(self, path, name):
        self.fs.removexattr(path, name)

    def mkfifo(self, path, mode):
        parent, name = self.fs._parent(path)
        with self.fs._fid(parent) as fid:
            self.c.mknod(fid, name, stat.S_IFIFO | mode)

    def mksock(self, path, mode):
        parent, name = self.fs._parent(path)
        with self.fs._fid(parent) as fid:
            self.c.mknod(fid, name, stat.S_IFSOCK | mode)

    def tree(self) -> dict:
        out = {}

        def walk(path):
            with self.fs._fid(path) as fid:
                a = _Attr(self.c.getattr(fid))
            out[path] = _entry(a, lambda: self.fs.read_file(path), lambda: self.fs.readlink(path),
                               lambda: self.fs.xattrs(path))
            if stat.S_ISDIR(a.st_mode):
                for name in sorted(self.fs.listdir(path)):
                    walk(join(path, name))

        walk("")
        return out


def compare(ours: dict, kernel: dict, explicit_mtime: set[str], uid: int | None) -> list[str]:
    """The differences that count (see :data:`DIFFERENCES`)."""
    out = []
    if sorted(ours) != sorted(kernel):
        return [f"listing: ours has {sorted(set(ours) - set(kernel))}, the kernel {sorted(set(kernel) - set(ours))}"]
    for path in sorted(kernel):
        o, k = dict(ours[path]), dict(kernel[path])
        skip = {"mtime"} if path not in explicit_mtime else set()
        if "owners" in DIFFERENCES or (k["fmt"] in SPECIAL_FMTS and "special-owner" in DIFFERENCES):
            skip |= {"uid", "gid"}
        if "setid-clearing" in DIFFERENCES:
            o["mode"] &= ~0o6000 if uid is not None else ~0
            k["mode"] &= ~0o6000 if uid is not None else ~0
        if k["fmt"] in (stat.S_IFIFO, stat.S_IFSOCK) and "special-setid" in DIFFERENCES:
            o["mode"], k["mode"] = o["mode"] & ~0o6000, k["mode"] & ~0o6000
        if path == "":
            skip |= {"mtime", "uid", "gid", "nlink", "xattrs"}
        for key in sorted(set(o) | set(k)):
            if key not in skip and o.get(key) != k.get(key):
                out.append(f"{path or '<root>'}: {key} ours {o.get(key)!r} != kernel {k.get(key)!r}")
    return out


class PosixModel(RuleBasedStateMachine):
    """See the module doc. ``uid`` None: as root; else the unprivileged uid."""

    uid: int | None = None
    tmp = None
    transport = "9p"

    @initialize()
    def start(self):
        self.n = getattr(type(self), "_runs", 0)
        type(self)._runs = self.n + 1
        base = os.path.join(type(self).tmp, f"run{self.n}")
        work, kern = os.path.join(base, "work"), os.path.join(base, "kernel")
        for d in (work, kern):
            os.makedirs(d)
            os.chmod(d, 0o777)  # the unprivileged uid may create at the top
        self.ws = Workspace.open(work, state_dir=os.path.join(base, "state"))
        self.start_snapshot = oracle.snapshot(self.ws.fs.host)
        self.client = self.mounted = None
        if self.transport.startswith("fuse"):
            point = os.path.join(base, "mnt")
            os.makedirs(point)
            # fuse-noopen: served coherent (as with the watcher: long caches, no OPEN/RELEASE)
            self.mounted = ServedMount(Provider.intercepted(self.ws), point, coherent=self.transport == "fuse-noopen")
            try:
                self.mounted.start()
            except OSError as e:
                self.mounted = None
                pytest.skip(f"mounting a FUSE filesystem failed here: {e}")
            self.ours = Oracle(point)  # the same system calls, on the mount
        else:
            self._serve = serve(Provider.intercepted(self.ws))
            _st, sock = self._serve.__enter__()
            self.client = Client.connect_unix(sock)
            self.client.attach(uname="nobody" if self.uid else "root", n_uname=self.uid or 0)
            self.ours = Share(_Attached(self.client), self.uid or 0)
        self.kernel = Oracle(kern)
        self.explicit_mtime: set[str] = set()
        self.compared = 0
        self.umask = os.umask(0)  # restored at teardown: later tests in this process need theirs

    def teardown(self):
        if not hasattr(self, "ws"):
            return
        os.umask(self.umask)
        try:
            if self.mounted is not None:
                self.mounted.stop()
            if self.client is not None:
                self.client.close()
                self._serve.__exit__(None, None, None)
            self.ws.close_active()
            if self.ws.history():
                self.ws.rollback(len(self.ws.history()))
            oracle.assert_same(self.start_snapshot, oracle.snapshot(self.ws.fs.host), "undo of the whole run")
        finally:
            self.ws.close()

    # -- the one step every rule takes --

    def both(self, op: str, *args, touches: tuple[str, ...] = ()):
        """Apply ``op`` to the kernel (as ``uid``) and, unless the kernel refused that uid
        the permission, to our share; compare the outcomes."""
        if (self.transport.startswith("fuse") and self.uid is not None and op in OWNER_CHECKED_OPS
                and "special-owner-checks" in FUSE_DIFFERENCES and self.names_special(op, args)):
            return None
        k = run_as(self.uid, getattr(self.kernel, op), *args)
        if self.transport.startswith("fuse"):  # the host kernel checks permissions on the mount: compared too
            o = run_as(self.uid, getattr(self.ours, op), *args)
        elif self.uid is not None and k[0] == "err" and k[1] in CLASSES_REFUSED:
            return None  # the guest kernel's permission check: never sent to the server
        else:
            o = run_as(None, getattr(self.ours, op), *args)
        assert o == k, f"{op}{tuple(a if len(repr(a)) < 60 else repr(a)[:40] + '…' for a in args)}: ours {o!r}, the kernel {k!r}"
        self.compared += 1
        if k[0] == "ok":
            for p in touches:
                self.explicit_mtime.discard(p)
                self.explicit_mtime.discard(parent_of(p))
            if op in ("rename", "rmdir"):
                self.explicit_mtime.clear()
        return k

    def names_special(self, op: str, args) -> bool:
        """True if a path ``op`` names is a symlink, fifo or socket (in the kernel's tree)."""
        paths = args[:2] if op in ("rename", "link") else args[:1]
        for p in paths:
            try:
                if stat.S_IFMT(os.lstat(self.kernel.p(p)).st_mode) in SPECIAL_FMTS:
                    return True
            except OSError:
                pass
        return False

    @invariant()
    def trees_agree(self):
        if not hasattr(self, "ws"):
            return
        diffs = compare(self.ours.tree(), self.kernel.tree(), self.explicit_mtime, self.uid)
        assert not diffs, "\n".join(diffs)

    # -- rules --

    @rule(path=st.sampled_from(FILES), mode=st.sampled_from(MODES))
    def create(self, path, mode):
        self.both("create", path, mode, touches=(path,))

    def local_to_the_guest(self, path) -> bool:
        """True if ``path`` is a fifo or socket: the guest kernel opens those itself (a pipe,
        ENXIO) and sends the server nothing; the oracle's open would block on a fifo."""
        try:
            return stat.S_IFMT(os.lstat(self.kernel.p(path)).st_mode) in (stat.S_IFIFO, stat.S_IFSOCK)
        except OSError:
            return False

    @rule(path=st.sampled_from(FILES), offset=st.sampled_from([0, 3, 4096]), data=st.binary(max_size=20))
    def write(self, path, offset, data):
        if not self.local_to_the_guest(path):
            self.both("write", path, offset, data, touches=(path,))

    @rule(path=st.sampled_from(FILES), size=st.sampled_from([0, 1, 5000]))
    def truncate(self, path, size):
        if not self.local_to_the_guest(path):
            self.both("truncate", path, size, touches=(path,))

    @rule(path=st.sampled_from(DIRS), mode=st.sampled_from(DIR_MODES))
    def mkdir(self, path, mode):
        self.both("mkdir", path, mode, touches=(path,))

    @rule(path=st.sampled_from(DIRS))
    def rmdir(self, path):
        self.both("rmdir", path, touches=(path,))

    @rule(path=st.sampled_from(FILES))
    def unlink(self, path):
        self.both("unlink", path, touches=(path,))

    @rule(pair=st.one_of(st.tuples(st.sampled_from(FILES), st.sampled_from(FILES)),
                         st.tuples(st.sampled_from(DIRS), st.sampled_from(DIRS))))
    def rename(self, pair):
        self.both("rename", *pair, touches=pair)

    @rule(src=st.sampled_from(FILES), dst=st.sampled_from(FILES))
    def link(self, src, dst):
        self.both("link", src, dst, touches=(src, dst))

    @rule(to=st.sampled_from(["f", "d", "../x", "/etc/passwd", LONG, "a" * 4000]), path=st.sampled_from(FILES))
    def symlink(self, to, path):
        self.both("symlink", to, path, touches=(path,))

    @rule(path=st.sampled_from(FILES))
    def readlink(self, path):
        self.both("readlink", path)

    @rule(path=st.sampled_from(FILES + DIRS), mode=st.sampled_from(MODES + DIR_MODES))
    def chmod(self, path, mode):
        self.both("chmod", path, mode, touches=(path,))

    @precondition(lambda self: "chown" not in DIFFERENCES)
    @rule(path=st.sampled_from(FILES + DIRS), uid=st.sampled_from(UIDS), gid=st.sampled_from(UIDS))
    def chown(self, path, uid, gid):
        self.both("chown", path, uid, gid, touches=(path,))

    @rule(path=st.sampled_from(FILES + DIRS), atime=st.sampled_from(TIMES + [UTIME_NOW, UTIME_OMIT]),
          mtime=st.sampled_from(TIMES + [UTIME_NOW, UTIME_OMIT]))
    def utime(self, path, atime, mtime):
        k = self.both("utime", path, atime, mtime)
        if k is not None and k[0] == "ok":
            if mtime == UTIME_NOW:
                self.explicit_mtime.discard(path)
            elif mtime != UTIME_OMIT:
                self.explicit_mtime.add(path)

    @rule(path=st.sampled_from(FILES + DIRS), name=st.sampled_from(["user.a", "user." + "x" * 200]),
          value=st.binary(max_size=16))
    def setxattr(self, path, name, value):
        self.both("setxattr", path, name, value)

    @rule(path=st.sampled_from(FILES + DIRS), name=st.sampled_from(["user.a", "user." + "x" * 200]))
    def removexattr(self, path, name):
        self.both("removexattr", path, name)

    @precondition(lambda self: "fifo" not in DIFFERENCES)
    @rule(path=st.sampled_from(FILES), mode=st.sampled_from([0o644, 0o600]))
    def mkfifo(self, path, mode):
        self.both("mkfifo", path, mode, touches=(path,))

    @precondition(lambda self: "socket" not in DIFFERENCES)
    @rule(path=st.sampled_from(FILES), mode=st.sampled_from([0o755, 0o600]))
    def mksock(self, path, mode):
        self.both("mksock", path, mode, touches=(path,))


#: the default run replays the same examples every time (CI stays deterministic); the full run
#: (SANDBOX_TEST_FULL=1) explores new ones — a random search found a set-id difference on create
#: still under study (see the issue's note)
SETTINGS = settings(max_examples=scale(12, 150), stateful_step_count=scale(20, 40), deadline=None,
                    derandomize=not os.environ.get("SANDBOX_TEST_FULL"), database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture
def open_tmp():
    """A scratch directory every uid can reach (pytest's tmp_path is 0700 root)."""
    d = tempfile.mkdtemp(prefix="posix-model-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("transport", ["9p", "fuse", "fuse-noopen"])
@pytest.mark.parametrize("uid", [None, NOBODY], ids=["root", "uid65534"])
def test_posix_model(open_tmp, uid, transport):
    if transport.startswith("fuse") and fuse_unavailable():
        pytest.skip(fuse_unavailable())

    class Model(PosixModel):
        pass

    Model.uid, Model.tmp, Model.transport = uid, open_tmp, transport
    run_state_machine_as_test(Model, settings=SETTINGS)


def test_the_differences_table_names_a_reason_for_every_entry():
    for key, why in {**DIFFERENCES, **FUSE_DIFFERENCES}.items():
        assert why.startswith(("pending: wt-", "by design: ")), key
