"""Step diffs: what one finished step changed, per path, computed from the undo store.

:func:`step_diff` answers "what did step N do?" for ``undo.diff`` (STDIO), ``sandbox diff``
(CLI), MCP's ``diff_step`` and the web timeline — one computation for all of them.

How. The region of the folder the step touched — every path its journal names, their
parents, and the whole subtree of every rename's destination — is mirrored into an
in-memory scratch tree (structure and metadata; each regular file's bytes replaced by a
token naming where its real bytes are). The step's undo is then replayed on the scratch
tree by the very code a rollback runs (:meth:`Workspace.replay_undo_onto`), a ``pre``
record's content being a token naming that preimage. The scratch tree is now the region
as it was *before* the step; the working folder is *now*. Each path present in either is
compared — tokens resolve to the current file or to the preimage, compared by size and
then by the preimage's recorded hash, so unchanged files are never decompressed.

Invariants:

* **Read-only.** The undo store and the working folder are only read: no record, no
  progress file, no promotion, no eviction (a test compares the store's bytes). The
  current tree is read through the workspace's host filesystem (no symlink is followed,
  nothing outside the folder is reached), never with ``open()`` on a joined path.
* **"Now" is the current tree.** For the newest step this is exactly what the step left;
  for an older one, later steps' effects on the same paths show too (the issue's
  "preimage vs now"). If something the step left is gone or replaced since (a later step
  removed a directory this one renamed, say) — or the replay cannot apply — the result
  says ``"approximate": true``: what a rename moved there is no longer in the tree, and
  this step's journal alone cannot rebuild it.
* **Path-based**, like ``diff -r``: a rename is its source ``deleted`` and its
  destination ``created`` (or ``modified``), each file of a renamed directory included.
* **Change kinds.** ``created``: absent before, present now. ``deleted``: present before,
  absent now. ``modified``: both present, and the type or a regular file's bytes differ.
  ``metadata``: same type and bytes, but the mode, the mtime, the xattrs or a symlink's
  target differ. A directory whose only difference is its mtime (a consequence of its
  entries changing) is not listed; nor is a path equal on both sides.
* **Text** is bytes that decode as UTF-8 with no NUL in their first
  :data:`TEXT_SNIFF_BYTES` (8 KiB); a text file gets a unified diff
  (:func:`difflib.unified_diff`, headers ``a/PATH`` and ``b/PATH``, ``/dev/null`` for a
  side that does not exist). Anything else is binary and gets a one-line summary.
* **Bounded.** At most :data:`DIFF_PATHS_LISTED_MAX` paths listed (``paths_total`` counts
  all, ``paths_truncated``); at most :data:`DIFF_FILE_BYTES_MAX` read from either side of
  a file for its diff (larger: a summary and ``diff_truncated``); a path's diff text at most
  :data:`DIFF_TEXT_PATH_CHARS_MAX`, the result's :data:`DIFF_TEXT_RESULT_CHARS_MAX` (cut at
  a line, ``diff_truncated``); at most :data:`DIFF_MIRROR_ENTRIES_MAX` entries mirrored
  (past it renamed subtrees are not expanded and ``paths_truncated`` is set).
* **Errors.** An unknown step: :class:`~sandbox.core.errors.NoSuchStep`
  (``undo.no_such_step``); a damaged journal: :class:`~sandbox.core.errors.CorruptStep`. A
  preimage that is damaged, or was not kept (an unprotected step), only loses that path's
  diff: its summary says so.
"""

from __future__ import annotations

import codecs
import difflib
import os
import stat as _stat

from ..hostfs import DIR, LNK, OTHER, REG, HostFS, Stat, join, parent_of
from ..hostfs.memory import MemoryHostFS
from . import preimage
from .errors import CorruptStep
from .store import UndoLog

