"""The error taxonomy of the STDIO API (and, later, MCP): stable codes by category.

An error reaches a client as ``{"code": "<category>.<name>", "message": str, "data": {}}``.
Codes are part of the protocol contract: a code is never renamed or reused for another
meaning; new codes may be added. ``message`` is for humans and may change; ``data`` holds
the machine-readable details listed with each code.

Every exception that reaches the API is turned into one of these by :func:`to_api_error`:
the undo core's errors already carry their code; ``OSError`` maps by errno to ``fs.*``;
anything else is ``protocol.internal`` (a bug — logged with its traceback).
"""

from __future__ import annotations

import errno

from ..core.errors import SandboxError

#: code -> what it means (and the ``data`` fields it carries). docs/stdio-api.md's table is checked against it.
CODES: dict[str, str] = {
    # protocol: the message itself
    "protocol.invalid_json": "The line is not valid JSON (data: position).",
    "protocol.not_an_object": "The line is JSON but not an object.",
    "protocol.line_too_long": "The line exceeds the agent's limit (data: limit_bytes); it was discarded.",
    "protocol.too_deep": "Arrays/objects in the line nest deeper than the agent's limit (data: limit); it was not parsed.",
    "protocol.invalid_request": "The request does not match its schema: a missing or unknown field, a wrong type, a value out of bounds, or text no process can receive (a NUL or lone surrogate in a command, env or cwd; '=' in an env name) (data: path, reason).",
    "protocol.unknown_type": "No operation has this type (data: type, known).",
    "protocol.unsupported_version": "hello asked for a protocol version the agent does not speak (data: requested, supported_versions).",
    "protocol.busy": "Too many requests in flight (data: limit); retry after some complete.",
    "protocol.not_allowed": "The operation is not offered on this transport: the web page (sandbox ui) cannot start, stop or reset the session nor change its mounts (data: type).",
    "protocol.internal": "A bug in the agent; the request failed, the agent goes on (data: exception).",
    # session: lifecycle and configuration
    "session.not_started": "The operation needs a session: send session.start first.",
    "session.already_started": "A session is running; stop it before starting another.",
    "session.invalid_config": "session.start's payload is inconsistent (data: field when known).",
    "session.invalid_mounts": "The mount table is invalid: a bad target, a duplicate, a missing mount point.",
    "session.unknown_directory": "No working directory has this index or label (data: directory, known).",
    "session.read_only_directory": "The directory is read-only: it has no undo history.",
    "session.widen_denied": "A restriction may only narrow the view (subtree, read-only), never widen it.",
    "session.start_failed": "The session could not start (data: reason); nothing is left running.",
    "session.guest_failed": "The guest stopped or failed while working (data: console tail).",
    "session.lock_unavailable": "external_modification_policy lock needs the right to bind-mount (root).",
    # agent: commands in the guest
    "agent.busy": "A command is already running; one runs at a time (data: request_id of the running one).",
    "agent.not_configured": "agent.prompt needs session.start's agent.command.",
    "agent.not_running": "agent.cancel: no command is running with that request_id.",
    # undo
    "undo.nothing_to_undo": "Fewer steps in history than asked for (data: available).",
    "undo.barrier": "An external modification (barrier) lies between now and the target step (data: barrier_ids, paths); retry with force to overwrite them.",
    "undo.external_change": "A path the rollback would touch is not as the sandbox left it (data: paths); retry with force.",
    "undo.no_such_step": "No finished step in this directory's history has this id: never made, undone, evicted or discarded (data: step_id).",
    "undo.unprotected": "The step exceeded max_single_step_size and cannot be rolled back (data: step_id).",
    "undo.corrupt_step": "A step's undo data (manifest, journal or a preimage) is damaged or unreadable; nothing was undone, other steps stay usable (data: step_id, seq, reason).",
    "undo.version_mismatch": "The undo store was written by an incompatible version: undo is off until undo.discard.",
    "undo.step_running": "A command step is still running; undo when it has finished (data: step_id).",
    "undo.invalid_limits": "undo.configure: a limit is out of range.",
    "undo.failed": "A rollback (an undo, or recovery of a crashed step) stopped part-way and cannot finish now (data: step_id, path, errno); undo and writes are refused until it finishes — retried at every undo and start — or undo.discard.",
    # fs: file access through the API
    "fs.not_found": "No such file or directory.",
    "fs.not_a_directory": "A path component, or the listed path, is not a directory.",
    "fs.is_a_directory": "fs.read on a directory.",
    "fs.access_denied": "Outside the restricted view, read-only, or refused by the host.",
    "fs.outside_mounts": "The path is in no working directory or mount (or escapes /).",
    "fs.symlink": "The path goes through a symlink; paths are never resolved through symlinks.",
    "fs.not_a_file": "A special file (FIFO, device, socket): listed but never opened.",
    "fs.too_large": "More than the per-request limit (data: limit_bytes); read it in ranges.",
    "fs.invalid_path": "The path is malformed (NUL, too long, not a string).",
    "fs.io_error": "The host reported an I/O error (data: errno).",
    "fs.invalid_argument": "A bad argument to a file operation: an unknown mode, a negative or too large offset, a handle not open for reading/writing, data that is not valid base64 (data: errno EINVAL or EBADF, field).",
    "fs.invalid_handle": "No open handle has this number: closed, never opened, or another client's (data: errno EINVAL, handle).",
    "fs.too_many_handles": "This client has as many handles open as it may (data: errno EMFILE, limit); close some.",
    "fs.not_supported": "The operation is not supported there (data: errno ENOTSUP).",
    "fs.exists": "The path exists already: fs.open mode x, fs.mkdir without parents (data: errno EEXIST).",
    "fs.not_empty": "fs.remove of a directory that is not empty, without recursive (data: errno ENOTEMPTY).",
    "fs.busy": "A mount point (or a directory holding one) cannot be removed, renamed or replaced (data: errno EBUSY).",
    "fs.cross_mount": "fs.rename between two mounts: copy, then remove (data: errno EXDEV).",
    # safeguard
    "safeguard.unknown_id": "No pending safeguard has this id (already answered, timed out, or never existed).",
    "safeguard.invalid_config": "safeguard.configure: a threshold or timeout is out of range.",
    "safeguard.denied": "The step was denied by a safeguard and rolled back.",
}


