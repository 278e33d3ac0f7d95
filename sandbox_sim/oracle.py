"""Tree snapshots: the oracle every invariant compares against.

A snapshot maps each path to ``(kind, mode, mtime_ns, content, xattrs, fmt, uid, gid, links)``
where content is the bytes of a regular file, the target of a symlink, or ``None`` for a
directory or a special file, ``fmt`` the exact ``S_IFMT`` type (a fifo undone into a
socket or a regular file differs), and ``links`` the link structure: for anything but a
directory (a regular file, symlink, fifo or socket) that shares its inode with other paths
of the snapshot, all those paths (itself included, sorted) — a partition of the snapshot's
non-directories into link groups, independent of inode numbers — else ``()``. Two hard links undone into two separate files differ. Fields are
only ever appended (unpack with ``*_`` at the end). atime is deliberately absent (seed §11.3). The root is included (path
``""``), so the working root's own mode and mtime are checked too.
"""

from __future__ import annotations

from sandbox.hostfs import DIR, LNK, REG, HostFS, join
from sandbox.hostfs.memory import MemoryHostFS, SimClock

Snapshot = dict[str, tuple]


def snapshot(fs: HostFS, path: str = "", skip: frozenset[str] = frozenset()) -> Snapshot:
    """The snapshot of ``path`` (default: the whole tree) on ``fs``, ``skip`` left out
    (with everything under it). A simulated disk is read from its inodes directly
    (:func:`snapshot_nodes`), any other filesystem through the HostFS calls
    (:func:`snapshot_via_calls`); both give the same snapshot of the same tree, which
    ``sandbox_sim/test_oracle.py`` checks and a campaign re-checks every
    ``CROSS_CHECK_EVERY`` actions (:func:`cross_check`)."""
    if isinstance(fs, MemoryHostFS):
        return snapshot_nodes(fs, path, skip)
    return snapshot_via_calls(fs, path, skip)


def snapshot_nodes(fs: MemoryHostFS, path: str = "", skip: frozenset[str] = frozenset()) -> Snapshot:
    """The snapshot of a simulated disk from its inodes (``MemoryHostFS.tree_nodes``, a
    fresh walk): no path lookups, no host calls. A campaign's check after every action
    reads the whole tree through a :class:`KeptSnapshot` instead, which this cross-checks."""
    out: Snapshot = {}
    inodes: dict[int, list[str]] = {}
    skipping = None
    for p, node in fs.tree_nodes(path):
        if skipping is not None and (p == skipping or p.startswith(skipping + "/")):
            continue
        if p in skip and p != path:
            skipping = p
            continue
        if node.kind != DIR and node.nlink > 1:
            inodes.setdefault(node.ino, []).append(p)
        out[p] = _entry(node)
    _link_groups(out, inodes)
    return out


def _entry(node, links: tuple = ()) -> tuple:
    """One inode's snapshot entry (``links`` given: the link group is the walk's business)."""
    kind = node.kind
    xattrs = node.xattrs
    xattrs = tuple(sorted(xattrs.items())) if xattrs else ()
    content = bytes(node.data) if kind == REG else node.target if kind == LNK else None
    return (kind, node.mode, node.mtime_ns, content, xattrs, node.fmt, node.uid, node.gid, links)


class KeptSnapshot:
    """The whole-tree snapshot of one simulated disk, kept from one read to the next and
    brought up to date by reading again only what may have changed — what
    :func:`snapshot_nodes` of the whole tree gives, for less.

    What it relies on (``sandbox/hostfs/memory.py``):

    * ``changes`` unchanged: no call that may change the tree ran — the kept dict is it;
    * ``names`` unchanged: every path leads to the inode it led to
      (``MemoryHostFS.tree_nodes_kept``), so the paths, their kinds and the link groups
      are the same, and only entries whose inode changed are read again; after a change of
      names the tree is walked again, and the entry of an inode that did not change reused;
    * an inode's mode, mtime, bytes, target, xattrs and owner change only with its ctime
      set from the disk's clock, and a :class:`SimClock` never returns a value twice: an
      unchanged ctime (of the same inode number: never reused) is an unchanged entry. A power loss sets older ctimes back:
      after one (``power_losses``) nothing kept is reused; on a disk with another clock
      every read is a whole one.

    A change made behind the disk's back (an inode's field set directly) is not seen:
    ``World.cross_check`` compares the kept snapshot with a fresh :func:`snapshot_nodes`.
    """

    def __init__(self, fs: MemoryHostFS):
        self.fs = fs
        self._changes = -1
        self._names = -1
        self._power_losses = -1
        self._snap: Snapshot = {}
        self._read: list[list] = []  # [path, inode, its ctime when read] per entry, the walk's order
        self._entries: dict[int, tuple[int, tuple]] = {}  # ino -> (ctime, its entry without links), as last read

    def read(self) -> Snapshot:
        """The snapshot now: the kept dict itself, which the next read may change — callers
        that keep it or change it take a copy."""
        fs = self.fs
        if fs.changes == self._changes:
            return self._snap
        self._changes = fs.changes
        if fs.power_losses != self._power_losses or not isinstance(fs.clock, SimClock):
            self._power_losses = fs.power_losses
            self._entries.clear()
            self._names = -1
        if fs.names != self._names:
            self._names = fs.names
            self._read_all(isinstance(fs.clock, SimClock))
            return self._snap
        snap = self._snap
        for seen in self._read:
            node = seen[1]
            if node.ctime_ns != seen[2]:
                seen[2] = node.ctime_ns
                path = seen[0]
                snap[path] = self._entry_of(node)[:-1] + snap[path][-1:]
        return snap

    def _entry_of(self, node) -> tuple:
        kept = self._entries.get(node.ino)
        if kept is not None and kept[0] == node.ctime_ns:
            return kept[1]
        entry = _entry(node)
        self._entries[node.ino] = (node.ctime_ns, entry)
        return entry

    def _read_all(self, reuse: bool) -> None:
        walk = self.fs.tree_nodes_kept()
        self._read = [[p, node, node.ctime_ns] for p, node in walk]
        out: Snapshot = {}
        inodes: dict[int, list[str]] = {}
        if not reuse:
            self._entries.clear()
        for p, node in walk:
            if node.kind != DIR and node.nlink > 1:
                inodes.setdefault(node.ino, []).append(p)
            out[p] = self._entry_of(node)
        _link_groups(out, inodes)
        if reuse:  # keep the entries of the inodes in the tree now only
            self._entries = {node.ino: self._entries[node.ino] for _p, node in walk}
        else:
            self._entries.clear()
        self._snap = out