KiB = 1 << 10
MiB = 1 << 20
#: paths listed in one result (``paths_total`` counts every changed path)
DIFF_PATHS_LISTED_MAX = 1000
#: bytes read from either side of one file to diff it; a larger file gets a summary
DIFF_FILE_BYTES_MAX = 1 * MiB
#: characters of unified diff per path (cut at a line, ``diff_truncated``)
DIFF_TEXT_PATH_CHARS_MAX = 64 * KiB
#: characters of unified diff in one result; paths past it get ``diff: None``, ``diff_truncated``
DIFF_TEXT_RESULT_CHARS_MAX = 1 * MiB
#: entries of the folder mirrored into the scratch tree (renamed subtrees are expanded up to it)
DIFF_MIRROR_ENTRIES_MAX = 100_000
#: a file is text if this much of its head decodes as UTF-8 and holds no NUL
TEXT_SNIFF_BYTES = 8 * KiB

_KINDS = {REG: "file", DIR: "dir", LNK: "symlink", OTHER: "other"}


def is_text(data: bytes) -> bool:
    """The first :data:`TEXT_SNIFF_BYTES` decode as UTF-8 (a character cut at the end is
    fine) and contain no NUL."""
    head = data[:TEXT_SNIFF_BYTES]
    if b"\0" in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return True


class _Budget:
    def __init__(self, chars: int):
        self.chars = chars


class _Mirror:
    """The scratch tree: a copy of part of the working folder, with regular files' bytes
    replaced by ``token + b"N" + path`` (the bytes of the current file at ``path``)."""

    def __init__(self, work: HostFS, token: bytes, entries_max: int = DIFF_MIRROR_ENTRIES_MAX):
        self.work = work
        self.token = token
        self.fs = MemoryHostFS("diff")
        self.entries_max = entries_max
        self.copied: dict[str, Stat] = {"": work.lstat("")}
        self.incomplete = False

    def path(self, p: str) -> None:
        """``p`` and its parents, if they exist now (a parent that is not a directory ends it)."""
        chain = []
        while p not in self.copied:
            chain.append(p)
            p = parent_of(p)
        for q in reversed(chain):  # shallowest first; no recursion, however deep the path
            pst = self.copied.get(parent_of(q))
            st = self.work.lstat_or_none(q) if pst is not None and pst.kind == DIR else None
            if st is None:
                return
            if len(self.copied) >= self.entries_max:
                self.incomplete = True
                return
            self._copy(q, st)

    def subtree(self, p: str) -> None:
        """``p`` and, if it is a directory now, everything below it (up to the entry limit)."""
        self.path(p)
        todo = [p]
        while todo:
            q = todo.pop()
            st = self.copied.get(q)
            if st is None or st.kind != DIR:
                continue
            for name in sorted(self.work.listdir(q)):
                if len(self.copied) >= self.entries_max:
                    self.incomplete = True
                    return
                child = join(q, name)
                if child not in self.copied:
                    st = self.work.lstat_or_none(child)  # gone since the listing (the guest is writing)
                    if st is None:
                        continue
                    self._copy(child, st)
                todo.append(child)

    def _copy(self, p: str, st: Stat) -> None:
        fs = self.fs
        if st.kind == DIR:
            fs.mkdir(p, st.mode)
        elif st.kind == REG:
            fs.create(p, st.mode)
            fs.write(p, 0, self.token + b"N" + os.fsencode(p))
        elif st.kind == LNK:
            fs.symlink(self.work.readlink(p), p)
        else:
            fs.make_special(p, st.mode, st.file_type)  # a fifo, a socket, a device: its own type
        self.copied[p] = st

    def finish(self) -> None:
        """Metadata last, deepest first: making children changed the directories' mtimes."""
        for p in sorted(self.copied, key=lambda q: -(q.count("/") + 1 if q else 0)):
            st = self.copied[p]
            _copy_xattrs(self.work, self.fs, p)  # a symlink's, fifo's, socket's too (trusted.*)
            if st.kind != LNK:
                self.fs.chmod(p, st.mode)
            self.fs.utime(p, st.mtime_ns)


