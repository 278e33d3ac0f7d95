"""Preimage capture, preimage restore, and fingerprints of what a step left behind.

A *record* is a JSON-able dict; every record is the undo of one thing that happened:

=========== ==================================== ======================================
``op``      written                              undone by
=========== ==================================== ======================================
``pre``     before the first content change of   making the path that object again:
            a file/symlink, before any entry     regular file (bytes + meta), symlink
            change of a directory, before an     (target + xattrs, mtime), directory
            rmdir; before any change of a fifo   (meta; created if missing) or fifo/
            or socket node (``kind`` other)      socket node (``mknod`` of ``fmt`` + meta)
            A regular file with more than one    with ``LinkGroups``: a name of an
            link (or of an inode the step        inode restored earlier in the same
            captured so) also has ``ino``,       rollback, or a survivor in ``links``,
            ``nlink`` and ``links`` (its other   is linked to, not copied: all names
            names then, at most 64)              end as one inode
``meta``    before a metadata-only change of a   setting mode, xattrs, mtime again
            regular file (chmod, utime, xattr)
``created`` before something is created at path  removing whatever is at path
``renamed`` before ``src`` is renamed to ``dst`` renaming ``dst`` back to ``src`` (a
                                                 no-op if ``dst`` is gone: a later
                                                 record already covers it)
``exchanged`` before ``src`` and ``dst`` swap     exchanging them back — unless a
            names (RENAME_EXCHANGE); with both   recorded inode is at its own name and
            inode numbers (``src_ino``,          none at the other's (the exchange never
            ``dst_ino``)                         ran, or its undo already did)
=========== ==================================== ======================================

Undo of every record is idempotent, so an interrupted rollback may redo the record it
was in the middle of. ``restore`` never follows a symlink: the host filesystem cannot.
A regular file is restored through one handle — the one its creation returned, or one
open before its truncation — so its bytes, mode, xattrs and mtime reach that inode even
if someone swaps the name meanwhile (for a hard link to a file of theirs, say). A
directory is made by ``mkdir`` (which sets its mode through its own descriptor) and gets
its metadata in pass 2, by name, as every existing entry does: without following links.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
from dataclasses import dataclass
from typing import Callable

from ..hostfs import DIR, LNK, MKNOD_FMTS, OTHER, REG, Entry, FileHandle, HostFS, Stat, is_within, join, parent_of

CHUNK_BYTES = 1 << 20
#: records written before a host call that may then fail (its ``op_failed`` voids them)
INTENT_OPS = ("created", "renamed", "exchanged")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)


def meta_of(fs: HostFS, path: str, st: Stat, handle: FileHandle | Entry | None = None) -> dict:
    """The metadata part of a preimage record. With ``handle`` (open on the inode ``st``
    describes, or a removal's :class:`~sandbox.hostfs.Entry` that just looked at it: anything
    with ``xattrs()``) the xattrs are read through it: that inode's, and no path resolution
    per call."""
    rec = {"kind": st.kind, "mode": st.mode, "mtime_ns": st.mtime_ns, "uid": st.uid, "gid": st.gid}
    # every kind's: a symlink, fifo or socket keeps trusted.* ones (the guest's owner, for a
    # privileged server), which an undo must bring back with the node
    xattrs = handle.xattrs() if handle is not None else fs.xattrs(path)
    rec["xattrs"] = {name: b64(value) for name, value in xattrs.items()}
    if st.kind == LNK:
        rec["target"] = fs.readlink(path)
    elif st.kind == OTHER:
        rec["fmt"] = st.file_type
    return rec


def is_restorable_special(st: Stat) -> bool:
    """A special file the undo core captures and remakes: a fifo or a unix-socket node
    (:data:`~sandbox.hostfs.MKNOD_FMTS`). A device node on the host is not (it is never
    made there, so it is refused before anything changes)."""
    return st.kind == OTHER and st.file_type in MKNOD_FMTS


class _AtPath:
    """The metadata calls of a :class:`FileHandle`, made by name on ``fs``."""

    def __init__(self, fs: HostFS, path: str):
        self.fs, self.path = fs, path

    def xattrs(self) -> dict[str, bytes]:
        return self.fs.xattrs(self.path)

    def setxattr(self, name: str, value: bytes) -> None:
        self.fs.setxattr(self.path, name, value)

    def removexattr(self, name: str) -> None:
        self.fs.removexattr(self.path, name)

    def chmod(self, mode: int) -> None:
        self.fs.chmod(self.path, mode)

    def utime(self, mtime_ns: int) -> None:
        self.fs.utime(self.path, mtime_ns)

    def chown(self, uid: int, gid: int) -> None:
        self.fs.lchown(self.path, uid, gid)

    def fstat(self) -> Stat:
        return self.fs.lstat(self.path)


def _restore_owner(at, rec: dict, cur: Stat | None = None) -> Stat | None:
    """The host owner ``rec`` recorded, where it differs and this process may set it (root;
    anyone else gets ``EPERM`` and the file stays its own). Before the mode: a chown clears
    set-id bits. Records from before owners were kept have none: nothing to do. ``cur``:
    the node's stat if the caller has a current one. Returns a stat still current (nothing
    changed since it was taken), or None (none taken, or a chown ran)."""
    if "uid" not in rec:
        return cur
    cur = cur if cur is not None else at.fstat()
    if (cur.uid, cur.gid) == (rec["uid"], rec["gid"]):
        return cur
    try:
        at.chown(rec["uid"], rec["gid"])
    except PermissionError:
        return cur
    return None


def _apply_meta(fs: HostFS, path: str, rec: dict, handle: FileHandle | None = None, st: Stat | None = None) -> None:
    """Set xattrs, mode and mtime as ``rec`` says: by name — or, given ``handle``, on
    the inode it holds, whatever ``path`` names by now. A symlink's xattrs only where ``rec``
    has them (records from before symlinks' were captured have none: left as they are).
    ``st``: the node's current stat, if the caller has one (no look again). The mode is set
    unless a stat still current shows it is already the recorded one (no chown and no xattr
    change since: either may change the mode — set-id bits, an access ACL)."""
    at = handle if handle is not None else _AtPath(fs, path)
    kind = rec["kind"]
    cur = _restore_owner(at, rec, st)
    if kind != LNK or "xattrs" in rec:
        wanted = {name: unb64(v) for name, v in rec.get("xattrs", {}).items()}
        current = at.xattrs()
        for name in current:
            if name not in wanted:
                at.removexattr(name)
                cur = None
        for name, value in wanted.items():
            if current.get(name) != value:
                at.setxattr(name, value)
                cur = None
    if kind != LNK and (cur is None or cur.mode != rec["mode"]):
        at.chmod(rec["mode"])
    at.utime(rec["mtime_ns"])


def _lstat(fs: HostFS, path: str) -> Stat | None:
    """What is at ``path``, or None — also below a symlink: nothing is reachable there
    without following it (``ELOOP``, see :data:`~sandbox.hostfs.ABSENT_ERRNOS`)."""
    return fs.lstat_or_none(path)


def remove_tree(fs: HostFS, path: str) -> None:
    """Remove whatever is at path, recursively (only used when a rollback is forced)."""
    st = _lstat(fs, path)
    if st is None:
        return
    if st.kind == DIR:
        for name in fs.listdir(path):
            remove_tree(fs, join(path, name))
        fs.rmdir(path)
    else:
        fs.unlink(path)


def _clear(fs: HostFS, path: str, st: Stat, force: bool) -> None:
    if st.kind == DIR:
        try:
            fs.rmdir(path)
        except OSError as e:
            if e.errno != errno.ENOTEMPTY or not force:
                raise
            remove_tree(fs, path)
    else:
        fs.unlink(path)


def _make_room(fs: HostFS, path: str) -> None:
    """Forced undo only: whatever someone else put at ``path`` goes, and its parent exists."""
    _ensure_parent(fs, path)
    if _lstat(fs, path) is not None:
        remove_tree(fs, path)


def _ensure_parent(fs: HostFS, path: str) -> None:
    """Forced undo only: the parent chain of ``path`` exists as directories (foreign files in
    the way are removed; recreated directories get their metadata in pass 2 if the step
    recorded it)."""
    parent = parent_of(path)
    if not parent:
        return
    st = _lstat(fs, parent)
    if st is not None and st.kind == DIR:
        return
    _ensure_parent(fs, parent)
    if st is not None:
        remove_tree(fs, parent)
    fs.mkdir(parent, 0o700)


def restore(fs: HostFS, rec: dict, open_content, force: bool = False, dir_meta: bool = True, user_forced: bool = False,
            trust_intent: bool = False, links: "LinkGroups | None" = None,
            exchange_note: "ExchangeNote | None" = None) -> None:
    """Apply the undo of one record to the working filesystem.

    With ``dir_meta=False`` a directory's ``pre`` only makes sure the directory exists;
    its metadata is left to the second pass (:func:`dir_meta_plan`).

    ``open_content(rec)`` returns the preimage bytes of a ``pre`` record of a regular file
    in chunks, having checked them first (it raises if they are damaged): it is called
    before the path is touched, so a damaged preimage never leaves a half-restored file.
    ``force`` lets the undo remove foreign content that is in the way
    (otherwise a non-empty directory where a file must go raises ``ENOTEMPTY``).
    ``user_forced``: the user asked to overwrite external changes — only then is an object
    at a rename's source taken for foreign and removed; otherwise it proves the rename
    never ran (a crash between its intent and the host call) and the record is skipped.
    ``trust_intent``: the record's intent is known to have run (a finished or denied step's,
    or a replay on another filesystem, where the inode numbers an ``exchanged`` record names
    mean nothing); only the newest record of a dead process's step may be a stale intent,
    and only then do an ``exchanged`` record's inode numbers decide (nothing was re-created
    since, so they still mean what they meant).
    ``links``: the rollback's :class:`LinkGroups` (hard links made one inode again); it
    follows every record undone, this one included. ``exchange_note``: see
    :class:`ExchangeNote` (an ``exchanged`` record undone where progress is kept).
    """
    try:
        _restore(fs, rec, open_content, force, dir_meta, user_forced, trust_intent, links, exchange_note)
    finally:
        if links is not None:
            links.undone(rec)


def _restore(fs: HostFS, rec: dict, open_content, force: bool, dir_meta: bool, user_forced: bool,
             trust_intent: bool, links: "LinkGroups | None", exchange_note: "ExchangeNote | None" = None) -> None:
    op = rec["op"]
    if op == "created":
        st = _lstat(fs, rec["path"])
        if st is not None:
            _clear(fs, rec["path"], st, force)
        return
    if op == "renamed":
        # Every later record is undone by now, so if the rename happened ``src`` is empty.
        # Something at ``src`` means it never ran (a stale intent) — unless forced, when it
        # is someone else's object in the way.
        if _lstat(fs, rec["dst"]) is not None:
            if user_forced:
                _make_room(fs, rec["src"])
            elif _lstat(fs, rec["src"]) is not None:
                return
            elif force:  # e.g. src's directory replaced by a symlink since: the move back needs it
                _ensure_parent(fs, rec["src"])
            fs.rename(rec["dst"], rec["src"])
        return
    if op == "exchanged":
        _unexchange(fs, rec, trust_intent, exchange_note)
        return
    path = rec["path"]
    kind = rec["kind"]
    content = open_content(rec) if op == "pre" and kind == REG else ()  # checked before anything changes
    if force:
        _ensure_parent(fs, path)
    st = _lstat(fs, path)
    if op == "meta":
        if st is not None and st.kind == kind:
            _apply_meta(fs, path, rec, st=st)
        return
    assert op == "pre", op
    if st is not None and (st.kind != kind or (kind == OTHER and st.file_type != rec["fmt"])):
        _clear(fs, path, st, force)
        st = None
    if kind == REG:
        live = links.live(fs, rec) if links is not None else []
        if st is None and live:
            fs.link(live[0], path)  # one atomic call: the name appears as one of the inode's links
            st = _lstat(fs, path)
        if st is None:
            handle = fs.create_handle(path, 0o600)
        else:
            handle = fs.open(path, os.O_WRONLY)
        with handle:
            if st is not None:
                handle.truncate(0)
            offset = 0
            for chunk in content:
                handle.pwrite_all(chunk, offset)
                offset += len(chunk)
            _apply_meta(fs, path, rec, handle)
        if links is not None:
            links.restored(fs, rec, live)
        return
    if kind == LNK and st is not None and fs.readlink(path) != rec["target"]:
        fs.unlink(path)
        st = None
    live = links.live(fs, rec) if links is not None and kind != DIR else []
    if st is None and live:
        fs.link(live[0], path)  # a symlink, fifo or socket with other names: one of its links again
        st = _lstat(fs, path)
    if kind == LNK:
        if st is None:
            fs.symlink(rec["target"], path)
    elif kind == DIR:
        if st is None:
            fs.mkdir(path, 0o700)
        if not dir_meta:
            return
    elif kind == OTHER:
        if st is None:
            fs.mknod(path, rec["mode"], rec["fmt"])  # never opened; mode and mtime follow by name, no follow
    else:  # pragma: no cover - capture refuses other kinds
        raise OSError(errno.EPERM, f"cannot restore a {kind} file", path)
    _apply_meta(fs, path, rec, st=st)  # st: None if just made, else unchanged since the look
    if links is not None and kind != DIR:
        links.restored(fs, rec, live)


#: capture looks through at most this many entries of the working folder, once per step
#: (at its first change of a file with more than one name), for the other names of its files
LINK_INDEX_ENTRIES_MAX = 200_000


def link_index(fs: HostFS) -> dict[int, set[str]]:
    """Inode number -> the names of everything but a directory (a regular file, symlink,
    fifo or socket) with more than one link in the folder (the first :data:`LINK_INDEX_ENTRIES_MAX` entries walked; never follows a symlink)."""
    index: dict[int, set[str]] = {}
    budget = [LINK_INDEX_ENTRIES_MAX]

    def walk(d: str) -> None:
        try:
            names = sorted(fs.listdir(d))
        except OSError:
            return
        for name in names:
            if budget[0] <= 0:
                return
            budget[0] -= 1
            p = join(d, name)
            st = _lstat(fs, p)
            if st is not None and st.kind == DIR:
                walk(p)
            elif st is not None and st.nlink > 1:
                index.setdefault(st.ino, set()).add(p)

    walk("")
    return index


#: a record names at most this many other names of its file (``links``); more are not restored as links
LINKS_PER_RECORD_MAX = 64
#: the temporary name (in the name's own directory) through which a restored name is
#: replaced by a link to the inode restored under another name: ``link`` to it, ``rename`` over
RELINK_TMP_PREFIX = ".sandbox-relink-"


class LinkGroups:
    """The hard links of one rollback: every name a ``pre`` record of a regular file
    restores, by the inode number it had when captured (``ino``), and where that name is
    now as the rollback moves things back. A record carries ``ino`` and ``nlink`` when
    its file had more than one name then, or shared the inode of one that had, and
    ``links``: the file's other names found then (see ``UndoInterceptor._capture``).

    Undone newest first, the records of one inode restore it: the first name restored is
    made (or found) as usual; each later — older — record of the same inode makes its
    name a link of that inode (``link`` if the name is gone, else the other names are
    relinked to it by :func:`_relink`), then writes its own older bytes and metadata
    through it: the oldest record, the state before the step, is what every name ends
    with. A name the step left alone (a *survivor*) is one of the record's ``links``:
    undone back to the moment of the capture, the tree has it at that path again — by
    path, not inode number, since a later step's undo may have remade it as a new inode.

    Invariant: a restored name is used only while the object at its path is a regular
    file with the inode number it had when noted; so a stale path (moved or removed by
    someone) is skipped, never linked. Idempotent across an interrupted rollback:
    :meth:`replay` notes the records already undone (newest first) without touching
    anything, and every step of a restore can run again (``link`` only where nothing is,
    a relink only where the inodes differ).
    """

    def __init__(self, records: list[dict]):
        self.multi = {r["ino"] for r in records
                      if r.get("op") == "pre" and r.get("kind") != DIR and r.get("nlink", 1) > 1}
        self._members: dict[int, dict[str, int]] = {}  # recorded ino -> path -> ino now
        self.touched: list[str] = []  # names relinked outside the record's own path (to sync)

    def _of(self, rec: dict) -> int | None:
        ino = rec.get("ino")
        return ino if rec.get("op") == "pre" and rec.get("kind") != DIR and ino in self.multi else None

    def replay(self, fs: HostFS, done: list[dict]) -> None:
        """Note ``done`` (already undone by an earlier, interrupted run; newest first)."""
        for rec in done:
            ino = self._of(rec)
            if ino is not None:
                for p in (rec["path"], *rec.get("links", ())):
                    self._members.setdefault(ino, {})[p] = -1
            self.undone(rec)
        for members in self._members.values():
            for path in members:
                st = _lstat(fs, path)
                members[path] = st.ino if st is not None and st.kind != DIR else -1  # -1: never matches

    def live(self, fs: HostFS, rec: dict) -> list[str]:
        """The other names of ``rec``'s inode at hand now: restored ones, and survivors."""
        ino = self._of(rec)
        if ino is None:
            return []
        path, out = rec["path"], []
        for p, cur in self._members.get(ino, {}).items():
            st = _lstat(fs, p) if p != path else None
            if st is not None and st.kind != DIR and st.ino == cur:
                out.append(p)
        for p in rec.get("links", ()):
            st = _lstat(fs, p) if p != path and p not in out else None
            if st is not None and _same_object(fs, p, st, rec):
                out.append(p)
        return out

    def restored(self, fs: HostFS, rec: dict, live: list[str]) -> None:
        """``rec``'s name has its inode and bytes back: every other name at hand becomes
        a link of it, and it is noted."""
        ino = self._of(rec)
        if ino is None:
            return
        path = rec["path"]
        st = _lstat(fs, path)
        for q in live:
            cur = _lstat(fs, q)
            if cur is not None and cur.ino != st.ino:  # type: ignore[union-attr]
                _relink(fs, path, q)
                self.touched.append(q)
        members = self._members.setdefault(ino, {})
        for q in live:
            members[q] = st.ino  # type: ignore[union-attr]
        members[path] = st.ino  # type: ignore[union-attr]

    def undone(self, rec: dict) -> None:
        """Follow the names through the undo of ``rec`` (a move back, a removal)."""
        op = rec.get("op")
        if op == "renamed":
            self._move(lambda p: rec["src"] + p[len(rec["dst"]):] if is_within(p, rec["dst"]) else p)
        elif op == "exchanged":
            a, b = rec["src"], rec["dst"]
            self._move(lambda p: b + p[len(a):] if is_within(p, a) else a + p[len(b):] if is_within(p, b) else p)
        elif op == "created" or (op == "pre" and rec.get("kind") != REG and self._of(rec) is None):
            for members in self._members.values():
                for p in [p for p in members if (is_within(p, rec["path"]) if op == "created" else p == rec["path"])]:
                    del members[p]

    def _move(self, where) -> None:
        for ino, members in self._members.items():
            self._members[ino] = {where(p): cur for p, cur in members.items()}


