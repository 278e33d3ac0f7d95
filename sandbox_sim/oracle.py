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

Snapshot = dict[str, tuple]


def snapshot(fs: HostFS, path: str = "", skip: frozenset[str] = frozenset()) -> Snapshot:
    out: Snapshot = {}
    inodes: dict[tuple[int, int], list[str]] = {}
    _walk(fs, path, out, skip, inodes)
    for group in inodes.values():
        if len(group) > 1:
            links = tuple(sorted(group))
            for p in group:
                out[p] = out[p][:-1] + (links,)
    return out


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
    xattrs = tuple(sorted(fs.xattrs(path).items())) if st.kind in (REG, DIR) else ()
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