def _copy_xattrs(src: HostFS, dst: HostFS, p: str) -> None:
    for name, value in src.xattrs(p).items():
        try:
            dst.setxattr(p, name, value)
        except OSError:  # a namespace the scratch tree does not keep: compared as "unchanged" below
            pass


def _left_since(work: HostFS, info) -> bool:
    """Something the step left (its fingerprints) is gone or of another type now: a later
    change removed or replaced it, so what a rename of the step moved there is no longer
    in the tree, and the before-state rebuilt from this step's journal alone may miss it."""
    for path, fp in info.fingerprints.items():
        if fp is None:
            continue
        st = work.lstat_or_none(path)
        if st is None or st.kind != fp[0]:
            return True
    return False


def _all_paths(fs: HostFS) -> list[str]:
    """Every path of the scratch tree, the root ``""`` included (no recursion)."""
    out, todo = [], [""]
    while todo:
        p = todo.pop()
        out.append(p)
        if fs.lstat(p).kind == DIR:
            todo.extend(join(p, name) for name in fs.listdir(p))
    return out


def step_diff(workspace, step_id: int | None = None) -> dict:
    """What the finished step ``step_id`` (None: the newest) changed, preimage vs now.

    Result (COMMON14 interface 1): ``step_id``, ``command``, ``type``, ``paths`` — each
    ``{path, change, kind, diff, binary, summary, diff_truncated}`` sorted by path —
    ``paths_total``, ``paths_truncated``; plus ``approximate`` (see the module docstring).
    Nothing is written anywhere but an in-memory scratch tree.
    """
    info = workspace.step_info(step_id)
    records = workspace.step_records(info)
    work: HostFS = workspace.work
    token = b"\0sandbox-diff:" + os.urandom(8).hex().encode() + b":"
    mirror = _Mirror(work, token)
    for p in UndoLog.touched_paths(records) + list(UndoLog.final_paths(records)):
        mirror.path(p)
    for r in records:
        if r["op"] == "renamed":
            mirror.subtree(r["dst"])
        elif r["op"] == "exchanged":
            mirror.subtree(r["src"])
            mirror.subtree(r["dst"])
    mirror.finish()
    now_paths = set(mirror.copied)
    index = {id(r): i for i, r in enumerate(records)}

    def content(rec: dict):
        return (token + b"P" + str(index[id(rec)]).encode(),)

    approximate = _left_since(work, info)
    try:
        workspace.replay_undo_onto(info, records, mirror.fs, content)
    except OSError:
        approximate = True
    before_paths = set(_all_paths(mirror.fs))

    cmp = _Compare(workspace, info, records, mirror.fs, token)
    changes = []
    for p in sorted(now_paths | before_paths):
        c = cmp.change(p)
        if c is not None:
            changes.append(c)
    budget = _Budget(DIFF_TEXT_RESULT_CHARS_MAX)
    listed = [cmp.describe(c, budget) for c in changes[:DIFF_PATHS_LISTED_MAX]]
    return {"step_id": info.id, "command": info.command, "type": info.type, "paths": listed,
            "paths_total": len(changes), "paths_truncated": len(changes) > DIFF_PATHS_LISTED_MAX or mirror.incomplete,
            "approximate": approximate}


