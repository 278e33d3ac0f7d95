"""UndoLog: the on-disk undo store, outside the working folder.

Layout (all reached through the store's HostFS, rooted at the state directory)::

    VERSION               format version, "1"
    lock                  flock'd by the opener; holds its pid
    WORKDIR               the working folder's real path (for humans)
    counters.json         bounds on the next step seq / id / ambient id (ids are never reused: COUNTERS_LEASE_STEPS)
    wal/in_progress/      the open step: journal.jsonl (+ b/<n> preimage blobs)
    wal/rollback/         a step being rolled back: its files + progress (1 byte/record)
                          (+ ``forced``: the user forced it, and so is its resumption)
    steps/<seq>/          finished steps: manifest.json, journal.jsonl, b/<n>
    barriers/<n>.json     recorded external modifications
    trash/                directories being deleted (evictions, finished rollbacks)

Journal: one JSON object per line. Line 1 is the header; each later line one record
(see ``preimage.py``) or ``{"op": "void", "lines": [...]}`` cancelling the records on those
(0-based) journal lines whose host call failed, or ``{"op": "unprotected"}``. A final line
without its newline is torn and ignored: its mutation never started.

Preimage contents: zstd level 3, inline in the record when the compressed form is small
(saves a file per small file), else in ``b<n>``; a reflink (FICLONE, stored raw) when the
filesystems allow it.

Integrity (format 2; ``docs/undo-store.md`` § Integrity): nothing read from the store is
trusted before it is checked. Every journal line, manifest, barrier and ``counters.json``
is *sealed* — its last member ``"h"`` is a checksum of the bytes before it (:func:`seal`)
— and schema-checked after; every regular-file preimage carries the blake2b of the
original bytes (``hash``), checked before a byte of it reaches the working folder; a
manifest records its journal's line count, size, hash and record count. A step that fails
any check is :class:`CorruptStep`, named, refused before anything is touched.
"""

from __future__ import annotations

import binascii
import errno
import hashlib
import io
import json
import marshal
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Iterator

from json.encoder import c_make_encoder as _c_make_encoder, encode_basestring_ascii as _encode_ascii  # type: ignore[attr-defined]

import zstandard

from ..hostfs import ABSENT_ERRNOS, DIR, LNK, MKNOD_FMTS, OTHER, REG, FileHandle, HostFS, PathError, Stat, is_within, join, normalize, parent_of
from . import preimage
from .errors import CorruptStep, NothingToUndo, RollbackIncomplete, StepUnprotected, UndoUnavailable
from .preimage import b64, unb64

# 2: sealed lines and files, preimage hashes, journal counts in the manifest, voids by line.
# A store of another version is refused as a whole (undo unavailable until discard).
FORMAT_VERSION = 2
ZSTD_LEVEL = 3
INLINE_MAX_BYTES = 4096  # compressed preimages up to this size live in the journal line
REFLINK_MIN_BYTES = 64 * 1024
#: a preimage read whole by its first read and at most this long is compressed as one frame
#: (``ZstdCompressor.compress``: zstd knows the size and sizes its tables to it) instead of
#: streamed; another frame of the same ``zstd`` form. Bounded so that either frame is inline:
#: zstd grows n bytes by at most n/256 + (128 KiB - n)/2048 + its 18-byte header, which for
#: 3 KiB stays under ``INLINE_MAX_BYTES`` — so the store's host calls are the same either way
ONE_SHOT_COMPRESS_BYTES_MAX = 3 * 1024
#: beside ``progress`` in a journal directory being undone: the inode numbers at an
#: ``exchanged`` record's names just before its undo moved them (preimage.ExchangeNote)
EXCHANGE_NOTE = "progress.exchange"
EXCHANGE_NOTE_MAX_BYTES = 256
# a preimage up to this size is decoded and checked in memory, then written in one go; a
# larger one is checked by a first full pass, then decoded again (and re-checked) as written
VERIFY_IN_MEMORY_BYTES_MAX = 8 << 20
#: inline preimages (zstd in a journal line) that a rollback's check decoded and verified
#: (:meth:`UndoLog.check_content`), kept by their record's fields for the restore that follows
#: instead of being decoded again — their bytes are a function of the line's base64 alone:
#: at most this many, each at most INLINE_CHECKED_BYTES_MAX decoded, the oldest forgotten first
INLINE_CHECKED_KEPT_MAX = 64
INLINE_CHECKED_BYTES_MAX = 64 << 10
HEADER_READ_BYTES_MAX = 64 << 10
#: parsed journals of finished steps remembered by their exact bytes (:meth:`UndoLog.records_of`):
#: a rollback reads each journal twice (checked before anything is touched, then undone) and
#: parsing — seals, JSON, schema — is a pure function of the bytes, so the second read of
#: unchanged bytes reuses the first parse (a copy of it). Oldest forgotten past the count;
#: a journal over the byte bound is parsed every time. The same bound counts the journals this
#: process wrote itself whose lines it still has as objects (:meth:`UndoLog.finish`): if the
#: bytes read back are exactly the ones it wrote, the first parse checks those objects (every
#: schema check) instead of unsealing each line again (see :meth:`UndoLog._parse_checked`).
PARSED_JOURNALS_KEPT_MAX = 16
#: zstd decompression contexts kept for reuse (making one costs more than decoding a small
#: preimage): each preimage being read owns one until it is done, so readers never share one;
#: past the bound a finished reader's context is dropped
DECOMPRESSORS_KEPT_MAX = 4
PARSED_JOURNAL_KEPT_BYTES_MAX = 1 << 20
#: ``counters.json`` holds bounds, not exact counters: when a step begins past the bounds it
#: last wrote, it writes new ones this many steps ahead (seq, id and ambient id alike), so
#: most steps begin without a write; a clean close writes the exact counters. Every seq and id
#: handed out lies below the bounds on the disk before its step's WAL exists, so none is ever
#: reused; after a crash the next ones continue from the bounds (a gap of at most this many).
COUNTERS_LEASE_STEPS = 64
REPORT_PATHS_MAX = 100  # paths named in a recovery report (the message gives the count)  # a step's journal header is read for history when its manifest is corrupt

WAL = "wal/in_progress"
WAL_JOURNAL = join(WAL, "journal.jsonl")
ROLLBACK = "wal/rollback"


@dataclass
class Limits:
    """Undo log limits (seed §4.4.3). Units in the names."""

    max_log_size_bytes: int = 1 << 30
    max_step_count: int = 100
    max_single_step_size_bytes: int = 200 << 20

    def __post_init__(self):
        for name in ("max_log_size_bytes", "max_step_count", "max_single_step_size_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer")


@dataclass(init=False)
class StepInfo:
    """One step of history, as the store knows it."""

    seq: int
    id: int
    type: str  # command | api | ambient
    command: str
    started_ns: int
    ended_ns: int | None = None
    exit_code: int | None = None
    outcome: str = "completed"  # completed | denied | recovered
    unprotected: bool = False
    size_bytes: int = 0
    paths: list[str] = field(default_factory=list)
    fingerprints: dict = field(default_factory=dict)
    corrupt: str | None = None  # why the step cannot be read
    # what the manifest says its journal is (checked whenever the journal is read)
    journal_lines: int = 0
    journal_bytes: int = 0
    journal_hash: str = ""
    records: int = 0

    def __init__(self, seq: int, id: int, type: str, command: str, started_ns: int, ended_ns: int | None = None,
                 exit_code: int | None = None, outcome: str = "completed", unprotected: bool = False, size_bytes: int = 0,
                 paths: list[str] | None = None, fingerprints: dict | None = None, corrupt: str | None = None,
                 journal_lines: int = 0, journal_bytes: int = 0, journal_hash: str = "", records: int = 0):
        """The fields above, in their order and with their defaults (a new list and dict where
        none is given); written out rather than generated: a campaign's build compiles this
        one (``sandbox_sim/compiled.py``), not a generated one, and a reopen makes one a step."""
        self.seq = seq
        self.id = id
        self.type = type
        self.command = command
        self.started_ns = started_ns
        self.ended_ns = ended_ns
        self.exit_code = exit_code
        self.outcome = outcome
        self.unprotected = unprotected
        self.size_bytes = size_bytes
        self.paths = [] if paths is None else paths
        self.fingerprints = {} if fingerprints is None else fingerprints
        self.corrupt = corrupt
        self.journal_lines = journal_lines
        self.journal_bytes = journal_bytes
        self.journal_hash = journal_hash
        self.records = records

    @property
    def dirname(self) -> str:
        return f"steps/{self.seq:010d}"

    def copy(self) -> "StepInfo":
        """An equal StepInfo whose ``paths`` and ``fingerprints`` are its own (what the
        Workspace hands out: changing it changes nothing in the store). By
        ``dataclasses.replace``: a compiled StepInfo (``sandbox_sim/compiled.py``) has no
        ``__dict__`` to copy, nor an ``object.__new__``."""
        return replace(self, paths=list(self.paths), fingerprints=dict(self.fingerprints))


@dataclass
class OpenStep:
    seq: int
    id: int
    type: str
    command: str
    started_ns: int
    records: list[dict] = field(default_factory=list)
    size_bytes: int = 0
    unprotected: bool = False
    journal_offset: int = 0
    touched_ns: int = 0
    blobs: int = 0  # blob names are never reused, even after a failed capture
    outcome: str = "completed"
    journal_lines: int = 0  # lines written, the header included
    record_lines: list[int] = field(default_factory=list)  # the journal line of each of ``records``
    #: intents whose host call failed but whose void line could not be written yet (the
    #: store failed too): written before any other line and before the step finishes
    pending_void: list[int] = field(default_factory=list)
    journal_hash: Any = field(default_factory=lambda: _new_journal_hash())  # of the bytes written; None: not known
    #: every line written, as sealed and as the object sealed (the header included), while the
    #: journal is at most PARSED_JOURNAL_KEPT_BYTES_MAX; None past it or when not known (recovery)
    lines: list[bytes] | None = field(default_factory=list)
    line_objs: list[dict] | None = field(default_factory=list)
    #: the journal's appends go through this handle (HostFS.append_handle: a real disk), else
    #: by path; dropped before the journal is replaced or renamed (:meth:`UndoLog._keep_journal`)
    journal_out: FileHandle | None = None
    #: an append raised, so bytes may lie past ``journal_offset`` (a write that failed
    #: part-way): the step's finish looks at the file's size and cuts them off
    tail_unknown: bool = False
    #: records held for the next journal write (:meth:`UndoLog.hold`), each with its sealed
    #: line: written, in order, with the next line appended or by :meth:`UndoLog.flush` —
    #: before the host call they describe runs; not in ``records`` until written
    held: list[tuple[dict, bytes]] = field(default_factory=list)

    # set when the step has ended (its command finished) but its promotion failed: the
    # exit code and whether a safeguard denied it; promotion is retried at the next boundary
    closing: tuple[int | None, bool] | None = None
    closing_warned: bool = False


