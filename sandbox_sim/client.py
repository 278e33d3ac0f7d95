"""A simulated filesystem client: what a guest kernel sends for common programs.

Each method issues the same primitive sequence a v9fs/virtiofs client would send to
the server for that program, through the :class:`InterceptedFS` the servers call —
so the simulation exercises exactly the code behind the wire.

:func:`random_op` draws one such program over a small namespace (so names collide,
get reused and move around often) and applies it. Failures with an ``OSError`` are a
normal outcome (renaming a missing file, rmdir of a non-empty directory …): the op is
reported as failed and the tree must be exactly as the failed call left it.
"""

from __future__ import annotations

import errno
import os
import random
import stat
from typing import Any, Callable

from sandbox.core.intercepted_fs import InterceptedFS
from sandbox.hostfs import DIR, REG, join, parent_of
from sandbox.hostfs.memory import MemoryHostFS

NAMES = ("a", "b", "c", "d")
DIRS = ("", "d1", "d2", "d1/e", "d2/e", "d1/e/f")
MODES = (0o644, 0o600, 0o755, 0o700, 0o4755, 0o2750, 0o1777, 0o444)
# trusted.* needs CAP_SYS_ADMIN on a real host (EPERM otherwise, a tolerated failure); over the
# wire it is a guest's privileged name, kept by the server as user.sandbox.x.trusted.three
XATTR_NAMES = ("user.one", "user.two", "trusted.three")