class _Compare:
    """Compares the scratch tree (before) with the working folder (now), path by path."""

    def __init__(self, workspace, info, records: list[dict], before: HostFS, token: bytes):
        self.ws, self.info, self.records = workspace, info, records
        self.before, self.now = before, workspace.work
        self.token = token

    # ---------------------------------------------------------------- what is where

    def _origin(self, p: str) -> tuple[str, object]:
        """Where the bytes of the before-file at ``p`` are: ``("now", path)`` or ``("pre", record)``."""
        data = self.before.read(p, 0, len(self.token) + 4 * KiB + 32)
        assert data.startswith(self.token), p
        tag, rest = data[len(self.token):len(self.token) + 1], data[len(self.token) + 1:]
        if tag == b"N":
            return "now", os.fsdecode(rest)
        return "pre", self.records[int(rest)]

    def _before_size_hash(self, p: str) -> tuple[int, object]:
        where, what = self._origin(p)
        if where == "pre":
            return what["size"], ("hash", what["hash"])
        return self.now.lstat(what).size, ("path", what)

    def _same_bytes(self, p: str, now_st: Stat) -> bool:
        where, what = self._origin(p)
        if where == "now" and what == p:
            return True
        size, ref = self._before_size_hash(p)
        if size != now_st.size:
            return False
        h = ref[1] if ref[0] == "hash" else preimage.content_hash(self.now, ref[1])
        return preimage.content_hash(self.now, p) == h

    def before_bytes(self, p: str) -> tuple[bytes | None, str | None]:
        """(the before-bytes of ``p`` up to the file limit, or None; why None)."""
        where, what = self._origin(p)
        if where == "now":
            return _read_bounded(self.now, what)
        try:
            data = self.ws.step_preimage(self.info, what, DIFF_FILE_BYTES_MAX)
        except (CorruptStep, OSError):
            why = "its preimage was not kept (unprotected step)" if self.info.unprotected else "its preimage is damaged"
            return None, why
        return data, None if data is not None else "too large to diff"

    # ---------------------------------------------------------------- per path

    def change(self, p: str) -> dict | None:
        b, n = self.before.lstat_or_none(p), self.now.lstat_or_none(p)
        if b is None and n is None:
            return None
        if b is None:
            return {"path": p, "change": "created", "b": None, "n": n}
        if n is None:
            return {"path": p, "change": "deleted", "b": b, "n": None}
        if b.kind != n.kind or b.file_type != n.file_type or (n.kind == REG and not self._same_bytes(p, n)):
            return {"path": p, "change": "modified", "b": b, "n": n}
        meta = self._meta_changes(p, b, n)
        if not meta:
            return None
        return {"path": p, "change": "metadata", "b": b, "n": n, "meta": meta}

    def _meta_changes(self, p: str, b: Stat, n: Stat) -> list[str]:
        out = []
        if n.kind == LNK:
            bt, nt = self.before.readlink(p), self.now.readlink(p)
            if bt != nt:
                out.append(f"symlink {bt} → {nt}")
        elif b.mode != n.mode:
            out.append(f"mode {b.mode:04o} → {n.mode:04o}")
        # every kind's xattrs: a symlink, fifo or socket keeps trusted.* ones (the guest's owner)
        bx, nx = self.before.xattrs(p), _xattrs_or_empty(self.now, p)
        names = sorted(k for k in set(bx) | set(nx) if bx.get(k) != nx.get(k))
        if names:
            out.append("xattrs " + ", ".join(names[:5]) + (", …" if len(names) > 5 else ""))
        if b.mtime_ns != n.mtime_ns and n.kind != DIR:
            out.append("mtime")
        return out

    def describe(self, c: dict, budget: _Budget) -> dict:
        p, change, b, n = c["path"], c["change"], c["b"], c["n"]
        kind = _KINDS.get((n or b).kind, "other")
        out = {"path": p or ".", "change": change, "kind": kind, "diff": None, "binary": False, "summary": "",
               "diff_truncated": False}
        if change == "metadata":
            out["summary"] = "; ".join(c["meta"])
            return out
        old = b if b is not None and b.kind == REG else None
        new = n if n is not None and n.kind == REG else None
        if old is None and new is None:
            out["summary"] = _summary_of_kinds(self, p, change, b, n)
            return out
        before, why_b = self.before_bytes(p) if old is not None else (b"", None)
        after, why_n = _read_bounded(self.now, p) if new is not None else (b"", None)
        sizes = _sizes(self, p, old, new)
        if before is None or after is None:
            out["diff_truncated"] = True
            out["binary"] = not all(is_text(x) for x in (before, after) if x is not None)
            out["summary"] = f"{sizes} ({why_b or why_n})"
            return out
        if not (is_text(before) and is_text(after)):
            out["binary"] = True
            out["summary"] = "binary, " + sizes
            return out
        text, added, removed = _unified(p, before if old is not None else None, after if new is not None else None)
        out["summary"] = _text_summary(change, b, n, added, removed)
        if len(text) > DIFF_TEXT_PATH_CHARS_MAX:
            text = _cut(text, DIFF_TEXT_PATH_CHARS_MAX)
            out["diff_truncated"] = True
        if len(text) > budget.chars:
            out["diff_truncated"] = True
            return out
        budget.chars -= len(text)
        out["diff"] = text
        return out