def _same_object(fs: HostFS, path: str, st: Stat, rec: dict) -> bool:
    """A survivor at ``path`` (``st``) can be ``rec``'s object: of its kind — a fifo or a
    socket of its type, a symlink with its target (a regular file's bytes are written
    through the link by the restore)."""
    kind = rec["kind"]
    if st.kind != kind:
        return False
    if kind == OTHER:
        return st.file_type == rec.get("fmt")
    if kind == LNK:
        return fs.readlink(path) == rec.get("target")
    return True


def _relink(fs: HostFS, existing: str, name: str) -> None:
    """Make ``name`` a link of ``existing``'s inode: ``link`` to a temporary name beside it,
    then ``rename`` over — at every moment ``name`` is one whole file. A temporary name
    left by an interrupted run (a link of some file) is removed first."""
    tmp = join(parent_of(name), f"{RELINK_TMP_PREFIX}{fs.lstat(existing).ino}")
    if _lstat(fs, tmp) is not None:
        fs.unlink(tmp)
    fs.link(existing, tmp)
    fs.rename(tmp, name)


@dataclass
class ExchangeNote:
    """Makes the undo of one ``exchanged`` record idempotent where inode numbers cannot.

    When later records' undos re-created *both* objects (new inode numbers), neither recorded
    inode is left to say whether an interrupted run already exchanged them back. So just
    before the exchange back (or the one-sided move) the inode numbers at ``(src, dst)`` are
    kept durably by ``keep``; a resumed run is given them as ``before``: finding them
    swapped, it knows the move ran (and does nothing); finding them unchanged, it knows the
    move was decided and had not run (and runs it). Invariant: ``keep`` returns only once
    the note is durable, and the move runs only after it.
    """

    before: tuple[int | None, int | None] | None
    keep: Callable[[tuple[int | None, int | None]], None]


