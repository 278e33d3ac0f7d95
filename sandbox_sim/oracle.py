"""Tree snapshots: the oracle every invariant compares against.

A snapshot maps each path to ``(kind, mode, mtime_ns, content, xattrs, fmt, uid, gid, links)``
where content is the bytes of a regular file, the target of a symlink, or ``None`` for a
directory or a special file, ``fmt`` the exact ``S_IFMT`` type (a fifo undone into a
socket or a regular file differs), and ``links`` the link structure: for a regular file
that shares its inode with other paths of the snapshot, all those paths (itself included,
sorted) — a partition of the snapshot's files into link groups, independent of inode
numbers — else ``()``. Two hard links undone into two separate files differ. Fields are
only ever appended (unpack with ``*_`` at the end). atime is deliberately absent (seed §11.3). The root is included (path
``""``), so the working root's own mode and mtime are checked too.
"""

from __future__ import annotations

from sandbox.hostfs import DIR, LNK, REG, HostFS, join
from sandbox.hostfs.memory import MemoryHostFS

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
    """The snapshot of a simulated disk from its inodes (``MemoryHostFS.tree_nodes``): no
    path lookups, no host calls — what makes a campaign's check after every action cheap."""
    out: Snapshot = {}
    inodes: dict[int, list[str]] = {}
    skipping = None
    for p, node in fs.tree_nodes(path):
        if skipping is not None and (p == skipping or p.startswith(skipping + "/")):
            continue
        if p in skip and p != path:
            skipping = p
            continue
        kind = node.kind
        xattrs = node.xattrs
        xattrs = tuple(sorted(xattrs.items())) if xattrs else ()
        if kind == REG:
            if node.nlink > 1:
                inodes.setdefault(node.ino, []).append(p)
            out[p] = (kind, node.mode, node.mtime_ns, bytes(node.data), xattrs, node.fmt, node.uid, node.gid, ())
        elif kind == DIR:
            out[p] = (kind, node.mode, node.mtime_ns, None, xattrs, node.fmt, node.uid, node.gid, ())
        else:
            out[p] = (kind, node.mode, node.mtime_ns, node.target if kind == LNK else None, xattrs, node.fmt, node.uid,
                      node.gid, ())
    _link_groups(out, inodes)
    return out


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
    if st.kind == REG and st.nlink > 1:
        inodes.setdefault((st.ino, st.dev), []).append(path)
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
            lines.append(f"+ {name}: unexpected {a[0]}")
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
