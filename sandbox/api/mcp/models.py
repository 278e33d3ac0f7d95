"""The MCP tools' input and output models — defined with every other API message in
:mod:`sandbox.api.messages` (:mod:`~sandbox.api.messages.tools`, built from the shapes STDIO
uses too) and re-exported here under the names the MCP modules use.

``inputSchema``/``outputSchema`` in ``tools/list`` are these models' JSON Schemas
(:func:`input_schema`, :func:`output_schema`); a call's arguments are validated by the
input model (extra fields refused) and its ``structuredContent`` is the output model
dumped — so what a client sees always matches what it was promised.
"""

from __future__ import annotations

from ..messages.bounds import COMMAND_CHARS_MAX, PATH_CHARS_MAX, UNDO_COUNT_MAX
from ..messages.shapes import DiffPath, DirEntry, PathChange, RestoredPath
from ..messages.tools import (DiffStepIn, DiffStepOut, EditFileIn, EditFileOut, ExecuteCommandIn, ExecuteCommandOut,
                              FolderOut, GetSessionStatusOut, GetUndoHistoryOut, HistoryStep, ListDirectoryIn,
                              ListDirectoryOut, NoArgsIn, PathArg, ReadFileIn, ReadFileOut, SafeguardDecision,
                              StepChanges, ToolErrorOut, UndoIn, UndoOut, WriteFileIn, WriteFileOut)
from ..schema import tool_input_schema as input_schema
from ..schema import tool_output_schema as output_schema

__all__ = [
    "COMMAND_CHARS_MAX", "PATH_CHARS_MAX", "UNDO_COUNT_MAX", "PathArg",
    "DiffPath", "DirEntry", "PathChange", "RestoredPath",
    "DiffStepIn", "DiffStepOut", "EditFileIn", "EditFileOut", "ExecuteCommandIn", "ExecuteCommandOut", "FolderOut",
    "GetSessionStatusOut", "GetUndoHistoryOut", "HistoryStep", "ListDirectoryIn", "ListDirectoryOut", "NoArgsIn",
    "ReadFileIn", "ReadFileOut", "SafeguardDecision", "StepChanges", "ToolErrorOut", "UndoIn", "UndoOut",
    "WriteFileIn", "WriteFileOut", "input_schema", "output_schema",
]