class _StoreFile:
    """A store file as the file-like object zstd's stream reader reads from."""

    def __init__(self, fs: HostFS, path: str):
        self.fs, self.path, self.offset = fs, path, 0

    def read(self, n: int = -1) -> bytes:
        n = preimage.CHUNK_BYTES if n is None or n < 0 else min(n, preimage.CHUNK_BYTES)
        data = self.fs.read(self.path, self.offset, n)
        self.offset += len(data)
        return data


@dataclass
class Barrier:
    id: int
    after_seq: int
    paths: list[str]
    created_ns: int
    reason: str = "external modification"

    def as_dict(self) -> dict:
        """Its fields by name (the values themselves, not copies); a compiled Barrier
        (``sandbox_sim/compiled.py``) has no ``__dict__``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _errno_name(code: int | None) -> str | None:
    return None if code is None else errno.errorcode.get(code, str(code))


# ---------------------------------------------------------------------------- seals and schemas

SEAL_KEY = "h"
_SEAL_PREFIX = b',"h":"'
_SEAL_HEX = 16  # blake2b-64: detects damage (a flipped bit, a torn write), not an attacker
_SEAL_TAIL = len(_SEAL_PREFIX) + _SEAL_HEX + 2  # ,"h":"<hex>"}


def _seal_hash(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=_SEAL_HEX // 2).hexdigest().encode("ascii")


# what json.dumps(obj, separators=(",", ":"), ensure_ascii=True) builds on every call, built once
_LINE_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True)


# The C encoder ``JSONEncoder.encode`` builds for a one-shot encode, built once and without
# circular-reference markers (``None``): it keeps no state between calls (so any thread may use
# it at once), and a circular object, which it would recurse into until RecursionError, is
# encoded again by the checking encoder, which refuses it with json's own ValueError.
_LINE_C_ENCODER = None if _c_make_encoder is None else _c_make_encoder(
    None, _LINE_ENCODER.default, _encode_ascii, None, _LINE_ENCODER.key_separator, _LINE_ENCODER.item_separator,
    _LINE_ENCODER.sort_keys, _LINE_ENCODER.skipkeys, _LINE_ENCODER.allow_nan)


def _encode_line(obj: dict) -> str:
    """``_LINE_ENCODER.encode(obj)``, the same characters: the C encoder called without the
    two Python layers around it (``_LINE_C_ENCODER``). What it cannot encode — a circular or
    too deeply nested object — goes to ``_LINE_ENCODER`` itself, which refuses it as
    ``json.dumps`` does. Without the C accelerator: the encoder itself."""
    if _LINE_C_ENCODER is None:
        return _LINE_ENCODER.encode(obj)
    try:
        return "".join(_LINE_C_ENCODER(obj, 0))
    except RecursionError:
        return _LINE_ENCODER.encode(obj)


def seal(obj: dict) -> bytes:
    """``obj`` as one JSON line whose last member, ``"h"``, is a checksum of the bytes
    before it: any change to the line (a bit, a byte, a cut) fails :func:`unseal`."""
    body = _encode_line(obj).encode("ascii")
    assert body[:1] == b"{" and len(body) > 2 and SEAL_KEY not in obj, obj
    return body[:-1] + _SEAL_PREFIX + _seal_hash(body) + b'"}\n'


def unseal(line: bytes) -> dict:
    """The object of a sealed line (with or without its newline); ``ValueError`` saying
    what is wrong if the checksum is missing or does not match."""
    if line.endswith(b"\n"):
        line = line[:-1]
    if len(line) < _SEAL_TAIL + 2 or line[-_SEAL_TAIL:-_SEAL_HEX - 2] != _SEAL_PREFIX or line[-2:] != b'"}':
        raise ValueError("no checksum (truncated or not written by this version)")
    body = line[:-_SEAL_TAIL] + b"}"
    if _seal_hash(body) != line[-_SEAL_HEX - 2:-2]:
        raise ValueError("checksum mismatch")
    try:
        obj = json.loads(body)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


def _inline_key(rec: dict) -> tuple:
    """What determines and vouches for an inline preimage's bytes: its base64 zstd, and the
    size and hash they were verified against (:attr:`UndoLog._inline_checked`)."""
    return rec["data"], rec["enc"], rec["size"], rec["hash"]


def journal_hash(data: bytes) -> str:
    """The hash of a whole journal file that its manifest records."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _new_journal_hash():
    return hashlib.blake2b(digest_size=16)