def _unexchange(fs: HostFS, rec: dict, trust_intent: bool, note: ExchangeNote | None = None) -> None:
    """Undo of an ``exchanged`` record: exchange ``src`` and ``dst`` back.

    Every later record is undone by now, so if the exchange ran, ``src`` holds the object
    that was at ``dst`` and the other way round — though either may be a re-creation (a later
    record's undo remade it: a new inode number, or on a real disk a reused one). With
    ``trust_intent`` (the exchange ran: every record but the newest of a dead process's
    step) they are swapped back. Otherwise — the newest record of a step whose process died,
    undone first, so nothing was re-created since — the recorded inode numbers decide: one at
    its own name and none at the other's means the exchange never ran (a crash between the
    intent and the host call): nothing to do. Only one side left (someone removed the other;
    a forced undo): it goes back to its own name. An interrupted run of this very undo is
    told apart by ``note`` (:class:`ExchangeNote`), so the move back runs exactly once."""
    src, dst = rec["src"], rec["dst"]
    s, d = _lstat(fs, src), _lstat(fs, dst)
    now = (s.ino if s is not None else None, d.ino if d is not None else None)
    if note is not None and note.before is not None and now != (None, None):
        before = note.before
        if now == (before[1], before[0]) and now != before:
            return  # an interrupted run moved them back (see ExchangeNote)
        if now == before:
            _swap_back(fs, src, dst, now)
            return
    if s is not None and d is not None:
        in_effect = s.ino == rec["dst_ino"] or d.ino == rec["src_ino"]
        in_place = s.ino == rec["src_ino"] or d.ino == rec["dst_ino"]
        if not trust_intent and in_place and not in_effect:
            return
    if now != (None, None):
        if note is not None:
            note.keep(now)
        _swap_back(fs, src, dst, now)


