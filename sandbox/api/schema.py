"""The STDIO API's JSON Schema, generated from the message models (:mod:`sandbox.api.messages`).

The models are the one source of truth; this module turns them into one JSON Schema
document (draft 2020-12), shipped as ``sandbox/api/protocol.schema.json`` (regenerate with
``python -m sandbox.api.schema --write``, re-embed in docs/stdio-api.md with ``--doc``; a
test fails if either is stale). The agent validates every incoming request against the
shipped file with ``jsonschema``; the test suite validates everything the agent emits
against it and against the models.

Layout of the document: ``$defs`` holds ``request.<type>`` (the payload of each request),
``result.<type>`` (the payload of its ``ok`` response) and ``event.<name>`` (the payload of
each event), plus the envelopes ``request``, ``response``, ``event``, ``error`` and the
shared shapes (``barrier``, ``step``, ``folder``, ``diff_path``…, each a model's
``schema_name``). Payload objects are closed (``additionalProperties: false``) in requests,
so a misspelt field is an error rather than silently ignored; results and events are open,
so the agent may add fields in a compatible version.

The agent itself never imports the models (building them costs startup time): it uses
:mod:`sandbox.api.protocol`, which reads the shipped file; this module re-exports it.

Generation: pydantic's schema, then :func:`_tidy` removes its artefacts — ``title``s, and
``default``s (a request field that may be omitted is never nullable unless its type says
so); ``anyOf`` with ``null`` becomes a type list, other unions ``oneOf`` (their branches
never overlap); ``additionalProperties: true`` (the default) is left out.
"""

from __future__ import annotations

import copy
import json
import sys

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import models_json_schema

from .messages.events import EVENTS
from .messages.fields import BY_CLASS_NAME
from .messages.requests import REQUESTS, RequestId
from .messages.results import RESULTS
from .messages.shapes import Barrier, StdioError
# the runtime half (what the agent uses: the shipped document, validation), re-exported
from .protocol import (PROTOCOL_VERSION, SCHEMA_ID, SCHEMA_PATH, SUPPORTED_VERSIONS, first_error,  # noqa: F401
                       shipped, valid_request_id, validator)

_REF = "#/$defs/{model}"


def _def_name(cls_name: str) -> str:
    """A ``$defs`` name: the model's ``schema_name``, else its class name in snake case."""
    cls = BY_CLASS_NAME.get(cls_name)
    if cls is not None and cls.schema_name:
        return cls.schema_name
    return "".join("_" + c.lower() if c.isupper() else c for c in cls_name).lstrip("_")


def _tidy(node, *, keep_defaults: bool = False):
    """pydantic's JSON Schema without its artefacts (see the module docstring)."""
    if isinstance(node, list):
        return [_tidy(n, keep_defaults=keep_defaults) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k in ("properties", "$defs", "patternProperties"):
            out[k] = {name: _tidy(s, keep_defaults=keep_defaults) for name, s in v.items()}
        elif k == "title" or (k == "default" and not keep_defaults) or (k == "additionalProperties" and v is True):
            continue
        elif k == "$ref":
            out[k] = "#/$defs/" + _def_name(v.rsplit("/", 1)[1])
        else:
            out[k] = _tidy(v, keep_defaults=keep_defaults)
    if isinstance(out.get("propertyNames"), dict):
        out["propertyNames"] = {"type": "string", **out["propertyNames"]}
    alts = out.pop("anyOf", None)
    if alts is not None:
        rest = [a for a in alts if a != {"type": "null"}]
        if len(rest) == 1 and len(alts) == 2 and isinstance(rest[0].get("type"), str) and "$ref" not in rest[0]:
            out = {**rest[0], **out, "type": [rest[0]["type"], "null"]}  # a nullable scalar: a type list
        else:
            out["oneOf"] = alts
    if keep_defaults and out.get("default", 0) is None and not _nullable(out):
        del out["default"]  # `x: T = None`: left out when unset, never null
    return out


def _nullable(node: dict) -> bool:
    t = node.get("type")
    return t == "null" or (isinstance(t, list) and "null" in t) or any(
        a == {"type": "null"} for a in node.get("oneOf", []) + node.get("anyOf", []))


def _tool_schema(model: type[BaseModel], mode: str) -> dict:
    out = _tidy(model.model_json_schema(mode=mode, ref_template=_REF), keep_defaults=True)
    if "$defs" in out:
        out["$defs"] = _renamed(out["$defs"])
    return out


def tool_input_schema(model: type[BaseModel]) -> dict:
    """An MCP tool's ``inputSchema``: its input model's JSON Schema (defaults kept: clients show them)."""
    return _tool_schema(model, "validation")


def tool_output_schema(model: type[BaseModel]) -> dict:
    """An MCP tool's ``outputSchema``: its output model's JSON Schema as dumped."""
    return _tool_schema(model, "serialization")


def _payload_defs() -> dict[str, dict]:
    """``$defs`` of every payload model and every shape they use, under their schema names."""
    models = [Barrier, StdioError, *REQUESTS.values(), *RESULTS.values(), *EVENTS.values()]
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    return _renamed({k: _tidy(v) for k, v in top["$defs"].items()})


def _renamed(defs: dict[str, dict]) -> dict[str, dict]:
    """``defs`` under their schema names (two models never share one: a ValueError)."""
    out = {_def_name(k): v for k, v in defs.items()}
    if len(out) != len(defs):
        raise ValueError(f"two message models share a $defs name: {sorted(defs)}")
    return out


def _ref(name: str) -> dict:
    return {"$ref": f"#/$defs/{name}"}


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def document() -> dict:
    """The whole schema document (a fresh copy): the payload models' definitions and the envelopes."""
    defs = _payload_defs()
    REQUEST_ID = _tidy(TypeAdapter(RequestId).json_schema())  # noqa: N806 - as the envelopes spell it
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
