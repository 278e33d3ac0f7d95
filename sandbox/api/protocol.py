"""The STDIO protocol at run time: its version, the shipped JSON Schema document and validation.

The document ``sandbox/api/protocol.schema.json`` is generated from the message models
(:mod:`sandbox.api.schema`, which re-exports this module) and a test fails while it is
stale; the agent reads it — never the models, whose construction would cost every
``sandbox serve`` start about half a second — to validate each request and to know the
request types and event names.
"""

from __future__ import annotations

import functools
import json
import os

from .messages.bounds import INT64_MAX, INT64_MIN, NAME_CHARS_MAX

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
SCHEMA_ID = "https://sandbox.invalid/protocol/v1"
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.schema.json")


@functools.lru_cache(maxsize=1)
def shipped() -> dict:
    """The schema document shipped in the package."""
    with open(SCHEMA_PATH) as f:
        return json.load(f)


#: every request type and every event name, as the shipped document lists them
REQUEST_TYPES: frozenset[str] = frozenset(shipped()["$defs"]["request"]["properties"]["type"]["enum"])
EVENT_NAMES: frozenset[str] = frozenset(shipped()["$defs"]["event"]["properties"]["type"]["enum"])
#: the undo limits a request may set (undo.configure, session.start's undo_limits)
UNDO_LIMIT_FIELDS: tuple[str, ...] = tuple(shipped()["$defs"]["undo_limits"]["properties"])


def valid_request_id(value) -> bool:
    """``value`` is a request_id the schema accepts (a string of at most NAME_CHARS_MAX
    characters or a 64-bit integer), so it may be echoed back."""
    if isinstance(value, str):
        return len(value) <= NAME_CHARS_MAX
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


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
