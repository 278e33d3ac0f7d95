"""The MCP server's named limits (docs/mcp.md quotes them). Each says what happens past it.

The bounds of tool arguments live with the message models (:mod:`sandbox.api.messages.bounds`).
"""

from ..messages.bounds import COMMAND_TIMEOUT_S_MAX  # noqa: F401 - quoted with the others

#: stdout / stderr of one execute_command kept for the result, per stream, in characters:
#: the first half and the last half are kept, the middle is replaced by a truncation marker
COMMAND_OUTPUT_CHARS_MAX = 32_000
#: progress notifications carry output in chunks of at most this many characters; output
#: arriving faster than the client reads is coalesced (never queued without bound)
PROGRESS_CHUNK_CHARS_MAX = 4_000
#: progress notifications of one command not yet sent; more output is coalesced into the next
PROGRESS_PENDING_MAX = 64
#: paths listed per change kind (created/modified/deleted) in execute_command's result
STEP_PATHS_SAMPLE_MAX = 20
#: paths listed in undo's result (the rest are counted)
UNDO_PATHS_LISTED_MAX = 200
#: entries of get_undo_history's result (newest first; the rest are counted)
HISTORY_STEPS_MAX = 100
#: entries of list_directory's result (the rest are counted)
LIST_ENTRIES_MAX = 1_000
#: bytes one read_file returns without an explicit length (more: ask with offset/length)
READ_DEFAULT_BYTES = 256 << 10
#: characters of edit_file's unified diff (dry run and result); longer is cut with a marker
EDIT_DIFF_CHARS_MAX = 32_000
#: seconds between two boot progress notifications while the first tool call waits for the session
BOOT_PROGRESS_INTERVAL_S = 1.0
#: seconds the user has to answer a safeguard elicitation; then --on-hold applies
ELICITATION_TIMEOUT_S = 300.0
#: roots a client may list; more are refused (the view is not narrowed by a partial list)
ROOTS_MAX = 64
#: seconds to wait for the client's roots/list answer; on timeout the view stays as it is
ROOTS_TIMEOUT_S = 10.0
#: paths listed in diff_step's result (the rest are counted: paths_total, paths_truncated)
DIFF_PATHS_LISTED_MAX = 200
#: characters of unified diff text in one diff_step result, all paths together; past it a path's
#: diff is left out (diff_truncated) — ask sandbox diff / undo.diff for the whole thing
DIFF_TEXT_CHARS_MAX = 64_000