class SimClient:
    def __init__(self, fs: InterceptedFS | Any):
        # an InterceptedFS, or a server driver's client: the 9P one (``WireFS``), a FUSE mount
        # (``MountFS``) — the same calls, no common class (Any: a compiled build checks no type)
        self.fs = fs
        self._kept_tree: tuple[int, tuple] | None = None  # (the simulated disk's ``names``, :meth:`tree`)

    def tree(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """:func:`_tree`; on the simulated disk kept until a directory's entries change
        (``MemoryHostFS.names``: until then every path is the same kind of entry)."""
        host = self.fs.host
        if not isinstance(host, MemoryHostFS):
            return _tree(self.fs)
        kept = self._kept_tree
        if kept is not None and kept[0] == host.names:
            return kept[1]
        tree = _tree(self.fs)
        self._kept_tree = (host.names, tree)
        return tree

    # -- programs --

    def echo_to(self, path: str, data: bytes) -> None:
        """``echo data > path``: open(O_CREAT|O_TRUNC) then write."""
        self.fs.write_file(path, data)

    def append(self, path: str, data: bytes) -> None:
        """``echo data >> path``."""
        size = self.fs.lstat(path).size
        self.fs.write(path, size, data)

    def write_at(self, path: str, offset: int, data: bytes) -> None:
        """``dd conv=notrunc``: overwrite in the middle."""
        self.fs.write(path, offset, data)

    def editor_save(self, path: str, data: bytes) -> None:
        """An editor's safe save: write a temp file beside it, then rename over."""
        tmp = join(parent_of(path), "." + path.rsplit("/", 1)[-1] + ".swp")
        self.fs.create(tmp, 0o644)
        self.fs.write(tmp, 0, data)
        self.fs.rename(tmp, path)

    def rm_rf(self, path: str) -> None:
        self.fs.remove_tree(path)

    def mkdir_p(self, path: str, mode: int = 0o755) -> None:
        self.fs.makedirs(path, mode)

    def cp(self, src: str, dst: str) -> None:
        """``cp src dst`` with copy_file_range, like coreutils."""
        size = self.fs.lstat(src).size
        if not self.fs.exists(dst):
            self.fs.create(dst, 0o644)
        else:
            self.fs.open_trunc(dst)
        done = 0
        while done < size:
            n = self.fs.copy_file_range(src, dst, done, done, size - done)
            if n == 0:
                break
            done += n

    def touch_d(self, path: str, mtime_ns: int) -> None:
        self.fs.utime(path, mtime_ns)


def _tree(fs: InterceptedFS | Any) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The client's view of the tree (what ``ls -R`` would show it), sorted: files,
    directories, other entries. On the simulated disk it is read from the inodes (no host
    calls: the client looking around is not part of the run under test, and fault
    positions count only the calls that are); elsewhere through lstat/listdir."""
    files: list[str] = []
    dirs: list[str] = []
    links: list[str] = []
    if isinstance(fs.host, MemoryHostFS):
        for p, node in fs.host.tree_nodes_kept():
            if p:
                (dirs if node.kind == DIR else files if node.kind == REG else links).append(p)
        return tuple(files), tuple(dirs), tuple(links)

    def walk(p: str) -> None:
        for name in sorted(fs.host.listdir(p)):
            c = join(p, name)
            st = fs.host.lstat(c)
            if st.kind == DIR:
                dirs.append(c)
                walk(c)
            elif st.kind == REG:
                files.append(c)
            else:  # a symlink, or a fifo/socket node: renamed, touched and removed alike
                links.append(c)

    walk("")
    return tuple(files), tuple(dirs), tuple(links)


def _data(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.15:
        return b""
    if kind < 0.8:
        return (rng.choice([b"hello ", b"world ", b"undo "]) * rng.randint(1, 40))[: rng.randint(1, 200)]
    return rng.randbytes(rng.randint(1, 9000))  # big enough to leave the inline path


def _new_path(rng: random.Random) -> str:
    """A name for a new file, link or directory: usually a file name, sometimes the name of a
    directory (which may have been removed — in this step or an earlier one), so that a path
    can change kind and later paths can run into (or through) what took a directory's place."""
    if rng.random() < 0.1:
        return rng.choice(DIRS[1:])
    return join(rng.choice(DIRS), rng.choice(NAMES))


#: where a symlink that replaces a directory points: a directory inside the folder, outside
#: it (absolute and relative), nowhere (dangling) — a release-directory switch, a package
#: manager's `rm -rf d && ln -s …`
REPLACEMENT_LINK_TARGETS = ("d2", "d1/e", "/outside/of/the/root", "../../outside", "nowhere/at/all")

# OPS: what every random workload does. Hard links (``ln``) are in the undo model's programs
# (OPS_UNDO_MODEL) and the seeded tree has some: a rollback makes the names of one inode one
# inode again (sandbox/core/preimage.py LinkGroups; sandbox_sim/test_core.py).
OPS = ("echo", "append", "write_at", "editor_save", "rm_rf", "mkdir_p", "cp", "chmod", "touch", "symlink",
       "setxattr", "removexattr", "fallocate", "punch", "truncate", "rename", "rename_dir", "unlink", "rmdir",
       "mkdir", "replace_dir_by_symlink", "replace_file_by_dir", "replace_symlink_by_dir", "replace_dir_by_file")
OPS_WITH_HARDLINKS = OPS + ("hardlink",)
#: the undo model's programs: OPS plus ``mkfifo`` and a unix socket's ``bind`` (a socket node),
#: which later programs move, touch and remove (``rm -rf`` of trees holding them) like symlinks
OPS_WITH_SPECIALS = OPS + ("mkfifo", "mksock")
#: the undo model's programs on a filesystem that has ``exchange`` (renameat2 RENAME_EXCHANGE,
#: as ``mv --exchange``): any two entries swap, files with directories too. 9P has no exchange:
#: its driver's filesystem lacks the method and the op is then a plain ``mv``. And ``ln`` (twice
#: as likely as another op): later programs write, rename over, replace and remove its names.
OPS_UNDO_MODEL = OPS_WITH_SPECIALS + ("exchange", "hardlink", "hardlink")
#: the undo model's programs plus what a program does through an open descriptor (what the
#: 9P and FUSE servers call with a file's handle and where the file is now): writes after
#: the file was renamed or lost a name, ftruncate/fchmod/futime/fsetxattr, fallocate, and
#: copy_file_range between two descriptors. A campaign's ``--programs handles``.
OPS_WITH_HANDLES = OPS_UNDO_MODEL + ("fd_write_after_mv", "fd_write_after_rm", "fd_meta", "fd_fallocate", "fd_copy_range")
#: a campaign's program sets, by the name its config keeps (``programs``; absent: ``undo``)
PROGRAM_SETS = {"undo": OPS_UNDO_MODEL, "handles": OPS_WITH_HANDLES}


def random_op(client: SimClient, rng: random.Random, clock_ns: int, ops: tuple[str, ...] = OPS) -> tuple[str, bool]:
    """Apply one random program; returns (description, succeeded)."""
    fs = client.fs
    files, dirs, links = client.tree()
    anything = files + dirs + links
    op = rng.choice(ops)
    pick = lambda xs, fallback: rng.choice(xs) if xs else fallback  # noqa: E731
    try:
        if op == "echo":
            p = pick(files, _new_path(rng)) if rng.random() < 0.6 else _new_path(rng)
            desc = f"echo > {p}"
            client.echo_to(p, _data(rng))
        elif op == "append":
            p = pick(files, _new_path(rng))
            desc = f"echo >> {p}"
            client.append(p, _data(rng) or b"x")
        elif op == "write_at":
            p = pick(files, _new_path(rng))
            desc = f"dd {p}"
            client.write_at(p, rng.randint(0, 300), _data(rng) or b"y")
        elif op == "editor_save":
            p = pick(files, _new_path(rng))
            desc = f"save {p}"
            client.editor_save(p, _data(rng))
        elif op == "rm_rf":
            p = pick(anything, "d1")
            desc = f"rm -rf {p}"
            client.rm_rf(p)
        elif op == "mkdir_p":
            p = rng.choice(DIRS[1:]) + rng.choice(("", "/g", "/g/h"))
            desc = f"mkdir -p {p}"
            client.mkdir_p(p, rng.choice((0o755, 0o700, 0o2775)))
        elif op == "cp":
            s, d = pick(files, "a"), _new_path(rng)
            desc = f"cp {s} {d}"
            client.cp(s, d)
        elif op == "chmod":
            p = pick(files + dirs, "")
            m = rng.choice(MODES)
            desc = f"chmod {m:o} {p or '.'}"
            fs.chmod(p, m)
        elif op == "touch":
            p = pick(anything, "")
            t = clock_ns - rng.randint(0, 10**12)
            desc = f"touch -h -d @{t} {p or '.'}"
            client.touch_d(p, t)
        elif op == "symlink":
            p = _new_path(rng)
            target = rng.choice(("a", "../b", "/etc/passwd", "d1/e", "nowhere/x", "../../../outside"))
            desc = f"ln -s {target} {p}"
            fs.symlink(target, p)
        elif op in ("mkfifo", "mksock"):
            p = _new_path(rng)
            m = rng.choice(MODES)
            desc = f"{op} -m {m:o} {p}"
            fs.mknod(p, m, stat.S_IFIFO if op == "mkfifo" else stat.S_IFSOCK)
        elif op == "hardlink":
            s, d = pick(files, "a"), _new_path(rng)
            desc = f"ln {s} {d}"
            fs.link(s, d)
        elif op == "setxattr":
            p = pick(files + dirs, "")
            n = rng.choice(XATTR_NAMES)
            desc = f"setfattr -n {n} {p or '.'}"
            fs.setxattr(p, n, rng.randbytes(rng.randint(0, 30)))
        elif op == "removexattr":
            p = pick(files + dirs, "")
            n = rng.choice(XATTR_NAMES)
            desc = f"setfattr -x {n} {p or '.'}"
            fs.removexattr(p, n)
        elif op == "fallocate":
            p = pick(files, _new_path(rng))
            desc = f"fallocate {p}"
            fs.fallocate(p, rng.randint(0, 500), rng.randint(1, 5000), rng.choice((0, 1)))
        elif op == "punch":
            p = pick(files, _new_path(rng))
            desc = f"fallocate -p {p}"
            fs.fallocate(p, rng.randint(0, 100), rng.randint(1, 200), 3)
        elif op == "truncate":
            p = pick(files, _new_path(rng))
            desc = f"truncate {p}"
            fs.truncate(p, rng.randint(0, 400))
        elif op == "rename":
            s, d = pick(files + links, "a"), pick(files, _new_path(rng)) if rng.random() < 0.4 else _new_path(rng)
            desc = f"mv {s} {d}"
            fs.rename(s, d)
        elif op == "rename_dir":
            s = pick(dirs, "d1")
            d = pick(dirs, "d3") if rng.random() < 0.3 else rng.choice(("d3", "d2/moved", "d1/e/moved", "x"))
            desc = f"mv {s}/ {d}"
            fs.rename(s, d)
        elif op == "exchange":
            s, d = pick(anything, "a"), pick(anything, "d1") if rng.random() < 0.8 else _new_path(rng)
            if not hasattr(fs, "exchange"):
                desc = f"mv {s} {d}"
                fs.rename(s, d)
            else:
                desc = f"mv --exchange {s} {d}"
                fs.exchange(s, d)
        elif op == "unlink":
            p = pick(files + links, "a")
            desc = f"rm {p}"
            fs.unlink(p)
        elif op == "mkdir":  # a directory where a file or a link is (EEXIST) or was
            p = _new_path(rng)
            desc = f"mkdir {p}"
            fs.mkdir(p, rng.choice((0o755, 0o700)))
        elif op == "replace_dir_by_symlink":
            p = pick(dirs, rng.choice(DIRS[1:])) if rng.random() < 0.8 else rng.choice(DIRS[1:])
            target = rng.choice(REPLACEMENT_LINK_TARGETS)
            desc = f"rm -rf {p} && ln -s {target} {p}"
            client.rm_rf(p)
            fs.symlink(target, p)
        elif op == "replace_file_by_dir":
            p = pick(files, _new_path(rng))
            desc = f"rm -f {p} && mkdir {p}"
            client.rm_rf(p)
            client.mkdir_p(p, rng.choice((0o755, 0o700)))
            if rng.random() < 0.5:
                client.echo_to(join(p, rng.choice(NAMES)), _data(rng))
        elif op == "replace_symlink_by_dir":
            p = pick(links, _new_path(rng))
            desc = f"rm -f {p} && mkdir {p}"
            client.rm_rf(p)
            fs.mkdir(p, 0o755)
        elif op == "replace_dir_by_file":
            p = pick(dirs, rng.choice(DIRS[1:]))
            desc = f"rm -rf {p} && echo > {p}"
            client.rm_rf(p)
            client.echo_to(p, _data(rng))
        elif op.startswith("fd_"):
            desc, program = _descriptor_program(client, rng, op, files, clock_ns)
            program()
        else:
            p = pick(dirs, "d1")
            desc = f"rmdir {p}"
            fs.rmdir(p)
    except OSError as e:
        if e.errno is None or isinstance(e, PermissionError) and e.errno != errno.EPERM:
            raise
        return f"{desc} -> {errno.errorcode.get(e.errno, e.errno)}", False
    return desc, True


def _descriptor_program(client: SimClient, rng: random.Random, op: str, files: tuple[str, ...],
                        clock_ns: int) -> tuple[str, Callable[[], None]]:
    """One of OPS_WITH_HANDLES' descriptor programs: its description and the program. Files are
    opened without ``O_CREAT`` (a server creates through the create hook, never ``open``)."""
    fs = client.fs
    p = rng.choice(files) if files else "a"
    off, data = rng.randint(0, 300), _data(rng) or b"z"
    if op == "fd_copy_range":
        d = rng.choice(files) if files else "b"  # sometimes the same file

        def copy() -> None:
            with fs.open(p, os.O_RDONLY) as src, fs.open(d, os.O_RDWR) as dst:
                fs.fcopy_file_range(src, dst, d, rng.randint(0, 100), off, rng.randint(1, 5000))
        return f"exec 3<{p} 4<>{d}; copy_file_range 3 4", copy
    if op == "fd_write_after_mv":
        q = join(parent_of(p), rng.choice(NAMES)) if rng.random() < 0.5 else _new_path(rng)

        def write_after_mv() -> None:
            with fs.open(p, os.O_RDWR) as h:
                fs.rename(p, q)
                fs.pwrite(h, q, off, data)
        return f"exec 3<>{p}; mv {p} {q}; dd >&3", write_after_mv
    if op == "fd_write_after_rm":
        def write_after_rm() -> None:  # the bytes reach its other names, if any; else no name shows them
            with fs.open(p, os.O_RDWR) as h:
                ino = fs.lstat(p).ino
                others = [q for q in files if q != p and fs.lstat(q).ino == ino]
                fs.unlink(p)
                fs.pwrite(h, others[0] if others else p, off, data)
        return f"exec 3<>{p}; rm {p}; dd >&3", write_after_rm
    if op == "fd_meta":
        size, mode, mtime = rng.randint(0, 400), rng.choice(MODES), clock_ns - rng.randint(0, 10**12)
        name, value = rng.choice(XATTR_NAMES[:2]), rng.randbytes(rng.randint(0, 30))

        def meta() -> None:
            with fs.open(p, os.O_RDWR) as h:
                fs.ftruncate(h, p, size)
                fs.fchmod(h, p, mode)
                fs.futime(h, p, mtime)
                fs.fsetxattr(h, p, name, value)
        return f"exec 3<>{p}; truncate -s {size}, chmod {mode:o}, touch, setfattr -n {name} >&3", meta
    length, mode = rng.randint(1, 5000), rng.choice((0, 1, 3))

    def fallocate() -> None:
        with fs.open(p, os.O_RDWR) as h:
            fs.ffallocate(h, p, off, length, mode)
    return f"exec 3<>{p}; fallocate -m {mode} >&3", fallocate


def seed_tree(fs, rng: random.Random, files: int = 8) -> None:
    """Populate a raw HostFS (not intercepted) with a small mixed tree."""
    for d in ("d1", "d2", "d1/e"):
        fs.mkdir(d, 0o755)
    for _ in range(files):
        p = join(rng.choice(("", "d1", "d2", "d1/e")), rng.choice(NAMES))
        try:
            fs.create(p, rng.choice(MODES))
        except FileExistsError:
            continue
        data = _data(rng)
        if data:
            fs.write_all(p, 0, data)
        if rng.random() < 0.3:
            fs.setxattr(p, "user.one", b"seeded")
    fs.symlink("a", "d2/link")
    _link_some(fs, rng)
    fs.setxattr("d1", "user.two", b"dir-xattr")
    _give_some_away(fs)
    fs.utime("", 1_600_000_000_123_456_789)


def _link_some(fs, rng: random.Random) -> None:
    """Hard links in the seeded tree (a ``cp -al`` backup, a pnpm store): a few files get a
    second (sometimes a third) name in another directory."""
    files = [join(d, n) for d in ("", "d1", "d2", "d1/e") for n in sorted(fs.listdir(d))
             if fs.lstat(join(d, n)).kind == REG]
    for p in rng.sample(files, min(len(files), rng.randint(1, 3))):
        for _ in range(rng.choice((1, 1, 2))):
            q = join(rng.choice(("", "d1", "d2", "d1/e")), rng.choice(NAMES) + ".ln")
            if fs.lstat_or_none(q) is None:
                fs.link(p, q)


def _give_some_away(fs) -> None:
    """Entries of other host users (a shared checkout): undo must give them back to their
    owners, not to whoever undoes. Only where the process may (root, or the simulation);
    no random draw, so every seed's tree is what it was."""
    owned = [("d1/e", 1000, 1000), ("d2/link", 1001, 1002)]
    files = sorted(n for n in fs.listdir("d1") if fs.lstat(f"d1/{n}").kind == "reg")
    owned += [(f"d1/{files[0]}", 1003, 1004)] if files else []
    for path, uid, gid in owned:
        try:
            fs.lchown(path, uid, gid)
        except PermissionError:
            return
