"""Tool failures: :class:`McpToolError` carries an error code, a message and data.

A tool that fails returns an ``isError`` result whose structured content is
``{"code", "message", "data"}`` — the STDIO API's codes (:data:`sandbox.api.errors.CODES`)
plus the few that only MCP has (:data:`MCP_CODES`). Codes are stable, like the STDIO ones.
"""

from __future__ import annotations

from ...core.errors import SandboxError
from ..errors import CODES, ApiError, to_api_error

#: codes only the MCP server produces: code -> meaning (docs/mcp.md lists them)
MCP_CODES: dict[str, str] = {
    "session.boot_failed": "The session could not start (the VM did not boot); every tool call fails with this (data: reason).",
    "edit.no_match": "edit_file: old_text does not occur in the file.",
    "edit.ambiguous": "edit_file: old_text occurs more than once (data: occurrences); give more context.",
}


class McpToolError(ApiError):
    """A tool failure with a code from :data:`~sandbox.api.errors.CODES` or :data:`MCP_CODES`."""

    def __init__(self, code: str, message: str, **data):
        if code not in CODES and code not in MCP_CODES:
            raise ValueError(f"unknown MCP error code {code!r}")
        SandboxError.__init__(self, message, **data)
        self.code = code


def tool_error(exc: BaseException) -> ApiError:
    """``exc`` as an error with a stable code (:func:`~sandbox.api.errors.to_api_error`)."""
    return exc if isinstance(exc, ApiError) else to_api_error(exc)
