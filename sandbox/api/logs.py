"""The host agent's logs: JSON Lines on stderr (seed 003 §4.9), on the standard ``logging`` module.

Every record handled by :func:`setup_logging`'s handler becomes one JSON object on one line::

    {"timestamp":"2025-03-01T12:00:01.234567Z","level":"info","component":"stdio_api",
     "request_id":"7","step_id":"s-12","message":"request done","logger":"sandbox.api.server",
     "duration_ms":3.2}

Keys, in this order:

* ``timestamp`` — the record's creation time, ISO 8601 in UTC with microseconds and a ``Z``;
* ``level`` — ``error|warn|info|debug|trace`` (lower case; ``warn``, never ``warning``;
  ``CRITICAL`` is written as ``error``, an in-between level as the named level below it);
* ``component`` — ``fs_backend, control, undo, file_watcher, stdio_api, mcp, session,
  safeguard``, or ``agent`` for anything else: from the logger's name by :data:`COMPONENTS`
  (longest dotted prefix wins), unless the record says ``extra={"component": ...}`` with one
  of those names (any other value is ignored);
* ``request_id``, ``step_id`` — when known, from ``extra={"request_id": ..., "step_id": ...}``
  or else from the context (:func:`bound`). **When unknown the key is omitted** (never
  ``null``); an explicit ``extra={"request_id": None}`` makes it unknown for that record;
* ``message`` — ``record.getMessage()``;
* ``logger`` — the logger's name;
* then the structured fields: those bound by :func:`bound`, overridden by
  ``extra={"fields": {...}}``, overridden by any other ``extra`` keys. A field named like one
  of the keys of this list is written as ``field_<name>`` (the keys above always win);
* ``exception`` — the formatted traceback, when the record has ``exc_info``;
  ``stack`` — when it has ``stack_info``.

Invariants:

* stdout is never written (it carries the STDIO API); :func:`setup_logging` configures the
  ``sandbox`` logger only — never the root logger — with ``propagate = False``;
* one line per record: the JSON is ASCII-only (``ensure_ascii``), so newlines, U+2028,
  U+0085 and every other line break inside values are escaped;
* every line is valid JSON: values that JSON cannot carry (objects, bytes, NaN/inf, …) are
  written as their ``repr``; :meth:`JsonFormatter.format` never raises — if a record cannot
  be formatted (e.g. ``%`` arguments that do not match) a minimal valid line is written
  instead, with the raw message and a ``format_error`` field; a stream that cannot be
  written is ignored (no ``--- Logging error ---`` text on stderr).

Context: :func:`bound` sets ``request_id``/``step_id`` and other fields for a block, in
:mod:`contextvars`. asyncio tasks inherit the context of the code that creates them; threads
do **not** — wrap a thread's target with :func:`bind_context` (or
``contextvars.copy_context().run``) where it is created.
"""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, TextIO, TypeVar

__all__ = [
    "COMPONENTS",
    "COMPONENT_NAMES",
    "LEVELS",
    "TRACE",
    "JsonFormatter",
    "bind_context",
    "bound",
    "component_for",
    "level_number",
    "request_id",
    "setup_logging",
    "step_id",
]

T = TypeVar("T")

#: below DEBUG; ``logger.log(TRACE, ...)``
TRACE = 5
logging.addLevelName(TRACE, "TRACE")  # so that setLevel("TRACE") works too …
logging.addLevelName(TRACE, "trace")  # … and "trace" (the name it prints under until another
# library names it again — uvicorn says "TRACE" —; the JSON lines name levels themselves: _level_name)

#: the ``--log-level`` choices, most to least severe
LEVELS = ("error", "warn", "info", "debug", "trace")
_LEVEL_NUMBERS = {"error": logging.ERROR, "warn": logging.WARNING, "warning": logging.WARNING,
                  "info": logging.INFO, "debug": logging.DEBUG, "trace": TRACE}

#: every value of the ``component`` key
COMPONENT_NAMES = frozenset({"fs_backend", "control", "undo", "file_watcher", "stdio_api", "mcp", "session",
                             "safeguard", "agent"})

#: logger-name prefix → component (matched on whole dotted segments; the longest prefix wins).
#: ``sandbox.<component>`` is mapped too, for loggers named after their component
#: (``sandbox.fs_backend`` in the 9P server).
COMPONENTS: Mapping[str, str] = MappingProxyType({
    "sandbox.ninep": "fs_backend",
    "sandbox.mounts": "fs_backend",
    "sandbox.fuse": "fs_backend",
    "sandbox.fs_backend": "fs_backend",
    "sandbox.control": "control",
    "sandbox.vm.control": "control",
    "sandbox.core": "undo",
    "sandbox.undo": "undo",
    "sandbox.watch": "file_watcher",
    "sandbox.barriers.watch": "file_watcher",
    "sandbox.file_watcher": "file_watcher",
    "sandbox.api": "stdio_api",
    "sandbox.stdio": "stdio_api",
    "sandbox.stdio_api": "stdio_api",
    "sandbox.mcp": "mcp",
    "sandbox.session": "session",
    "sandbox.vm": "session",
    "sandbox.safeguard": "safeguard",
})

