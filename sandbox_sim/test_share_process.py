"""The confined share-server process (issue 13): the control channel's codec, a real child
over a real folder (no VM), holds over the channel, confinement evidence, the child dying.

The child is a real ``python -m sandbox.serving.shareserver`` started through the spawner
(:mod:`sandbox.lifeline`); the guest is the scripted one, speaking real 9P to the child's
socket. ``SANDBOX_TEST_PROBES=1`` (set here) compiles in the ``probe_open`` request.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import threading

import pytest

from sandbox.confine import landlock_abi
from sandbox.core.errors import NoSuchStep, NothingToUndo
from sandbox.core.safeguard import SafeguardConfig
from sandbox.limits import CONTROL_LINE_BYTES_MAX
from sandbox.serving.channel import BadLine, Channel, ChannelClosed, LineReader, RemoteError, decode_line, encode_line
from sandbox.session.runtime import Folder, Session, SessionError

pytestmark = pytest.mark.timeout(120)
WAIT_S = 60


@pytest.fixture(autouse=True)
def _probes(monkeypatch):
    monkeypatch.setenv("SANDBOX_TEST_PROBES", "1")


# ---------------------------------------------------------------------------- the codec


def test_a_line_over_the_limit_is_not_sent():
    assert encode_line({"event": "x", "v": "a" * 10}, limit=100).endswith(b"\n")
    with pytest.raises(ValueError, match="CONTROL_LINE_BYTES_MAX"):
        encode_line({"event": "x", "v": "a" * 200}, limit=100)


@pytest.mark.parametrize("line", [b"{not json", b"[1, 2]", b'{"id": "7", "op": "x"}', b'{"id": 1}',
                                  b'{"event": 3}', b'{"id": true, "ok": true}', b'{"id": 1, "op": "x", "args": []}',
                                  b"\xff\xfe"])
def test_bad_lines_are_refused_by_the_decoder(line):
    with pytest.raises(BadLine):
        decode_line(line)


def test_the_reader_splits_lines_and_refuses_an_overlong_one():
    r = LineReader(limit=16)
    assert r.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert r.feed(b":2}\n") == [b'{"b":2}']
    with pytest.raises(ValueError):
        r.feed(b"x" * 17)


def _pair(handler=None, **kw):
    a, b = socket.socketpair()
    events = queue.Queue()
    closed = queue.Queue()
    left = Channel(a, handler=handler, on_event=events.put, on_closed=closed.put, name="left", **kw).start()
    return left, b, events, closed


def test_a_bad_line_is_skipped_and_the_channel_goes_on():
    left, raw, events, _closed = _pair(handler=lambda op, args: {"echo": args})
    raw.sendall(b"garbage\n" + encode_line({"event": "hello"}) + encode_line({"id": 5, "op": "ping", "args": {"x": 1}}))
    assert events.get(timeout=WAIT_S) == {"event": "hello"}
    reply = json.loads(raw.makefile("rb").readline())
    assert reply == {"id": 5, "ok": True, "result": {"echo": {"x": 1}}}
    assert left.bad_lines == 1 and not left.closed
    left.close()


def test_an_overlong_line_closes_the_channel_and_fails_waiting_callers():
    left, raw, _events, closed = _pair(line_max=64)
    box = []
    t = threading.Thread(target=lambda: box.append(_catch(lambda: left.request("slow", timeout_s=WAIT_S))))
    t.start()
    raw.makefile("rb").readline()  # the request arrived: the caller waits
    raw.sendall(b"x" * 100)
    assert "over 64 bytes" in closed.get(timeout=WAIT_S)
    t.join(WAIT_S)
    assert isinstance(box[0], ChannelClosed)


def test_a_handler_error_comes_back_with_its_type_and_data():
    from sandbox.core.errors import NothingToUndo as E

    def handler(op, args):
        raise E("only 0 steps", available=0)

    a, b = socket.socketpair()
    left = Channel(a, handler=handler, name="left").start()
    right = Channel(b, name="right").start()
    with pytest.raises(RemoteError) as e:
        right.request("undo")
    assert (e.value.type, e.value.message, e.value.data) == ("NothingToUndo", "only 0 steps", {"available": 0})
    left.close()
    right.close()


def _catch(fn):
    try:
        return fn()
    except Exception as e:
        return e


def test_the_default_line_limit_is_the_named_one():
    assert Channel(socket.socketpair()[0]).line_max == CONTROL_LINE_BYTES_MAX


# ---------------------------------------------------------------------------- a real child


def make_session(tmp_path, files: int = 3, **kw) -> tuple:
    work = tmp_path / "proj"
    (work / "many").mkdir(parents=True)
    for i in range(files):
        (work / "many" / f"f{i}").write_bytes(b"%d" % i)
    (work / "keep.txt").write_text("v1")
    events = []
    s = Session([Folder(str(work), state_dir=str(tmp_path / "state"))], guest="scripted", share_servers="process",
                on_event=events.append, **kw)
    return work, s, events


def test_steps_rollback_and_history_go_through_the_child(tmp_path):
    work, s, events = make_session(tmp_path)
    with s:
        pid = s.status()["share_server_pid"]
        assert pid and pid != os.getpid()
        ws = s.workspaces[0]
        r = s.run("rm -r many; write keep.txt v2")
        assert r.exit_code == 0 and not (work / "many").exists() and (work / "keep.txt").read_text() == "v2"
        h = s.history()
        assert [(x["id"], x["command"], x["outcome"]) for x in h] == [(r.step_id, "rm -r many; write keep.txt v2",
                                                                       "completed")]
        assert ws.active_step_id is None and ws.undo_available
        out = s.undo(1)
        assert out["step_ids"] == [r.step_id]
        assert sorted(p.name for p in (work / "many").iterdir()) == ["f0", "f1", "f2"]
        assert (work / "keep.txt").read_text() == "v1"
        assert s.history() == []
        with pytest.raises(NothingToUndo):  # the core's error class, across the process boundary
            s.undo(1)
    assert any(e["type"] == "event.step_completed" and e["directory"] == 0 for e in events)
    assert any(e["type"] == "event.rollback" for e in events)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped with the session


def test_a_step_diff_is_computed_in_the_child_and_its_errors_keep_their_class(tmp_path):
    work, s, _ = make_session(tmp_path)
    with s:
        r = s.run("rm -r many; write keep.txt v2")
        d = s.workspaces[0].step_diff()
        assert d["step_id"] == r.step_id
        by = {p["path"]: p for p in d["paths"]}
        assert by["many/f1"]["change"] == "deleted" and by["keep.txt"]["change"] == "modified"
        assert "-v1" in by["keep.txt"]["diff"] and "+v2" in by["keep.txt"]["diff"]
        with pytest.raises(NoSuchStep):
            s.workspaces[0].step_diff(r.step_id + 7)


def test_safeguard_configuration_reaches_the_child(tmp_path):
    _work, s, _ = make_session(tmp_path)
    with s:
        ws = s.workspaces[0]
        ws.configure_safeguard(delete_threshold=2, timeout_s=5.0)
        assert (ws.safeguard_config.delete_threshold, ws.safeguard_config.timeout_s) == (2, 5.0)


@pytest.mark.skipif(landlock_abi() == 0, reason="Landlock is not available on this kernel")
def test_the_child_is_confined_to_its_shares_and_the_share_still_works(tmp_path):
    """The issue's evidence: a read outside the share, from inside the server, is EACCES."""
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    work, s, _ = make_session(tmp_path)
    with s:
        share = s._s.share
        assert share.ready["landlock_abi"] > 0 and share.ready["no_new_privs"]
        import errno

        assert share.probe_open(str(secret))["errno"] == errno.EACCES
        assert share.probe_open("/etc/passwd")["errno"] == errno.EACCES
        assert share.probe_open(str(work / "keep.txt"))["errno"] == 0
        assert s.run("write new.txt served").exit_code == 0  # the share serves writes …
        assert (work / "new.txt").read_text() == "served"
        assert s.run("cat keep.txt").exit_code == 0  # … and reads


