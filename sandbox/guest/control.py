"""The guest control protocol, defined once: message types, fields, limits, one JSON line.

Stdlib only and free of any package import: the shim imports it as ``control`` beside it
in the guest (``sandbox.vm.image`` copies both into the initramfs), the host as
``sandbox.guest.control`` (``sandbox.vm.control``). Both ends therefore agree by
construction on every name, field and limit below.

The channel is a byte stream (a virtio-serial port in the VM; a socketpair in tests) of
JSON objects, one per line, UTF-8, ``\\n``-terminated; every object has a string ``type``.
Ids (``id``, ``step_id``) are integers in the i64 range (the host's ids).

Host → guest::

    exec            {id, command, env?, cwd?}      run ``sh -c command`` (env: name → str)
    cancel          {id}                           SIGTERM the command's process group,
                                                   SIGKILL after the shim's grace
    rollback_notify {step_id, step_ids?, folder?, paths?, paths_truncated?}
                                                   an undo happened (``step_ids``: all it undid,
                                                   newest first; ``folder``: the working folder's
                                                   guest path; ``paths``: [{path (relative to it),
                                                   change}], bounded): the shim appends one line
                                                   to UNDO_EVENTS_PATH (see "Undo notifications")
    ping            {id}                           any JSON id, echoed in ``pong``
    mount           {id, port, aname, target, read_only, msize?, tag?}
                                                   with ``tag`` (issue 17): mount -t virtiofs TAG
                                                   (a device the host hot-plugged; retried until it
                                                   appears, at most VIRTIOFS_APPEAR_S; port unused);
                                                   else mount 9P at ``target``: trans=tcp to
                                                   NINEP_ADDR:port (one of ``live_mount_ports()``),
                                                   attach name ``aname``; missing directories
                                                   of ``target`` are made (0755)
    unmount         {id, target}                   unmount ``target`` (not lazily: a busy mount
                                                   fails with EBUSY and stays)

Guest → host::

    ready           {version, pid}                 first line on every (re)connect
    step_started    {id}                           the exec was accepted
    output          {id, stream, data}             stream "stdout"|"stderr", data text
    step_completed  {id, exit_code, signal?}       exactly once per accepted exec, last
    rollback_noted  {step_id}
    pong            {id}
    error           {id, message}                  a refused line (id null when unknown)
    mounted         {id, target}                   the mount is in place
    mount_failed    {id, target, message}
    unmounted       {id, target}
    unmount_failed  {id, target, message}

A ``mount``/``unmount`` whose ``id`` is valid always gets exactly one of its two replies
(never ``error``), so the host routes mount replies by id without sharing the exec id
space. A line without a valid id gets ``error`` with id null.

Live mounts and ports: QEMU forwards each guest TCP port on NINEP_ADDR to one connection to
the host's 9P server (a ``guestfwd`` chardev is connected once, at start), so one port
carries one 9P session at a time. The boot shares use ``NINEP_PORT + k``; the VM also boots
with ``LIVE_MOUNTS_MAX`` spare ports (``live_mount_ports()``), any of which can attach any
export by attach name. The host picks a free one per ``mount``; after ``unmounted`` the
port is free again (the next mount's Tversion resets the server's session on it).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

PROTOCOL_VERSION = 2  # 2: mount/unmount
DEFAULT_PORT = "/dev/virtio-ports/control"

# ---------------------------------------------------------------------------- limits
READ_CHUNK_BYTES_MAX = 64 * 1024  # per read of a child pipe, so per ``output`` chunk
COMMANDS_RUNNING_MAX = 64
OUT_QUEUE_BYTES_MAX = 4 * 1024 * 1024  # guest → host lines queued before backpressure
LINE_MAX_BYTES_DEFAULT = 1024 * 1024
LINE_MAX_BYTES_MIN = 1024
LINE_MAX_BYTES_MAX = 64 * 1024 * 1024
KILL_GRACE_S_MAX = 3600.0
MESSAGE_CHARS_MAX = 300  # an error message's text is clipped to this
ID_MIN, ID_MAX = -(2**63), 2**63 - 1  # ids must fit the host's i64
SPAWN_FAILED_EXIT_CODE = 127

# ---------------------------------------------------------------------------- 9P shares and live mounts
NINEP_ADDR = "10.0.2.100"  # QEMU guestfwd address of the host's 9P server
NINEP_PORT = 564  # boot share k is on NINEP_PORT + k
LIVE_MOUNTS_MAX = 4  # spare forwarded ports, so live mounts at once
LIVE_MOUNT_PORT_FIRST = 5640  # spare ports: LIVE_MOUNT_PORT_FIRST + j, j < LIVE_MOUNTS_MAX
MSIZE_DEFAULT = 512 * 1024
MSIZE_MIN, MSIZE_MAX = 4096, 16 * 1024 * 1024
ANAME_CHARS_MAX = 255
TARGET_BYTES_MAX = 4095  # PATH_MAX - 1
MOUNT_TIMEOUT_S = 60.0  # the shim kills a mount/unmount still running after this
MOUNT_OPS_RUNNING_MAX = 2 * LIVE_MOUNTS_MAX  # mount/unmount operations in flight in the shim
#: the readahead of every virtio-fs mount, KiB (init.sh for boot shares, from the kernel
#: command line ``sandbox.vfs_ra_kb``; the shim for live mounts): one full FUSE request
#: (``fuse.abi.MAX_WRITE_BYTES``). Linux's default, 128 KiB, made a sequential read 128 KiB
#: READs; INIT can only lower it. Reads never go past a file's end, so small files cost nothing
VIRTIOFS_READ_AHEAD_KB = 1024


def bdi_read_ahead_path(st_dev: int) -> str:
    """The ``read_ahead_kb`` file of the backing device of a mount whose ``st_dev`` this is
    (FUSE and virtio-fs name it by the superblock's ``major:minor``)."""
    return f"/sys/class/bdi/{os.major(st_dev)}:{os.minor(st_dev)}/read_ahead_kb"

# ---------------------------------------------------------------------------- undo notifications
# The convention guest processes use to learn of an undo (docs/vm.md "Undo notifications in the
# guest"): the shim appends one JSON line per undo to UNDO_EVENTS_PATH (0644, in a 0755 root-owned
# directory) and sets UNDO_EVENTS_ENV to that path for every command. No signals.
UNDO_EVENTS_PATH = "/run/sandbox-undo/events.jsonl"
UNDO_EVENTS_ENV = "SANDBOX_UNDO_EVENTS"
UNDO_EVENTS_BYTES_MAX = 1024 * 1024  # a line that would take the file past this rotates it to <path>.1 first
ROLLBACK_NOTIFY_PATHS_MAX = 1000  # paths in one rollback_notify (then paths_truncated)
ROLLBACK_NOTIFY_PATH_BYTES_MAX = 128 * 1024  # their UTF-8 bytes in all (then paths_truncated); JSON-escaped at worst 6x: under the line limit
ROLLBACK_NOTIFY_STEP_IDS_MAX = 100_000  # the most steps one undo can undo (the store's step count ceiling)
ROLLBACK_CHANGES = ("restored", "removed", "recreated")

HOST_TO_GUEST = frozenset({"exec", "cancel", "rollback_notify", "ping", "mount", "unmount"})
GUEST_TO_HOST = frozenset({"ready", "step_started", "output", "step_completed", "rollback_noted", "pong", "error",
                           "mounted", "mount_failed", "unmounted", "unmount_failed"})


def live_mount_ports() -> tuple[int, ...]:
    """The spare forwarded ports a live mount may use (the VM boots with all of them)."""
    return tuple(LIVE_MOUNT_PORT_FIRST + j for j in range(LIVE_MOUNTS_MAX))


class ProtocolError(ValueError):
    """A line or a field that breaks the protocol; ``str()`` is the reason (clipped)."""


# ---------------------------------------------------------------------------- one line


def clip(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARS_MAX else text[:MESSAGE_CHARS_MAX] + "…"


def describe(value: Any) -> str:
    """A short, safe rendering of an untrusted JSON value for an error message."""
    if isinstance(value, str):
        return repr(clip(value))
    if value is None or isinstance(value, (bool, int, float)):
        return clip(str(value))
    return type(value).__name__


def encode(obj: dict) -> bytes:
    """One wire line: UTF-8 JSON, ``\\n``-terminated; ASCII-escaped only if a string holds a
    lone surrogate (which UTF-8 cannot carry), so any ``str`` can be sent.
    Raises ValueError for NaN/infinity and RecursionError for absurd nesting."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        return text.encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("ascii") + b"\n"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode(line: bytes, line_max_bytes: int = LINE_MAX_BYTES_DEFAULT) -> dict:
    """One line (with or without its ``\\n``) → a JSON object. Raises :class:`ProtocolError`
    for an oversized line, bad UTF-8 or JSON (NaN included) or a non-object — never anything
    else. The caller checks ``type`` (against HOST_TO_GUEST / GUEST_TO_HOST), so that a line
    with no or an unknown type can still be answered by its id."""
    if len(line.rstrip(b"\n")) > line_max_bytes:
        raise ProtocolError(f"line longer than {line_max_bytes} bytes")
    try:
        msg = json.loads(line, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(clip(f"malformed JSON: {exc}")) from None
    if not isinstance(msg, dict):
        raise ProtocolError("message must be a JSON object")
    return msg


# ---------------------------------------------------------------------------- fields


def valid_id(value: Any) -> bool:
    return type(value) is int and ID_MIN <= value <= ID_MAX


def check_target(target: Any) -> str:
    """A guest mount point: absolute, normalised (no ``.``, ``..`` or empty components),
    not ``/``, no NUL or newline, at most TARGET_BYTES_MAX bytes."""
    if not isinstance(target, str) or not target.startswith("/") or target == "/":
        raise ProtocolError(f"target must be an absolute path other than /, not {describe(target)}")
    if "\0" in target or "\n" in target or "\r" in target:
        raise ProtocolError("target must not hold NUL or a line break")
    try:
        size = len(target.encode("utf-8"))
    except UnicodeEncodeError:
        raise ProtocolError("target must be valid UTF-8") from None
    if size > TARGET_BYTES_MAX:
        raise ProtocolError(f"target longer than {TARGET_BYTES_MAX} bytes")
    if any(c in ("", ".", "..") for c in target[1:].split("/")):
        raise ProtocolError(f"target must be normalised (no //, . or ..): {describe(target)}")
    return target


_ANAME = re.compile(r"[^\s,\0]+")


def check_aname(aname: Any) -> str:
    """A 9P attach name that fits a mount option: no whitespace, comma or NUL."""
    if not isinstance(aname, str) or not 1 <= len(aname) <= ANAME_CHARS_MAX or not _ANAME.fullmatch(aname):
        raise ProtocolError(f"aname must be 1-{ANAME_CHARS_MAX} characters without whitespace, ',' or NUL, "
                            f"not {describe(aname)}")
    return aname


# -- virtio-fs (issue 17): a live mount may be a hot-plugged vhost-user-fs device
VIRTIOFS_TAG = re.compile(r"[A-Za-z0-9_.-]{1,36}")  # the device's config space holds 36 bytes
VIRTIOFS_APPEAR_S = 30.0  # the shim retries mount -t virtiofs this long while the hot-plugged device appears
VIRTIOFS_RETRY_S = 0.05


def mount_request(req_id: int, *, port: int, aname: str, target: str, read_only: bool,
                  msize: int = MSIZE_DEFAULT, tag: str | None = None) -> dict:
    """A ``mount`` message, checked as the shim checks it (:func:`parse_mount`)."""
    msg = {"type": "mount", "id": req_id, "port": port, "aname": aname, "target": target,
           "read_only": read_only, "msize": msize}
    if tag is not None:
        msg["tag"] = tag
    parse_mount(msg)
    return msg


def parse_mount(msg: dict) -> dict:
    """The checked fields of a ``mount`` (id already valid or not: checked here too).
    Raises ProtocolError with the reason."""
    if not valid_id(msg.get("id")):
        raise ProtocolError("mount: id must be an integer in the i64 range")
    port, tag = msg.get("port"), msg.get("tag")
    if tag is not None and (not isinstance(tag, str) or not VIRTIOFS_TAG.fullmatch(tag)):
        raise ProtocolError(f"mount: tag must be 1-36 of [A-Za-z0-9_.-], not {describe(tag)}")
    if tag is not None:
        port = None
    elif type(port) is not int or port not in live_mount_ports():
        raise ProtocolError(f"mount: port must be one of {list(live_mount_ports())}, not {describe(port)}")
    read_only = msg.get("read_only")
    if type(read_only) is not bool:
        raise ProtocolError("mount: read_only must be true or false")
    msize = msg.get("msize", MSIZE_DEFAULT)
    if type(msize) is not int or not MSIZE_MIN <= msize <= MSIZE_MAX:
        raise ProtocolError(f"mount: msize must be an integer in [{MSIZE_MIN}, {MSIZE_MAX}]")
    try:
        aname, target = check_aname(msg.get("aname")), check_target(msg.get("target"))
    except ProtocolError as exc:
        raise ProtocolError(f"mount: {exc}") from None
    return {"id": msg["id"], "port": port, "aname": aname, "target": target, "read_only": read_only,
            "msize": msize, "tag": tag}


def unmount_request(req_id: int, target: str) -> dict:
    msg = {"type": "unmount", "id": req_id, "target": target}
    parse_unmount(msg)
    return msg


def parse_unmount(msg: dict) -> dict:
    if not valid_id(msg.get("id")):
        raise ProtocolError("unmount: id must be an integer in the i64 range")
    try:
        target = check_target(msg.get("target"))
    except ProtocolError as exc:
        raise ProtocolError(f"unmount: {exc}") from None
    return {"id": msg["id"], "target": target}


def ninep_mount_options(port: int, aname: str, msize: int) -> str:
    """The 9P mount data for a share on ``port`` (the same options init.sh uses at boot)."""
    return f"trans=tcp,port={port},version=9p2000.L,cache=none,msize={msize},aname={aname}"


# ---------------------------------------------------------------------------- rollback_notify


def rollback_notify_request(step_id: int, *, step_ids: list[int] | None = None, folder: str | None = None,
                            paths: list[dict] | None = None, paths_truncated: bool = False) -> dict:
    """A ``rollback_notify`` message, bounded as :func:`parse_rollback_notify` requires: paths
    past ROLLBACK_NOTIFY_PATHS_MAX or ROLLBACK_NOTIFY_PATH_BYTES_MAX are left off and
    ``paths_truncated`` says so."""
    kept, size = [], 0
    for p in paths or ():
        size += len(p["path"].encode("utf-8", "surrogatepass"))
        if len(kept) == ROLLBACK_NOTIFY_PATHS_MAX or size > ROLLBACK_NOTIFY_PATH_BYTES_MAX:
            paths_truncated = True
            break
        kept.append({"path": p["path"], "change": p["change"]})
    msg = {"type": "rollback_notify", "step_id": step_id, "step_ids": list(step_ids or [step_id])[:ROLLBACK_NOTIFY_STEP_IDS_MAX],
           "paths": kept, "paths_truncated": bool(paths_truncated)}
    if folder is not None:
        msg["folder"] = folder
    parse_rollback_notify(msg)
    return msg


def parse_rollback_notify(msg: dict) -> dict:
    """The checked fields of a ``rollback_notify``: ``step_id``, ``step_ids`` (default
    ``[step_id]``), ``folder`` (None, or a guest path as :func:`check_target`), ``paths``
    (relative, no NUL or line break, ``change`` one of ROLLBACK_CHANGES; bounded by
    ROLLBACK_NOTIFY_PATHS_MAX and ROLLBACK_NOTIFY_PATH_BYTES_MAX), ``paths_truncated``.
    Raises ProtocolError with the reason."""
    step_id = msg.get("step_id")
    if not valid_id(step_id):
        raise ProtocolError("rollback_notify: step_id must be an integer in the i64 range")
    step_ids = msg.get("step_ids", [step_id])
    if (not isinstance(step_ids, list) or not 1 <= len(step_ids) <= ROLLBACK_NOTIFY_STEP_IDS_MAX
            or not all(valid_id(i) for i in step_ids)):
        raise ProtocolError("rollback_notify: step_ids must be a non-empty list of ids")
    folder = msg.get("folder")
    if folder is not None:
        check_target(folder)
    paths = msg.get("paths", [])
    if not isinstance(paths, list) or len(paths) > ROLLBACK_NOTIFY_PATHS_MAX:
        raise ProtocolError(f"rollback_notify: paths must be a list of at most {ROLLBACK_NOTIFY_PATHS_MAX}")
    size = 0
    for p in paths:
        path = p.get("path") if isinstance(p, dict) else None
        if (not isinstance(path, str) or not path or path.startswith("/") or "\0" in path or "\n" in path
                or "\r" in path or p.get("change") not in ROLLBACK_CHANGES):
            raise ProtocolError(f"rollback_notify: a path must be {{path: relative, change: one of {ROLLBACK_CHANGES}}}")
        size += len(path.encode("utf-8", "surrogatepass"))
    if size > ROLLBACK_NOTIFY_PATH_BYTES_MAX:
        raise ProtocolError(f"rollback_notify: paths longer than {ROLLBACK_NOTIFY_PATH_BYTES_MAX} bytes in all")
    truncated = msg.get("paths_truncated", False)
    if not isinstance(truncated, bool):
        raise ProtocolError("rollback_notify: paths_truncated must be a boolean")
    return {"step_id": step_id, "step_ids": step_ids, "folder": folder, "paths": paths, "paths_truncated": truncated}
