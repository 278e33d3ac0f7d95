"""The named bounds of every API message field, STDIO and MCP: defined here once.

Every integer, string, array and map a client sends is bounded by one of these, so nothing
schema-valid can overflow a handler (a 64-bit offset, a count the undo history can never
hold, a megabyte label); the handlers still check what they rely on. A request past a bound
is refused before any handler runs (STDIO: ``protocol.invalid_request`` from the shipped
JSON Schema; MCP: an ``isError`` result from the input model's validation).
"""

from __future__ import annotations

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: characters of a path (PATH_MAX); an MCP path argument too
PATH_CHARS_MAX = 4096
#: labels, ids, client names, environment variable names, allowlist entries
NAME_CHARS_MAX = 256
#: a command, a prompt, an environment value: Linux's MAX_ARG_STRLEN, one execve string
TEXT_CHARS_MAX = 128 << 10
#: one base64 file of an in-memory mount, one fs.write's data (the line limit's default)
CONTENT_CHARS_MAX = 64 << 20
#: files in one in-memory mount
MEMORY_FILES_MAX = 100_000
#: entries of one command environment
ENV_ENTRIES_MAX = 1024
#: max_step_count's ceiling, so also the most undo.rollback/history can ask for
UNDO_STEP_COUNT_MAX = 100_000
#: a safeguard hold's longest timeout: one day
SAFEGUARD_TIMEOUT_S_MAX = 86_400
#: the largest protocol version a hello may name
PROTOCOL_VERSION_MAX = (1 << 31) - 1
#: working directories of one session.start
WORKING_DIRECTORIES_MAX = 8
#: mounts of one session.start
SESSION_MOUNTS_MAX = 16
#: python_path entries of one session.start
PYTHON_PATH_MAX = 64
#: network_allowlist entries / guest_packages of one session.start
ALLOWLIST_MAX = 256
GUEST_PACKAGES_MAX = 256
#: characters of one Debian package name
PACKAGE_CHARS_MAX = 128

# -- MCP tool arguments (docs/mcp.md quotes them)
#: the longest execute_command line accepted, in characters (one execve string, as STDIO's agent.execute)
COMMAND_CHARS_MAX = TEXT_CHARS_MAX
#: the most steps one MCP undo may roll back
UNDO_COUNT_MAX = 1_000
#: the longest execute_command timeout_s accepted (a day); the command is cancelled when it passes
COMMAND_TIMEOUT_S_MAX = 86_400.0