def test_probes_are_not_compiled_in_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("SANDBOX_TEST_PROBES")
    _work, s, _ = make_session(tmp_path)
    with s:
        with pytest.raises(ValueError, match="unknown request"):
            s._s.share.probe_open("/etc/passwd")


def test_the_child_killed_mid_session_is_reported_and_the_next_start_recovers(tmp_path):
    work, s, events = make_session(tmp_path)
    s.start()
    try:
        ws = s.workspaces[0]
        sid = ws.begin_step("half done")  # a step open in the child, as during a command
        s._s.guest  # noqa: B018 — the guest is there
        from sandbox.ninep.client import Client
        from sandbox.scripted.guest import _MountFS

        c = Client.connect_unix(s._s.share.config["socket"])
        fs = _MountFS(c, "0")
        fs.unlink("keep.txt")
        c.close()
        assert not (work / "keep.txt").exists() and sid
        warned = threading.Event()
        s.on_event = lambda e: warned.set() if e["type"] == "event.warning" and "share server" in e["message"] else None
        os.kill(s._s.share.pid, signal.SIGKILL)
        assert warned.wait(WAIT_S)
        with pytest.raises(SessionError, match="share server process exited"):
            s.run("true")
        with pytest.raises(SessionError):
            s.history()
    finally:
        s.stop()
    events.clear()
    s.on_event = events.append
    with s:  # recovery on open: the half-done step is rolled back
        assert (work / "keep.txt").read_text() == "v1"
        assert s.workspaces[0].recovery is not None