def _swap_back(fs: HostFS, src: str, dst: str, now: tuple[int | None, int | None]) -> None:
    if now[0] is not None and now[1] is not None:
        fs.exchange(src, dst)
    elif now[0] is not None:
        fs.rename(src, dst)
    else:
        fs.rename(dst, src)


def apply_dir_meta(fs: HostFS, rec: dict) -> None:
    """Second pass: set a directory's mode, xattrs and mtime (if it is still a directory)."""
    st = _lstat(fs, rec["path"])
    if st is not None and st.kind == DIR:
        _apply_meta(fs, rec["path"], rec, st=st)


class _Origins:
    """Which object is at a path, as the journal goes: the one that was at some path
    before the step (its *origin*), or one the step created (``None``)."""

    def __init__(self) -> None:
        self._moves: dict[str, str | None] = {}  # path prefix now -> origin prefix (None: new)

    def of(self, path: str) -> str | None:
        best = None
        for k in self._moves:
            if is_within(path, k) and (best is None or len(k) > len(best)):
                best = k
        if best is None:
            return path  # untouched by any create or rename: still where it always was
        origin = self._moves[best]
        return None if origin is None else origin + path[len(best):]

    def created(self, path: str) -> None:
        self._forget(path)
        self._moves[path] = None

    def exchanged(self, a: str, b: str) -> None:
        under_a = {k: v for k, v in self._moves.items() if is_within(k, a)}
        under_b = {k: v for k, v in self._moves.items() if is_within(k, b)}
        origin_a, origin_b = self.of(a), self.of(b)
        for k in list(under_a) + list(under_b):
            del self._moves[k]
        self._moves[b], self._moves[a] = origin_a, origin_b
        for k, v in under_a.items():
            self._moves[b + k[len(a):]] = v
        for k, v in under_b.items():
            self._moves[a + k[len(b):]] = v

    def renamed(self, src: str, dst: str) -> None:
        moved = {k: v for k, v in self._moves.items() if is_within(k, src)}
        src_origin = self.of(src)
        self._forget(dst)  # whatever was at dst is replaced
        for k in moved:
            del self._moves[k]
        self._moves[dst] = src_origin
        for k, v in moved.items():
            self._moves[dst + k[len(src):]] = v
        self._moves[src] = None  # vacated: anything there later is new

    def _forget(self, path: str) -> None:
        for k in [k for k in self._moves if is_within(k, path)]:
            del self._moves[k]


