"""The host agent's JSON Lines logs (``sandbox.api.logs``, seed 003 §4.9).

Records go through the real ``sandbox`` logger tree into the handler ``setup_logging``
installs, written to a StringIO (or to the captured stderr, or a subprocess's stderr), and
every line is parsed back. Unknown ``request_id``/``step_id`` are *omitted* (never null).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime
from types import MappingProxyType

import pytest

from sandbox.api import logs
from sandbox.api.logs import (
    LEVELS,
    TRACE,
    JsonFormatter,
    bind_context,
    bound,
    setup_logging,
)

TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")
REQUIRED = {"timestamp": str, "level": str, "component": str, "message": str}
COMPONENTS = {"fs_backend", "control", "undo", "file_watcher", "stdio_api", "mcp", "session", "safeguard", "agent"}

# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def restore_sandbox_logger():
    """setup_logging changes the process-wide ``sandbox`` logger: put it back after each test."""
    logger = logging.getLogger("sandbox")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for h in list(logger.handlers):
        if h not in saved[0]:
            logger.removeHandler(h)
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


@pytest.fixture
def out():
    stream = io.StringIO()
    setup_logging("trace", stream)
    return stream


def parse(text: str) -> list[dict]:
    """Every line of ``text`` as JSON, checked for the required keys and their types."""
    assert text == "" or text.endswith("\n"), "every record ends its line"
    objs = []
    for line in text.splitlines():
        obj = json.loads(line)
        assert isinstance(obj, dict)
        for key, typ in REQUIRED.items():
            assert isinstance(obj.get(key), typ), (key, obj)
        assert TIMESTAMP.match(obj["timestamp"]), obj["timestamp"]
        assert obj["level"] in LEVELS, obj
        assert obj["component"] in COMPONENTS, obj
        for key in ("request_id", "step_id"):
            if key in obj:
                assert isinstance(obj[key], (str, int)) and obj[key] is not None, obj
        objs.append(obj)
    return objs


def one(stream: io.StringIO) -> dict:
    objs = parse(stream.getvalue())
    assert len(objs) == 1, stream.getvalue()
    stream.seek(0)
    stream.truncate()
    return objs[0]


# --------------------------------------------------------------------------- shape


def test_every_line_is_json_with_required_fields(out):
    log = logging.getLogger("sandbox.api.server")
    log.log(TRACE, "t")
    log.debug("d")
    log.info("i %s", "arg")
    log.warning("w")
    log.error("e")
    log.critical("c")
    objs = parse(out.getvalue())
    assert [o["level"] for o in objs] == ["trace", "debug", "info", "warn", "error", "error"]
    assert [o["message"] for o in objs] == ["t", "d", "i arg", "w", "e", "c"]
    assert all(o["component"] == "stdio_api" and o["logger"] == "sandbox.api.server" for o in objs)
    assert list(objs[0])[:4] == ["timestamp", "level", "component", "message"]


def test_timestamp_is_utc_with_microseconds(out):
    before = datetime.now(UTC)
    logging.getLogger("sandbox").info("now")
    ts = one(out)["timestamp"]
    assert TIMESTAMP.match(ts)
    parsed = datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    assert abs((parsed - before).total_seconds()) < 5


def test_timestamp_ignores_the_local_time_zone():
    created = datetime(2025, 3, 1, 12, 0, 1, 234567, tzinfo=UTC).timestamp()
    record = logging.LogRecord("sandbox.core", logging.INFO, __file__, 1, "m", (), None)
    record.created = created
    old = os.environ.get("TZ")
    os.environ["TZ"] = "NST+03:30"  # POSIX TZ: UTC-3:30, no tzdata needed
    time.tzset()
    try:
        assert time.timezone != 0
        line = JsonFormatter().format(record)
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()
    assert json.loads(line)["timestamp"] == "2025-03-01T12:00:01.234567Z"


# --------------------------------------------------------------------------- components


@pytest.mark.parametrize("name, component", [
    ("sandbox.ninep.server", "fs_backend"),
    ("sandbox.mounts", "fs_backend"),
    ("sandbox.fuse.ops", "fs_backend"),
    ("sandbox.fs_backend", "fs_backend"),
    ("sandbox.control", "control"),
    ("sandbox.vm.control", "control"),        # longer than sandbox.vm
    ("sandbox.vm.control.client", "control"),
    ("sandbox.vm", "session"),
    ("sandbox.vm.qemu", "session"),
    ("sandbox.core.store", "undo"),
    ("sandbox.undo", "undo"),
    ("sandbox.watch", "file_watcher"),
    ("sandbox.barriers.watch.inotify", "file_watcher"),
    ("sandbox.hostfs", "agent"),              # only sandbox.barriers.watch is mapped
    ("sandbox.api.server", "stdio_api"),
    ("sandbox.stdio", "stdio_api"),
    ("sandbox.mcp.tools", "mcp"),
    ("sandbox.session", "session"),
    ("sandbox.safeguard", "safeguard"),
    ("sandbox.cli", "agent"),
    ("sandbox", "agent"),
    ("sandbox.vmx", "agent"),                 # prefixes match whole dotted segments
    ("sandbox.corelib", "agent"),
])
def test_component_by_longest_prefix(out, name, component):
    logging.getLogger(name).info("x")
    assert one(out)["component"] == component


def test_longest_prefix_wins_whatever_the_order(monkeypatch):
    # COMPONENTS lists sandbox.vm.control before sandbox.vm; reversed, a first-match lookup would say "session"
    monkeypatch.setattr(logs, "COMPONENTS", MappingProxyType(dict(reversed(list(logs.COMPONENTS.items())))))
    logs.component_for.cache_clear()
    try:
        assert logs.component_for("sandbox.vm.control.client") == "control"
        assert logs.component_for("sandbox.barriers.watch") == "file_watcher"
        assert logs.component_for("sandbox.vm.qemu") == "session"
    finally:
        logs.component_for.cache_clear()


def test_component_override_in_extra(out):
    log = logging.getLogger("sandbox.core.workspace")
    log.info("x", extra={"component": "mcp"})
    assert one(out)["component"] == "mcp"
    log.info("x", extra={"component": "not-a-component"})  # ignored: the key stays in the closed set
    assert one(out)["component"] == "undo"


# --------------------------------------------------------------------------- request_id / step_id / fields


def test_ids_are_omitted_when_unknown(out):
    logging.getLogger("sandbox.api").info("no ids")
    obj = one(out)
    assert "request_id" not in obj and "step_id" not in obj


def test_ids_from_bound_nest_and_reset(out):
    log = logging.getLogger("sandbox.api")
    with bound(request_id="r1"):
        log.info("a")
        obj = one(out)
        assert obj["request_id"] == "r1" and "step_id" not in obj
        with bound(step_id="s9", request_id=7):
            log.info("b")
            obj = one(out)
            assert obj["request_id"] == 7 and obj["step_id"] == "s9"
        log.info("c")
        obj = one(out)
        assert obj["request_id"] == "r1" and "step_id" not in obj
    log.info("d")
    obj = one(out)
    assert "request_id" not in obj and "step_id" not in obj


def test_ids_from_extra_win_over_context(out):
    log = logging.getLogger("sandbox.api")
    log.info("x", extra={"request_id": "e1", "step_id": "e2"})
    obj = one(out)
    assert (obj["request_id"], obj["step_id"]) == ("e1", "e2")
    with bound(request_id="ctx", step_id="ctx-step"):
        log.info("x", extra={"request_id": "explicit"})
        obj = one(out)
        assert obj["request_id"] == "explicit" and obj["step_id"] == "ctx-step"
        log.info("x", extra={"step_id": None})  # explicitly unknown for this record
        obj = one(out)
        assert obj["request_id"] == "ctx" and "step_id" not in obj


def test_structured_fields_from_bound_and_extra(out):
    log = logging.getLogger("sandbox.mcp")
    with bound(tool="write_file", path="/ctx"):
        log.info("x", extra={"fields": {"path": "/fields", "n": 1}, "size": 3})
        obj = one(out)
    assert obj["tool"] == "write_file" and obj["path"] == "/fields" and obj["n"] == 1 and obj["size"] == 3
    log.info("x", extra={"fields": {"path": "/a"}, "path": "/direct"})
    assert one(out)["path"] == "/direct"
    log.info("after")
    assert "tool" not in one(out)


def test_field_named_like_a_core_key_does_not_replace_it(out):
    logging.getLogger("sandbox.mcp").info("real", extra={"fields": {"timestamp": "bogus", "level": "nope"},
                                                         "logger": "x"})
    obj = one(out)
    assert obj["message"] == "real" and obj["level"] == "info" and obj["logger"] == "sandbox.mcp"
    assert obj["field_timestamp"] == "bogus" and obj["field_level"] == "nope" and obj["field_logger"] == "x"


def test_bound_refuses_core_keys():
    with pytest.raises(TypeError, match="message"), bound(message="x"):
        pass


def test_threads_need_bind_context(out):
    log = logging.getLogger("sandbox.session")
    with bound(request_id="r-thread", step_id="s-thread"):
        t1 = threading.Thread(target=bind_context(log.info, "wrapped"))
        t2 = threading.Thread(target=log.info, args=("bare",))
    for t in (t1, t2):
        t.start()
        t.join()
    objs = {o["message"]: o for o in parse(out.getvalue())}
    assert objs["wrapped"]["request_id"] == "r-thread" and objs["wrapped"]["step_id"] == "s-thread"
    assert "request_id" not in objs["bare"]  # threads do not inherit contextvars


def test_bind_context_can_run_twice():
    seen = []
    with bound(request_id="again"):
        fn = bind_context(lambda: seen.append(logs.request_id.get()))
    fn()
    fn()
    assert seen == ["again", "again"] and logs.request_id.get() is None


# --------------------------------------------------------------------------- levels


def test_info_hides_debug_and_trace():
    stream = io.StringIO()
    setup_logging("info", stream)
    log = logging.getLogger("sandbox.core")
    log.log(TRACE, "t")
    log.debug("d")
    log.info("i")
    assert [o["message"] for o in parse(stream.getvalue())] == ["i"]


def test_trace_level_shows_trace():
    stream = io.StringIO()
    setup_logging("TRACE", stream)
    logging.getLogger("sandbox.core").log(TRACE, "t")
    assert [(o["level"], o["message"]) for o in parse(stream.getvalue())] == [("trace", "t")]
    # both names parse (setLevel("TRACE") and "trace"); the name 5 prints under is global and
    # other libraries set it too (uvicorn, imported by the MCP and UI servers: "TRACE"), so
    # the JSON lines never use it (their level names are their own)
    assert TRACE == 5 and logging.getLevelName("trace") == TRACE and logging.getLevelName("TRACE") == TRACE


@pytest.mark.parametrize("name, shown", [
    ("error", ["error"]),
    ("warn", ["warn", "error"]),
    ("Warning", ["warn", "error"]),
    ("DEBUG", ["debug", "info", "warn", "error"]),
])
def test_level_names(name, shown):
    stream = io.StringIO()
    setup_logging(name, stream)
    log = logging.getLogger("sandbox.core")
    for level in (TRACE, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        log.log(level, "m")
    assert [o["level"] for o in parse(stream.getvalue())] == shown


@pytest.mark.parametrize("bad", ["critical", "verbose", "", 10])
def test_unknown_level_is_a_value_error_listing_choices(bad):
    with pytest.raises(ValueError) as e:
        setup_logging(bad, io.StringIO())
    assert all(choice in str(e.value) for choice in LEVELS)


def test_warning_is_written_warn(out):
    logging.getLogger("sandbox.safeguard").warning("careful")
    obj = one(out)
    assert obj["level"] == "warn" and "warning" not in out.getvalue()


# --------------------------------------------------------------------------- robustness


def test_exception_field(out):
    log = logging.getLogger("sandbox.undo")
    try:
        _ = 1 / 0
    except ZeroDivisionError:
        log.exception("boom")
    text = out.getvalue()
    obj = one(out)
    assert obj["level"] == "error" and obj["message"] == "boom"
    assert obj["exception"].startswith("Traceback") and "ZeroDivisionError" in obj["exception"]
    assert text.count("\n") == 1
    log.info("no exception")
    assert "exception" not in one(out)


class Opaque:
    def __repr__(self):
        return "<Opaque>"


class BrokenRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


def test_non_serialisable_extras_do_not_break_the_line(out):
    cyclic: list = []
    cyclic.append(cyclic)
    logging.getLogger("sandbox.control").info("x", extra={
        "obj": Opaque(), "raw": b"\x00\xff", "nan": math.nan, "inf": math.inf, "tags": {"a"},
        "nested": {"k": [1, Opaque(), {2: "two"}]}, "broken": BrokenRepr(), "cyclic": cyclic,
        "fields": {"when": datetime(2025, 1, 1)}})
    obj = one(out)
    assert obj["message"] == "x"
    assert obj["obj"] == "<Opaque>" and obj["raw"] == repr(b"\x00\xff")
    assert obj["nan"] == "nan" and obj["inf"] == "inf" and obj["tags"] == ["a"]
    assert obj["nested"] == {"k": [1, "<Opaque>", {"2": "two"}]}
    assert obj["broken"].startswith("<unrepresentable BrokenRepr")
    assert isinstance(obj["cyclic"], list)
    assert obj["when"] == repr(datetime(2025, 1, 1))


def test_a_record_that_cannot_be_formatted_still_gives_a_valid_line():
    # set up here, not in a fixture: pytest attaches its own capture handlers (which fail the
    # test on a bad record) to the loggers that are non-propagating when a test phase begins
    out = io.StringIO()
    setup_logging("info", out)
    logging.getLogger("sandbox.core").info("%d items", "not a number")
    obj = one(out)
    assert obj["message"] == "%d items" and obj["level"] == "info" and obj["component"] == "undo"
    assert "TypeError" in obj["format_error"]


def test_formatter_never_raises_even_on_a_mangled_record():
    record = logging.LogRecord("sandbox.core", logging.INFO, __file__, 1, BrokenRepr(), ("x",), None)
    record.created = "not a time"  # type: ignore[assignment]
    obj = json.loads(JsonFormatter().format(record))
    assert TIMESTAMP.match(obj["timestamp"]) and obj["level"] == "info" and "format_error" in obj


def test_line_breaks_in_the_message_stay_on_one_line(out):
    message = "a\nb\r\nc\u2028d\u2029e\x85f\x0bg\x0ch\x1ci"
    logging.getLogger("sandbox.api").info(message, extra={"note": "x\ny"})
    text = out.getvalue()
    assert text.count("\n") == 1 and len(text.splitlines()) == 1 and text.isascii()
    obj = one(out)
    assert obj["message"] == message and obj["note"] == "x\ny"


# --------------------------------------------------------------------------- setup


def test_setup_twice_does_not_duplicate_lines():
    logger = logging.getLogger("sandbox")
    foreign = logging.NullHandler()
    logger.addHandler(foreign)
    first = io.StringIO()
    h1 = setup_logging("info", first)
    second = io.StringIO()
    h2 = setup_logging("info", second)
    logging.getLogger("sandbox.core").info("once")
    assert first.getvalue() == ""
    assert [o["message"] for o in parse(second.getvalue())] == ["once"]
    assert h2 in logger.handlers and h1 not in logger.handlers and foreign in logger.handlers
    assert logger.propagate is False


def test_root_logger_is_left_alone():
    root = logging.getLogger()
    before = list(root.handlers)
    seen: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record)

    collect = Collect()
    root.addHandler(collect)
    try:
        setup_logging("info", io.StringIO())
        assert [h for h in root.handlers if h is not collect] == before
        logging.getLogger("sandbox.core").info("not for root")
    finally:
        root.removeHandler(collect)
    assert seen == []


def test_default_stream_is_stderr_at_call_time_and_stdout_is_untouched(capsys):
    setup_logging("debug")  # capsys has replaced sys.stderr by now
    log = logging.getLogger("sandbox.vm")
    log.debug("to stderr")
    try:
        raise KeyError("k")
    except KeyError:
        log.exception("with traceback")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert [o["message"] for o in parse(captured.err)] == ["to stderr", "with traceback"]


def test_subprocess_writes_only_json_lines_to_stderr(tmp_path):
    script = textwrap.dedent("""
        import logging
        from sandbox.api.logs import TRACE, bound, setup_logging
        setup_logging("trace")
        log = logging.getLogger("sandbox.api.server")
        with bound(request_id="r1", step_id="s1"):
            log.log(TRACE, "trace\\nline")
            log.warning("w %s", object())
            try:
                {}["missing"]
            except KeyError:
                log.exception("failed")
        log.info("bad %d", "x")
        logging.getLogger("sandbox.ninep").error("fs", extra={"blob": b"\\xff"})
    """)
    r = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, timeout=60,
                       cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert r.stdout == b""
    objs = parse(r.stderr.decode("ascii"))
    assert [o["level"] for o in objs] == ["trace", "warn", "error", "info", "error"]
    assert [o.get("request_id") for o in objs] == ["r1", "r1", "r1", None, None]
    assert "KeyError" in objs[2]["exception"] and "format_error" in objs[3]
    assert objs[4]["component"] == "fs_backend"