# ---------------------------------------------------------------------------- API writes (FileService)


def test_api_writes_go_through_the_childs_undo_core_and_undo_exactly(tmp_path):
    from sandbox.files import FileService
    from sandbox.serving.remotefs import REMOTE_FS_CHUNK_BYTES

    work, s, _events = make_session(tmp_path)
    big = bytes(range(256)) * (2 * REMOTE_FS_CHUNK_BYTES // 256 + 3)  # more than two chunks
    with s:
        files = FileService(s)
        files.write_file("keep.txt", b"v2")
        h = files.open("big.bin", "w+")
        assert files.write(h, big) == len(big)
        files.seek(h, 0)
        assert files.read(h, len(big)) == big[:len(big)]  # read back through the child's handle
        files.close(h)
        assert files.remove("many", recursive=True) == 4
        files.mkdir("made/deep", parents=True)
        files.rename("keep.txt", "moved.txt")
        assert (work / "moved.txt").read_text() == "v2" and (work / "big.bin").read_bytes() == big
        steps = s.history()
        assert [x["type"] for x in steps] == ["api"] * 5
        assert all(x["outcome"] == "completed" for x in steps)
        s.undo(5)
        assert sorted(p.name for p in work.iterdir()) == ["keep.txt", "many"]
        assert (work / "keep.txt").read_text() == "v1"
        assert sorted(p.name for p in (work / "many").iterdir()) == ["f0", "f1", "f2"]
        assert s.history() == []


def test_an_api_write_tripping_a_safeguard_in_the_child_is_denied_and_rolled_back(tmp_path):
    from sandbox.api.errors import ApiError
    from sandbox.files import FileService

    work, s, _events = make_session(tmp_path, files=6, safeguard=SafeguardConfig(delete_threshold=3, timeout_s=60))
    with s:
        files = FileService(s)
        with pytest.raises(ApiError) as e:
            files.remove("many", recursive=True)
        assert e.value.code == "safeguard.denied"
        assert sorted(x.name for x in (work / "many").iterdir()) == [f"f{i}" for i in range(6)]  # rolled back
        assert s.workspaces[0].active_step_id is None
        files.write_file("after.txt", b"ok")  # the next API step is fine
        assert (work / "after.txt").read_text() == "ok"
        assert s.holds.pending() == []


def test_the_childs_handle_table_is_bounded(tmp_path):
    import errno

    from sandbox.serving.remotefs import REMOTE_HANDLES_MAX

    _work, s, _ = make_session(tmp_path)
    with s:
        p = s.provider("0")
        handles = [p.create(f"h{i}", 0o644, os.O_WRONLY)[0] for i in range(REMOTE_HANDLES_MAX)]
        with pytest.raises(OSError) as e:
            p.create("one-more", 0o644, os.O_WRONLY)
        assert e.value.errno == errno.EMFILE
        handles.pop().close()
        p.create("one-more", 0o644, os.O_WRONLY)[0].close()
        for fh in handles:
            fh.close()


def test_the_confined_child_watches_for_external_modifications(tmp_path):
    """The watcher starts after confinement (inotify's libc lookup is done before it) and
    an outside write becomes a barrier in the child's undo core."""
    work, s, events = make_session(tmp_path, external_policy="barrier")
    heard = threading.Event()
    s.on_event = lambda e: (events.append(e), heard.set() if e["type"] == "event.external_modification" else None)
    with s:
        (work / "outside.txt").write_text("not the sandbox")
        assert heard.wait(WAIT_S)
        assert s.workspaces[0].barriers()


def test_the_childs_log_records_are_logged_by_the_agent(tmp_path, caplog):
    """The child writes nothing to the stderr it shares with the agent (JSON Lines under
    ``sandbox serve``): its records arrive as events and are logged here."""
    caplog.set_level(logging.INFO, logger="sandbox")
    _work, s, _ = make_session(tmp_path)
    got = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if record.name == "sandbox.shareserver" and record.getMessage().startswith("share server: serving 1 "):
                got.set()

    seen = Seen()
    logging.getLogger("sandbox.shareserver").addHandler(seen)
    try:
        with s:
            assert got.wait(WAIT_S)
    finally:
        logging.getLogger("sandbox.shareserver").removeHandler(seen)


@pytest.mark.skipif(landlock_abi() == 0, reason="Landlock is not available on this kernel")
def test_each_folder_has_its_own_child_confined_to_it(tmp_path):
    """One share server per folder: their own pids (more than one core), each confined to its
    own folder — the other folder is EACCES from inside it — and each folder's steps undo."""
    import errno

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "keep.txt").write_text(d.name)
    s = Session([Folder(str(a), state_dir=str(tmp_path / "sa")), Folder(str(b), state_dir=str(tmp_path / "sb"))],
                guest="scripted", share_servers="process")
    with s:
        pids = s.status()["share_server_pids"]
        assert len(set(pids)) == 2 and os.getpid() not in pids
        first, second = s._s.shares[0], s._s.shares[1]
        assert first.probe_open(str(a / "keep.txt"))["errno"] == 0
        assert first.probe_open(str(b / "keep.txt"))["errno"] == errno.EACCES
        assert second.probe_open(str(a / "keep.txt"))["errno"] == errno.EACCES
        r = s.run("write /mnt/working/0/keep.txt A2; write /mnt/working/1/keep.txt B2")
        assert r.exit_code == 0 and (a / "keep.txt").read_text() == "A2" and (b / "keep.txt").read_text() == "B2"
        s.undo(1, folder=0)
        s.undo(1, folder=1)
        assert (a / "keep.txt").read_text() == "a" and (b / "keep.txt").read_text() == "b"