def dir_meta_plan(records: list[dict]) -> list[dict]:
    """The directory metadata a rollback must restore, deepest first (pass 2).

    Every directory that existed before the step gets the metadata captured *first* for
    it, wherever it was at that moment, applied at the path it had before the step (where
    pass 1 has put it back). Directories the step created get nothing: they are gone.
    """
    origins = _Origins()
    first: dict[str, dict] = {}
    for r in records:
        op = r.get("op")
        if op == "renamed":
            origins.renamed(r["src"], r["dst"])
        elif op == "exchanged":
            origins.exchanged(r["src"], r["dst"])
        elif op == "created":
            origins.created(r["path"])
        elif op == "pre" and r.get("kind") == DIR:
            origin = origins.of(r["path"])
            if origin is not None and origin not in first:
                first[origin] = {**r, "path": origin}
    plan = list(first.values())
    plan.sort(key=lambda rec: -(rec["path"].count("/") + 1 if rec["path"] else 0))
    return plan


def content_hash(fs: HostFS, path: str, size: int | None = None, head: bytes | None = None) -> str:
    """The blake2b of the file's bytes, read until a read returns none — or, given the
    ``size`` it was just seen with, until a short read at or past that size (the end then:
    no read more to see nothing, which costs a path resolution). ``head``: the first read
    (at offset 0, of ``read_size(size, 0)`` bytes), already made (:meth:`HostFS.lstat_head`)."""
    h = hashlib.blake2b(digest_size=16)
    offset = 0
    while True:
        want = CHUNK_BYTES if size is None else read_size(size, offset)
        if head is not None:
            chunk, head = head, None
        else:
            chunk = fs.read(path, offset, want)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        offset += len(chunk)
        if size is not None and len(chunk) < want and offset >= size:
            return h.hexdigest()


