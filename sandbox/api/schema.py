"""JSON Schemas of every STDIO API message: requests, responses and events.

The schemas are written here once, as data, and shipped as
``sandbox/api/protocol.schema.json`` (JSON Schema draft 2020-12; regenerate with
``python -m sandbox.api.schema --write``; a test fails if the file is stale). The agent
validates every incoming request against them with ``jsonschema``; the test suite
validates everything the agent emits.

Layout of the document: ``$defs`` holds ``request.<type>`` (the payload of each request),
``result.<type>`` (the payload of its ``ok`` response) and ``event.<name>`` (the payload of
each event), plus the envelopes ``request``, ``response``, ``event`` and shared pieces.
Payload objects are closed (``additionalProperties: false``) in requests, so a misspelt
field is an error rather than silently ignored; results and events are open, so the
agent may add fields in a compatible version.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
SCHEMA_ID = "https://sandbox.invalid/protocol/v1"
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.schema.json")


def _obj(props: dict, required=(), closed: bool = True) -> dict:
    out = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    return out


def _open(props: dict, required=()) -> dict:
    return _obj(props, required, closed=False)


def _ref(name: str) -> dict:
    return {"$ref": f"#/$defs/{name}"}


STR = {"type": "string"}
NESTR = {"type": "string", "minLength": 1}
BOOL = {"type": "boolean"}
INT = {"type": "integer"}
POS = {"type": "integer", "minimum": 1}
NONNEG = {"type": "integer", "minimum": 0}
NUM = {"type": "number"}
STRS = {"type": "array", "items": STR}
NULLABLE_INT = {"type": ["integer", "null"]}

# Bounds of request fields. Every integer, string, array and map a client sends is bounded
# here, so nothing schema-valid can overflow a handler (a 64-bit offset, a count the undo
# history can never hold, a megabyte label); the handlers still check what they rely on.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
PATH_CHARS_MAX = 4096  # PATH_MAX
NAME_CHARS_MAX = 256  # labels, ids, client names, environment variable names, allowlist entries
TEXT_CHARS_MAX = 128 << 10  # a command, a prompt, an environment value: Linux's MAX_ARG_STRLEN, one execve string
CONTENT_CHARS_MAX = 64 << 20  # one base64 file of an in-memory mount (the line limit's default)
MEMORY_FILES_MAX = 100_000  # files in one in-memory mount
ENV_ENTRIES_MAX = 1024
UNDO_STEP_COUNT_MAX = 100_000  # max_step_count's ceiling, so also the most undo.rollback/history can ask for
SAFEGUARD_TIMEOUT_S_MAX = 86_400  # one day
PROTOCOL_VERSION_MAX = (1 << 31) - 1


def _int(lo: int, hi: int, nullable: bool = False, **extra) -> dict:
    return {"type": ["integer", "null"] if nullable else "integer", "minimum": lo, "maximum": hi, **extra}


def _str(chars_max: int, chars_min: int = 0, **extra) -> dict:
    out = {"type": "string", "maxLength": chars_max, **extra}
    if chars_min:
        out["minLength"] = chars_min
    return out


U_POS = _int(1, INT64_MAX)
U_NONNEG = _int(0, INT64_MAX)
NAME = _str(NAME_CHARS_MAX)
PATH = _str(PATH_CHARS_MAX, 1)
ABS = _str(PATH_CHARS_MAX, 1, pattern="^/")
ENV = {"type": "object", "maxProperties": ENV_ENTRIES_MAX, "propertyNames": _str(NAME_CHARS_MAX, 1),
       "additionalProperties": _str(TEXT_CHARS_MAX)}
STEP_COUNT = _int(1, UNDO_STEP_COUNT_MAX)
DIRECTORY = {"description": "A working directory: its index, its label, its guest path or its host path; default the first.",
             "oneOf": [U_NONNEG, PATH]}
HANDLE = {**U_NONNEG, "description": "A handle from fs.open or fs.create_temp (this client's)."}
FILE_MODES = ("r", "r+", "w", "w+", "a", "a+", "x", "x+")
REQUEST_ID = {"oneOf": [_str(NAME_CHARS_MAX), _int(INT64_MIN, INT64_MAX)]}


def valid_request_id(value) -> bool:
    """``value`` is a request_id :data:`REQUEST_ID` accepts (so it may be echoed back)."""
    if isinstance(value, str):
        return len(value) <= NAME_CHARS_MAX
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


SAFEGUARD_CONFIG = {
    "delete_threshold": _int(1, INT64_MAX, nullable=True,
                             description="Deletions in one step that need confirmation (null: off)."),
    "overwrite_threshold": _int(1, INT64_MAX, nullable=True,
                                description="Overwrites/truncations of files over overwrite_size_bytes in one step (null: off)."),
    "overwrite_size_bytes": U_NONNEG,
    "rename_over_threshold": _int(1, INT64_MAX, nullable=True,
                                  description="Renames onto an existing destination in one step (null: off)."),
    "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": SAFEGUARD_TIMEOUT_S_MAX,
                        "description": "Unanswered holds are denied after this."},
}
UNDO_LIMITS = {
    "max_log_size_bytes": U_POS,
    "max_step_count": STEP_COUNT,
    "max_single_step_size_bytes": U_POS,
}

REQUESTS: dict[str, dict] = {
    "hello": _obj({"protocol_version": _int(1, PROTOCOL_VERSION_MAX), "client": NAME}, ["protocol_version"]),
    "session.start": _obj({
        "working_directories": {"type": "array", "minItems": 1, "maxItems": 8, "items": _obj({
            "path": PATH, "label": NAME, "access": {"enum": ["read_write", "read_only"]}, "target": ABS}, ["path"])},
        "root": {**PATH, "description": "Seed 004 style: the project folder (with root_target and bind mounts)."},
        "readonly": BOOL,
        "root_target": ABS,
        "mounts": {"type": "array", "maxItems": 16, "items": {"oneOf": [
            _obj({"path": ABS, "files": {"type": "object", "maxProperties": MEMORY_FILES_MAX,
                                         "propertyNames": PATH, "additionalProperties": _str(CONTENT_CHARS_MAX),
                                         "description": "relative path -> base64 contents"},
                  "writable": BOOL, "label": NAME}, ["path", "files"]),
            _obj({"source": PATH, "target": ABS, "readonly": BOOL}, ["source", "target"]),
        ]}},
        "python_path": {"type": "array", "items": ABS, "maxItems": 64},
        "network_policy": {"enum": ["disabled", "open", "allowlist"]},
        "network_allowlist": {"type": "array", "items": _str(NAME_CHARS_MAX, 1), "maxItems": 256},
        "vm_mode": {"enum": ["ephemeral", "persistent"]},
        "as_root": {**BOOL, "description": "Commands run as root in the guest. Default false: as the unprivileged "
                    "user `agent` (uid/gid of the first working directory's owner; 1000 if root owns it), no sudo; "
                    "the control port and the shim are unreachable from it."},
        "guest_root": {"enum": ["host-usr", "image"], "description": "The guest's userland. host-usr (default): the "
                       "host's /usr read-only and an /etc synthesized from an allowlist of non-secret files; image: a "
                       "Debian root built once by mmdebstrap from the host's apt sources (cached under "
                       "~/.cache/sandbox/guest/roots/; the first start downloads its packages)."},
        "guest_packages": {"type": "array", "maxItems": 256, "uniqueItems": True,
                           "items": _str(128, 2, pattern="^[a-z0-9][a-z0-9+.-]+$"),
                           "description": "The image root's Debian packages (only with guest_root image; default "
                           "python3, python3-venv, python3-pip, git, ca-certificates, build-essential, nftables; "
                           "python3 is always added)."},
        "external_modification_policy": {"enum": ["barrier", "warn", "lock"]},
        "safeguard": _obj(SAFEGUARD_CONFIG),
        "undo_limits": _obj(UNDO_LIMITS),
        "agent": _obj({"command": _str(TEXT_CHARS_MAX, 1), "cwd": ABS, "env": ENV}, ["command"]),
        "restrict": _obj({"path": ABS, "readonly": BOOL}),
        "memory_mb": _int(128, 65536),
        "cpus": _int(1, 64),
    }),
    "session.stop": _obj({}),
    "session.reset": _obj({}),
    "session.status": _obj({}),
    "session.restrict": _obj({"path": ABS, "readonly": BOOL}),
    "undo.rollback": _obj({"count": STEP_COUNT, "force": BOOL, "directory": DIRECTORY}),
    "undo.history": _obj({"directory": DIRECTORY, "limit": STEP_COUNT}),
    "undo.configure": _obj({"directory": DIRECTORY, **UNDO_LIMITS}),
    "undo.discard": _obj({"directory": DIRECTORY}),
    "undo.diff": _obj({"directory": DIRECTORY, "step_id": {**_int(INT64_MIN, INT64_MAX, nullable=True),
                                                           "description": "A step of undo.history (default: the newest)."}}),
    "agent.execute": _obj({"command": _str(TEXT_CHARS_MAX, 1), "cwd": ABS, "env": ENV}, ["command"]),
    "agent.prompt": _obj({"text": _str(TEXT_CHARS_MAX)}, ["text"]),
    "agent.cancel": _obj({"request_id": REQUEST_ID}),
    "fs.list": _obj({"path": _str(PATH_CHARS_MAX), "directory": DIRECTORY}),
    "fs.read": {**_obj({"path": PATH, "handle": HANDLE, "directory": DIRECTORY, "offset": U_NONNEG, "length": U_NONNEG,
                        "encoding": {"enum": ["utf-8", "base64"]}}),
                "description": "By path (a range of the file: offset, length) or by handle (length bytes at its position).",
                "oneOf": [{"required": ["path"]}, {"required": ["handle"], "not": {"required": ["offset"]}}]},
    "fs.status": _obj({"directory": DIRECTORY}),
    "fs.open": _obj({"path": PATH, "directory": DIRECTORY, "mode": {"enum": list(FILE_MODES)}}, ["path"]),
    "fs.write": {**_obj({"path": PATH, "handle": HANDLE, "directory": DIRECTORY, "data": _str(CONTENT_CHARS_MAX),
                         "encoding": {"enum": ["utf-8", "base64"]}}, ["data"]),
                 "oneOf": [{"required": ["path"]}, {"required": ["handle"]}]},
    "fs.seek": _obj({"handle": HANDLE, "offset": _int(INT64_MIN, INT64_MAX), "whence": {"enum": ["set", "cur", "end"]}},
                    ["handle", "offset"]),
    "fs.stat": {**_obj({"path": PATH, "handle": HANDLE, "directory": DIRECTORY}),
                "oneOf": [{"required": ["path"]}, {"required": ["handle"]}]},
    "fs.close": _obj({"handle": HANDLE}, ["handle"]),
    "fs.create_temp": _obj({}),
    "fs.mkdir": _obj({"path": PATH, "parents": BOOL, "directory": DIRECTORY}, ["path"]),
    "fs.remove": _obj({"path": PATH, "recursive": BOOL, "directory": DIRECTORY}, ["path"]),
    "fs.rename": _obj({"src": PATH, "dst": PATH, "directory": DIRECTORY}, ["src", "dst"]),
    "safeguard.configure": _obj({"directory": DIRECTORY, **SAFEGUARD_CONFIG}),
    # live mounts (seed 000): an in-memory tree mounted into the running guest, never undo-tracked
    "mount.add": _obj({"path": ABS, "files": {"type": "object", "maxProperties": MEMORY_FILES_MAX,
                                              "propertyNames": PATH, "additionalProperties": _str(CONTENT_CHARS_MAX),
                                              "description": "relative path -> base64 contents"},
                       "writable": BOOL, "label": NAME}, ["path", "files"]),
    "mount.remove": _obj({"path": ABS}, ["path"]),
    "safeguard.confirm": _obj({"safeguard_id": _str(NAME_CHARS_MAX, 1), "action": {"enum": ["allow", "deny"]}},
                              ["safeguard_id", "action"]),
}

FOLDER = _open({"index": NONNEG, "label": STR, "path": STR, "guest_path": STR, "access": {"enum": ["read_write", "read_only"]},
                "undo_available": BOOL}, ["index", "label", "path", "guest_path", "access"])
MOUNT = _open({"guest_path": STR, "label": STR, "read_only": BOOL, "files": NONNEG, "live": BOOL},
              ["guest_path", "read_only"])
# a step whose undo data is damaged is still listed: "corrupt" says why, and if neither its
# manifest nor its journal header can be read, its type is "unknown" and ended_ns null
STEP = _open({"id": INT, "type": {"enum": ["command", "api", "ambient", "unknown"]}, "command": STR, "paths": STRS,
              "exit_code": NULLABLE_INT, "outcome": STR, "unprotected": BOOL, "size_bytes": NONNEG,
              "started_ns": INT, "ended_ns": NULLABLE_INT, "corrupt": STR,
              "barriers": {"type": "array", "items": _ref("barrier")}}, ["id", "type", "paths", "outcome", "barriers"])
BARRIER = _open({"id": INT, "paths": STRS, "created_ns": INT, "reason": STR,
                 "blocks_rollback_of": {"type": "array", "items": INT}}, ["id", "paths", "created_ns"])
# -- step diffs and restored paths (issue 14)
ROLLBACK_PATH = _open({"path": STR, "change": {"enum": ["restored", "removed", "recreated"]}}, ["path", "change"])
DIFF_PATH = _open({"path": STR, "change": {"enum": ["created", "modified", "deleted", "metadata"]},
                   "kind": {"enum": ["file", "dir", "symlink", "other"]}, "diff": {"type": ["string", "null"]},
                   "binary": BOOL, "summary": STR, "diff_truncated": BOOL},
                  ["path", "change", "kind", "diff", "binary", "summary", "diff_truncated"])
ENTRY = _open({"name": STR, "type": {"enum": ["file", "dir", "symlink", "other"]}, "size": NONNEG, "mode": NONNEG,
               "mtime_ns": INT, "target": STR}, ["name", "type"])
COMMAND_RESULT = _open({"step_id": NULLABLE_INT, "step_ids": {"type": "array", "items": NULLABLE_INT},
                        "exit_code": INT, "signal": NULLABLE_INT, "cancelled": BOOL},
                       ["step_id", "exit_code", "cancelled"])

RESULTS: dict[str, dict] = {
    "hello": _open({"protocol_version": POS, "supported_versions": {"type": "array", "items": POS},
                    "agent_version": STR, "operations": STRS, "events": STRS},
                   ["protocol_version", "supported_versions", "agent_version"]),
    "session.start": _open({"folders": {"type": "array", "items": FOLDER}, "mounts": {"type": "array", "items": MOUNT},
                            "guest": STR, "accel": {"type": ["string", "null"]}, "boot_s": {"type": ["number", "null"]},
                            "view": STR, "read_only": BOOL}, ["folders", "mounts", "guest"]),
    "session.stop": _open({}),
    "session.reset": _open({}),
    "session.status": _open({"state": {"enum": ["not_started", "idle", "running", "stopped", "error"]},
                             "vm": STR, "guest": {"type": ["string", "null"]}, "accel": {"type": ["string", "null"]},
                             "as_root": BOOL, "guest_root": {"enum": ["host-usr", "image"]},
                             "folders": {"type": "array", "items": FOLDER}, "mounts": {"type": "array", "items": MOUNT},
                             "running": {"type": ["object", "null"]},
                             "pending_safeguards": {"type": "array", "items": _ref("event.safeguard_triggered")},
                             "view": STR, "read_only": BOOL}, ["state"]),
    "session.restrict": _open({"view": STR, "read_only": BOOL}, ["view", "read_only"]),
    "undo.rollback": _open({"step_ids": {"type": "array", "items": INT}, "paths_restored": NONNEG, "directory": NONNEG,
                            "forced": BOOL, "paths": {"type": "array", "items": ROLLBACK_PATH},
                            "paths_truncated": BOOL}, ["step_ids", "paths_restored", "paths", "paths_truncated"]),
    "undo.diff": _open({"directory": NONNEG, "step_id": INT, "command": STR, "type": STR,
                        "paths": {"type": "array", "items": DIFF_PATH}, "paths_total": NONNEG, "paths_truncated": BOOL,
                        "approximate": BOOL}, ["step_id", "command", "type", "paths", "paths_total", "paths_truncated"]),
    "undo.history": _open({"directory": NONNEG, "steps": {"type": "array", "items": STEP},
                           "barriers": {"type": "array", "items": _ref("barrier")}, "undo_available": BOOL},
                          ["steps", "barriers", "undo_available"]),
    "undo.configure": _open({"limits": _open(UNDO_LIMITS)}, ["limits"]),
    "undo.discard": _open({"directory": NONNEG}),
    "agent.execute": COMMAND_RESULT,
    "agent.prompt": COMMAND_RESULT,
    "agent.cancel": _open({"cancelled": BOOL}),
    "fs.list": _open({"path": STR, "entries": {"type": "array", "items": ENTRY}, "truncated": BOOL}, ["path", "entries"]),
    "fs.read": _open({"path": STR, "handle": NONNEG, "size": NONNEG, "offset": NONNEG, "data": STR,
                      "encoding": {"enum": ["utf-8", "base64"]}, "bytes": NONNEG, "eof": BOOL},
                     ["data", "encoding", "eof"]),
    "fs.status": _open({"warnings": {"type": "array", "items": _open({"kind": STR, "path": STR, "message": STR},
                                                                      ["kind", "message"])},
                        "truncated": BOOL}, ["warnings"]),
    "fs.open": _open({"handle": NONNEG, "path": STR, "mode": STR}, ["handle", "path"]),
    "fs.write": _open({"handle": NONNEG, "path": STR, "bytes_written": NONNEG}, ["bytes_written"]),
    "fs.seek": _open({"handle": NONNEG, "position": NONNEG}, ["handle", "position"]),
    "fs.stat": _open({"handle": NONNEG, "path": {"type": ["string", "null"]}, "type": {"enum": ["file", "dir", "symlink", "other"]},
                      "size": NONNEG, "mode": NONNEG, "mtime_ns": INT, "atime_ns": INT, "ctime_ns": INT, "nlink": NONNEG,
                      "temporary": BOOL}, ["type", "size", "mode", "mtime_ns"]),
    "fs.close": _open({"handle": NONNEG}),
    "fs.create_temp": _open({"handle": NONNEG}, ["handle"]),
    "fs.mkdir": _open({"path": STR}, ["path"]),
    "fs.remove": _open({"path": STR, "removed": NONNEG}, ["path", "removed"]),
    "fs.rename": _open({"path": STR}, ["path"]),
    "safeguard.configure": _open({"config": _open(SAFEGUARD_CONFIG)}, ["config"]),
    "safeguard.confirm": _open({"safeguard_id": STR, "action": STR}),
    "mount.add": _open({"mount": MOUNT, "mounts": {"type": "array", "items": MOUNT}}, ["mount", "mounts"]),
    "mount.remove": _open({"mounts": {"type": "array", "items": MOUNT}}, ["mounts"]),
}

_DIR = {"directory": NONNEG}
EVENTS: dict[str, dict] = {
    "event.step_completed": _open({"step_id": INT, "step_type": STR, "exit_code": NULLABLE_INT,
                                   "affected_paths": STRS, "paths_count": NONNEG, "unprotected": BOOL, **_DIR},
                                  ["step_id", "exit_code", "affected_paths"]),
    "event.terminal_output": _open({"stream": {"enum": ["stdout", "stderr"]}, "data": STR, "step_id": NULLABLE_INT},
                                   ["stream", "data"]),
    "event.agent_output": _open({"stream": {"enum": ["stdout", "stderr"]}, "data": STR, "step_id": NULLABLE_INT},
                                ["stream", "data"]),
    "event.warning": _open({"message": STR, "code": STR, **_DIR}, ["message"]),
    "event.error": _open({"message": STR, "code": STR, **_DIR}, ["message"]),
    "event.safeguard_triggered": _open({"safeguard_id": STR, "step_id": INT, "kind": {"enum": ["delete", "overwrite", "rename_over"]},
                                        "count": POS, "delete_count": NULLABLE_INT, "path": STR, "sample_paths": STRS,
                                        "message": STR, "timeout_seconds": NUM, **_DIR},
                                       ["safeguard_id", "step_id", "kind", "count", "sample_paths", "message"]),
    "event.external_modification": _open({"paths": STRS, "barrier_id": NULLABLE_INT, "policy": STR, **_DIR},
                                         ["paths", "barrier_id"]),
    "event.recovery": _open({"paths_restored": NONNEG, "step_id": NULLABLE_INT, "message": STR, **_DIR},
                            ["paths_restored"]),
    "event.undo_version_mismatch": _open({"message": STR, **_DIR}, ["message"]),
}


def document() -> dict:
    """The whole schema document (a fresh copy)."""
    defs: dict[str, dict] = {"barrier": BARRIER}
    for t, s in REQUESTS.items():
        defs[f"request.{t}"] = s
    for t, s in RESULTS.items():
        defs[f"result.{t}"] = s
    for t, s in EVENTS.items():
        defs[t] = s
    error = _obj({"code": {"type": "string", "pattern": r"^(protocol|session|agent|undo|fs|safeguard)\.[a-z_]+$"},
                  "message": STR, "data": {"type": "object"}}, ["code", "message", "data"])
    defs["error"] = error
    defs["request"] = {
        "type": "object", "required": ["type", "request_id"],
        "properties": {"type": {"enum": sorted(REQUESTS)}, "request_id": REQUEST_ID, "payload": {"type": "object"}},
        "additionalProperties": False,
        "allOf": [{"if": {"properties": {"type": {"const": t}}},
                   "then": {"properties": {"payload": _ref(f"request.{t}")}}} for t in REQUESTS],
    }
    defs["response"] = {"oneOf": [
        _obj({"type": {"const": "response"}, "request_id": REQUEST_ID, "status": {"const": "ok"},
              "payload": {"type": "object"}}, ["type", "request_id", "status", "payload"]),
        _obj({"type": {"const": "response"}, "request_id": {"oneOf": [REQUEST_ID, {"type": "null"}]},
              "status": {"const": "error"}, "error": _ref("error")}, ["type", "request_id", "status", "error"]),
    ]}
    defs["event"] = {
        "type": "object", "required": ["type", "payload"],
        "properties": {"type": {"enum": sorted(EVENTS)}, "payload": {"type": "object"}, "request_id": REQUEST_ID},
        "additionalProperties": False,
        "allOf": [{"if": {"properties": {"type": {"const": t}}}, "then": {"properties": {"payload": _ref(t)}}}
                  for t in EVENTS],
    }
    return copy.deepcopy({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "sandbox STDIO API, protocol version 1",
        "description": "One JSON object per line on stdin (requests) and stdout (responses and events).",
        "oneOf": [_ref("request"), _ref("response"), _ref("event")],
        "$defs": defs,
    })


@functools.lru_cache(maxsize=1)
def shipped() -> dict:
    """The schema document shipped in the package."""
    with open(SCHEMA_PATH) as f:
        return json.load(f)


@functools.lru_cache(maxsize=None)
def validator(name: str):
    """A ``jsonschema`` validator for ``$defs/<name>`` (e.g. ``request.fs.read``, ``event``)."""
    import jsonschema

    doc = shipped()
    return jsonschema.Draft202012Validator({"$schema": doc["$schema"], "$defs": doc["$defs"], "$ref": f"#/$defs/{name}"})


def first_error(name: str, instance) -> tuple[str, str] | None:
    """``(json path, reason)`` of the first schema violation, or None if ``instance`` is valid."""
    errors = sorted(validator(name).iter_errors(instance), key=lambda e: (len(e.absolute_path), e.path))
    if not errors:
        return None
    e = errors[0]
    path = _clip("$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path))
    return path, _clip(e.message)


def _clip(text: str, chars_max: int = 300) -> str:
    """Error details echo client data (a key, a value): never more than ``chars_max`` of it."""
    return text if len(text) <= chars_max else text[:chars_max] + "…"


DOC_PATH = "docs/stdio-api.md"
DOC_MARK = "<!-- protocol.schema.json -->"


def main(argv: list[str] | None = None) -> int:
    """``--write``: regenerate the shipped file; ``--doc [PATH]``: re-embed it in the protocol
    reference (default ``docs/stdio-api.md``, after the marker line, in a ``json`` code block);
    otherwise print it."""
    argv = sys.argv[1:] if argv is None else argv
    text = json.dumps(document(), indent=1, sort_keys=True) + "\n"
    if argv == ["--write"]:
        with open(SCHEMA_PATH, "w") as f:
            f.write(text)
        return 0
    if argv[:1] == ["--doc"]:
        path = argv[1] if len(argv) > 1 else DOC_PATH
        with open(path) as f:
            doc = f.read()
        head, sep, rest = doc.partition(DOC_MARK)
        if not sep:
            raise SystemExit(f"{path}: no {DOC_MARK} line")
        after = rest.split("```json\n", 1)[1].split("```", 1)[1]
        with open(path, "w") as f:
            f.write(head + sep + "\n\n```json\n" + text + "```" + after)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