_STEP_TYPES = ("command", "api", "ambient")
_OUTCOMES = ("completed", "denied", "recovered")
_HASH_RE = re.compile(r"[0-9a-f]{32}")
_BLOB_RE = re.compile(r"b[1-9][0-9]{0,17}")
_INLINE_B64_MAX = 4 * (INLINE_MAX_BYTES // 3 + 1)


def _is_int(v) -> bool:
    return type(v) is int  # bool is an int to Python, never to us


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _need_int(obj: dict, key: str, lo: int | None = None, hi: int | None = None, nullable: bool = False) -> None:
    v = obj.get(key)
    if v is None and nullable and key in obj:
        return
    if not (type(v) is int and (lo is None or v >= lo) and (hi is None or v <= hi)):
        raise ValueError(f"{key!r} is not a valid integer")  # (the message is built only when raised)


def _need_path(obj: dict, key: str, root_ok: bool = False) -> None:
    v = obj.get(key)
    try:
        ok = isinstance(v, str) and normalize(v) == v and (root_ok or v != "")
    except PathError:
        ok = False
    if not ok:
        raise ValueError(f"{key!r} is not a valid path")


def _need_b64(v, key: str, max_len: int | None = None) -> None:
    if not (isinstance(v, str) and (max_len is None or len(v) <= max_len)):
        raise ValueError(f"{key!r} is not valid base64")
    try:
        unb64(v)
    except (ValueError, binascii.Error, UnicodeEncodeError):
        raise ValueError(f"{key!r} is not valid base64") from None


def _need_keys(obj: dict, keys: set[str], what: str) -> None:
    if obj.keys() == keys:
        return
    missing, extra = keys - obj.keys(), obj.keys() - keys
    _need(not missing, f"{what} lacks {sorted(missing)}")
    _need(not extra, f"{what} has unknown {sorted(extra)}")


def check_header(h: dict) -> None:
    """A journal header (line 1), or ``ValueError``."""
    _need_keys(h, {"seq", "id", "type", "command", "started_ns"}, "header")
    _need_int(h, "seq", 1)
    _need_int(h, "id")
    _need(h["id"] != 0, "'id' is 0")
    _need(h["type"] in _STEP_TYPES, "'type' is not a step type")
    _need(isinstance(h["command"], str), "'command' is not a string")
    _need_int(h, "started_ns")


#: records naming two paths (``src``, ``dst``): things moved
_TWO_PATHS = ("renamed", "exchanged")


def moved_forward(path: str, moves: list[tuple[str, str, str]]) -> str:
    """Where ``path`` is after ``moves`` — ``(op, src, dst)`` of ``renamed``/``exchanged``
    records, chronological: a rename moves what is at or below ``src`` to ``dst``; an exchange
    swaps what is at or below either name."""
    for op, src, dst in moves:
        if is_within(path, src):
            path = dst + path[len(src):]
        elif op == "exchanged" and is_within(path, dst):
            path = src + path[len(dst):]
    return path


def check_record(r: dict) -> None:
    """One journal record (see ``preimage.py`` for their meaning), or ``ValueError``:
    every field a rollback reads has its type and range, so no rollback meets a bad one."""
    op = r.get("op")
    if op == "created":
        _need_keys(r, {"op", "path"}, "created record")
        _need_path(r, "path")
    elif op == "renamed":
        _need_keys(r, {"op", "src", "dst"}, "renamed record")
        _need_path(r, "src")
        _need_path(r, "dst")
    elif op == "exchanged":
        _need_keys(r, {"op", "src", "dst", "src_ino", "dst_ino"}, "exchanged record")
        _need_path(r, "src")
        _need_path(r, "dst")
        _need_int(r, "src_ino", 0)
        _need_int(r, "dst_ino", 0)
    elif op == "void":
        _need_keys(r, {"op", "lines"}, "void record")
        _need(isinstance(r["lines"], list) and all(_is_int(n) and n >= 1 for n in r["lines"]), "'lines' is not a list of line numbers")
    elif op == "unprotected":
        _need_keys(r, {"op"}, "unprotected record")
    elif op in ("pre", "meta"):
        kind = r.get("kind")
        if not (kind in (REG, DIR, LNK, OTHER) and (op == "pre" or kind == REG)):
            raise ValueError(f"'kind' {kind!r} is not valid for {op}")
        keys = {"op", "path", "kind", "mode", "mtime_ns"}
        _need_path(r, "path", root_ok=kind == DIR)
        _need_int(r, "mode", 0, 0o7777)
        _need_int(r, "mtime_ns")
        if "uid" in r or "gid" in r:  # the host owner (records from before owners were kept have none)
            keys |= {"uid", "gid"}
            _need_int(r, "uid", 0, 0xFFFFFFFE)
            _need_int(r, "gid", 0, 0xFFFFFFFE)
        if kind in (REG, DIR) or "xattrs" in r:  # a symlink's, fifo's or socket's: records since trusted owners
            keys.add("xattrs")
            x: Any = r.get("xattrs")
            _need(isinstance(x, dict) and all(isinstance(k, str) and k for k in x), "'xattrs' is not a map of names")
            for v in x.values():
                _need_b64(v, "xattrs")
        if kind in (REG, DIR):
            pass
        elif kind == OTHER:  # a fifo or a socket node: remade by mknod
            keys.add("fmt")
            _need(_is_int(r.get("fmt")) and r["fmt"] in MKNOD_FMTS, "'fmt' is not a fifo or a socket")
        else:
            keys.add("target")
            t = r.get("target")
            _need(isinstance(t, str) and t != "" and "\0" not in t, "'target' is not a symlink target")
        if op == "pre" and kind != DIR and ("ino" in r or "nlink" in r or "links" in r):
            # a file, symlink, fifo or socket with hard links (preimage.LinkGroups)
            keys |= {"ino", "nlink", "links"}
            _need_int(r, "ino", 0)
            _need_int(r, "nlink", 1)
            ln: Any = r.get("links")
            _need(isinstance(ln, list) and len(ln) <= preimage.LINKS_PER_RECORD_MAX, "'links' is not a list of paths")
            for v in ln:
                _need_path({"links": v}, "links")
        if op == "pre" and kind == REG:
            keys |= {"enc", "size", "stored", "hash", "data" if "data" in r else "blob"}
            _need(r.get("enc") in ("zstd", "raw"), "'enc' is not zstd or raw")
            if "data" in r:
                _need(r["enc"] == "zstd", "inline data must be zstd")
                _need_b64(r["data"], "data", _INLINE_B64_MAX)
            else:
                _need(isinstance(r.get("blob"), str) and _BLOB_RE.fullmatch(r["blob"]) is not None, "'blob' is not a blob name")
            _need_int(r, "size", 0)
            _need_int(r, "stored", 0)
            _need(isinstance(r.get("hash"), str) and _HASH_RE.fullmatch(r["hash"]) is not None, "'hash' is not a content hash")
        _need_keys(r, keys, f"{op} record")
    else:
        raise ValueError(f"unknown op {op!r}")


def check_manifest(m: dict) -> None:
    """A step's ``manifest.json`` (after :func:`unseal`), or ``ValueError`` naming the field."""
    _need_keys(m, {"id", "type", "command", "started_ns", "ended_ns", "exit_code", "outcome", "unprotected", "size_bytes",
                   "paths", "fingerprints", "format", "journal_lines", "journal_bytes", "journal_hash", "records"}, "manifest")
    _need_int(m, "id")
    _need(m["id"] != 0, "'id' is 0")
    _need(m["type"] in _STEP_TYPES, "'type' is not a step type")
    _need(isinstance(m["command"], str), "'command' is not a string")
    _need_int(m, "started_ns")
    _need_int(m, "ended_ns", nullable=True)
    _need_int(m, "exit_code", nullable=True)
    _need(m["outcome"] in _OUTCOMES, "'outcome' is not an outcome")
    _need(type(m["unprotected"]) is bool, "'unprotected' is not a boolean")
    _need_int(m, "size_bytes", 0)
    _need(isinstance(m["paths"], list) and all(isinstance(p, str) for p in m["paths"]), "'paths' is not a list of paths")
    fps = m["fingerprints"]
    _need(isinstance(fps, dict) and all(
        v is None or (isinstance(v, list) and v and isinstance(v[0], str) and all(isinstance(x, str) or _is_int(x) for x in v))
        for v in fps.values()), "'fingerprints' is not a map of fingerprints")
    _need(m["format"] == FORMAT_VERSION and _is_int(m["format"]), "'format' is not this format")
    _need_int(m, "journal_lines", 1)
    _need_int(m, "journal_bytes", 1)
    _need(isinstance(m["journal_hash"], str) and _HASH_RE.fullmatch(m["journal_hash"]) is not None, "'journal_hash' is not a hash")
    _need_int(m, "records", 0)


def parse_journal(data: bytes, where: str, strict: bool = True) -> tuple[dict | None, list[dict]]:
    """(header, live records) of a journal; a torn final line is dropped.

    Every line must be sealed and pass its schema. ``strict`` (a promoted step, whose
    manifest vouches for every line): a line that does not is :class:`CorruptStep`.
    Otherwise (recovery of a WAL): it becomes ``{"op": "corrupt", "line": n, "why": ...}``
    where it stood — a rollback stops there, since it cannot know what that line undid —
    and a damaged header is ``None``.

    Voided records are removed here, so every caller sees the same list. A void names
    journal lines, never positions among records, so a damaged line shifts nothing.
    """
    lines = data.split(b"\n")
    lines.pop()  # the part after the last newline: empty, or a torn line
    return _check_journal(map(_unsealed, lines), where, strict)


def _unsealed(line: bytes) -> dict | ValueError:
    """:func:`unseal` of ``line``, or the ``ValueError`` it raised."""
    try:
        return unseal(line)
    except ValueError as e:
        return e


def _check_journal(objs: Iterable[dict | ValueError], where: str, strict: bool) -> tuple[dict | None, list[dict]]:
    """:func:`parse_journal` from each line's unsealed object (or the error unsealing it
    raised): the schema checks, the voids, the header. Reads the objects only; the records
    returned are those objects."""
    header = None
    records: list[tuple[int, dict]] = []
    voided: set[int] = set()
    for i, obj in enumerate(objs):
        try:
            if type(obj) is not dict:
                raise obj  # type: ignore[misc]
            if i == 0:
                check_header(obj)
            else:
                check_record(obj)
                if obj["op"] == "void":
                    _need(all(n < i for n in obj["lines"]), "a void names a later line")
        except ValueError as e:
            why = f"journal line {i + 1} is corrupt ({e})"
            if strict:
                raise CorruptStep(f"{where}: {why}", where=where, reason=why) from None
            if i > 0:
                records.append((i, {"op": "corrupt", "line": i + 1, "why": why}))
            continue
        if i == 0:
            header = obj
        elif obj["op"] == "void":
            voided.update(obj["lines"])
        else:
            records.append((i, obj))
    if strict:
        kinds = {n: r["op"] for n, r in records}
        bad = sorted(n for n in voided if kinds.get(n) not in preimage.INTENT_OPS)
        if bad:
            why = f"journal line {bad[0] + 1} is voided but holds no intent"
            raise CorruptStep(f"{where}: {why}", where=where, reason=why)
    return header, [r for n, r in records if n not in voided]


class UndoLog:
    """The undo store of one working folder. Not thread-safe: the interceptor serialises."""

    def __init__(self, store: HostFS, limits: Limits | None = None, clock_ns: Callable[[], int] | None = None,
                 emit: Callable[[dict], None] | None = None, durable: bool = False):
        """``durable``: power-loss mode — fsync in WAL order (see :meth:`_sync`). Off by
        default: the target is an agent crash, which the page cache survives."""
        import time

        self.durable = durable
        self.fs = store
        self.limits = limits or Limits()
        self.clock_ns = clock_ns or time.time_ns
        self._emit = emit or (lambda event: None)
        self._lock: Any = None
        self.available = True
        self.version_problem: str | None = None
        self.open_step: OpenStep | None = None
        self._steps: list[StepInfo] = []  # oldest first
        #: ``sum(s.size_bytes for s in self._steps)``, kept with every change of ``_steps``
        #: (appended, popped at either end, or replaced whole: :meth:`_set_steps`) — read by
        #: every record's accounting, where the sum took ~4 µs at the default 100 steps
        self._steps_bytes = 0
        self._parsed: dict[bytes, bytes] = {}  # journal bytes -> marshal of their parse (PARSED_JOURNALS_KEPT_MAX)
        self._written: dict[bytes, list[dict]] = {}  # journal bytes this process wrote -> its lines' objects (same bound)
        self._inline_checked: dict[tuple, bytes] = {}  # _inline_key -> verified bytes (INLINE_CHECKED_KEPT_MAX)
        self._barriers: list[Barrier] = []
        self._counters = {"next_seq": 1, "next_id": 1, "next_ambient": -1, "next_barrier": 1}
        #: what ``counters.json`` holds, as far as this process knows (None: unknown, missing
        #: or corrupt): every counter handed out lies below its bound there (COUNTERS_LEASE_STEPS)
        self._leased: dict | None = None
        self._reflink_ok: bool | None = None
        self.eviction_pending = False
        #: known, while the store is locked by this process, that ``wal/rollback`` (resp.
        #: ``wal/in_progress`` while no step is open) is absent: this process makes and
        #: retires both, so the look before each step and undo is needed only after one
        #: was made and not yet retired, or a call that might retire it failed
        self._no_rollback_dir = False
        self._no_wal_dir = False
        #: known that ``trash/`` is empty (open emptied it and every retirement since was
        #: deleted): a retirement's name is then free without a look
        self._trash_empty = False
        self._cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self._dctxs: list[zstandard.ZstdDecompressor] = []  # free for the next reader (DECOMPRESSORS_KEPT_MAX)

    # ------------------------------------------------------------------ opening

    def open(self, work: HostFS, workdir_label: str = "") -> dict | None:
        """Lock, check the version, recover. Returns the recovery report (or None)."""
        self._work = work
        self._lock = self.fs.lock("lock")
        try:
            names = set(self.fs.listdir(""))
            if "VERSION" not in names:
                if names - {"lock", "WORKDIR"}:
                    self._unavailable("the store has no VERSION file")
                    return None
                self._init_fresh(workdir_label)
            else:
                raw = self.fs.read_all("VERSION")
                text = raw.decode("ascii", "replace").strip()
                if text != str(FORMAT_VERSION):
                    self._unavailable(f"undo log format version {text or '(empty)'!r}, this agent uses {FORMAT_VERSION}")
                    return None
            self._load()
            report = self._recover()
            self.enforce_limits(best_effort=True)  # e.g. a crash interrupted an eviction
            return report
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.open_step is not None:
            self._keep_journal(self.open_step, keep=False)
        if self._lock is None:
            return
        try:
            if self._leased is not None and self._leased != self._counters:
                # the exact counters — below the bounds, above every seq and id handed out (they
                # are the next ones) — so a clean reopen continues without a gap; if this fails,
                # the bounds stand and the lock is released all the same
                try:
                    self._save_counters()
                except OSError:
                    pass
        finally:
            self._lock.release()
            self._lock = None

    def _unavailable(self, why: str) -> None:
        self.available = False
        self.version_problem = why
        self._emit({"type": "event.undo_version_mismatch", "message": why})

    def require_available(self) -> None:
        if not self.available:
            raise UndoUnavailable(f"undo is unavailable: {self.version_problem}; discard the undo history to continue "
                                  "(`sandbox discard --workdir DIR`)", reason=self.version_problem)

    def _init_fresh(self, workdir_label: str) -> None:
        for d in ("wal", "steps", "barriers", "trash"):
            if not self.fs.exists(d):
                self.fs.mkdir(d, 0o700)
        self._sync("")
        if workdir_label:
            self._write_file("WORKDIR", (workdir_label + "\n").encode("utf-8", "surrogateescape"))
        self._write_file("VERSION", f"{FORMAT_VERSION}\n".encode())

    def _sync(self, *paths: str) -> None:
        """Power-loss mode: make these store paths durable (a directory: its entries)."""
        if self.durable:
            for p in paths:
                self.fs.fsync(p)

    def sync_work(self, work: HostFS, *paths: str) -> None:
        """Power-loss mode: make these working paths and their directory entries durable."""
        if not self.durable:
            return
        for p in paths:
            for q in ((p, parent_of(p)) if p else (p,)):
                try:
                    work.fsync(q)
                except OSError as e:
                    if e.errno not in ABSENT_ERRNOS:
                        raise

    def _write_file(self, path: str, data: bytes) -> None:
        """Replace ``path`` atomically: write a temp file, then rename over. A temp file an
        interrupted run left is found by the create (``EEXIST``) and removed first."""
        tmp = path + ".tmp"
        self._create_written(tmp, data)
        self._sync(tmp)
        self.fs.rename(tmp, path)
        self._sync(parent_of(path))

    def _write_unpromoted(self, path: str, data: bytes) -> None:
        """Write ``path`` inside the WAL, in place: nothing reads a file there before the
        promotion renames the directory, and every fault before that leaves the WAL to
        recovery (which reads only its journal), so no temp file and rename are needed — a
        file an earlier attempt left is found by the create (``EEXIST``) and replaced. In
        power-loss mode the file and its entry are durable before it returns (before the
        promotion)."""
        self._create_written(path, data)
        self._sync(path, parent_of(path))

    def _create_written(self, path: str, data: bytes) -> None:
        """Create ``path`` (0600) holding ``data``, not yet synced; a file an interrupted run
        left there is found by the create (``EEXIST``), removed, and created again."""
        try:
            self.fs.create(path, 0o600)
        except FileExistsError:
            self.fs.unlink(path)
            self.fs.create(path, 0o600)
        self.fs.write_all(path, 0, data)

    def discard(self, workdir_label: str = "") -> None:
        """Delete all undo history (after a version mismatch, on the user's word), whatever
        state the store is in: an unfinished rollback and a step waiting for its promotion
        go too (the working folder stays as it is)."""
        if self.open_step is not None and self.open_step.closing is None:
            raise UndoUnavailable("cannot discard while a step is open")
        if self.open_step is not None:
            self._keep_journal(self.open_step, keep=False)
        self.open_step = None
        self._no_rollback_dir = self._no_wal_dir = self._trash_empty = False
        for name in self.fs.listdir(""):
            if name != "lock":
                preimage.remove_tree(self.fs, name)
        self._set_steps([])
        self._barriers = []
        self._counters = {"next_seq": 1, "next_id": 1, "next_ambient": -1, "next_barrier": 1}
        self._leased = None
        self._init_fresh(workdir_label)
        self.available, self.version_problem = True, None

    def wipe(self, workdir_label: str = "") -> None:
        """Lock the store, :meth:`discard` it, unlock — without :meth:`open`: no recovery
        runs and nothing is read, so it works whatever the store holds (an unfinished
        rollback, a journal nobody can parse, a foreign version). ``StoreBusy`` if in use."""
        self._lock = self.fs.lock("lock")
        try:
            self.discard(workdir_label)
        finally:
            self.close()

    def _load(self) -> None:
        for d in ("wal", "steps", "barriers", "trash"):
            if not self.fs.exists(d):
                self.fs.mkdir(d, 0o700)
        try:
            counters = unseal(self.fs.read_all("counters.json"))
            _need_keys(counters, set(self._counters), "counters")
            for key in self._counters:
                _need_int(counters, key)
            self._counters.update(counters)
            self._leased = {key: counters[key] for key in self._counters}
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:
            # ids then continue after the newest step in history (below); an evicted step's
            # id may come back, nothing else depends on them
            self._emit({"type": "event.warning", "message": f"undo store file counters.json is corrupt ({e}); "
                        "step ids continue after the newest step in history"})
        steps = []
        for name in sorted(self.fs.listdir("steps")):
            if name.isdigit():
                steps.append(self._read_step(int(name)))
        self._set_steps(steps)
        self._barriers = []
        for name in sorted(self.fs.listdir("barriers")):
            if name.endswith(".json"):
                try:
                    b = unseal(self.fs.read_all(join("barriers", name)))
                    _need_keys(b, {"id", "after_seq", "paths", "created_ns", "reason"}, "barrier")
                    for key in ("id", "after_seq", "created_ns"):
                        _need_int(b, key)
                    _need(isinstance(b["paths"], list) and all(isinstance(p, str) for p in b["paths"]), "'paths' is not a list")
                    _need(isinstance(b["reason"], str), "'reason' is not a string")
                    self._barriers.append(Barrier(**b))
                except (OSError, ValueError) as e:
                    # a barrier may only ever stop a rollback: one we cannot read stops them all
                    self._emit({"type": "event.warning", "message": f"barrier file {name} unreadable ({e}); treated as a barrier after every step"})
                    self._barriers.append(Barrier(id=0, after_seq=1 << 62, paths=[], created_ns=0, reason=f"unreadable barrier {name}"))
        # counters never go backwards, even if counters.json was lost
        top_seq = max([s.seq for s in self._steps], default=0)
        top_id = max([s.id for s in self._steps if s.id > 0], default=0)
        low_amb = min([s.id for s in self._steps if s.id < 0], default=0)
        self._counters["next_seq"] = max(self._counters["next_seq"], top_seq + 1)
        self._counters["next_id"] = max(self._counters["next_id"], top_id + 1)
        self._counters["next_ambient"] = min(self._counters["next_ambient"], low_amb - 1)
        self._counters["next_barrier"] = max(self._counters["next_barrier"], max([b.id for b in self._barriers], default=0) + 1)

    def _read_step(self, seq: int) -> StepInfo:
        """A finished step as history shows it. Never raises: a step whose manifest fails
        its seal or schema, or whose journal is not the size the manifest says (emptied,
        truncated), is returned with ``corrupt`` saying why — named by the id in its
        journal's header if that is intact — and every rollback that needs it is refused.
        The rest of the journal and the preimages are checked when a rollback reads them."""
        where = f"steps/{seq:010d}"
        try:
            man = unseal(self.fs.read_all(join(where, "manifest.json")))
            check_manifest(man)
        except FileNotFoundError:
            why = "manifest.json is missing"
        except OSError as e:
            why = f"manifest.json is unreadable ({e.strerror or e})"
        except ValueError as e:
            why = f"manifest.json is corrupt ({e})"
        else:
            info = StepInfo(seq=seq, id=man["id"], type=man["type"], command=man["command"], started_ns=man["started_ns"],
                            ended_ns=man["ended_ns"], exit_code=man["exit_code"], outcome=man["outcome"],
                            unprotected=man["unprotected"], size_bytes=man["size_bytes"], paths=man["paths"],
                            fingerprints=man["fingerprints"], journal_lines=man["journal_lines"],
                            journal_bytes=man["journal_bytes"], journal_hash=man["journal_hash"], records=man["records"])
            try:
                size = self.fs.lstat(join(where, "journal.jsonl")).size
            except OSError as e:
                info.corrupt = f"journal.jsonl is missing or unreadable ({e.strerror or e})"
            else:
                if size != info.journal_bytes:
                    info.corrupt = (f"journal.jsonl is {size} bytes, its manifest says {info.journal_bytes} "
                                    "(emptied, truncated or torn)")
            return info
        info = StepInfo(seq=seq, id=0, type="unknown", command="", started_ns=0, corrupt=why)
        header = self._read_header(where)
        if header is not None and header["seq"] == seq:
            info.id, info.type, info.command, info.started_ns = header["id"], header["type"], header["command"], header["started_ns"]
        return info

    def _read_header(self, where: str) -> dict | None:
        """The sealed, valid header of ``where``'s journal, or None."""
        try:
            head = self.fs.read(join(where, "journal.jsonl"), 0, HEADER_READ_BYTES_MAX)
            line, nl, _ = head.partition(b"\n")
            if not nl:
                return None
            header = unseal(line)
            check_header(header)
            return header
        except (OSError, ValueError):
            return None

    def corrupt(self, info: StepInfo, what: str | None = None) -> CorruptStep:
        """The error for a corrupt step: one line naming it (by id when known) and what is wrong."""
        what = " ".join((what or info.corrupt or "corrupt").split())
        name = f"step {info.id} " if info.id else "step (id unknown) "
        return CorruptStep(f"{name}is corrupt ({info.dirname}: {what})", step_id=info.id or None, seq=info.seq, reason=what)

    # ------------------------------------------------------------------ ids

    def allocate_id(self, ambient: bool) -> int:
        key = "next_ambient" if ambient else "next_id"
        value = self._counters[key]
        self._counters[key] = value - 1 if ambient else value + 1
        return value

    def _save_counters(self, lease: bool = False) -> None:
        """Write ``counters.json``: the exact counters, or (``lease``) bounds
        COUNTERS_LEASE_STEPS ahead of them."""
        c = dict(self._counters)
        if lease:
            c["next_seq"] += COUNTERS_LEASE_STEPS
            c["next_id"] += COUNTERS_LEASE_STEPS
            c["next_ambient"] -= COUNTERS_LEASE_STEPS
        self._leased = None  # unknown while it is being replaced
        self._write_file("counters.json", seal(c))
        self._leased = c

    def _counters_leased(self) -> bool:
        """Every counter handed out so far lies below the bounds ``counters.json`` holds."""
        c, lease = self._counters, self._leased
        return (lease is not None and c["next_seq"] <= lease["next_seq"] and c["next_id"] <= lease["next_id"]
                and c["next_ambient"] >= lease["next_ambient"] and c["next_barrier"] <= lease["next_barrier"])

    # ------------------------------------------------------------------ the open step

    def begin(self, step_id: int, step_type: str, command: str) -> OpenStep:
        self.require_available()
        if self.open_step is not None:
            raise RuntimeError("a step is already open")
        self.finish_recovery()  # RollbackIncomplete: no step may begin between two steps
        if self.eviction_pending:
            self.enforce_limits(best_effort=True)
        seq = self._counters["next_seq"]
        self._counters["next_seq"] = seq + 1
        if not self._counters_leased():  # (the step's id was handed out already: allocate_id)
            self._save_counters(lease=True)
        now = self.clock_ns()
        step = OpenStep(seq=seq, id=step_id, type=step_type, command=command, started_ns=now, touched_ns=now)
        self._no_wal_dir = False
        self.fs.mkdir(WAL, 0o700)
        header = {"seq": seq, "id": step_id, "type": step_type, "command": command, "started_ns": now}
        self.fs.create(WAL_JOURNAL, 0o600)
        self._keep_journal(step)
        try:
            self._append_line(step, header)
            self._sync(WAL, "wal")
        except BaseException:
            self._keep_journal(step, keep=False)
            raise
        self.open_step = step
        return step

    def _append_line(self, step: OpenStep, obj: dict, written: Callable[[], None] | None = None, *,
                     record: bool = False, line: bytes | None = None) -> None:
        """Append one sealed journal line — after the records held for it (:meth:`hold`), in
        the same write. Once the write has succeeded the lines exist, so memory is updated
        (``written``; ``record``: ``obj`` becomes the step's last record, at this line; each
        held record before it) *before* the fsync: if the fsync fails the caller's operation
        fails, but memory and file still agree (record indices, line numbers, offsets and the
        running journal hash never drift). If the write fails, the held records are dropped
        with it (their host call will not run). A void still owed (``pending_void``) is
        written first: no line may follow an intent that never ran. A void line itself goes
        before held records (none are held when a void is written: see :meth:`hold`).
        ``line``: ``seal(obj)``, if the caller has it."""
        if step.pending_void and obj.get("op") != "void":
            self.void([])
        if line is None:
            line = seal(obj)
        held = step.held if obj.get("op") != "void" else ()
        data = b"".join([h[1] for h in held] + [line]) if held else line
        try:
            if step.journal_out is not None:
                step.journal_out.pwrite_all(data, step.journal_offset)
            else:
                self.fs.write_all(WAL_JOURNAL, step.journal_offset, data)
        except BaseException:
            step.tail_unknown = True
            if held:
                step.held = []
            raise
        if held:
            step.held = []
            for h in held:
                self._wrote(step, h[0], h[1], True)
        self._wrote(step, obj, line, record)
        if written is not None:
            written()
        if self.durable:  # (no call of _sync otherwise: once per journal write)
            self._sync(WAL_JOURNAL)

    @staticmethod
    def _wrote(step: OpenStep, obj: dict, line: bytes, record: bool) -> None:
        """Memory after ``line`` (``seal(obj)``) was written at the journal's end."""
        step.journal_offset += len(line)
        step.journal_lines += 1
        if step.lines is not None:
            if step.journal_offset <= PARSED_JOURNAL_KEPT_BYTES_MAX:
                step.lines.append(line)
                step.line_objs.append(obj)  # type: ignore[union-attr]
            else:
                step.lines = step.line_objs = None
        if step.journal_hash is not None:
            step.journal_hash.update(line)
        if record:  # after the line (and any owed void before it): the step's last line
            step.records.append(obj)
            step.record_lines.append(step.journal_lines - 1)

    def hold(self, rec: dict) -> None:
        """Journal ``rec`` with the next line appended — one write for an operation's
        preimages and its intent — or at :meth:`flush`, whichever comes first. The caller
        flushes before the host call the record is for (rule 1: the interceptor's hooks do,
        as they return or raise); if the process dies first, that call never ran. A void
        still owed is written now, before anything is held."""
        step = self.open_step
        assert step is not None
        if step.pending_void:
            self.void([])
        step.held.append((rec, seal(rec)))

    def flush(self) -> None:
        """Write the records :meth:`hold` holds, in one write (nothing if none)."""
        step = self.open_step
        if step is not None and step.held:
            rec, line = step.held.pop()
            self._append_line(step, rec, record=True, line=line)

    def _keep_journal(self, step: OpenStep, keep: bool = True) -> None:
        """Close the open step's journal handle, if any, and (``keep``) open one on the journal
        now at its path: one resolution for all its appends where a path write takes one per
        line (the real disk; elsewhere None and no host call). Called wherever the journal is
        made, replaced or renamed, so a line never goes to a file the path no longer names."""
        old, step.journal_out = step.journal_out, None
        if old is not None:
            old.close()
        if keep:
            try:
                step.journal_out = self.fs.append_handle(WAL_JOURNAL)
            except OSError:
                step.journal_out = None  # written by path, as without it

    def append(self, rec: dict) -> int:
        """Make ``rec`` durable in the WAL (rule 1); returns its index."""
        step = self.open_step
        assert step is not None
        self._append_line(step, rec, record=True)
        return len(step.records) - 1

    def void(self, indices: list[int]) -> None:
        """Cancel records whose host call failed (rule 2). If the void line cannot be
        written (the store fails too), it is owed (``OpenStep.pending_void``): written
        before the next line, before the step finishes, and left out of a denied step's
        undo; ``void([])`` pays what is owed."""
        step = self.open_step
        assert step is not None
        indices = step.pending_void + [i for i in indices if i not in step.pending_void]
        step.pending_void = indices

        def written() -> None:
            for i in indices:
                step.records[i] = {"op": "void"}
            step.pending_void = []

        if indices:
            self._append_line(step, {"op": "void", "lines": [step.record_lines[i] for i in indices]}, written)

    def capture_content(self, work: HostFS, path: str, st: Stat, index: int,
                        handle: FileHandle | None = None) -> dict:
        """Store the bytes of regular file ``path``; returns the record fields describing them,
        with ``hash``, the blake2b of the bytes stored — for a reflink, of the clone itself
        (read back: what was cloned, even if the file changed meanwhile). With ``handle``
        (open on the inode ``st`` describes) the bytes are read through it
        (:meth:`FileHandle.read_own`: that inode's, no path resolution per read); a reflink
        still clones by path."""
        step = self.open_step
        assert step is not None
        step.blobs += 1
        name = f"b{step.blobs}"
        blob = join(WAL, name)
        if st.size >= REFLINK_MIN_BYTES and self._reflink_ok is not False:
            try:
                work.clone_to(path, self.fs, blob)
                self._sync(blob, WAL)
                self._reflink_ok = True
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS):
                    raise
                self._reflink_ok = False
            else:
                size = self.fs.lstat(blob).size
                return {"enc": "raw", "blob": name, "size": size, "stored": size, "hash": preimage.content_hash(self.fs, blob)}
        comp = None  # a streaming frame, made only for a file not read whole by its first read
        digest = hashlib.blake2b(digest_size=16)  # the same hash as preimage.content_hash
        pending = bytearray()
        stored = 0
        size = 0
        in_blob = False
        offset = 0
        while True:
            want = preimage.read_size(st.size, offset)
            chunk = handle.read_own(want, offset) if handle is not None else work.read(path, offset, want)
            if not chunk:
                break
            offset += len(chunk)
            size += len(chunk)
            digest.update(chunk)
            if comp is None and offset == len(chunk) <= ONE_SHOT_COMPRESS_BYTES_MAX and len(chunk) < want and offset >= st.size:
                # the whole small file in one short read: one frame at once, its size known to
                # zstd (which sizes its tables to it instead of resetting a level's full ones);
                # the same record form, inline as the streamed frame would have been
                data = self._cctx.compress(chunk)
                assert len(data) <= INLINE_MAX_BYTES, (len(chunk), len(data))
                return {"enc": "zstd", "data": b64(data), "size": size, "stored": len(data), "hash": digest.hexdigest()}
            if comp is None:
                comp = self._cctx.compressobj()
            pending += comp.compress(chunk)
            if len(pending) > INLINE_MAX_BYTES:
                if not in_blob:
                    self.fs.create(blob, 0o600)
                    in_blob = True
                self.fs.write_all(blob, stored, bytes(pending))
                stored += len(pending)
                pending.clear()
            if len(chunk) < want and offset >= st.size:
                break  # a short read at the size just seen: the end (no read more to find nothing)
        if comp is None:  # an empty file: an empty frame, as before
            comp = self._cctx.compressobj()
        pending += comp.flush()
        if not in_blob and len(pending) <= INLINE_MAX_BYTES:
            return {"enc": "zstd", "data": b64(bytes(pending)), "size": size, "stored": len(pending), "hash": digest.hexdigest()}
        if not in_blob:
            self.fs.create(blob, 0o600)
        self.fs.write_all(blob, stored, bytes(pending))
        self._sync(blob, WAL)
        stored += len(pending)
        return {"enc": "zstd", "blob": name, "size": size, "stored": stored, "hash": digest.hexdigest()}

    def mark_unprotected(self) -> None:
        step = self.open_step
        assert step is not None
        if step.unprotected:
            return
        self._append_line(step, {"op": "unprotected"}, lambda: setattr(step, "unprotected", True))
        for name in self.fs.listdir(WAL):
            if name.startswith("b"):
                self.fs.unlink(join(WAL, name))
        self._emit({"type": "event.warning", "message": f"step {step.id} exceeded max_single_step_size_bytes "
                    f"({self.limits.max_single_step_size_bytes}); it is unprotected and cannot be rolled back"})

    def finish(self, work: HostFS, exit_code: int | None, outcome: str = "completed") -> StepInfo:
        """Fingerprint what the step left, write its manifest, promote it (rule 4), apply limits."""
        step = self.open_step
        assert step is not None
        self.flush()  # none held: the hooks flush (else written now, as before the promotion)
        if step.pending_void and not step.unprotected:
            self.void([])
        live = [r for r in step.records if r.get("op") not in ("void", "unprotected")]
        info = StepInfo(seq=step.seq, id=step.id, type=step.type, command=step.command, started_ns=step.started_ns,
                        ended_ns=self.clock_ns(), exit_code=exit_code, outcome=step.outcome if step.outcome != "completed" else outcome, unprotected=step.unprotected,
                        size_bytes=0 if step.unprotected else step.size_bytes)
        # power-loss mode: the journal (an append's fsync may have failed since), the step's
        # effects, then its promotion
        self._sync(WAL_JOURNAL)
        final = self.final_paths(live)
        self.sync_work(work, *final)
        info.paths, info.fingerprints = self._fingerprints(work, live, final)
        info.journal_lines, info.journal_bytes, info.journal_hash = self._journal_summary(step)
        info.records = len(live)
        man = {"id": info.id, "type": info.type, "command": info.command, "started_ns": info.started_ns,
               "ended_ns": info.ended_ns, "exit_code": exit_code, "outcome": info.outcome, "unprotected": info.unprotected,
               "size_bytes": info.size_bytes, "paths": info.paths, "fingerprints": info.fingerprints,
               "format": FORMAT_VERSION, "journal_lines": info.journal_lines, "journal_bytes": info.journal_bytes,
               "journal_hash": info.journal_hash, "records": info.records}
        self._write_unpromoted(join(WAL, "manifest.json"), seal(man))
        self._keep_journal(step, keep=False)  # a retry after a failed rename appends by path
        self.fs.rename(WAL, info.dirname)  # the promotion: from here on the step is finished
        self.open_step = None
        self._no_wal_dir = True
        self._steps.append(info)
        self._steps_bytes += info.size_bytes
        if step.lines is not None and step.journal_hash is not None:
            self._keep_bounded(self._written, b"".join(step.lines), step.line_objs)
        try:
            self._sync("steps", "wal")
        finally:
            self.enforce_limits(best_effort=True)
        return info

    def _journal_summary(self, step: OpenStep) -> tuple[int, int, str]:
        """(lines, bytes, hash) of the open step's journal, as its manifest records them.

        Known from the appends (bytes a failed append left past them are cut off); for a
        step rebuilt by recovery (hash unknown) read from the file, a torn last line cut
        off first (its mutation never started)."""
        path = WAL_JOURNAL
        if step.journal_hash is not None:
            if step.tail_unknown and self.fs.lstat(path).size != step.journal_offset:
                # an append that failed part-way (ENOSPC, EIO) left bytes past the last line
                self.fs.truncate(path, step.journal_offset)
            return step.journal_lines, step.journal_offset, step.journal_hash.hexdigest()
        data = self.fs.read_all(path)
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) != len(data):
            self._write_file(path, whole)
        return whole.count(b"\n"), len(whole), journal_hash(whole)

    @staticmethod
    def touched_paths(records: list[dict]) -> list[str]:
        """Every path the step's records name, at the moment each was written."""
        seen: dict[str, None] = {}
        for r in records:
            if r.get("op") in _TWO_PATHS:
                seen.setdefault(r["src"], None)
                seen.setdefault(r["dst"], None)
            elif "path" in r:
                seen.setdefault(r["path"], None)
        return list(seen)

    @staticmethod
    def final_paths(records: list[dict]) -> dict[str, bool]:
        """Where each touched thing is at the end of the step: every recorded path moved
        forward through the step's later renames. Value: True if it was created in the step.

        A regular file's preimage also names the file's other names then (``links``): they
        are here too, though the step left them alone, because undoing the record writes the
        saved bytes into that inode again — through them. Fingerprinted with the rest, a
        user's edit made through one of them since refuses the undo (``ExternalChange``)
        instead of being overwritten under every name."""
        out: dict[str, bool] = {}
        later: list[tuple[str, str, str]] = []  # moves after the record in hand, chronological
        for r in records[::-1]:
            op = r.get("op")
            paths: tuple = ((r["src"], r["dst"]) if op in _TWO_PATHS else
                            (r["path"], *r.get("links", ())) if "path" in r else ())
            for p in paths:
                p = moved_forward(p, later)
                out[p] = out.get(p, False) or op == "created"
            if op in _TWO_PATHS:
                later.insert(0, (op, r["src"], r["dst"]))
        return out

    def _fingerprints(self, work: HostFS, records: list[dict], final: dict[str, bool]) -> tuple[list[str], dict]:
        """``final``: :meth:`final_paths` of ``records``."""
        fps = {p: preimage.fingerprint(work, p, with_dir_mtime=created) for p, created in final.items()}
        return self.touched_paths(records), fps

    def deny_open(self, work: HostFS) -> int:
        """Roll back the open step (a safeguard said deny) and keep it open, empty, as
        a tombstone: history will show it with ``outcome: "denied"``. Returns records undone.

        A crash half-way is safe: the journal still holds every record until the rewrite,
        and undoing a record twice is harmless.
        """
        step = self.open_step
        assert step is not None
        step.held = []  # none: the hooks flush (a held record's host call never ran)
        owed = set(step.pending_void)  # intents that never ran, their void not yet written
        live = [r for n, r in enumerate(step.records) if r.get("op") not in ("void", "unprotected") and n not in owed]
        not_restored: list[tuple[str, str]] = []
        self._undo_resumable(work, WAL, live, not_restored=not_restored)
        if not_restored:
            self._emit({"type": "event.warning", "message": f"denied step {step.id}: {len(not_restored)} path(s) keep what "
                        f"the step wrote, their undo data is damaged ({not_restored[0][1]})"})
        header_obj = {"seq": step.seq, "id": step.id, "type": step.type, "command": step.command, "started_ns": step.started_ns}
        header = seal(header_obj)
        self._keep_journal(step, keep=False)
        self._write_file(WAL_JOURNAL, header)  # a new file at the path
        self._keep_journal(step)
        for name in self.fs.listdir(WAL):
            if name.startswith("b") or name in ("progress", EXCHANGE_NOTE):
                self.fs.unlink(join(WAL, name))
        step.records, step.journal_offset, step.size_bytes, step.outcome = [], len(header), 0, "denied"
        step.pending_void = []
        step.record_lines, step.journal_lines, step.journal_hash = [], 1, _new_journal_hash()
        step.journal_hash.update(header)
        step.lines, step.line_objs = [header], [header_obj]
        return len(live)

    # ------------------------------------------------------------------ history

    def steps(self) -> list[StepInfo]:
        """Finished steps, oldest first."""
        return list(self._steps)

    def barriers(self) -> list[Barrier]:
        return list(self._barriers)

    def add_barrier(self, paths: list[str], reason: str = "external modification") -> Barrier:
        self.require_available()
        after = self.open_step.seq if self.open_step is not None else max([s.seq for s in self._steps], default=0)
        b = Barrier(id=self._counters["next_barrier"], after_seq=after, paths=sorted(paths)[:1000], created_ns=self.clock_ns(), reason=reason)
        self._counters["next_barrier"] += 1
        self._save_counters(lease=True)  # (bounds ahead, as a step's begin writes them: not lowered)
        self._write_file(f"barriers/{b.id:010d}.json", seal(b.as_dict()))
        self._barriers.append(b)
        return b

    def remove_barrier(self, b: Barrier) -> None:
        name = f"barriers/{b.id:010d}.json"
        if self.fs.exists(name):
            self.fs.unlink(name)
            self._sync("barriers")
        self._barriers.remove(b)

    def records_of(self, info: StepInfo, where: str | None = None) -> list[dict]:
        """The live records of a finished step, every one checked: the journal is exactly
        the one its manifest describes (lines, bytes, hash — so an emptied, torn, truncated
        or one-record-short journal is caught), every line is sealed and passes its schema,
        its header is this step's. Raises :class:`CorruptStep` naming the step otherwise."""
        where = where or info.dirname
        if info.corrupt:
            raise self.corrupt(info)
        try:
            data = self.fs.read_all(join(where, "journal.jsonl"))
        except OSError as e:
            raise self.corrupt(info, f"journal.jsonl is missing or unreadable ({e.strerror or e})") from None
        if len(data) != info.journal_bytes or journal_hash(data) != info.journal_hash:
            lines = data.count(b"\n")
            if lines < info.journal_lines:
                what = f"journal.jsonl has {lines} of its {info.journal_lines} lines (emptied, truncated or torn)"
            elif len(data) != info.journal_bytes:
                what = f"journal.jsonl is {len(data)} bytes, its manifest says {info.journal_bytes}"
            else:
                what = "journal.jsonl does not match the checksum in its manifest"
            raise self.corrupt(info, what)
        header, records = self._parse_checked(info, data, where)
        if header is None or header["seq"] != info.seq or header["id"] != info.id:
            raise self.corrupt(info, "journal.jsonl belongs to another step")
        live = [r for r in records if r["op"] != "unprotected"]
        if len(live) != info.records:
            raise self.corrupt(info, f"journal.jsonl has {len(live)} records, its manifest says {info.records}")
        return live

    def _parse_checked(self, info: StepInfo, data: bytes, where: str) -> tuple[dict | None, list[dict]]:
        """``parse_journal(data, where)`` (strict), or a fresh copy of the parse of the same
        bytes done before: the same result, every record its own object.

        If ``data`` is exactly a journal this process wrote (:meth:`finish` kept its lines'
        objects), its lines are not unsealed again: each line is ``seal(obj)`` of a kept
        object, so unsealing it gives that object back (JSON of the strings, integers, lists
        and string-keyed maps every schema check demands) — and every schema and void check
        runs on those objects as on parsed ones, at every read of those bytes (the kept objects
        stay kept, and only a parse of bytes from the disk is kept as its marshalled result:
        a rollback reads a journal this process wrote once, so marshalling its parse for a
        second read cost more than it saved). Bytes that differ by one bit are parsed."""
        kept = self._parsed.get(data)
        if kept is not None:
            return marshal.loads(kept)
        objs = self._written.get(data)
        if objs is not None:
            try:
                objs = marshal.loads(marshal.dumps(objs))  # copies, of exactly the types JSON gives
            except ValueError:  # a subclass (of str, dict, ...): never what JSON gives, so parse the bytes
                objs = None
        try:
            parsed = _check_journal(objs, where, True) if objs is not None else parse_journal(data, where)
        except CorruptStep as e:
            raise self.corrupt(info, e.data.get("reason", e.message)) from None
        if objs is None and len(data) <= PARSED_JOURNAL_KEPT_BYTES_MAX:
            self._keep_bounded(self._parsed, data, marshal.dumps(parsed))
        return parsed  # its own objects: a copy of the kept parse is what the next call gets

    @staticmethod
    def _keep_bounded(kept: dict, key: bytes, value) -> None:
        """``kept[key] = value``, the oldest entry forgotten first at PARSED_JOURNALS_KEPT_MAX."""
        if key not in kept and len(kept) >= PARSED_JOURNALS_KEPT_MAX:
            del kept[next(iter(kept))]
        kept[key] = value

    # ------------------------------------------------------------------ rollback

    def rollback_top(self, work: HostFS, force: bool = False, checked: dict[int, list[dict]] | None = None) -> int:
        """Undo the newest finished step (rollback is pop). Returns records undone.
        ``checked``: records the caller read with :meth:`records_of` since the store last
        changed, by step seq — used (and not read again) if they are the newest step's."""
        self.require_available()
        self.finish_pending_rollback()
        if not self._steps:
            raise NothingToUndo("no step to undo")
        info = self._steps[-1]
        if info.corrupt:
            raise self.corrupt(info)
        if info.unprotected:
            raise StepUnprotected(f"step {info.id} is unprotected (it exceeded max_single_step_size_bytes) and cannot be rolled back", step_id=info.id)
        records = (checked or {}).get(info.seq)
        if records is None:
            records = self.records_of(info)  # the caller has verified content and fingerprints
        self._no_rollback_dir = False
        self.fs.rename(info.dirname, ROLLBACK)
        self._steps.pop()
        self._steps_bytes -= info.size_bytes
        if force:  # before any record is undone: a resumption is forced too
            self.fs.create(join(ROLLBACK, "forced"), 0o600)
        self._sync(ROLLBACK, "steps", "wal")
        n = self._undo_resumable(work, ROLLBACK, records, user_forced=force, fresh=True)
        self._to_trash(ROLLBACK, f"rb-{info.seq}")
        self._no_rollback_dir = True
        self._drop_barriers_from(info.seq)
        return n

    def check_content(self, info: StepInfo, records: list[dict]) -> None:
        """Every preimage a rollback will read is present, decodes, and is its recorded size
        and hash — checked before the tree is touched, so a corrupt store refuses instead of
        half-undoing. ``records`` come from :meth:`records_of` (schema-checked)."""
        for r in records:
            if r["op"] == "pre" and r["kind"] == REG:
                try:
                    if "data" in r and r["size"] <= INLINE_CHECKED_BYTES_MAX:
                        data = b"".join(self._preimage_chunks(info.dirname, r))  # raises unless verified
                        key = _inline_key(r)
                        if key not in self._inline_checked and len(self._inline_checked) >= INLINE_CHECKED_KEPT_MAX:
                            del self._inline_checked[next(iter(self._inline_checked))]
                        self._inline_checked[key] = data
                        continue
                    for _ in self._preimage_chunks(info.dirname, r):
                        pass
                except CorruptStep as e:
                    raise self.corrupt(info, e.data.get("reason", e.message)) from None

    def _preimage_chunks(self, where: str, rec: dict) -> Iterator[bytes]:
        """The preimage bytes of a checked ``pre`` record of a regular file, in chunks of at
        most ``preimage.CHUNK_BYTES`` (zstd output is bounded too: a damaged frame cannot
        balloon). Raises :class:`CorruptStep` naming the path if they do not decode, or
        are not ``size`` bytes with blake2b ``hash`` — known only at the end, so a caller
        that writes must check first (:meth:`_open_content`)."""
        path, want = rec["path"], rec["size"]

        def bad(what: str) -> CorruptStep:
            why = f"the preimage of {path!r} {what}"
            return CorruptStep(f"{where}: {why}", reason=why)

        digest = hashlib.blake2b(digest_size=16)
        size = 0
        dctx = None
        try:
            if "data" in rec:
                src: Any = io.BytesIO(unb64(rec["data"]))
            else:
                src = _StoreFile(self.fs, join(where, rec["blob"]))
            if rec["enc"] == "raw":
                reader: Any = src
            else:
                try:
                    dctx = self._dctxs.pop()  # this reader's own (atomic: no other reader gets it)
                except IndexError:
                    dctx = zstandard.ZstdDecompressor()
                reader = dctx.stream_reader(src, read_size=preimage.CHUNK_BYTES)  # resets the context
            while True:
                chunk = reader.read(preimage.CHUNK_BYTES)
                if not chunk:
                    break
                size += len(chunk)
                if size > want:
                    raise bad(f"is longer than its recorded {want} bytes")
                digest.update(chunk)
                yield chunk
        except FileNotFoundError:
            raise bad(f"is missing ({rec['blob']})") from None
        except (OSError, ValueError, zstandard.ZstdError) as e:
            raise bad(f"is unreadable ({e})") from None
        finally:  # done, failed or abandoned: no read of this reader follows
            if dctx is not None and len(self._dctxs) < DECOMPRESSORS_KEPT_MAX:
                self._dctxs.append(dctx)
        if size != want:
            raise bad(f"has {size} bytes, expected {want}")
        if digest.hexdigest() != rec["hash"]:
            raise bad("does not match its checksum")

    def _open_content(self, where: str) -> Callable[[dict], Iterable[bytes]]:
        """``open_content`` for :func:`preimage.restore`: it checks the whole preimage when
        called — before restore touches the path — and raises :class:`CorruptStep` if it
        fails, so a damaged preimage never leaves a half-written file. A preimage over
        ``VERIFY_IN_MEMORY_BYTES_MAX`` is decoded twice and checked both times; only if the
        store changes between the two reads is the file left half-written (and the error raised).
        An inline preimage :meth:`check_content` just verified is not decoded again."""
        def content(rec: dict) -> Iterable[bytes]:
            if rec["size"] <= VERIFY_IN_MEMORY_BYTES_MAX:
                data = self._inline_checked.get(_inline_key(rec)) if "data" in rec else None
                if data is None:
                    data = b"".join(self._preimage_chunks(where, rec))
                return (data,) if data else ()
            for _ in self._preimage_chunks(where, rec):
                pass
            return self._preimage_chunks(where, rec)
        return content

    def _undo_resumable(self, work: HostFS, where: str, records: list[dict], user_forced: bool = False,
                        not_restored: list[tuple[str, str]] | None = None, last_may_be_stale: bool = False,
                        fresh: bool = False) -> int:
        """Undo a journal directory's records, resuming after the ones already undone.

        ``<where>/progress`` grows by one byte per record undone, after the undo; so a crash,
        ENOSPC or EIO at any point leaves a count that is exact or one short, and redoing
        one record's undo is harmless (every undo is idempotent on its own). Undoing from
        the newest again would not be: a ``renamed`` record's inverse must never run twice.
        Used by rollback, recovery and deny alike. ``not_restored``: see :meth:`_undo_records`.

        ``last_may_be_stale``: the journal of a step whose process died (recovery), whose
        newest record alone may be an intent whose host call never ran — every host call
        runs under the interceptor's lock right after its intent, so nothing follows a stale
        one. Every other intent ran: a finished step's, a denied step's (a failed call voids
        its intent), and so their undo never guesses from inode numbers, which a real disk
        reuses (see :func:`preimage.restore`, ``trust_intent``).

        ``fresh``: ``where`` was a finished step's directory an instant ago (a finished step
        keeps no progress and no exchange note), so neither is looked for.
        """
        done = None
        if not fresh:
            try:
                done = self.fs.lstat(join(where, "progress")).size
            except FileNotFoundError:
                pass
        if done is None:
            self.fs.create(join(where, "progress"), 0o600)
            self._sync(where)
            done = 0
        done = min(done, len(records))
        return self._undo_records(work, where, records, start=done, progress=done, user_forced=user_forced,
                                  not_restored=not_restored, last_may_be_stale=last_may_be_stale, fresh=fresh)

    def _undo_records(self, work: HostFS, where: str, records: list[dict], start: int, progress: int | None,
                      user_forced: bool = False, not_restored: list[tuple[str, str]] | None = None,
                      open_content: Callable[[dict], Iterable[bytes]] | None = None, trust_intents: bool = False,
                      last_may_be_stale: bool = False, fresh: bool = False) -> int:
        """Pass 1: undo records newest first, skipping the ``start`` already done (rule 3).
        Pass 2: directory metadata, deepest first (idempotent, so always redone whole).

        A damaged record (a preimage failing its checksum, a journal line that is not one)
        raises :class:`CorruptStep` — before that record touches anything. With a
        ``not_restored`` list (recovery, deny: the undo must end) it is survived instead,
        and ``(path, why)`` of each path left as the step made it is appended: a record whose preimage
        fails is skipped (that path keeps the step's version, never wrong bytes); a damaged
        line stops pass 1 there — what it was is unknown (it may have voided an older
        intent), so the older records stay as the step left them, and the tree is as it was
        at that point of the step, a state that really existed. ``open_content``: what a
        ``pre`` record of a regular file restores (default: its checked preimage bytes)."""
        open_content = open_content or self._open_content(where)
        links = preimage.LinkGroups(records)
        links.replay(work, list(reversed(records[len(records) - start:])))  # what an interrupted run undid
        noted = self._exchange_noted(where) if progress is not None and not fresh else None
        progress_file = join(where, "progress")
        done = start
        stop = 0
        for i in range(len(records) - start - 1, -1, -1):
            rec = records[i]
            if rec["op"] == "corrupt":
                if not_restored is None:
                    raise CorruptStep(f"{where}: {rec['why']}", reason=rec["why"])
                seen = {p for p, _ in not_restored}
                not_restored.extend((p, rec["why"]) for p in self.touched_paths(records[: i + 1]) if p not in seen)
                stop = i + 1
                break
            try:
                # a rollback that began always completes (force); only the user's force overrides
                # the evidence that a rename never ran (see preimage.restore)
                note = None
                if rec["op"] == "exchanged" and progress is not None:
                    note = preimage.ExchangeNote(before=noted[1] if noted is not None and noted[0] == i else None,
                                                 keep=lambda now, i=i: self._keep_exchange_note(where, i, now))  # type: ignore[misc]
                trust = trust_intents or not (last_may_be_stale and i == len(records) - 1)
                preimage.restore(work, rec, open_content, force=True, dir_meta=False, user_forced=user_forced,
                                 trust_intent=trust, links=links, exchange_note=note)
            except CorruptStep as e:
                if not_restored is None:
                    raise
                if rec["path"] not in {p for p, _ in not_restored}:
                    not_restored.append((rec["path"], e.data.get("reason", e.message)))
            except OSError as e:  # name the path being restored, not just the host call's final component
                raise OSError(e.errno, e.strerror or str(e), rec["src"] if rec["op"] in _TWO_PATHS else rec["path"]) from e
            if self.durable:
                self.sync_work(work, *((rec["src"], rec["dst"]) if rec["op"] in _TWO_PATHS else (rec["path"],)), *links.touched)
            links.touched.clear()
            done += 1
            if progress is not None:
                self.fs.write_all(progress_file, done - 1, b".")
                if self.durable:  # (no call of _sync otherwise: once per record undone)
                    self._sync(progress_file)
        plan = preimage.dir_meta_plan(records[stop:])
        for rec in plan:
            preimage.apply_dir_meta(work, rec)
        self.sync_work(work, *(rec["path"] for rec in plan))
        return done - start

    def _keep_exchange_note(self, where: str, index: int, now: tuple[int | None, int | None]) -> None:
        """Durably note the inode numbers at an ``exchanged`` record's two names just before
        its undo moves them (:class:`preimage.ExchangeNote`); ``index``: the record's."""
        self._write_file(join(where, EXCHANGE_NOTE), json.dumps({"record": index, "before": list(now)}).encode())

    def _exchange_noted(self, where: str) -> tuple[int, tuple[int | None, int | None]] | None:
        """``(record index, inode numbers)`` of the last exchange note in ``where``, or None
        (none, or unreadable: then the inode numbers the record carries decide alone)."""
        try:
            if self.fs.lstat(join(where, EXCHANGE_NOTE)).size > EXCHANGE_NOTE_MAX_BYTES:
                return None
            raw = self.fs.read_all(join(where, EXCHANGE_NOTE))
        except FileNotFoundError:
            return None
        try:
            note = json.loads(raw)
            index, (a, b) = note["record"], note["before"]
            if isinstance(index, int) and all(x is None or isinstance(x, int) for x in (a, b)):
                return index, (a, b)
        except (ValueError, KeyError, TypeError):
            pass
        return None

    # ------------------------------------------------------------------ inspection (read-only)

    def preimage_bytes(self, info: StepInfo, rec: dict, max_bytes: int) -> bytes | None:
        """The preimage bytes of ``rec`` (a ``pre`` record of a regular file of the finished
        step ``info``, from :meth:`records_of`), checked against its size and hash; None if
        it is over ``max_bytes`` (nothing is decoded then). :class:`CorruptStep` if they are
        damaged or gone (an unprotected step keeps no blobs). Reads only."""
        if rec["size"] > max_bytes:
            return None
        return b"".join(self._preimage_chunks(info.dirname, rec))

    def replay_undo(self, info: StepInfo, records: list[dict], onto: HostFS,
                    open_content: Callable[[dict], Iterable[bytes]]) -> None:
        """Apply the undo of the finished step ``info`` (its ``records``) to ``onto`` — another
        filesystem, never the working folder — exactly as :meth:`rollback_top` would, with
        ``open_content`` standing in for the preimage bytes. The store is only read: no
        progress file, no rename, the step stays in history."""
        self._undo_records(onto, info.dirname, records, start=0, progress=None, open_content=open_content,
                           trust_intents=True)  # a finished step: every intent ran; onto's inodes are not work's

    def _to_trash(self, path: str, name: str) -> None:
        """Atomically retire ``path`` (one rename), then delete it. If the deletion fails
        the directory is already out of the way; ``open`` empties trash/ again."""
        dst = join("trash", name)
        if not self._trash_empty and self.fs.exists(dst):
            preimage.remove_tree(self.fs, dst)
        self.fs.rename(path, dst)  # the retirement: after this the caller's change has happened
        try:
            self._sync(parent_of(path), "trash")
            self._remove_dir(dst)
        except BaseException as e:
            self._trash_empty = False
            if not isinstance(e, OSError):
                raise
            self._emit({"type": "event.warning", "message": f"could not delete {dst} from the undo store ({e}); retried on next open"})

    def _remove_dir(self, path: str) -> None:
        """Remove directory ``path`` of the store and everything in it: what
        :func:`preimage.remove_tree` does, one look fewer per entry — each entry is unlinked
        first, and only one that refuses (``EISDIR``, or ``EPERM`` as some systems answer)
        is looked at and, if a directory, emptied the same way."""
        for name in self.fs.listdir(path):
            child = join(path, name)
            try:
                self.fs.unlink(child)
            except (IsADirectoryError, PermissionError):
                st = self.fs.lstat_or_none(child)
                if st is None or st.kind != DIR:
                    raise
                self._remove_dir(child)
        self.fs.rmdir(path)

    # ------------------------------------------------------------------ limits

    def total_size_bytes(self) -> int:
        return self._steps_bytes + (self.open_step.size_bytes if self.open_step else 0)

    def _set_steps(self, steps: list[StepInfo]) -> None:
        """Replace the finished steps' list whole (its byte count with it)."""
        self._steps = steps
        self._steps_bytes = sum(s.size_bytes for s in steps)

    def enforce_limits(self, best_effort: bool = False) -> None:
        """Evict oldest steps until within limits. With ``best_effort`` an I/O error only
        warns and leaves ``eviction_pending`` set; the next step boundary retries."""
        evicted = []
        try:
            while len(self._steps) > self.limits.max_step_count:
                evicted.append(self._evict_oldest())
            while self._steps and self.total_size_bytes() > self.limits.max_log_size_bytes:
                evicted.append(self._evict_oldest())
            self.eviction_pending = False
        except OSError as e:
            self.eviction_pending = True
            if not best_effort:
                raise
            self._emit({"type": "event.warning", "message": f"evicting old undo steps failed ({e}); retried at the next step"})
        if evicted:
            oldest = self._steps[0].seq if self._steps else self._counters["next_seq"]
            for b in [b for b in self._barriers if b.after_seq < oldest]:
                self.remove_barrier(b)  # nothing it guarded can be rolled back any more
            self._emit({"type": "event.warning", "message": f"undo history limit reached: evicted {len(evicted)} oldest step(s) "
                        f"({', '.join(str(i) for i in evicted)})", "evicted_step_ids": evicted})

    def _evict_oldest(self) -> int:
        info = self._steps[0]
        self._to_trash(info.dirname, f"ev-{info.seq}")  # the rename into trash/ is the eviction
        self._steps.pop(0)
        self._steps_bytes -= info.size_bytes
        return info.id

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> dict | None:
        """Rule 5, on open. Returns ``{"kind", "step_id", "paths_restored"}`` or None if
        there was nothing to do.

        Never fails because the work cannot be finished now (a disk that answers EIO or is
        full, an immutable file, an unparsable journal): that is reported — kind
        ``rollback_incomplete`` with a ``message``, and an ``event.warning`` — and history
        stays readable; undo and new steps are refused until :meth:`finish_recovery`
        succeeds (it is retried before each), or the store is discarded. An open that
        failed instead would fail the same way every time: a wedged store.
        """
        try:
            for name in self.fs.listdir("trash"):
                preimage.remove_tree(self.fs, join("trash", name))
            self._trash_empty = True
        except OSError as e:  # only space is lost; retried at the next open
            self._emit({"type": "event.warning", "message": f"could not empty the undo store's trash ({e}); retried on next open"})
        try:
            report = self.finish_recovery()
        except RollbackIncomplete as e:
            report = {"kind": "rollback_incomplete", "step_id": e.data.get("step_id"), "paths_restored": 0,
                      "message": e.message}
            self._emit({"type": "event.warning", "code": e.code, "message": e.message})
        if report is not None:
            self._emit({"type": "event.recovery", **report})
        return report

    def finish_recovery(self) -> dict | None:
        """Finish what an earlier run (or call) left half-done: an interrupted rollback
        (``wal/rollback``), then the WAL of a step that never finished (never this run's own
        open step). Returns what was done, like :meth:`_recover`, or None.

        Raises :class:`RollbackIncomplete` if it cannot finish now; what was done so far
        stays done (progress counts), so the next call resumes.
        """
        report = None
        finished = self.finish_pending_rollback()
        if finished is not None:
            report = {"kind": "rollback_finished", **finished}
        if self.open_step is None and not self._no_wal_dir:
            if self.fs.exists(WAL):
                report = self._recover_wal() or report
            else:
                self._no_wal_dir = True
        return report

    def _recover_wal(self) -> dict | None:
        """Roll back (or, if unprotected, keep) the step a dead process left in the WAL.

        Never a loop on damaged undo data: what cannot be verified is reported
        (``paths_not_restored``, ``message``) and left as the step made it."""
        work = self._work
        header = None
        try:
            header, records, unprotected = self._read_wal(WAL)
            if not records and (header is None or not unprotected):
                self._to_trash(WAL, "wal-empty")  # died before its first record: nothing happened
                self._no_wal_dir = True
                return None
            if unprotected and header is not None:
                # its preimages are gone; promote it as unprotected so history says what happened
                self.open_step = OpenStep(seq=header["seq"], id=header["id"], type=header["type"], command=header["command"],
                                          started_ns=header["started_ns"], records=records, unprotected=True,
                                          journal_hash=None, lines=None, line_objs=None)  # finish() reads the journal
                try:
                    self.finish(work, None, outcome="recovered")
                except BaseException:
                    self.open_step = None  # still in the WAL: the next recovery tries again
                    raise
                return {"kind": "unprotected_step_kept", "step_id": header["id"], "paths_restored": 0}
            not_restored: list[tuple[str, str]] = []
            self._undo_resumable(work, WAL, records, not_restored=not_restored, last_may_be_stale=True)
            self._to_trash(WAL, f"wal-{header['seq'] if header else 'corrupt'}")
            self._no_wal_dir = True
        except (OSError, CorruptStep, KeyError, TypeError) as e:
            raise self._incomplete("recovery of an interrupted step", header, e) from e
        paths = [p for p in self.touched_paths(records) if p not in dict(not_restored)]
        report = {"kind": "in_progress_rolled_back", "step_id": header["id"] if header else None,
                  "paths_restored": len(paths)}
        if not_restored:
            names = [p for p, _ in not_restored]
            report["paths_not_restored"] = names[:REPORT_PATHS_MAX]
            report["message"] = (f"an interrupted step ({report['step_id']}) was rolled back, but its undo data is "
                                 f"damaged: {len(names)} path(s) keep what the step wrote: "
                                 f"{', '.join(repr(p) for p in names[:5])}{', …' if len(names) > 5 else ''} "
                                 f"({not_restored[0][1]})")
        else:
            damage = [r["why"] for r in records if r.get("op") == "corrupt"]
            if header is None or damage:
                report["paths_not_restored"] = []
                report["message"] = (f"an interrupted step ({report['step_id']}) left a damaged journal "
                                     f"({damage[0] if damage else 'its header is unreadable'}): what it changed "
                                     "from there on is unknown and was left as the step made it")
        return report

    def _incomplete(self, what: str, header: dict | None, e: BaseException) -> RollbackIncomplete:
        step_id = header.get("id") if isinstance(header, dict) else None
        path = getattr(e, "filename", None)
        code = getattr(e, "errno", None)
        cause = (f"{e.strerror or e}{f' on {path!r}' if path is not None else ''}" if isinstance(e, OSError)
                 else getattr(e, "message", None) or f"{type(e).__name__}: {e}")
        step = f"step {step_id}" if step_id is not None else "a step"
        return RollbackIncomplete(
            f"{what} ({step}) could not finish: {cause}. The working folder is between two steps: undo and "
            "new steps are refused until it finishes — it is retried on every open and undo once the cause is "
            "fixed — or discard the undo history (`sandbox discard`)",
            os_errno=code if isinstance(code, int) else None,
            step_id=step_id, path=path, errno=_errno_name(code), reason=cause)

    def _read_wal(self, where: str) -> tuple[dict | None, list[dict], bool]:
        """(header, live records, unprotected) of a WAL-like directory; no journal = no header.
        A damaged line is a ``corrupt`` marker in the records; a damaged header is None."""
        try:
            data = self.fs.read_all(join(where, "journal.jsonl"))
        except FileNotFoundError:
            return None, [], False
        header, records = parse_journal(data, where, strict=False)  # damaged lines: see _undo_records
        unprotected = any(r.get("op") == "unprotected" for r in records)
        return header, [r for r in records if r.get("op") != "unprotected"], unprotected

    @property
    def rollback_pending(self) -> bool:
        """A rollback or a recovery stopped part-way and is not finished yet."""
        return ((not self._no_rollback_dir and self.fs.exists(ROLLBACK))
                or (self.open_step is None and not self._no_wal_dir and self.fs.exists(WAL)))

    def finish_pending_rollback(self) -> dict | None:
        """Finish a rollback that was interrupted (crash, ENOSPC, EIO) from its progress count,
        forced if the user forced it. :class:`RollbackIncomplete` if it cannot finish now.

        Until this succeeds no new step may begin: the tree is between two steps.
        """
        if self._no_rollback_dir:
            return None
        if not self.fs.exists(ROLLBACK):
            self._no_rollback_dir = True
            return None
        header = None
        try:
            header, records, _ = self._read_wal(ROLLBACK)
            seq = header["seq"] if header else 0
            self._set_steps([s for s in self._steps if s.seq != seq])
            forced = self.fs.exists(join(ROLLBACK, "forced"))
            self._undo_resumable(self._work, ROLLBACK, records, user_forced=forced)
            self._to_trash(ROLLBACK, f"rb-{seq}")
            self._no_rollback_dir = True
        except (OSError, CorruptStep, KeyError, TypeError) as e:
            raise self._incomplete("an undo", header, e) from e
        self._drop_barriers_from(seq)
        return {"step_id": header["id"] if header else None, "paths_restored": len(self.touched_paths(records))}

    def _drop_barriers_from(self, seq: int) -> None:
        """Barriers after a step that no longer exists in history mean nothing now."""
        for b in [b for b in self._barriers if b.after_seq >= seq]:
            self.remove_barrier(b)
