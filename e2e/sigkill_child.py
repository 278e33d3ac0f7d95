"""Child process for ``e2e/test_sigkill_recovery.py`` (and a library the test imports).

The test (the parent) builds a tree with :func:`build_tree`, snapshots it, and runs this
file as a separate Python process::

    python sigkill_child.py WORKDIR STATE_DIR SEED FLAGS STOP

which opens a :class:`sandbox.Workspace` on WORKDIR and applies ONE large step — the
primitive operations of :func:`make_plan` — through ``ws.fs``. The plan is computed
from SEED and FLAGS alone (``x``: use user xattrs, ``-``: do not), so parent and child
agree on it without passing it around.

Progress protocol (one line per event on stdout, flushed at once)::

    open            Workspace.open returned (any recovery it did is finished)
    step <id>       the step is open (its journal header is durable)
    op <n>          the n-th primitive operation (1-based) has returned
    restored <n>    (STOP modes recover:/rollback:) the n-th record undo has returned
    pause           the child stopped at STOP and waits, doing nothing, to be killed
    closed          (STOP finish) the step was closed and the workspace released

STOP is where the child stops and waits (blocked reading stdin) for the parent's
SIGKILL: ``open`` (before any step), an integer ``N`` (after N operations; ``N`` = the
plan's length is "after the last op, before the step closed"), ``begin-journal`` (inside
``UndoLog.begin``, after the WAL directory exists and before its journal does),
``recover:K`` (reopen a store that holds an in-progress step and stop after K record
undos of its recovery), ``rollback:K`` (roll back the newest finished step and stop after
K record undos), or ``finish`` (apply the whole plan, close the step, exit 0).

If stdin reaches EOF while paused (the parent died) the child exits at once with
``os._exit`` so that nothing is closed or cleaned up on the parent's behalf.
"""

from __future__ import annotations

import functools
import os
import random
import sys

# --------------------------------------------------------------------------- the tree

DIR_MODES = (0o755, 0o755, 0o700, 0o750, 0o2775, 0o1777)
FILE_MODES = (0o644, 0o644, 0o600, 0o755, 0o4755, 0o640, 0o2755)
NEW_FILE_MODES = (0o644, 0o600, 0o755)
CHMOD_FILE_MODES = (0o600, 0o4755, 0o755, 0o640, 0o2755)
CHMOD_DIR_MODES = (0o700, 0o2755, 0o750, 0o1777)
BASE_NS = 1_500_000_000 * 10**9