def test_a_steps_events_are_handled_before_the_call_that_made_them_returns(tmp_path):
    """As in thread mode: ``event.step_completed`` is out before ``run`` returns (the STDIO
    API sends it before the command's response), though it crossed the process boundary."""
    _work, s, events = make_session(tmp_path)
    with s:
        for k in range(1, 6):
            s.run(f"write f{k}.txt {k}")
            assert sum(e["type"] == "event.step_completed" for e in events) == k


def test_the_child_ignores_the_terminals_ctrl_c(tmp_path):
    """Ctrl-C goes to the terminal's whole process group; the agent decides what stops."""
    _work, s, _ = make_session(tmp_path)
    with s:
        with open(f"/proc/{s._s.share.pid}/status") as f:
            ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
        assert ignored & (1 << (signal.SIGINT - 1))


def test_the_child_imports_lazily_when_started_from_elsewhere(tmp_path, monkeypatch):
    """Started from another working directory (not on the child's path: ``-P``), the
    confined child still reads its own package — the watcher's module is imported after
    confinement — and the agent's working directory is not readable from inside it."""
    import errno

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "private.txt").write_text("cwd data")
    monkeypatch.chdir(elsewhere)
    work, s, _ = make_session(tmp_path, external_policy="barrier")
    with s:
        assert s.run("write new.txt ok").exit_code == 0 and (work / "new.txt").read_text() == "ok"
        if landlock_abi():
            assert s._s.share.probe_open(str(elsewhere / "private.txt"))["errno"] == errno.EACCES


def test_the_default_is_process_for_a_vm_and_thread_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv("SANDBOX_SHARE_SERVERS", raising=False)
    folder = [Folder(str(tmp_path))]
    assert Session(folder, guest="vm").share_servers == "process"
    assert Session(folder, guest="scripted").share_servers == "thread"
    assert Session(folder, guest=lambda run_dir: None).share_servers == "thread"
    monkeypatch.setenv("SANDBOX_SHARE_SERVERS", "thread")
    assert Session(folder, guest="vm").share_servers == "thread"
    assert Session(folder, guest="vm", share_servers="process").share_servers == "process"
