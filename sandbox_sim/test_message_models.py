"""The API's message models (:mod:`sandbox.api.messages`) are the one source of the STDIO
schema and the MCP tool schemas (issue 14).

What the agent emits is checked against both the shipped schema and the models in every
STDIO test (``sandbox_sim/api_client.py``); the MCP tests compare ``tools/list`` with the
models' schemas. Here: the generated document keeps its contract (requests closed and never
nullable unless said so, results/events open), a shape shared by STDIO and MCP has one
definition, and the bounds come from one place.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sandbox.api import protocol, schema
from sandbox.api.messages import bounds, results, shapes, tools
from sandbox.api.messages.events import EVENTS
from sandbox.api.messages.fields import Open
from sandbox.api.messages.requests import REQUESTS, UndoLimits
from sandbox.api.messages.results import RESULTS
from sandbox.api.mcp.tools import TOOLS
from sandbox_sim.api_client import model_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _admits_none(model, name: str) -> bool:
    from pydantic import TypeAdapter, ValidationError
    try:
        TypeAdapter(model.model_fields[name].annotation).validate_python(None)
        return True
    except ValidationError:
        return False


def test_every_request_result_and_event_has_a_model_and_a_definition():
    defs = schema.shipped()["$defs"]
    assert set(REQUESTS) == set(RESULTS)
    for t in REQUESTS:
        assert f"request.{t}" in defs and f"result.{t}" in defs
    for name in EVENTS:
        assert name in defs
    assert defs["request"]["properties"]["type"]["enum"] == sorted(REQUESTS)
    assert defs["event"]["properties"]["type"]["enum"] == sorted(EVENTS)


def test_requests_are_closed_results_and_events_open():
    defs = schema.shipped()["$defs"]
    for t in REQUESTS:
        assert defs[f"request.{t}"]["additionalProperties"] is False, t
        assert "additionalProperties" not in defs[f"result.{t}"], t
    for name in EVENTS:
        assert "additionalProperties" not in defs[name], name
    assert defs["error"]["additionalProperties"] is False


@pytest.mark.parametrize("type_", sorted(REQUESTS))
def test_an_optional_request_field_is_never_nullable_unless_its_type_says_so(type_):
    """``"path": null`` is refused by the shipped schema (what the agent validates with)
    exactly when the model's type does not admit None; and no request schema carries a
    pydantic default or title."""
    model, v = REQUESTS[type_], schema.validator(f"request.{type_}")
    d = schema.shipped()["$defs"][f"request.{type_}"]
    for name in model.model_fields:
        errors = [e for e in v.iter_errors({name: None}) if list(e.absolute_path) == [name]]
        assert bool(errors) is not _admits_none(model, name), (type_, name)
        assert "default" not in d["properties"][name] and "title" not in d["properties"][name], (type_, name)


def test_a_shape_shared_by_stdio_and_mcp_has_one_definition():
    """The same classes compose the STDIO results and the MCP outputs, and their schemas are
    the same in the shipped document and in the tools' ``outputSchema``."""
    assert results.UndoDiffed.model_fields["paths"].annotation == list[shapes.DiffPath]
    assert tools.DiffStepOut.model_fields["paths"].annotation == list[shapes.DiffPath]
    assert issubclass(tools.UndoOut, shapes.Rollback) and issubclass(results.UndoRolledBack, shapes.Rollback)
    assert issubclass(tools.ListDirectoryOut, shapes.Listing) and issubclass(results.FsListed, shapes.Listing)
    assert issubclass(tools.FolderOut, shapes.FolderBase) and issubclass(shapes.Folder, shapes.FolderBase)
    stdio = schema.shipped()["$defs"]
    shared = set()
    for spec in TOOLS:
        for name, d in schema.tool_output_schema(spec.output).get("$defs", {}).items():
            if name in stdio:
                shared.add(name)
                assert d == stdio[name], (spec.name, name)
    assert shared == {"diff_path", "restored_path", "entry"}


def test_bounds_are_defined_once_and_used_by_both():
    defs = schema.shipped()["$defs"]
    assert defs["request.fs.open"]["properties"]["path"]["maxLength"] == bounds.PATH_CHARS_MAX
    assert tools.ReadFileIn.model_json_schema()["properties"]["path"]["maxLength"] == bounds.PATH_CHARS_MAX
    assert defs["request.agent.execute"]["properties"]["command"]["maxLength"] == bounds.TEXT_CHARS_MAX
    assert tools.ExecuteCommandIn.model_json_schema()["properties"]["command"]["maxLength"] == bounds.COMMAND_CHARS_MAX


def test_the_model_check_of_the_test_client_catches_a_mismatch():
    """The check every STDIO test applies to what the agent emits can fail."""
    assert model_error({"type": "event.warning", "payload": {"message": "m", "code": "x.y"}}, None) is None
    assert model_error({"type": "event.warning", "payload": {"message": 3}}, None) is not None
    ok = {"type": "response", "status": "ok", "payload": {"path": "a", "entries": [{"name": "f", "type": "file"}]}}
    assert model_error(ok, "fs.list") is None
    assert model_error({**ok, "payload": {"path": "a", "entries": [{"name": "f", "type": "fifo"}]}}, "fs.list")
    assert model_error({**ok, "payload": {"path": "a", "entries": [{"name": "f", "type": "file", "size": "1"}]}},
                       "fs.list")  # strict: no coercion


def test_message_class_names_are_unique():
    with pytest.raises(TypeError, match="used twice"):
        class Step(Open):  # noqa: F841 - shapes.Step exists
            pass


def test_docs_say_where_the_models_live():
    for doc in ("docs/stdio-api.md", "docs/mcp.md"):
        with open(os.path.join(ROOT, doc)) as f:
            assert "sandbox/api/messages/" in f.read(), doc


def test_the_agent_reads_the_shipped_document_not_the_models():
    """``sandbox serve`` starts without building the models (the shipped file has what it
    needs); the names it reads from that file are the models'."""
    assert protocol.REQUEST_TYPES == set(REQUESTS) and protocol.EVENT_NAMES == set(EVENTS)
    assert set(protocol.UNDO_LIMIT_FIELDS) == set(UndoLimits.model_fields)
    code = ("import sys, sandbox.api.stdio, sandbox.api.agent, sandbox.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('sandbox.api.messages.') and m != "
            "'sandbox.api.messages.bounds'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