def _data(rng: random.Random, size: int) -> bytes:
    """Random bytes (incompressible) or repetitive text (compressible)."""
    if size == 0:
        return b""
    if rng.random() < 0.5:
        return rng.randbytes(size)
    word = f"line {rng.randrange(10**6)} of some source text\n".encode()
    return (word * (size // len(word) + 1))[:size]


def _size(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.50:
        return rng.randrange(1, 300)
    if r < 0.80:
        return rng.randrange(300, 6000)
    if r < 0.95:
        return rng.randrange(6000, 60000)
    return rng.randrange(64 * 1024, 256 * 1024)  # at/over REFLINK_MIN_BYTES: blob files


# Hand-made trees and steps, addressed by name instead of an integer seed: each is the
# smallest reproduction of one bug found by the randomized trials (see the test file).
SCENARIOS: dict[str, tuple[tuple, tuple]] = {
    # a file's content changes, then the file is deleted, in one step
    "write_then_unlink": (
        (("dir", "d", 0o755, (), BASE_NS + 1_000_000_001),
         ("file", "d/f", 0o644, b"hello", (), BASE_NS + 2_000_000_002),
         ("dir", "", 0o755, (), BASE_NS + 3_000_000_003)),
        (("write", "d/f", 0, b"HELLO"), ("unlink", "d/f")),
    ),
    # a file renamed onto another existing file
    "rename_over": (
        (("file", "a", 0o644, b"content of a", (), BASE_NS + 1_000_000_001),
         ("file", "b", 0o600, b"content of b", (), BASE_NS + 2_000_000_002),
         ("dir", "", 0o755, (), BASE_NS + 3_000_000_003)),
        (("rename", "a", "b"),),
    ),
}


@functools.lru_cache(maxsize=8)
def tree_spec(seed: int | str, xattrs: bool, nfiles: int = 400, ndirs: int = 45, nlinks: int = 24) -> tuple:
    """The pre-step tree: an ordered tuple of entries, parents before children.

    ("dir", path, mode, xattrs, mtime_ns) / ("file", path, mode, data, xattrs, mtime_ns)
    / ("link", path, target, mtime_ns). The root is ("dir", "", ...), last in the tuple
    only in the sense that build_tree sets directory times after all content.
    """
    if isinstance(seed, str):
        return SCENARIOS[seed][0]
    rng = random.Random(f"tree-{seed}")
    t = BASE_NS + rng.randrange(10**9)

    def mtime() -> int:
        return t + rng.randrange(10**15)

    def xa() -> tuple:
        if not xattrs or rng.random() > 0.12:
            return ()
        return tuple(sorted({f"user.k{rng.randrange(3)}": rng.randbytes(rng.randrange(0, 40)) for _ in range(rng.randrange(1, 3))}.items()))

    entries: list[tuple] = []
    dirs = [""]
    depth = {"": 0}
    for i in range(ndirs):
        parent = rng.choice([d for d in dirs if depth[d] < 4])
        path = f"{parent}/d{i}" if parent else f"d{i}"
        dirs.append(path)
        depth[path] = depth[parent] + 1
        entries.append(("dir", path, rng.choice(DIR_MODES), xa(), mtime()))
    files = []
    for i in range(nfiles):
        parent = rng.choice(dirs)
        path = f"{parent}/f{i}" if parent else f"f{i}"
        files.append(path)
        entries.append(("file", path, rng.choice(FILE_MODES), _data(rng, _size(rng)), xa(), mtime()))
    for i in range(nlinks):
        parent = rng.choice(dirs)
        path = f"{parent}/l{i}" if parent else f"l{i}"
        target = rng.choice([
            os.path.relpath(rng.choice(files), parent or "."),  # a file (relative)
            os.path.relpath(rng.choice(dirs[1:]), parent or "."),  # a directory
            "does/not/exist",  # dangling
            "/etc/passwd",  # absolute: data, never followed
        ])
        entries.append(("link", path, target, mtime()))
    entries.append(("dir", "", 0o755, xa(), mtime()))  # the root's own metadata
    return tuple(entries)


def build_tree(root: str, seed: int | str, xattrs: bool) -> None:
    """Create the tree of :func:`tree_spec` under the existing directory ``root``."""
    spec = tree_spec(seed, xattrs)
    dir_meta = []
    for e in spec:
        kind, path = e[0], e[1]
        full = os.path.join(root, path) if path else root
        if kind == "dir":
            if path:
                os.mkdir(full)
            dir_meta.append(e)
        elif kind == "file":
            _, _, mode, data, xs, mt = e
            with open(full, "wb") as f:
                f.write(data)
            for name, value in xs:
                os.setxattr(full, name, value)
            os.chmod(full, mode)
            os.utime(full, ns=(mt, mt))
        else:
            _, _, target, mt = e
            os.symlink(target, full)
            os.utime(full, ns=(mt, mt), follow_symlinks=False)
    # directories last, deepest first, so no later entry change moves their mtime
    for _, path, mode, xs, mt in sorted(dir_meta, key=lambda e: -e[1].count("/") - (1 if e[1] else 0)):
        full = os.path.join(root, path) if path else root
        for name, value in xs:
            os.setxattr(full, name, value)
        os.chmod(full, mode)
        os.utime(full, ns=(mt, mt))


# --------------------------------------------------------------------------- the plan


class _Node:
    """One inode as the plan sees it (hardlinked names share one _Node)."""

    __slots__ = ("kind", "size", "xattrs")

    def __init__(self, kind: str, size: int = 0, xattrs=()):
        self.kind, self.size, self.xattrs = kind, size, set(xattrs)


class _Model:
    """What the tree looks like as the plan goes: path -> _Node."""

    def __init__(self, spec):
        self.e: dict[str, _Node] = {}
        for e in spec:
            if e[0] == "dir":
                self.e[e[1]] = _Node("dir", 0, (n for n, _ in e[3]))
            elif e[0] == "file":
                self.e[e[1]] = _Node("reg", len(e[3]), (n for n, _ in e[4]))
            else:
                self.e[e[1]] = _Node("lnk")

    def of(self, kind: str) -> list[str]:
        return sorted(p for p, v in self.e.items() if v.kind == kind and p)

    def subtree(self, d: str) -> list[str]:
        """``d`` and everything below it, deepest first (the order rm -rf removes them)."""
        return sorted((p for p in self.e if p == d or p.startswith(d + "/")), key=lambda p: -p.count("/"))

    def move(self, src: str, dst: str) -> None:
        for p in [p for p in self.e if p == src or p.startswith(src + "/")]:
            self.e[dst + p[len(src):]] = self.e.pop(p)


@functools.lru_cache(maxsize=8)
def make_plan(seed: int | str, xattrs: bool, actions: int = 130) -> tuple:
    """The step: a tuple of primitive operations (each one ``ws.fs`` call)."""
    if isinstance(seed, str):
        return SCENARIOS[seed][1]
    rng = random.Random(f"plan-{seed}")
    m = _Model(tree_spec(seed, xattrs))
    ops: list[tuple] = []
    fresh = iter(range(10**6))

    def new_name(parent: str, prefix: str) -> str:
        while True:
            name = f"{prefix}{next(fresh)}"
            p = f"{parent}/{name}" if parent else name
            if p not in m.e:
                return p

    def write_data(p: str, offset: int, size: int) -> None:
        # one to three write calls, like a program writing in chunks
        cuts = sorted(rng.sample(range(1, size), min(2, size - 1))) if size > 2 and rng.random() < 0.4 else []
        start = 0
        for end in cuts + [size]:
            ops.append(("write", p, offset + start, _data(rng, end - start)))
            start = end
        m.e[p].size = max(m.e[p].size, offset + size)

    def rename_dir() -> None:
        src = rng.choice(m.of("dir"))
        parents = [d for d in [""] + m.of("dir") if d != src and not d.startswith(src + "/")]
        dst = new_name(rng.choice(parents), "rd")
        ops.append(("rename", src, dst))
        m.move(src, dst)

    def act(kind: str) -> None:
        files, dirs, links = m.of("reg"), m.of("dir"), m.of("lnk")
        if kind == "rewrite" and files:  # open(O_TRUNC) + write
            p = rng.choice(files)
            ops.append(("open_trunc", p))
            m.e[p].size = 0
            size = _size(rng)
            if size:
                write_data(p, 0, size)
        elif kind == "append" and files:
            p = rng.choice(files)
            write_data(p, m.e[p].size, rng.randrange(1, 5000))
        elif kind == "patch" and files:  # write in the middle
            p = rng.choice(files)
            if m.e[p].size > 1:
                off = rng.randrange(m.e[p].size)
                ops.append(("write", p, off, _data(rng, rng.randrange(1, 200))))
                m.e[p].size = max(m.e[p].size, off + len(ops[-1][3]))
        elif kind == "truncate" and files:
            p = rng.choice(files)
            n = rng.randrange(0, m.e[p].size + 3000)
            ops.append(("truncate", p, n))
            m.e[p].size = n
        elif kind == "fallocate" and files:
            p = rng.choice(files)
            ops.append(("fallocate", p, m.e[p].size, 4096))
            m.e[p].size += 4096
        elif kind == "unlink" and files + links:
            p = rng.choice(files + links)
            ops.append(("unlink", p))
            del m.e[p]
        elif kind == "rm_rf" and dirs:  # rm -rf: one unlink/rmdir per entry, children first
            d = rng.choice([d for d in dirs if len(m.subtree(d)) <= 25] or dirs)
            for p in m.subtree(d):
                ops.append(("rmdir" if m.e[p].kind == "dir" else "unlink", p))
                del m.e[p]
        elif kind == "rename_dir" and dirs:
            rename_dir()
        elif kind == "rename_file" and files:
            src = rng.choice(files)
            dst = new_name(rng.choice([""] + dirs), "rf")
            ops.append(("rename", src, dst))
            m.move(src, dst)
        elif kind == "rename_over" and len(files) > 1:  # onto an existing file
            src, dst = rng.sample(files, 2)
            if m.e[src] is m.e[dst]:
                return  # two names of one inode: rename(2) would do nothing
            ops.append(("rename", src, dst))
            del m.e[dst]
            m.move(src, dst)
        elif kind == "editor_save" and files:  # mv f f~; write a new f
            p = rng.choice(files)
            backup = p + "~"
            if backup in m.e and (m.e[backup].kind != "reg" or m.e[backup] is m.e[p]):
                return
            ops.append(("rename", p, backup))
            m.e.pop(backup, None)
            m.move(p, backup)
            ops.append(("create", p, rng.choice(NEW_FILE_MODES)))
            m.e[p] = _Node("reg")
            write_data(p, 0, rng.randrange(1, 3000))
        elif kind == "temp_rename" and files:  # write a temp file, rename it over the real one
            p = rng.choice(files)
            parent = p.rsplit("/", 1)[0] if "/" in p else ""
            tmp = new_name(parent, ".tmp")
            ops.append(("create", tmp, 0o600))
            m.e[tmp] = _Node("reg")
            write_data(tmp, 0, _size(rng) or 1)
            ops.append(("rename", tmp, p))
            del m.e[p]
            m.move(tmp, p)
        elif kind == "create":
            p = new_name(rng.choice([""] + dirs), "nf")
            ops.append(("create", p, rng.choice(NEW_FILE_MODES)))
            m.e[p] = _Node("reg")
            size = _size(rng)
            if size:
                write_data(p, 0, size)
        elif kind == "mkdir":
            d = new_name(rng.choice([""] + dirs), "nd")
            ops.append(("mkdir", d, rng.choice((0o755, 0o700, 0o2775))))
            m.e[d] = _Node("dir")
            for _ in range(rng.randrange(0, 4)):
                p = new_name(d, "nf")
                ops.append(("create", p, 0o644))
                m.e[p] = _Node("reg")
                write_data(p, 0, rng.randrange(1, 2000))
        elif kind == "symlink":
            p = new_name(rng.choice([""] + dirs), "nl")
            ops.append(("symlink", rng.choice(["x/y", "../up", "/abs/target", "nf0"]), p))
            m.e[p] = _Node("lnk")
        elif kind == "link" and files:
            target = rng.choice(files)
            p = new_name(rng.choice([""] + dirs), "hl")
            ops.append(("link", target, p))
            m.e[p] = m.e[target]  # one inode, two names: size and xattrs are shared
        elif kind == "chmod":
            if dirs and rng.random() < 0.3:
                ops.append(("chmod", rng.choice(dirs), rng.choice(CHMOD_DIR_MODES)))
            elif files:
                ops.append(("chmod", rng.choice(files), rng.choice(CHMOD_FILE_MODES)))
        elif kind == "utime":
            p = rng.choice([""] + files + dirs + links)
            ops.append(("utime", p, BASE_NS + rng.randrange(10**16)))
        elif kind == "setxattr" and xattrs and files + dirs:
            p = rng.choice(files + dirs)
            name = f"user.k{rng.randrange(4)}"
            ops.append(("setxattr", p, name, rng.randbytes(rng.randrange(0, 60))))
            m.e[p].xattrs.add(name)
        elif kind == "removexattr" and xattrs:
            have = [p for p in files + dirs if m.e[p].xattrs]
            if have:
                p = rng.choice(have)
                name = rng.choice(sorted(m.e[p].xattrs))
                ops.append(("removexattr", p, name))
                m.e[p].xattrs.discard(name)

    kinds = {"rewrite": 14, "append": 6, "patch": 4, "truncate": 4, "fallocate": 1, "unlink": 8, "rm_rf": 2,
             "rename_dir": 3, "rename_file": 4, "rename_over": 4, "editor_save": 4, "temp_rename": 4, "create": 10,
             "mkdir": 4, "symlink": 3, "link": 2, "chmod": 6, "utime": 5, "setxattr": 4, "removexattr": 2}
    names, weights = zip(*sorted(kinds.items()))
    rename_dir()  # every plan renames a directory early, and works inside it afterwards
    for _ in range(actions):
        act(rng.choices(names, weights)[0])
    return tuple(ops)


def apply_op(fs, op: tuple) -> None:
    name, args = op[0], op[1:]
    if name == "open_trunc":
        fs.open_trunc(*args)
    elif name == "write":
        fs.write(*args)
    else:
        getattr(fs, name)(*args)


# --------------------------------------------------------------------------- the child


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _pause() -> None:
    """Wait to be killed. EOF on stdin means the parent is gone: die without cleanup."""
    _say("pause")
    sys.stdin.buffer.read()
    os._exit(3)


def _count_restores(stop_after: int) -> None:
    """Report every record undo; stop (still inside it, after it ran) at the given one."""
    from sandbox.core import preimage

    real = preimage.restore
    done = [0]

    def restore(*args, **kwargs):
        real(*args, **kwargs)
        done[0] += 1
        _say(f"restored {done[0]}")
        if done[0] == stop_after:
            _pause()

    preimage.restore = restore  # store.py calls preimage.restore through the module


def main(argv: list[str]) -> int:
    workdir, state_dir, seed, flags, stop = argv[1], argv[2], argv[3], argv[4], argv[5]
    seed = int(seed) if seed.lstrip("-").isdigit() else seed
    xattrs = "x" in flags
    from sandbox import Workspace

    if stop.startswith("recover:"):
        _count_restores(int(stop.split(":", 1)[1]))
        ws = Workspace.open(workdir, state_dir=state_dir)
        _say("open")
        ws.close()
        return 0
    if stop.startswith("rollback:"):
        _count_restores(int(stop.split(":", 1)[1]))
        ws = Workspace.open(workdir, state_dir=state_dir)
        _say("open")
        ws.rollback(1)
        ws.close()
        _say("closed")
        return 0
    if stop == "begin-journal":
        from sandbox.hostfs.real import RealHostFS

        real_create = RealHostFS.create

        def create(self, path, mode):
            if self.name == "store" and path == "wal/in_progress/journal.jsonl":
                _pause()
            return real_create(self, path, mode)

        RealHostFS.create = create

    plan = make_plan(seed, xattrs)
    ws = Workspace.open(workdir, state_dir=state_dir)
    _say("open")
    if stop == "open":
        _pause()
    stop_at = len(plan) if stop == "finish" else int(stop) if stop.lstrip("-").isdigit() else -1
    with ws.step(f"sigkill trial seed={seed}") as step:
        _say(f"step {step.id}")
        for n, op in enumerate(plan, 1):
            if n - 1 == stop_at and stop != "finish":
                _pause()
            apply_op(ws.fs, op)
            _say(f"op {n}")
        if stop != "finish":
            _pause()  # after the last op, before the step closes
    ws.close()
    _say("closed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