def _xattrs_or_empty(fs: HostFS, p: str) -> dict:
    try:
        return fs.xattrs(p)
    except OSError:
        return {}


def _read_bounded(fs: HostFS, p: str) -> tuple[bytes | None, str | None]:
    data = fs.read(p, 0, DIFF_FILE_BYTES_MAX + 1)
    if len(data) > DIFF_FILE_BYTES_MAX:
        return None, "too large to diff"
    return data, None


def _sizes(cmp: _Compare, p: str, old: Stat | None, new: Stat | None) -> str:
    parts = []
    if old is not None:
        parts.append(f"{cmp._before_size_hash(p)[0]} bytes")
    if new is not None:
        parts.append(f"{new.size} bytes")
    return " → ".join(parts)


def _summary_of_kinds(cmp: _Compare, p: str, change: str, b: Stat | None, n: Stat | None) -> str:
    def one(fs: HostFS, st: Stat) -> str:
        if st.kind == LNK:
            return f"symlink → {fs.readlink(p)}"
        if st.kind == DIR:
            return f"directory, mode {st.mode:04o}"
        return special_summary(st) if st.kind == OTHER else _KINDS.get(st.kind, "other")

    if change == "created":
        return one(cmp.now, n)
    if change == "deleted":
        return one(cmp.before, b)
    return f"{one(cmp.before, b)} → {one(cmp.now, n)}"


#: what a special file's summary calls each ``S_IFMT`` type
_SPECIAL_NAMES = {_stat.S_IFIFO: "fifo", _stat.S_IFSOCK: "socket", _stat.S_IFCHR: "character device",
                  _stat.S_IFBLK: "block device"}


def special_summary(st: Stat) -> str:
    """``"fifo, mode 0644"`` — the type a change of kind ``other`` is, and its mode."""
    return f"{_SPECIAL_NAMES.get(st.file_type, 'special file')}, mode {st.mode:04o}"


def _text_summary(change: str, b: Stat | None, n: Stat | None, added: int, removed: int) -> str:
    counts = f"+{added} −{removed} lines"
    if change == "modified" and b is not None and n is not None and b.kind != n.kind:
        return f"{_KINDS[b.kind]} → {_KINDS[n.kind]}, {counts}"
    return f"text, {counts}"


def _unified(p: str, before: bytes | None, after: bytes | None) -> tuple[str, int, int]:
    a = before.decode("utf-8", "replace").splitlines(keepends=True) if before is not None else []
    b = after.decode("utf-8", "replace").splitlines(keepends=True) if after is not None else []
    lines = list(difflib.unified_diff(a, b, "a/" + p if before is not None else "/dev/null",
                                      "b/" + p if after is not None else "/dev/null"))
    out, added, removed = [], 0, 0
    for i, line in enumerate(lines):
        if i >= 2:
            added += line.startswith("+")
            removed += line.startswith("-")
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out), added, removed


def _cut(text: str, chars: int) -> str:
    """``text`` cut to at most ``chars``, at the end of a line."""
    head = text[:chars]
    nl = head.rfind("\n")
    return head[: nl + 1] if nl >= 0 else ""


__all__ = ["step_diff", "is_text", "DIFF_PATHS_LISTED_MAX", "DIFF_FILE_BYTES_MAX", "DIFF_TEXT_PATH_CHARS_MAX",
           "DIFF_TEXT_RESULT_CHARS_MAX", "DIFF_MIRROR_ENTRIES_MAX", "TEXT_SNIFF_BYTES"]
