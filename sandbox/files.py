"""File operations for API clients: one module shared by the SDK, the STDIO API and (next) MCP.

A :class:`FileService` is one client's door to the session's files (seed 002's handle I/O
contract, over the session's mount table instead of a separate daemon):

* **handles** — ``open(path, mode) -> int``, ``read``, ``write``, ``seek``, ``stat``,
  ``close``, and ``create_temp()``: an ephemeral in-memory file that never reaches any
  working folder. Handle numbers are small ints, private to the service (another client's
  number is just unknown here); at most ``handles_max`` are open at once — one more is
  ``fs.too_many_handles``. :meth:`close_all` closes them (the session's stop does);
* **one-shot calls** — ``read_file``, ``write_file``, ``list``, ``mkdir``, ``remove``,
  ``rename``, ``status``.

Invariants:

* **allowlists before any I/O**: every path is resolved against the mount table and this
  service's *view* (a :class:`~sandbox.mounts.table.MountTable`, possibly restricted) before
  anything is opened; a write needs the mount and the view to be writable. Files are then
  reached through a :meth:`~sandbox.mounts.provider.Provider.narrowed` provider of the
  view — dir-fd relative, no symlink followed, special files never opened — so a path
  outside the view is refused twice;
* **bounded**: one read returns at most :data:`READ_CALL_BYTES_MAX` (larger content by
  chunks), one write takes at most :data:`WRITE_CALL_BYTES_MAX`; a write may not leave a
  hole larger than :data:`WRITE_HOLE_BYTES_MAX`; temporary files hold at most
  :data:`TEMP_BYTES_MAX` together; offsets are 0 … 2**63-1;
* **errors** are :class:`~sandbox.api.errors.ApiError` with a stable code whose ``data``
  carries the errno name (``fs.invalid_handle``/``EINVAL``, ``fs.access_denied``/``EACCES``,
  ``fs.not_supported``/``ENOTSUP``, ``fs.io_error``/``EIO``, …) — never ``protocol.internal``
  for bad input;
* **counters** (:meth:`counters`): opens, reads, writes, closes, bytes in/out, rejects
  (refused before any I/O: allowlist, bad handle, bad argument, caps) and errors; every
  call is logged (``sandbox.files``) with its duration — and the request id bound in the
  logging context by the caller.

**API steps** (seed 003 §4.6: a write outside a command is its own *API step*). The rule:
a **one-shot call is one step; a handle's writes are one step from its first mutation
(the create or truncation of ``open``, or its first write) to its ``close``** — so one
undo reverses a whole file written in chunks, and a chunked upload cannot evict the undo
history one chunk at a time. Handles of this service mutating the same folder at the same
time share that folder's open API step (a folder has one active step); it ends when the
last of them closes. When the guest runs a command meanwhile:

* a command that *starts* ends every open API step first (:meth:`end_steps`, called by the
  session before a command or an undo): the command's step never absorbs API writes made
  before it, and a handle's later writes open a new API step;
* a write made *while* a command runs joins the command's step (SPEC: an API step only "if
  no command is running") — undoing that command undoes it too;
* a safeguard hold on an API write is denied at once (the API step is rolled back, the call
  fails ``safeguard.denied``): nobody is asked while a request thread waits.

Reads never open a step. In-memory mounts and read-only folders have no undo: their writes
(where allowed) happen without a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import stat as _stat
import threading
import time
from collections.abc import Iterator

from .api.errors import ApiError, to_api_error
from .core.errors import HoldRequired
from .hostfs import DIR, LNK, NAME_LEN_MAX, REG, Attr, FileHandle, ListingTooLarge, join
from .limits import DIR_ENTRY_OVERHEAD_BYTES
from .mounts.table import MountTable, PathDenied, guest_path

log = logging.getLogger("sandbox.files")

HANDLES_MAX = 64  # open handles per FileService (client)
READ_CALL_BYTES_MAX = 1 << 20  # one handle read
READ_FILE_BYTES_MAX = 16 << 20  # one read_file (fs.read)
WRITE_CALL_BYTES_MAX = 16 << 20  # one write or write_file
WRITE_HOLE_BYTES_MAX = 64 << 20  # a write may extend a file by at most this much past its end plus its data
TEMP_BYTES_MAX = 64 << 20  # all temporary files of one FileService together
LIST_ENTRIES_MAX = 10_000  # per list
STATUS_ENTRIES_MAX = 100_000  # scanned by status
REMOVE_ENTRIES_MAX = 100_000  # removed by one recursive remove
OFFSET_MAX = (1 << 63) - 1
MODES = ("r", "r+", "w", "w+", "a", "a+", "x", "x+")
_TYPE = {REG: "file", DIR: "dir", LNK: "symlink"}
#: the errno an fs.* code carries when the error did not come with one (a mount-table refusal)
_CODE_ERRNO = {"fs.access_denied": "EACCES", "fs.outside_mounts": "EACCES", "fs.invalid_path": "EINVAL",
               "fs.not_found": "ENOENT", "fs.not_a_directory": "ENOTDIR"}
_REJECTS = frozenset({"fs.access_denied", "fs.outside_mounts", "fs.invalid_path", "fs.invalid_argument",
                      "fs.invalid_handle", "fs.too_large", "fs.too_many_handles", "fs.not_supported"})


def _err(code: str, message: str, err: int, **data) -> ApiError:
    return ApiError(code, message, errno=errno.errorcode[err], **data)


@dataclasses.dataclass
class _Handle:
    """One open handle. ``fh`` is None for a temporary file (``data`` holds it)."""

    id: int
    guest: str  # the guest path it was opened at ("" for a temporary file)
    readable: bool
    writable: bool
    append: bool
    pos: int = 0
    fh: FileHandle | None = None
    provider: object = None
    rel: str = ""
    mount: object = None
    folder: int | None = None  # the working folder (undo) whose API step it holds, if any
    data: bytearray | None = None

    @property
    def temp(self) -> bool:
        return self.fh is None


@dataclasses.dataclass
class _Loc:
    mount: object
    rel: str
    guest: str
    provider: object


class FileService:
    """One client's file operations over ``session`` within ``view`` (default: the session's
    whole mount table). See the module docstring."""

    def __init__(self, session, view: MountTable | None = None, *, client: str = "api", handles_max: int = HANDLES_MAX):
        if not isinstance(handles_max, int) or handles_max < 1:
            raise ValueError("handles_max must be a positive int")
        self.session = session
        self.client = client
        self.handles_max = handles_max
        self._view = view if view is not None else session.table
        self._lock = threading.RLock()
        self._handles: dict[int, _Handle] = {}
        self._next = 1
        self._providers: dict[str, object] = {}  # mount name -> provider narrowed to the view
        self._steps: dict[int, int] = {}  # folder index -> the API step this service has open there
        self._holders: dict[int, set[int]] = {}  # folder index -> handles that wrote in that step
        self._temp_bytes = 0
        self._counts = dict.fromkeys(("opens", "reads", "writes", "closes", "bytes_in", "bytes_out", "rejects",
                                      "errors"), 0)
        hooks = getattr(session, "before_step", None)
        if isinstance(hooks, list):
            hooks.append(self.end_steps)

    # ------------------------------------------------------------------ view

    @property
    def view(self) -> MountTable:
        return self._view

    def narrow(self, view: MountTable) -> None:
        """Use ``view`` from now on (it only narrows: the caller made it with
        :meth:`MountTable.restrict`). Handles it no longer allows — outside it, or writable
        when it became read-only — are closed."""
        with self._lock:
            self._view = view
            self._providers = {}
            for h in list(self._handles.values()):
                if h.temp:
                    continue
                try:
                    view.resolve(h.guest, write=h.writable)
                except PathDenied:
                    self._close(h)

    def _provider(self, mount):
        p = self._providers.get(mount.name)
        if p is None:
            p = self.session.provider(mount.name).narrowed(self._view.view_within(mount), self._view.read_only)
            self._providers[mount.name] = p
        return p

    def guest_path(self, path: str, directory=None) -> str:
        """The absolute guest path of ``path``: absolute as given, relative to ``directory``
        (a folder index/label/path) or else to the view (or the first folder)."""
        if not isinstance(path, str) or "\0" in path:
            raise _err("fs.invalid_path", "path must be a string without NUL", errno.EINVAL)
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise _err("fs.invalid_path", "path is not valid Unicode text (a lone surrogate): no file has that name",
                       errno.EINVAL) from None
        if path.startswith("/"):
            return path
        v = self._view
        base = v.view if directory is None and v.view != "/" else v.by_directory(directory).target
        return base.rstrip("/") + "/" + path if path not in ("", ".") else base

    def _locate(self, path: str, directory=None, write: bool = False) -> _Loc:
        guest = self.guest_path(path, directory)
        mount, rel = self._view.resolve(guest, write=write)
        return _Loc(mount, rel, mount.target + ("/" + rel if rel else ""), self._provider(mount))

    def _folder(self, mount) -> int | None:
        """The index of the working folder ``mount`` is, if it has undo (a workspace)."""
        folders = self.session.table.folders
        if mount not in folders:
            return None
        i = folders.index(mount)
        wss = self.session.workspaces
        return i if i < len(wss) and wss[i] is not None else None

    # ------------------------------------------------------------------ bookkeeping

    @contextlib.contextmanager
    def _op(self, name: str, **fields) -> Iterator[None]:
        """Serialise, count, log and map errors of one call."""
        t0 = time.monotonic()
        with self._lock:
            try:
                yield
            except BaseException as e:
                err = to_api_error(e) if isinstance(e, Exception) else None
                if err is None:
                    raise
                if err.code.startswith("fs.") and "errno" not in err.data:
                    err.data["errno"] = _CODE_ERRNO.get(err.code, "EIO")
                self._counts["rejects" if err.code in _REJECTS else "errors"] += 1
                log.info("%s %s failed: %s", self.client, name, err.code,
                         extra={"fields": {"op": name, "code": err.code, **fields,
                                           "duration_ms": round((time.monotonic() - t0) * 1000, 3)}})
                if err is e:
                    raise
                if err.code == "protocol.internal":
                    log.exception("%s %s failed", self.client, name)
                raise err from e
            log.debug("%s %s", self.client, name,
                      extra={"fields": {"op": name, **fields, "duration_ms": round((time.monotonic() - t0) * 1000, 3)}})

    def counters(self) -> dict:
        """Counts since this service was made, and what is open now."""
        with self._lock:
            return {**self._counts, "handles_open": len(self._handles), "handles_max": self.handles_max,
                    "temp_bytes": self._temp_bytes}

    # ------------------------------------------------------------------ API steps

    def _workspace(self, folder: int):
        return self.session.workspaces[folder]

    @contextlib.contextmanager
    def _mutation(self, folder: int | None, what: str, handle: _Handle | None = None) -> Iterator[None]:
        """Run a mutation of ``folder`` inside this service's API step there (module docstring)."""
        ws = self._workspace(folder) if folder is not None else None
        if ws is None:
            yield
            return
        lock = getattr(self.session, "command_lock", None)
        if lock is not None and not lock.acquire(blocking=False):
            yield  # a command runs: its step takes the write
            return
        try:
            sid = self._steps.get(folder)
            if sid is None or ws.active_step_id != sid:
                self._holders.pop(folder, None)
                try:
                    sid = ws.begin_step(f"api: {what}", type="api")
                except RuntimeError:  # another client's API step is open there: the write joins it
                    sid = None
                if sid is None:
                    self._steps.pop(folder, None)
                else:
                    self._steps[folder] = sid
            if handle is not None and sid is not None:
                self._holders.setdefault(folder, set()).add(handle.id)
                handle.folder = folder
            try:
                yield
            except HoldRequired as held:
                self.session.deny_hold(folder, held.hold.id)  # the session's broker forgets it too
                self._end_step(folder)
                raise ApiError("safeguard.denied", f"{held.hold.message} An API write cannot wait for a confirmation: "
                               "denied, and its API step was rolled back.", **held.data) from None
            finally:
                if sid is not None and not self._holders.get(folder):
                    self._end_step(folder)  # a one-shot call: its step ends with it
        finally:
            if lock is not None:
                lock.release()

    def _end_step(self, folder: int) -> None:
        sid = self._steps.pop(folder, None)
        self._holders.pop(folder, None)
        ws = self._workspace(folder) if folder < len(self.session.workspaces) else None
        if sid is not None and ws is not None and ws.active_step_id == sid:
            ws.close_step(sid, 0, 0.0)  # nothing is in flight for it: the call that wrote has returned

    def end_steps(self) -> None:
        """End every API step this service has open (before a command or an undo starts)."""
        with self._lock:
            for folder in list(self._steps):
                try:
                    self._end_step(folder)
                except Exception:  # the step's promotion failed: the core warned and retries
                    log.exception("could not end API step in folder %d", folder)

    # ------------------------------------------------------------------ handles

    def _get(self, h) -> _Handle:
        if isinstance(h, bool) or not isinstance(h, int):
            raise _err("fs.invalid_handle", f"a handle is an int, not {type(h).__name__}", errno.EINVAL)
        hd = self._handles.get(h)
        if hd is None:
            raise _err("fs.invalid_handle", f"no open handle {h} (closed, never opened, or another client's)",
                       errno.EINVAL, handle=h)
        return hd

    def _new_id(self) -> int:
        if len(self._handles) >= self.handles_max:
            raise _err("fs.too_many_handles", f"at most {self.handles_max} handles may be open: close some",
                       errno.EMFILE, limit=self.handles_max)
        hid = self._next
        self._next += 1
        return hid

    def open(self, path: str, mode: str = "r") -> int:
        """Open a regular file (binary). Modes as Python's: ``r`` read; ``r+`` read/write;
        ``w``/``w+`` create or truncate; ``a``/``a+`` create, every write at the end; ``x``/``x+``
        create, ``fs.exists`` if it does (a ``b`` is accepted and ignored)."""
        with self._op("open", path=path, mode=mode):
            m = mode.replace("b", "", 1) if isinstance(mode, str) else mode
            if m not in MODES:
                raise _err("fs.invalid_argument", f"mode must be one of {', '.join(MODES)}, not {mode!r}",
                           errno.EINVAL, field="mode")
            hid = self._new_id()
            writable = m != "r"
            loc = self._locate(path, write=writable)
            readable = m in ("r", "r+", "w+", "a+", "x+")
            acc = os.O_RDWR if readable and writable else (os.O_WRONLY if writable else os.O_RDONLY)
            p = loc.provider
            h = _Handle(hid, loc.guest, readable, writable, m[0] == "a", provider=p, rel=loc.rel, mount=loc.mount)
            creates, truncates = m[0] in "wax", m[0] == "w"
            if creates and not truncates and m[0] == "a":
                try:
                    p.lookup(loc.rel)
                    creates = False  # appending to a file that exists: nothing changes yet
                except FileNotFoundError:
                    pass
            if creates or truncates:
                folder = self._folder(loc.mount)
                with self._mutation(folder, f"open {loc.guest} {m}", h):
                    flags = acc | (os.O_EXCL if m[0] == "x" else 0) | (os.O_TRUNC if truncates else 0)
                    h.fh = self._create(loc, flags)
            else:
                self._regular(p, loc)
                h.fh = p.open(loc.rel, acc)
            self._handles[hid] = h
            self._counts["opens"] += 1
            return hid

    def _create(self, loc: _Loc, flags: int) -> FileHandle:
        """Create (or open, without ``O_EXCL``) the regular file at ``loc``. Something else
        already there — a symlink, a special file — is refused by the host (EPERM, never
        opened, never followed); the error then says what is there, as a read's does."""
        try:
            return loc.provider.create(loc.rel, 0o644, flags)[0]
        except PermissionError:
            self._regular(loc.provider, loc)  # raises fs.symlink / fs.not_a_file / fs.is_a_directory
            raise

    def _regular(self, p, loc: _Loc) -> Attr:
        """The attributes of the regular file at ``loc`` (clear errors for anything else)."""
        a = p.getattr(loc.rel)
        if a.kind == DIR:
            raise _err("fs.is_a_directory", f"{loc.guest} is a directory", errno.EISDIR)
        if a.kind == LNK:
            raise _err("fs.symlink", f"{loc.guest} is a symlink (to {p.readlink(loc.rel)!r}); it is not followed",
                       errno.ELOOP)
        if a.kind != REG:
            raise _err("fs.not_a_file", f"{loc.guest} is a special file: never opened", errno.ENXIO)
        return a

    def create_temp(self) -> int:
        """An empty read/write temporary file, in memory, private to this service: it never
        reaches any working folder and is gone when closed."""
        with self._op("create_temp"):
            hid = self._new_id()
            self._handles[hid] = _Handle(hid, "", True, True, False, data=bytearray())
            self._counts["opens"] += 1
            return hid

    def read(self, h: int, n: int = -1) -> bytes:
        """Up to ``n`` bytes at the handle's position (``-1``: up to :data:`READ_CALL_BYTES_MAX`);
        ``b""`` at or past the end."""
        with self._op("read", handle=h, n=n):
            hd = self._get(h)
            if isinstance(n, bool) or not isinstance(n, int) or n < -1:
                raise _err("fs.invalid_argument", f"n must be an int >= -1, not {n!r}", errno.EINVAL, field="n")
            if n > READ_CALL_BYTES_MAX:
                raise _err("fs.too_large", f"at most {READ_CALL_BYTES_MAX} bytes per read: read in chunks", errno.EINVAL,
                           limit_bytes=READ_CALL_BYTES_MAX)
            if not hd.readable:
                raise _err("fs.invalid_argument", "the handle is not open for reading", errno.EBADF)
            want = READ_CALL_BYTES_MAX if n == -1 else n
            if hd.temp:
                data = bytes(hd.data[hd.pos:hd.pos + want])
            else:
                size = hd.fh.fstat().size
                want = min(want, max(0, size - hd.pos))
                data = hd.fh.pread(want, hd.pos) if want else b""
            hd.pos += len(data)
            self._counts["reads"] += 1
            self._counts["bytes_out"] += len(data)
            return data

    def write(self, h: int, data: bytes) -> int:
        """Write all of ``data`` at the handle's position (at the end in an ``a`` mode)."""
        with self._op("write", handle=h, bytes=len(data) if isinstance(data, (bytes, bytearray)) else None):
            hd = self._get(h)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise _err("fs.invalid_argument", f"data must be bytes, not {type(data).__name__}", errno.EINVAL,
                           field="data")
            data = bytes(data)
            if len(data) > WRITE_CALL_BYTES_MAX:
                raise _err("fs.too_large", f"at most {WRITE_CALL_BYTES_MAX} bytes per write: write in chunks",
                           errno.EFBIG, limit_bytes=WRITE_CALL_BYTES_MAX)
            if not hd.writable:
                raise _err("fs.invalid_argument", "the handle is not open for writing", errno.EBADF)
            if hd.temp:
                pos = len(hd.data) if hd.append else hd.pos
                grow = max(0, pos + len(data) - len(hd.data))
                if pos - len(hd.data) > WRITE_HOLE_BYTES_MAX or self._temp_bytes + grow > TEMP_BYTES_MAX:
                    raise _err("fs.too_large", f"temporary files hold at most {TEMP_BYTES_MAX} bytes together",
                               errno.EFBIG, limit_bytes=TEMP_BYTES_MAX)
                if data:  # an empty write never extends a file (POSIX), here as on the host
                    if pos > len(hd.data):
                        hd.data.extend(bytes(pos - len(hd.data)))
                    hd.data[pos:pos + len(data)] = data
                    self._temp_bytes += grow
            else:
                size = hd.fh.fstat().size
                pos = size if hd.append else hd.pos
                if pos - size > WRITE_HOLE_BYTES_MAX:
                    raise _err("fs.too_large", f"a write may leave a hole of at most {WRITE_HOLE_BYTES_MAX} bytes "
                               f"past the end of the file ({pos - size} asked)", errno.EFBIG,
                               limit_bytes=WRITE_HOLE_BYTES_MAX)
                if data:
                    with self._mutation(self._folder(hd.mount), f"write {hd.guest}", hd):
                        hd.provider.write(hd.fh, hd.rel, pos, data)
            hd.pos = pos + len(data)
            self._counts["writes"] += 1
            self._counts["bytes_in"] += len(data)
            return len(data)

    def seek(self, h: int, offset: int, whence: int = 0) -> int:
        """Move the position: ``whence`` 0 from the start, 1 from here, 2 from the end.
        A position past the end is allowed (a later write leaves a hole, within
        :data:`WRITE_HOLE_BYTES_MAX`); a negative one, or one past 2**63-1, is ``EINVAL``."""
        with self._op("seek", handle=h, offset=offset, whence=whence):
            hd = self._get(h)
            if isinstance(offset, bool) or not isinstance(offset, int):
                raise _err("fs.invalid_argument", "offset must be an int", errno.EINVAL, field="offset")
            if whence not in (0, 1, 2) or isinstance(whence, bool):
                raise _err("fs.invalid_argument", f"whence must be 0, 1 or 2, not {whence!r}", errno.EINVAL,
                           field="whence")
            base = 0 if whence == 0 else hd.pos if whence == 1 else self._size(hd)
            pos = base + offset
            if not 0 <= pos <= OFFSET_MAX:
                raise _err("fs.invalid_argument", f"the position would be {pos}: it must be 0 … 2**63-1",
                           errno.EINVAL, field="offset")
            hd.pos = pos
            return pos

    def _size(self, hd: _Handle) -> int:
        return len(hd.data) if hd.temp else hd.fh.fstat().size

    def stat(self, path_or_handle, directory=None) -> dict:
        """``{path, type, size, mode, mtime_ns, atime_ns, ctime_ns, nlink}`` of a path (not
        followed if it is a symlink) or of an open handle (its file, even if renamed away)."""
        with self._op("stat", target=path_or_handle):
            if isinstance(path_or_handle, int) and not isinstance(path_or_handle, bool):
                hd = self._get(path_or_handle)
                if hd.temp:
                    now = time.time_ns()
                    return {"path": None, "type": "file", "size": len(hd.data), "mode": 0o600, "mtime_ns": now,
                            "atime_ns": now, "ctime_ns": now, "nlink": 0, "temporary": True}
                return _stat_dict(hd.guest, hd.provider.fstat(hd.fh, hd.rel))
            loc = self._locate(path_or_handle, directory)
            return _stat_dict(loc.guest, loc.provider.getattr(loc.rel))

    def close(self, h: int) -> None:
        with self._op("close", handle=h):
            self._close(self._get(h))
            self._counts["closes"] += 1

    def _close(self, hd: _Handle) -> None:
        self._handles.pop(hd.id, None)
        if hd.temp:
            self._temp_bytes -= len(hd.data)
            hd.data = bytearray()
            return
        try:
            hd.fh.close()
        finally:
            if hd.folder is not None:
                holders = self._holders.get(hd.folder)
                if holders is not None:
                    holders.discard(hd.id)
                    if not holders:
                        self._end_step(hd.folder)

    def close_all(self) -> None:
        """Close every handle and end every API step (the session's stop calls it)."""
        with self._lock:
            for hd in list(self._handles.values()):
                try:
                    self._close(hd)
                except Exception:
                    log.exception("closing handle %d", hd.id)
            self.end_steps()
            hooks = getattr(self.session, "before_step", None)
            if isinstance(hooks, list) and self.end_steps in hooks:
                hooks.remove(self.end_steps)

    # ------------------------------------------------------------------ one-shot

    def read_range(self, path: str, offset: int = 0, length: int | None = None, directory=None) -> tuple[str, int, bytes]:
        """``(guest path, size, data)``: up to ``length`` bytes (default: to the end, at most
        :data:`READ_FILE_BYTES_MAX`) at ``offset`` of the regular file at ``path``."""
        with self._op("read_file", path=path, offset=offset, length=length):
            if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
                raise _err("fs.invalid_argument", "length must be an int >= 0", errno.EINVAL, field="length")
            if length is not None and length > READ_FILE_BYTES_MAX:
                raise _err("fs.too_large", f"at most {READ_FILE_BYTES_MAX} bytes per read", errno.EFBIG,
                           limit_bytes=READ_FILE_BYTES_MAX)
            if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= OFFSET_MAX:
                raise _err("fs.invalid_argument", "offset must be an int 0 … 2**63-1", errno.EINVAL, field="offset")
            loc = self._locate(path, directory)
            a = self._regular(loc.provider, loc)
            n = min(max(0, a.size - offset), READ_FILE_BYTES_MAX if length is None else length)
            with loc.provider.open(loc.rel, os.O_RDONLY) as fh:
                data = fh.pread(n, offset) if n else b""
            self._counts["reads"] += 1
            self._counts["bytes_out"] += len(data)
            return loc.guest, a.size, data

    def read_file(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.read_range(path, offset, length)[2]

    def write_file(self, path: str, data: bytes, directory=None) -> str:
        """Create or replace the file at ``path`` with ``data`` (one API step); returns its guest path."""
        with self._op("write_file", path=path):
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise _err("fs.invalid_argument", f"data must be bytes, not {type(data).__name__}", errno.EINVAL,
                           field="data")
            data = bytes(data)
            if len(data) > WRITE_CALL_BYTES_MAX:
                raise _err("fs.too_large", f"at most {WRITE_CALL_BYTES_MAX} bytes per write_file", errno.EFBIG,
                           limit_bytes=WRITE_CALL_BYTES_MAX)
            loc = self._locate(path, directory, write=True)
            with self._mutation(self._folder(loc.mount), f"write_file {loc.guest}"):
                fh = self._create(loc, os.O_WRONLY | os.O_TRUNC)
                try:
                    if data:
                        loc.provider.write(fh, loc.rel, 0, data)
                finally:
                    fh.close()
            self._counts["writes"] += 1
            self._counts["bytes_in"] += len(data)
            return loc.guest

    def list(self, path: str = "", directory=None) -> dict:
        """``{path, entries: [{name, type, size, mode, mtime_ns[, target]}], truncated}``.

        A directory above the mounts (``/``, ``/mnt``) lists the way down: one ``dir``
        entry per next component of a mount inside the view."""
        with self._op("list", path=path):
            guest = guest_path(self.guest_path(path, directory))
            above = self._above_mounts(guest)
            if above is not None:
                names = sorted(above)
                return {"path": guest, "entries": [{"name": n, "type": "dir"} for n in names[:LIST_ENTRIES_MAX]],
                        "truncated": len(names) > LIST_ENTRIES_MAX}
            v = self._view
            if v.view != "/" and v.view.startswith(guest + "/"):  # above the view, inside a mount
                mount, rel = self.session.table.resolve(guest)
                loc = _Loc(mount, rel, guest, self._provider(mount))  # narrowed: lists only the way down
            else:
                loc = self._locate(guest)
            p = loc.provider
            if p.getattr(loc.rel).kind != DIR:
                raise _err("fs.not_a_directory", f"{loc.guest} is not a directory", errno.ENOTDIR)
            names, truncated = _first_names(p, loc.rel, LIST_ENTRIES_MAX)
            entries = []
            for name in names:
                child = join(loc.rel, name)
                try:
                    a = p.getattr(child)
                except OSError:
                    continue  # vanished meanwhile
                e = {"name": name, "type": _TYPE.get(a.kind, "other"), "size": a.size, "mode": a.mode,
                     "mtime_ns": a.mtime_ns}
                if a.kind == LNK:
                    try:
                        e["target"] = p.readlink(child)
                    except OSError:
                        pass
                entries.append(e)
            return {"path": loc.guest, "entries": entries, "truncated": truncated}

    def _above_mounts(self, guest: str) -> set[str] | None:
        """For a directory no mount contains but some mount (inside the view) lies below:
        the names leading down to them (None otherwise)."""
        v = self._view
        if any(guest == m.target or guest.startswith(m.target + "/") for m in v.mounts):
            return None
        prefix = "/" if guest == "/" else guest + "/"
        names = set()
        for m in v.mounts:
            # only what leads to the view: the view, or a mount inside it
            goal = m.target if (v.view == "/" or m.target == v.view or m.target.startswith(v.view + "/")) else \
                (v.view if v.view.startswith(m.target + "/") else None)
            if goal is not None and goal.startswith(prefix):
                names.add(goal[len(prefix):].split("/", 1)[0])
        return names or None

    def mkdir(self, path: str, parents: bool = False, directory=None) -> str:
        """Make a directory (``parents``: and the missing ones above it; an existing
        directory is then fine, as ``mkdir -p``)."""
        with self._op("mkdir", path=path, parents=parents):
            loc = self._locate(path, directory, write=True)
            if loc.rel == "":
                if parents:
                    return loc.guest
                raise _err("fs.exists", f"{loc.guest} is a mount point: it exists", errno.EEXIST)
            p = loc.provider
            with self._mutation(self._folder(loc.mount), f"mkdir {loc.guest}"):
                if not parents:
                    p.mkdir(loc.rel, 0o755)
                else:
                    parts = loc.rel.split("/")
                    for k in range(1, len(parts) + 1):
                        sub = "/".join(parts[:k])
                        try:
                            a = p.lookup(sub)
                        except FileNotFoundError:
                            p.mkdir(sub, 0o755)
                            continue
                        if a.kind != DIR:
                            raise _err("fs.not_a_directory", f"{loc.mount.target}/{sub} is not a directory",
                                       errno.ENOTDIR)
            return loc.guest

    def remove(self, path: str, recursive: bool = False, directory=None) -> int:
        """Remove a file, symlink or empty directory (``recursive``: a whole tree, at most
        :data:`REMOVE_ENTRIES_MAX` entries). A mount point is never removed. Returns the
        number of entries removed."""
        with self._op("remove", path=path, recursive=recursive):
            loc = self._locate(path, directory, write=True)
            if loc.rel == "":
                raise _err("fs.busy", f"{loc.guest} is a mount point: it cannot be removed", errno.EBUSY)
            if any(m.target.startswith(loc.guest + "/") for m in self.session.table.mounts):
                raise _err("fs.busy", f"{loc.guest} holds a mount point: it cannot be removed", errno.EBUSY)
            p = loc.provider
            a = p.lookup(loc.rel)
            with self._mutation(self._folder(loc.mount), f"remove {loc.guest}"):
                if a.kind != DIR:
                    p.unlink(loc.rel)
                    return 1
                if not recursive:
                    p.rmdir(loc.rel)
                    return 1
                return self._remove_tree(p, loc.rel, [0])

    def _remove_tree(self, p, rel: str, count: list[int]) -> int:
        """Remove the tree at ``rel`` depth first, without recursion: a tree may be nested
        deeper than Python's stack (only :data:`REMOVE_ENTRIES_MAX` bounds it)."""
        stack = [(rel, iter(_first_names(p, rel, REMOVE_ENTRIES_MAX)[0]))]
        while stack:
            d, names = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
                self._removed(count)
                p.rmdir(d)
                continue
            child = join(d, name)
            if p.lookup(child).kind == DIR:
                # a directory cut short holds more than can be removed: the count stops it before its rmdir
                stack.append((child, iter(_first_names(p, child, REMOVE_ENTRIES_MAX)[0])))
            else:
                self._removed(count)
                p.unlink(child)
        return count[0]

    @staticmethod
    def _removed(count: list[int]) -> None:
        count[0] += 1
        if count[0] > REMOVE_ENTRIES_MAX:
            raise _err("fs.too_large", f"a recursive remove takes at most {REMOVE_ENTRIES_MAX} entries (what was "
                       "removed so far is one API step: undo it, or go on with another remove)", errno.EFBIG,
                       limit=REMOVE_ENTRIES_MAX)

    def rename(self, src: str, dst: str, directory=None) -> str:
        """Rename ``src`` to ``dst`` (replacing a file there), within one mount."""
        with self._op("rename", src=src, dst=dst):
            a = self._locate(src, directory, write=True)
            b = self._locate(dst, directory, write=True)
            if a.mount != b.mount:
                raise _err("fs.cross_mount", f"{a.guest} and {b.guest} are in different mounts: copy, then remove",
                           errno.EXDEV)
            if a.rel == "" or b.rel == "":
                raise _err("fs.busy", "a mount point cannot be renamed or replaced", errno.EBUSY)
            with self._mutation(self._folder(a.mount), f"rename {a.guest} {b.guest}"):
                a.provider.rename(a.rel, b.rel)
            return b.guest

    def status(self, directory=None) -> dict:
        """Translation warnings of a folder: special files (listed, never opened), symlinks
        whose target leaves the folder (they resolve in the guest's namespace, not the
        host's), names that differ only by case (a case-insensitive host would collide)."""
        with self._op("status"):
            loc = self._locate("", directory)
            p = loc.provider
            warnings, seen, stack, cut = [], 0, [loc.rel], False
            while stack and seen < STATUS_ENTRIES_MAX:
                d = stack.pop()
                try:
                    names, more = _first_names(p, d, STATUS_ENTRIES_MAX - seen)
                except OSError:
                    continue
                cut = cut or more
                lower: dict[str, str] = {}
                for name in names:
                    seen += 1
                    child = join(d, name)
                    other = lower.setdefault(name.lower(), name)
                    if other != name:
                        warnings.append({"kind": "case_collision", "path": child,
                                         "message": f"{child} and {join(d, other)} differ only by case"})
                    try:
                        a = p.getattr(child)
                    except OSError:
                        continue
                    if a.kind == DIR:
                        stack.append(child)
                    elif a.kind == LNK:
                        target = p.readlink(child)
                        depth = len(d.split("/")) if d else 0
                        if target.startswith("/") or _escapes(target, depth):
                            warnings.append({"kind": "symlink_outside", "path": child,
                                             "message": f"{child} -> {target} points outside the folder; the guest "
                                                        "resolves it in its own namespace"})
                    elif a.kind != REG:
                        warnings.append({"kind": "special_file", "path": child,
                                         "message": f"{child} is a {_stat.filemode(a.st_mode)[0]!r}-type special "
                                                    "file: listed but never opened"})
            return {"warnings": warnings, "truncated": bool(stack) or cut}


# ---------------------------------------------------------------------------- helpers


#: the most one name can cost a bounded listing (:func:`~sandbox.limits.listing_cost`)
_NAME_COST_MAX = NAME_LEN_MAX + DIR_ENTRY_OVERHEAD_BYTES


def _first_names(p, rel: str, entries_max: int) -> tuple[list[str], bool]:
    """The first ``entries_max`` names of directory ``rel`` in code-point order, and whether
    it holds more. The host reads it only up to what ``entries_max + 1`` of the longest names
    cost (a bounded ``listdir``): all of a directory within that, so the answer is exact;
    of a larger one the part read, so its first names are those of that part."""
    try:
        names = p.listdir(rel, limit_bytes=(entries_max + 1) * _NAME_COST_MAX)
    except ListingTooLarge as e:
        names = e.names  # more than entries_max of them: each cost at most _NAME_COST_MAX
    names.sort()
    return names[:entries_max], len(names) > entries_max


def _stat_dict(guest: str, a: Attr) -> dict:
    return {"path": guest, "type": _TYPE.get(a.kind, "other"), "size": a.size, "mode": a.mode,
            "mtime_ns": a.mtime_ns, "atime_ns": a.atime_ns, "ctime_ns": a.ctime_ns, "nlink": a.nlink}


def _escapes(target: str, depth: int) -> bool:
    """A relative symlink target climbing above the folder root from ``depth`` levels down."""
    level = depth
    for part in target.split("/"):
        if part == "..":
            level -= 1
            if level < 0:
                return True
        elif part not in ("", "."):
            level += 1
    return False


