"""Base classes and field types of the API messages (pydantic v2).

* :class:`Closed` — a payload a client sends: unknown fields are refused
  (``additionalProperties: false``), so a misspelt field is an error, never ignored;
* :class:`Open` — a payload the agent sends (a result, an event, a shape inside them):
  unknown fields are allowed, so a compatible version may add fields.

A field that may be left out but is never ``null`` is declared ``name: T = None``: pydantic
does not validate a default, and the STDIO schema generator drops defaults, so the schema
stays non-nullable (a client sending ``"path": null`` is refused). A nullable field says so
in its type (``T | None``).

Each message class may name its JSON Schema definition with ``schema_name`` (``barrier``,
``event.safeguard_triggered``…); the generator (:mod:`sandbox.api.schema`) uses it for
``$defs``. Class names are unique across the package (:data:`BY_CLASS_NAME`).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from .bounds import INT64_MAX, INT64_MIN, NAME_CHARS_MAX, PATH_CHARS_MAX

#: every message class by its class name (the generator maps ``$defs`` names through it)
BY_CLASS_NAME: dict[str, type[BaseModel]] = {}


class Message(BaseModel):
    """A message model; registers itself in :data:`BY_CLASS_NAME` (names must be unique)."""

    schema_name: ClassVar[str | None] = None

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if cls.__name__ in BY_CLASS_NAME:
            raise TypeError(f"message class name {cls.__name__} is used twice")
        BY_CLASS_NAME[cls.__name__] = cls
        cls.schema_name = cls.__dict__.get("schema_name")  # never inherited: each class names its own def


class Closed(Message):
    model_config = ConfigDict(extra="forbid")


class Open(Message):
    model_config = ConfigDict(extra="allow")


def Int(lo: int, hi: int, **kw):  # noqa: N802 - a type factory
    """An integer in ``[lo, hi]``."""
    return Annotated[int, Field(ge=lo, le=hi, **kw)]


def Str(chars_max: int, chars_min: int = 0, **kw):  # noqa: N802 - a type factory
    """A string of ``chars_min``..``chars_max`` characters."""
    return Annotated[str, Field(max_length=chars_max, min_length=chars_min or None, **kw)]


NonNeg = Annotated[int, Field(ge=0)]
Pos = Annotated[int, Field(ge=1)]
U64 = Int(0, INT64_MAX)
UPos64 = Int(1, INT64_MAX)
I64 = Int(INT64_MIN, INT64_MAX)
Name = Str(NAME_CHARS_MAX)
NonEmptyName = Str(NAME_CHARS_MAX, 1)
Path = Str(PATH_CHARS_MAX, 1)
AbsPath = Str(PATH_CHARS_MAX, 1, pattern="^/")

#: what a path is
PathKind = Literal["file", "dir", "symlink", "other"]
#: how file content travels: UTF-8 text, or base64 for anything else
Encoding = Literal["utf-8", "base64"]
#: a working folder's access
Access = Literal["read_write", "read_only"]
#: an undo step's type ("unknown": a damaged step whose type cannot be read)
StepType = Literal["command", "api", "ambient", "unknown"]
#: what a step did to one path, preimage vs now
DiffChange = Literal["created", "modified", "deleted", "metadata"]
#: what undoing did to one path
RestoreChange = Literal["restored", "removed", "recreated"]
#: an answer to a safeguard hold
SafeguardAction = Literal["allow", "deny"]
#: what a safeguard counted
SafeguardKind = Literal["delete", "overwrite", "rename_over"]
#: a command's output stream
Stream = Literal["stdout", "stderr"]