#: the keys the formatter writes itself; a field of the same name becomes ``field_<name>``
_CORE_KEYS = frozenset({"timestamp", "level", "component", "request_id", "step_id", "message", "logger",
                        "exception", "stack", "format_error"})
#: attributes every LogRecord has (not extra fields)
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName"}
#: extra keys this module reads itself
_OWN_EXTRAS = frozenset({"component", "request_id", "step_id", "fields"})
_MAX_DEPTH = 16
_MISSING = object()
#: marks the handlers setup_logging installed (so that a second call replaces them)
_HANDLER_MARK = "_sandbox_api_logs_handler"

# --------------------------------------------------------------------------- context

#: the request being served, when known (a JSON-RPC id: str or int)
request_id: contextvars.ContextVar[Any] = contextvars.ContextVar("sandbox_log_request_id", default=None)
#: the undo step being recorded, when known
step_id: contextvars.ContextVar[Any] = contextvars.ContextVar("sandbox_log_step_id", default=None)
_fields: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "sandbox_log_fields", default=MappingProxyType({}))


@contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Within the block, records carry these fields (nested blocks add to and override outer ones).

    ``request_id`` and ``step_id`` set those keys (``None`` makes them unknown); any other
    name becomes a structured field. The other keys the formatter writes (``message``,
    ``level``, …) are refused with :class:`TypeError`.
    """
    reserved = sorted(fields.keys() & (_CORE_KEYS - {"request_id", "step_id"}))
    if reserved:
        raise TypeError(f"bound() cannot set {', '.join(reserved)}: the formatter writes those keys itself")
    tokens: list[tuple[contextvars.ContextVar, contextvars.Token]] = []
    try:
        if "request_id" in fields:
            tokens.append((request_id, request_id.set(fields.pop("request_id"))))
        if "step_id" in fields:
            tokens.append((step_id, step_id.set(fields.pop("step_id"))))
        if fields:
            tokens.append((_fields, _fields.set(MappingProxyType({**_fields.get(), **fields}))))
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def bind_context(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Callable[[], T]:
    """``fn(*args, **kwargs)`` as a no-argument callable that runs in the context of *this* call.

    Threads do not inherit :mod:`contextvars`, so wrap thread targets where they are created::

        threading.Thread(target=bind_context(worker, job)).start()

    Each call runs in its own copy of the captured context (so the callable may be called
    again, or from several threads at once).
    """
    captured = contextvars.copy_context()

    @functools.wraps(fn)
    def run() -> T:
        return captured.copy().run(fn, *args, **kwargs)

    return run


# --------------------------------------------------------------------------- formatting


@functools.lru_cache(maxsize=1024)
def component_for(logger_name: str) -> str:
    """The component of a logger name by :data:`COMPONENTS` (longest dotted prefix), else ``agent``."""
    best, best_len = "agent", -1
    for prefix, component in COMPONENTS.items():
        if (logger_name == prefix or logger_name.startswith(prefix + ".")) and len(prefix) > best_len:
            best, best_len = component, len(prefix)
    return best


def _level_name(levelno: int) -> str:
    if levelno >= logging.ERROR:
        return "error"
    if levelno >= logging.WARNING:
        return "warn"
    if levelno >= logging.INFO:
        return "info"
    if levelno >= logging.DEBUG:
        return "debug"
    return "trace"


def _timestamp(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)
    except Exception as e:  # a broken __repr__ must not lose the line
        try:
            return f"<unrepresentable {type(value).__qualname__}: {type(e).__name__}>"
        except Exception:
            return "<unrepresentable>"


def _jsonable(value: Any, depth: int = 0) -> Any:
    """``value`` as something ``json.dumps(allow_nan=False)`` accepts; ``repr`` where it cannot."""
    try:
        if value is None or isinstance(value, (str, bool, int)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else _safe_repr(value)
        if depth >= _MAX_DEPTH:
            return _safe_repr(value)
        if isinstance(value, Mapping):
            return {(k if isinstance(k, str) else _safe_repr(k)): _jsonable(v, depth + 1) for k, v in value.items()}
        if isinstance(value, (list, tuple, set, frozenset)):
            return [_jsonable(v, depth + 1) for v in value]
    except Exception:
        pass
    return _safe_repr(value)


def _dumps(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


class JsonFormatter(logging.Formatter):
    """A record → one line of JSON (see the module docstring for the keys); never raises."""

    def format(self, record: logging.LogRecord) -> str:
        try:
            return self._format(record)
        except Exception as e:
            return self._fallback(record, e)

    def _format(self, record: logging.LogRecord) -> str:
        attrs = record.__dict__
        component = attrs.get("component")
        if not (isinstance(component, str) and component in COMPONENT_NAMES):
            component = component_for(str(record.name))
        obj: dict[str, Any] = {
            "timestamp": _timestamp(record.created),
            "level": _level_name(record.levelno),
            "component": component,
        }
        for key, var in (("request_id", request_id), ("step_id", step_id)):
            value = attrs.get(key, _MISSING)
            if value is _MISSING:
                value = var.get()
            if value is not None:
                obj[key] = _jsonable(value)
        obj["message"] = str(record.getMessage())
        obj["logger"] = str(record.name)

        fields: dict[Any, Any] = dict(_fields.get())
        explicit = attrs.get("fields", _MISSING)
        if isinstance(explicit, Mapping):
            fields.update(explicit)
        elif explicit is not _MISSING:
            fields["fields"] = explicit
        fields.update((k, v) for k, v in attrs.items() if k not in _RECORD_ATTRS and k not in _OWN_EXTRAS)
        for key, value in fields.items():
            key = key if isinstance(key, str) else _safe_repr(key)
            obj[f"field_{key}" if key in _CORE_KEYS else key] = _jsonable(value)

        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            obj["exception"] = str(record.exc_text)
        if record.stack_info:
            obj["stack"] = str(self.formatStack(record.stack_info))
        return _dumps(obj)

    def _fallback(self, record: logging.LogRecord, error: BaseException) -> str:
        """The minimal line for a record that could not be formatted."""
        try:
            try:
                ts = _timestamp(record.created)
            except Exception:
                ts = _timestamp(datetime.now(UTC).timestamp())
            try:
                level = _level_name(int(record.levelno))
            except Exception:
                level = "error"
            try:
                component = component_for(str(record.name))
            except Exception:
                component = "agent"
            msg = getattr(record, "msg", None)
            return _dumps({
                "timestamp": ts,
                "level": level,
                "component": component,
                "message": msg if isinstance(msg, str) else _safe_repr(msg),
                "format_error": f"{type(error).__name__}: {_safe_repr(error)}; args={_safe_repr(getattr(record, 'args', None))}",
            })
        except Exception:
            return _dumps({"timestamp": _timestamp(datetime.now(UTC).timestamp()), "level": "error",
                           "component": "agent", "message": "a log record could not be formatted"})


# --------------------------------------------------------------------------- setup


class _JsonLinesHandler(logging.StreamHandler):
    """A StreamHandler that never writes anything but its formatter's lines."""

    def handleError(self, record: logging.LogRecord) -> None:
        # the default prints "--- Logging error ---" and a traceback to stderr: not JSON, and
        # the stream that failed is (usually) stderr itself. Drop the record instead.
        pass