#: the smallest read of a file whose size is known (:func:`read_size`)
SIZED_READ_BYTES_MIN = 64 << 10


def read_size(size: int, offset: int) -> int:
    """How much to read at ``offset`` of a file just seen ``size`` bytes long: what is left and
    one byte more (a short read then says it was the end), at least
    :data:`SIZED_READ_BYTES_MIN` (a file that grew meanwhile is read on in such steps), at
    most :data:`CHUNK_BYTES` — a small file costs no 1 MiB buffer."""
    return min(CHUNK_BYTES, max(size - offset + 1, SIZED_READ_BYTES_MIN))


def fingerprint(fs: HostFS, path: str, with_dir_mtime: bool = False) -> list | None:
    """What a later rollback must find at ``path`` to know nobody else changed it.

    Regular files: type, mode, size, mtime and a content hash (mtimes alone can collide
    within one timestamp tick). Symlinks: the target. Directories: only the type —
    unless the step created the directory (a rollback removes it, so any entry added
    since, which changes its mtime, must stop the rollback).
    """
    st, head = fs.lstat_head(path, lambda s: read_size(s.size, 0))  # one resolution for both, where it can
    if st is None:
        return None
    if st.kind == REG:
        return [REG, st.mode, st.size, st.mtime_ns, content_hash(fs, path, st.size, head)]
    if st.kind == LNK:
        return [LNK, fs.readlink(path)]
    if st.kind == DIR:
        return [DIR, st.mtime_ns] if with_dir_mtime else [DIR]
    return [st.kind, st.mode, st.file_type, st.mtime_ns]