class ApiError(SandboxError):
    """An error with a code from :data:`CODES` (checked: an unknown code is a bug)."""

    def __init__(self, code: str, message: str, **data):
        if code not in CODES:
            raise ValueError(f"unknown API error code {code!r}")
        super().__init__(message, **data)
        self.code = code

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "data": _jsonable(self.data)}


_CORE_CODES = {"step.error": "undo.step_running", "undo.error": "undo.failed", "safeguard.hold": "safeguard.denied",
               "undo.rollback_incomplete": "undo.failed"}

_ERRNO_CODES = {
    errno.ENOENT: "fs.not_found", errno.ENOTDIR: "fs.not_a_directory", errno.EISDIR: "fs.is_a_directory",
    errno.EACCES: "fs.access_denied", errno.EPERM: "fs.access_denied", errno.EROFS: "fs.access_denied",
    errno.ELOOP: "fs.symlink", errno.EXDEV: "fs.outside_mounts", errno.ENAMETOOLONG: "fs.invalid_path",
    errno.EINVAL: "fs.invalid_path", errno.EFBIG: "fs.too_large", errno.ENXIO: "fs.not_a_file",
    errno.EEXIST: "fs.exists", errno.ENOTEMPTY: "fs.not_empty", errno.EBUSY: "fs.busy", errno.ENOTSUP: "fs.not_supported",
}


def to_api_error(exc: BaseException) -> ApiError:
    """The API's view of ``exc`` (see the module docstring)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, SandboxError) and (not isinstance(exc, OSError) or exc.code in _CORE_CODES):
        code = _CORE_CODES.get(exc.code, exc.code)
        if code in CODES:
            return ApiError(code, exc.message, **exc.data)
    if isinstance(exc, OSError) and exc.errno is not None:
        code = _ERRNO_CODES.get(exc.errno, "fs.io_error")
        if getattr(exc, "code", None) == "safeguard.denied":
            code = "safeguard.denied"
        return ApiError(code, exc.strerror or str(exc), errno=errno.errorcode.get(exc.errno, str(exc.errno)))
    return ApiError("protocol.internal", f"internal error: {type(exc).__name__}: {exc}", exception=type(exc).__name__)


def _jsonable(value):
    """``data`` made JSON-safe (tuples → lists, unknown objects → str)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
