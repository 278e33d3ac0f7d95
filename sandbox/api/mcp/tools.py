"""The tool table: each tool's name, description, input/output models and annotations.

Names and argument names are fixed by issue 14 (clients and docs agree on them).
Annotations are set explicitly on every tool — never left to the protocol's defaults
(which call a tool destructive and open-world unless told otherwise):

==================  ========  ===========  ==========  ==========================
tool                readOnly  destructive  idempotent  openWorld
==================  ========  ===========  ==========  ==========================
execute_command     no        yes          no          network is not ``disabled``
read_file           yes       no           yes         no
write_file          no        yes          yes         no
edit_file           no        yes          no          no
list_directory      yes       no           yes         no
undo                no        yes          no          no
get_undo_history    yes       no           yes         no
get_session_status  yes       no           yes         no
diff_step           yes       no           yes         no
==================  ========  ===========  ==========  ==========================
"""

from __future__ import annotations

from dataclasses import dataclass

import mcp_types as types
from pydantic import BaseModel

from . import models as m


@dataclass(frozen=True)
class ToolSpec:
    name: str
    title: str
    description: str
    input: type[BaseModel]
    output: type[BaseModel]
    read_only: bool
    destructive: bool
    idempotent: bool
    reaches_network: bool = False  # openWorldHint follows the session's network policy

    def tool(self, network: str) -> types.Tool:
        return types.Tool(
            name=self.name, title=self.title, description=self.description,
            input_schema=m.input_schema(self.input), output_schema=m.output_schema(self.output),
            annotations=types.ToolAnnotations(
                title=self.title, read_only_hint=self.read_only, destructive_hint=self.destructive,
                idempotent_hint=self.idempotent, open_world_hint=self.reaches_network and network != "disabled"))


def _read(name: str, title: str, description: str, input: type[BaseModel], output: type[BaseModel]) -> ToolSpec:
    """A tool that only reads: readOnly, not destructive, idempotent, closed world."""
    return ToolSpec(name, title, description, input, output, read_only=True, destructive=False, idempotent=True)


_UNDO = " Undoable with the undo tool."
TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("execute_command", "Run a shell command in the sandbox",
             "Run a shell command line in the sandbox VM (sh -c, in the first working folder). Every file change "
             "it makes in the working folders is one undo step: the result gives its step id, the exit code, "
             "the output (bounded) and the paths created/modified/deleted." + _UNDO,
             m.ExecuteCommandIn, m.ExecuteCommandOut, read_only=False, destructive=True, idempotent=False,
             reaches_network=True),
    _read("read_file", "Read a file",
          "Read a file of the sandbox (text, or base64 when it is not UTF-8), optionally a byte range.",
          m.ReadFileIn, m.ReadFileOut),
    ToolSpec("write_file", "Write a file",
             "Create or replace a file with the given content: one undo step." + _UNDO,
             m.WriteFileIn, m.WriteFileOut, read_only=False, destructive=True, idempotent=True),
    ToolSpec("edit_file", "Edit a file by exact replacement",
             "Replace old_text, which must occur exactly once in the file, by new_text: one undo step. "
             "dry_run returns the unified diff without writing." + _UNDO,
             m.EditFileIn, m.EditFileOut, read_only=False, destructive=True, idempotent=False),
    _read("list_directory", "List a directory", "List a directory of the sandbox (default: the first working folder).",
          m.ListDirectoryIn, m.ListDirectoryOut),
    ToolSpec("undo", "Undo the newest steps",
             "Undo the newest count steps (commands and file writes), newest first, restoring every file they "
             "changed; the result lists the paths — re-read them. Refused when someone changed those files "
             "outside the sandbox since (undo.barrier): ask the user before retrying with force. folder picks the "
             "working folder (default: the first read-write one in view).",
             m.UndoIn, m.UndoOut, read_only=False, destructive=True, idempotent=False),
    _read("get_undo_history", "List the undo history",
          "The undo steps of one working folder (folder; default: the first read-write one in view), newest "
          "first: id, command, paths, outcome.",
          m.GetUndoHistoryIn, m.GetUndoHistoryOut),
    _read("get_session_status", "Show the session's state", "The sandbox session: VM state, network policy, "
          "working folders, the effective view (after the client's roots), pending safeguards.",
          m.NoArgsIn, m.GetSessionStatusOut),
    _read("diff_step", "Show what a step changed",
          "What one undo step changed (default: the newest), path by path: created/modified/deleted/metadata, "
          "with a unified diff for text files (before the step vs now) and a summary otherwise; folder picks the "
          "working folder (default: the first read-write one in view).",
          m.DiffStepIn, m.DiffStepOut),
)
BY_NAME: dict[str, ToolSpec] = {t.name: t for t in TOOLS}