def snapshot_via_calls(fs: HostFS, path: str = "", skip: frozenset[str] = frozenset()) -> Snapshot:
    """The snapshot through the HostFS calls (``lstat``, ``read``, ``readlink``,
    ``listxattr``/``getxattr``, ``listdir``): any filesystem, a real directory included."""
    out: Snapshot = {}
    inodes: dict[tuple[int, int], list[str]] = {}
    _walk(fs, path, out, skip, inodes)
    _link_groups(out, inodes)
    return out


def _link_groups(out: Snapshot, inodes: dict) -> None:
    for group in inodes.values():
        if len(group) > 1:
            links = tuple(sorted(group))
            for p in group:
                out[p] = out[p][:-1] + (links,)


def _walk(fs: HostFS, path: str, out: Snapshot, skip, inodes: dict) -> None:
    st = fs.lstat(path)
    if st.kind != DIR and st.nlink > 1:
        inodes.setdefault((st.ino, st.dev), []).append(path)
    content: bytes | str | None
    if st.kind == REG:
        content = fs.read_all(path)
    elif st.kind == LNK:
        content = fs.readlink(path)
    else:
        content = None
    xattrs = tuple(sorted(fs.xattrs(path).items()))
    out[path] = (st.kind, st.mode, st.mtime_ns, content, xattrs, st.file_type, st.uid, st.gid, ())
    if st.kind == DIR:
        for name in sorted(fs.listdir(path)):
            child = join(path, name)
            if child not in skip:
                _walk(fs, child, out, skip, inodes)


def diff(expected: Snapshot, actual: Snapshot, limit: int = 20) -> list[str]:
    """Human-readable differences, empty when equal."""
    lines = []
    for path in sorted(set(expected) | set(actual)):
        e, a = expected.get(path), actual.get(path)
        if e == a:
            continue
        name = path or "<root>"
        if e is None:
            lines.append(f"+ {name}: unexpected {a[0]}")  # type: ignore[index]
        elif a is None:
            lines.append(f"- {name}: missing {e[0]}")
        else:
            fields = ("kind", "mode", "mtime_ns", "content", "xattrs", "fmt", "uid", "gid", "links")
            bad = [f"{f} {_short(x, f)} != {_short(y, f)}" for f, x, y in zip(fields, e, a) if x != y]
            lines.append(f"~ {name}: " + "; ".join(bad))
        if len(lines) >= limit:
            lines.append("…")
            break
    return lines


def _short(v, field: str = "") -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v < 0o10000 and field not in ("uid", "gid"):
        return oct(v)
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def assert_same(expected: Snapshot, actual: Snapshot, what: str = "tree") -> None:
    if expected == actual:  # what diff() finds empty, found by the dicts' own comparison
        return
    d = diff(expected, actual)
    if d:
        raise AssertionError(f"{what} differs from the expected snapshot:\n  " + "\n  ".join(d))


def snapshot_dir(root: str) -> Snapshot:
    """Snapshot of a real directory (through a RealHostFS opened on it for the occasion)."""
    from sandbox.hostfs.real import RealHostFS

    fs = RealHostFS(root)
    try:
        return snapshot(fs)
    finally:
        fs.close()


def content_shape(root: str) -> dict:
    """A real directory's tree as JSON-able data without times: per path its kind, mode,
    content (sha256 and size for a file, the target for a symlink), xattrs (base64) and
    ``fmt``, the exact ``S_IFMT`` type (a fifo and a socket are both kind "other").
    What ``fixtures/ninep/capture.py`` records as a capture's end state."""
    import base64
    import hashlib

    out = {}
    for path, (kind, mode, _mtime, content, xattrs, fmt, *_appended) in sorted(snapshot_dir(root).items()):
        if isinstance(content, bytes):
            content = {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content)}
        out[path] = {"kind": kind, "mode": mode, "content": content,
                     "xattrs": {k: base64.b64encode(v).decode() for k, v in xattrs}, "fmt": fmt}
    return out
