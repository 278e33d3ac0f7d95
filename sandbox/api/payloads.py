"""Checks and conversions every API front end applies to a client's payloads (STDIO, MCP).

* :func:`check_exec_text` — text a process can receive (command, env, cwd);
* :func:`encode_data` / :func:`decode_data` — file content as UTF-8 text or base64;
* :func:`default_cwd` — where a command runs when the client names no directory;
* :func:`folder_index` — the working folder a ``directory`` (STDIO) or ``folder`` (MCP) names;
* :func:`diff_in_view` — a step's diff (:meth:`Workspace.step_diff <sandbox.core.workspace.Workspace.step_diff>`) cut to a client's view.

Each refuses bad input with an :class:`~sandbox.api.errors.ApiError` (a stable code),
never anything else.
"""

from __future__ import annotations

import base64
import binascii

from ..mounts.table import Mount, MountTable, PathDenied, PathOutside
from .errors import ApiError


def check_exec_text(path: str, value: str, env_name: bool = False) -> None:
    """Refuse text no process can receive — as an argument, an environment entry or a
    directory: a NUL, or a lone surrogate (not Unicode, so not encodable for the guest);
    an environment name also may not be empty or hold ``=``. Checked before anything
    reaches a guest, so every guest answers the same (``protocol.invalid_request``)."""
    reason = None
    if "\0" in value:
        reason = "contains a NUL character"
    elif env_name and (not value or "=" in value):
        reason = "an environment name must be non-empty and without '='"
    else:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            reason = "is not valid Unicode text (a lone surrogate)"
    if reason is not None:
        raise ApiError("protocol.invalid_request", f"{path}: {reason}", path=path, reason=reason)


def encode_data(data: bytes, encoding: str) -> tuple[str, str]:
    """``data`` as UTF-8 text if asked and it is, else base64; and the encoding used."""
    if encoding == "utf-8":
        try:
            return data.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            pass
    return base64.b64encode(data).decode(), "base64"


def decode_data(text: str, encoding: str) -> bytes:
    """A request's ``data`` in ``encoding`` → bytes (``fs.invalid_argument`` if it is not)."""
    if encoding == "base64":
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError("fs.invalid_argument", "data is not valid base64", errno="EINVAL", field="data") from None
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError("fs.invalid_argument", "data is not valid Unicode text (a lone surrogate): send base64",
                       errno="EINVAL", field="data") from None


def default_cwd(view: MountTable) -> str:
    """A command's working directory when none is given: the view, if it is a folder's
    subtree; else the first working folder."""
    v = view.view
    if v != "/":
        try:
            m, _rel = view.resolve(v)
            if m.kind == "folder":
                return v
        except Exception:
            pass
    return view.folders[0].target


def folder_index(table: MountTable, view: MountTable, key) -> int:
    """The index in the session's ``table`` of the working folder ``key`` names — STDIO's
    ``directory`` and MCP's ``folder``: an index, a label, a guest path or a host path
    (:meth:`MountTable.by_directory <sandbox.mounts.table.MountTable.by_directory>` on ``view``;
    None: its first folder). ``session.unknown_directory`` if no folder has that name. Whether
    the folder lies in ``view`` is the caller's to check."""
    m = view.by_directory(key)
    return table.folders.index(m) if m in table.folders else view.index_of(m)


def diff_in_view(ws, step_id: int | None, view: MountTable, folder: Mount) -> dict:
    """What step ``step_id`` (None: the newest) of ``folder``'s workspace ``ws`` changed,
    preimage vs now, reading only; a client whose view is narrower than the folder sees only
    the paths inside its view, and ``paths_total`` counts those."""
    d = ws.step_diff(step_id)
    if view.view != "/":
        d["paths"] = [e for e in d["paths"] if _visible(view, folder, e["path"])]
        d["paths_total"] = len(d["paths"])
    return d


def _visible(view: MountTable, folder: Mount, rel: str) -> bool:
    try:
        m, _ = view.resolve(folder.target if rel == "." else folder.target + "/" + rel)
    except (PathDenied, PathOutside):
        return False
    return m is folder