def level_number(level: str) -> int:
    """``error|warn|warning|info|debug|trace`` (any case) → the ``logging`` level number."""
    name = level.strip().lower() if isinstance(level, str) else None
    if name not in _LEVEL_NUMBERS:
        raise ValueError(f"unknown log level {level!r}: choose one of {', '.join(LEVELS)} (or warning)")
    return _LEVEL_NUMBERS[name]


def setup_logging(level: str = "info", stream: TextIO | None = None) -> logging.Handler:
    """Send the ``sandbox`` loggers' records, at ``level`` and above, to ``stream`` as JSON Lines.

    ``stream`` defaults to ``sys.stderr`` as it is when this is called. The ``sandbox``
    logger gets this one handler (the ones an earlier call installed are removed — calling
    twice does not duplicate lines; handlers installed by others are left alone), the level,
    and ``propagate = False``. The root logger is not touched. Returns the handler.
    """
    levelno = level_number(level)
    if stream is None:
        stream = sys.stderr
    logger = logging.getLogger("sandbox")
    for old in list(logger.handlers):
        if getattr(old, _HANDLER_MARK, False):
            logger.removeHandler(old)
            try:
                old.close()
            except (OSError, ValueError):
                pass
    handler = _JsonLinesHandler(stream)
    handler.setFormatter(JsonFormatter())
    setattr(handler, _HANDLER_MARK, True)
    logger.addHandler(handler)
    logger.setLevel(levelno)
    logger.propagate = False
    return handler
