"""The STDIO API, spoken to a real ``sandbox serve`` subprocess over its stdin/stdout.

The guest is the scripted test double (``--guest scripted``): its commands run over the
real 9P server, providers, undo core, safeguards and watcher — only the VM is replaced.
``e2e/test_stdio_api_vm.py`` runs the same tests against a real VM (fixture ``guest``).
Every message the agent emits is validated against the shipped JSON Schema as it
arrives; every test ends by checking that nothing violated it.
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import stat

import pytest

from sandbox.api import errors, schema
from sandbox_sim import oracle
from sandbox_sim.api_client import ApiClient, Commands
from sandbox_sim.budget import scale

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def guest() -> str:
    return "scripted"


@pytest.fixture
def cmds(guest) -> Commands:
    return Commands(guest)


@pytest.fixture
def state_home(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    return str(d)


@pytest.fixture
def project(tmp_path):
    p = tmp_path / "project"
    (p / "src").mkdir(parents=True)
    (p / "src" / "app.py").write_text("print('hello')\n")
    (p / "README.md").write_text("# project\n")
    (p / "victims").mkdir()
    for i in range(20):
        (p / "victims" / f"v{i:02d}").write_text(f"victim {i}\n")
    return p


@pytest.fixture
def api(guest, state_home):
    clients = []

    def make(*args, **kw):
        c = ApiClient(*args, guest=guest, env={"XDG_STATE_HOME": state_home}, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        if c.proc.poll() is None:
            c.close()
        c.check()


def start(c: ApiClient, project, **payload) -> dict:
    payload.setdefault("working_directories", [{"path": str(project), "label": "project"}])
    return c.ok("session.start", payload, timeout_s=400)


# ---------------------------------------------------------------------------- protocol


def test_hello_negotiates_the_version_and_requests_before_it_are_accepted(api, project):
    c = api()
    assert c.ok("session.status")["state"] == "not_started"  # before hello: accepted
    r = c.ok("hello", {"protocol_version": 1})
    assert r["protocol_version"] == 1 and r["supported_versions"] == [1] and r["agent_version"]
    assert set(r["operations"]) == set(schema.REQUESTS) and set(r["events"]) == set(schema.EVENTS)
    e = c.error("hello", {"protocol_version": 99})
    assert e["code"] == "protocol.unsupported_version" and e["data"]["supported_versions"] == [1]
    assert c.close() == 0


def test_malformed_input_gets_error_responses_and_never_kills_the_agent(api):
    c = api("--max-line-bytes", "4096")
    c.send_raw(b"this is not json\n")
    c.send_raw(b"[1, 2, 3]\n")
    c.send_raw(b"\xff\xfe\x00garbage\n")
    c.send_raw(b"[" * 4000 + b"\n")  # nesting past the parser's recursion limit: refused before parsing
    c.send_raw(b'{"type": "fs.read", "request_id": "big", "payload": {"path": "' + b"a" * 10_000 + b'"}}\n')
    c.send_raw(json.dumps({"type": "no.such.op", "request_id": "u"}).encode() + b"\n")
    c.send_raw(json.dumps({"request_id": "nt"}).encode() + b"\n")
    c.send_raw(json.dumps({"type": "hello", "request_id": "np", "payload": {}}).encode() + b"\n")
    c.send_raw(json.dumps({"type": "hello", "request_id": "xf", "payload": {"protocol_version": 1, "x": 1}}).encode() + b"\n")
    c.send_raw(json.dumps({"type": "hello", "request_id": {"not": "an id"}, "payload": {"protocol_version": 1}}).encode() + b"\n")
    c.send_raw(json.dumps({"type": "fs.read", "request_id": "wt", "payload": {"path": 7}}).encode() + b"\n")
    r = c.response("np")
    assert r["error"]["code"] == "protocol.invalid_request" and "protocol_version" in r["error"]["message"]
    assert c.response("xf")["error"]["code"] == "protocol.invalid_request"
    assert c.response("wt")["error"]["data"]["path"] == "$.payload.path"
    unknown = c.response("u")["error"]
    assert unknown["code"] == "protocol.unknown_type" and "fs.read" in unknown["data"]["known"]
    assert c.response("nt")["error"]["code"] == "protocol.invalid_request"
    codes = [m["error"]["code"] for m in c.messages if m.get("status") == "error" and m["request_id"] is None]
    assert codes.count("protocol.invalid_json") == 2 and "protocol.not_an_object" in codes
    assert codes.count("protocol.too_deep") == 1
    assert "protocol.line_too_long" in codes and "protocol.invalid_request" in codes  # the bad request_id
    assert c.ok("hello", {"protocol_version": 1})["protocol_version"] == 1  # still alive and answering
    assert c.close() == 0


def test_every_operation_needs_a_session_except_hello_and_status(api):
    c = api()
    payloads = {"undo.rollback": {}, "undo.history": {}, "undo.configure": {"max_step_count": 5}, "undo.discard": {},
                "agent.execute": {"command": "true"}, "agent.prompt": {"text": "hi"}, "fs.list": {},
                "fs.read": {"path": "x"}, "fs.status": {}, "safeguard.configure": {"delete_threshold": 3},
                "session.stop": {}, "session.reset": {}, "session.restrict": {"readonly": True}}
    for t, p in payloads.items():
        assert c.error(t, p)["code"] == "session.not_started", t
    assert c.error("safeguard.confirm", {"safeguard_id": "sg_x", "action": "allow"})["code"] == "safeguard.unknown_id"


STDIO_DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "stdio-api.md")


def test_every_error_code_is_in_the_protocol_reference():
    with open(STDIO_DOC) as f:
        doc = f.read()
    missing = [code for code in errors.CODES if f"`{code}`" not in doc]
    assert not missing, f"docs/stdio-api.md lacks error codes: {missing}"


def test_the_protocol_reference_documents_every_operation_and_event_and_embeds_the_schema():
    with open(STDIO_DOC) as f:
        doc = f.read()
    missing = [t for t in [*schema.REQUESTS, *schema.EVENTS] if f"| `{t}` |" not in doc]
    assert not missing, f"docs/stdio-api.md's tables lack: {missing}"
    start = doc.index("<!-- protocol.schema.json -->")
    block = doc[start:].split("```json\n", 1)[1].split("```", 1)[0]
    assert json.loads(block) == schema.shipped(), "re-embed: python -m sandbox.api.schema --doc"


def test_the_shipped_schema_is_current_and_valid():
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(schema.shipped())
    assert schema.shipped() == json.loads(json.dumps(schema.document())), "run: python -m sandbox.api.schema --write"


# ---------------------------------------------------------------------------- sessions


def test_session_start_status_stop_and_directories(api, project, tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "shared.txt").write_text("shared\n")
    c = api()
    r = start(c, project, working_directories=[{"path": str(project), "label": "project"},
                                               {"path": str(lib), "label": "lib", "access": "read_only"}])
    assert [(f["label"], f["guest_path"], f["access"]) for f in r["folders"]] == [
        ("project", "/mnt/working/0", "read_write"), ("lib", "/mnt/working/1", "read_only")]
    assert c.error("session.start", {"working_directories": [{"path": str(project)}]})["code"] == "session.already_started"
    st = c.ok("session.status")
    assert st["state"] == "idle" and st["filesystem_backend"] == "9p" and len(st["folders"]) == 2
    assert st["virtiofs_direct_io"] is None  # only a virtio-fs share has a direct-I/O mode
    assert c.ok("fs.read", {"path": "shared.txt", "directory": "lib"})["data"] == "shared\n"
    assert c.ok("fs.read", {"path": "/mnt/working/1/shared.txt"})["data"] == "shared\n"
    assert c.error("undo.history", {"directory": "lib"})["code"] == "session.read_only_directory"
    e = c.error("undo.history", {"directory": "nope"})
    assert e["code"] == "session.unknown_directory" and set(e["data"]["known"]) >= {"project", "lib"}
    assert c.ok("undo.history", {"directory": 0})["directory"] == 0
    c.ok("session.stop")
    assert c.ok("session.status")["state"] == "not_started"
    assert c.close() == 0


def test_a_working_directory_may_name_its_undo_store(api, project, tmp_path, cmds):
    """``working_directories[].state_dir`` (what `sandbox run --state-dir` / `sandbox ui
    --state-dir` set): the folder's history is kept there, and `sandbox history` finds it."""
    import subprocess
    import sys

    store = tmp_path / "elsewhere" / "store"
    c = api()
    assert c.error("session.start", {"working_directories": [{"path": str(project), "state_dir": "relative/store"}]}
                   )["code"] == "protocol.invalid_request"
    start(c, project, working_directories=[{"path": str(project), "state_dir": str(store)}])
    c.ok("agent.execute", {"command": cmds.write("named-store.txt", "x")})
    c.ok("session.stop")
    assert c.close() == 0
    r = subprocess.run([sys.executable, "-m", "sandbox", "history", "--workdir", str(project), "--state-dir", str(store),
                        "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "named-store.txt" in r.stdout, r.stdout + r.stderr


def test_as_root_is_a_session_option_reported_by_status(api, project):
    """Commands run as the unprivileged guest user unless session.start asks for root (issue 13)."""
    c = api()
    start(c, project)
    assert c.ok("session.status")["as_root"] is False
    c.ok("session.stop")
    start(c, project, as_root=True)
    assert c.ok("session.status")["as_root"] is True
    assert c.close() == 0


def test_session_reset_starts_the_same_session_fresh(api, project, cmds):
    c = api()
    start(c, project, vm_mode="persistent", working_directories=[{"path": str(project), "label": "p"}])
    c.ok("agent.execute", {"command": cmds.write("kept.txt", "x")})
    r = c.ok("session.reset", timeout_s=400)
    assert [f["label"] for f in r["folders"]] == ["p"]
    st = c.ok("session.status")
    assert st["state"] == "idle" and st["vm_mode"] == "persistent"
    assert c.ok("undo.history")["steps"][0]["paths"]  # the undo history is the folder's, not the VM's
    c.ok("undo.rollback", {})
    assert not (project / "kept.txt").exists()


@pytest.mark.parametrize("payload, code", [
    ({"working_directories": [{"path": "/nonexistent/folder"}]}, "session.invalid_config"),
    ({"working_directories": [{"path": "relative/path"}]}, "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp"}] * 9}, "protocol.invalid_request"),
    ({}, "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp", "target": "/mnt/a"}, {"path": "/usr", "target": "/mnt/a", "access": "read_only"}]},
     "session.invalid_mounts"),
    ({"working_directories": [{"path": "/tmp"}], "mounts": [{"path": "/mnt/x", "files": {"a": "!!notbase64"}}]},
     "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp"}], "mounts": [{"source": "/tmp", "target": "/c"}]}, "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp"}], "network_policy": "allowlist"}, "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp"}], "safeguard": {"delete_threshold": 0}}, "protocol.invalid_request"),
    ({"working_directories": [{"path": "/tmp"}, {"path": "/tmp/"}]}, "session.invalid_config"),
    ({"root": "/tmp", "mounts": [{"source": "/tmp", "target": "/again"}]}, "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp"}], "as_root": "yes"}, "protocol.invalid_request"),
    # -- virtio-fs (issue 17): a transport of VM guests only
    ({"working_directories": [{"path": "/tmp"}], "share": "virtiofs"}, "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp"}], "share": "virtiofs", "guest": "local"}, "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp"}], "share": "nfs"}, "protocol.invalid_request"),
    ({"working_directories": [{"path": "/tmp"}], "share": "9p", "virtiofs_direct_io": "all"}, "session.invalid_config"),
    ({"working_directories": [{"path": "/tmp"}], "virtiofs_direct_io": "reads"}, "protocol.invalid_request"),
])
def test_bad_session_configs_are_clear_errors_and_leave_nothing_running(api, payload, code):
    c = api()
    e = c.error("session.start", payload)
    assert e["code"] == code, e
    assert c.ok("session.status")["state"] == "not_started"


# ---------------------------------------------------------------------------- commands and undo


def test_execute_streams_output_then_step_completed_then_the_response(api, project, cmds):
    c = api()
    start(c, project)
    before = oracle.snapshot_dir(str(project))
    m = c.mark()
    rid = c.send("agent.execute", {"command": f"{cmds.echo('hi there')}; {cmds.write('out.txt', 'data')}; {cmds.rm_r('victims')}"})
    resp = c.response(rid)
    assert resp["status"] == "ok" and resp["payload"]["exit_code"] == 0
    sid = resp["payload"]["step_id"]
    out = [e for e in c.events("event.terminal_output", m) if e.get("request_id") == rid]
    assert "".join(e["payload"]["data"] for e in out) == "hi there\n"
    done = c.wait_event("event.step_completed", lambda p: p["step_id"] == sid, m)
    assert "out.txt" in done["payload"]["affected_paths"] and done["payload"]["exit_code"] == 0
    order = [x for x in c.messages[m:] if x in out or x is done or x is resp]
    assert order[-1] is resp and order.index(done) > max(order.index(o) for o in out)
    hist = c.ok("undo.history")["steps"]
    assert hist[0]["id"] == sid and hist[0]["type"] == "command" and "out.txt" in hist[0]["paths"]
    r = c.ok("undo.rollback", {"count": 1})
    assert r["step_ids"] == [sid] and r["paths_restored"] >= 2
    assert oracle.snapshot_dir(str(project)) == before
    assert c.error("undo.rollback", {"count": 5})["code"] == "undo.nothing_to_undo"


def test_failing_and_busy_and_cancelled_commands(api, project, cmds):
    c = api()
    start(c, project)
    assert c.ok("agent.execute", {"command": cmds.exit(3)})["exit_code"] == 3
    m = c.mark()
    rid = c.send("agent.execute", {"command": f"{cmds.echo('started')}; {cmds.wait()}"})
    c.wait_event("event.terminal_output", lambda p: "started" in p["data"], m)
    st = c.ok("session.status")
    assert st["state"] == "running"
    assert st["running"] == {"request_id": rid, "client": "stdio", "command": f"{cmds.echo('started')}; {cmds.wait()}"}
    e = c.error("agent.execute", {"command": "true"})
    assert e["code"] == "agent.busy" and e["data"]["request_id"] == rid
    assert c.error("agent.cancel", {"request_id": "someone-else"})["code"] == "agent.not_running"
    assert c.ok("agent.cancel", {"request_id": rid})["cancelled"] is True
    r = c.response(rid)
    assert r["status"] == "ok" and r["payload"]["cancelled"] is True and r["payload"]["exit_code"] != 0
    assert c.ok("session.status")["state"] == "idle"


def test_a_guest_that_dies_is_an_error_event_and_the_session_can_be_restarted(api, project, cmds):
    c = api()
    start(c, project)
    m = c.mark()
    e = c.error("agent.execute", {"command": f"{cmds.write('a.txt', 'x')}; {cmds.crash()}"}, timeout_s=120)
    assert e["code"] == "session.guest_failed"
    assert c.events("event.error", m)[0]["payload"]["code"] == "session.guest_failed"
    assert c.ok("session.status")["state"] == "error"
    assert "a.txt" in c.ok("undo.history")["steps"][0]["paths"]  # the step is closed and undoable
    c.ok("undo.rollback", {})
    c.ok("session.stop")
    start(c, project)
    assert c.ok("agent.execute", {"command": cmds.echo("back")})["exit_code"] == 0


def test_agent_prompt(api, project):
    c = api()
    start(c, project)
    assert c.error("agent.prompt", {"text": "hello"})["code"] == "agent.not_configured"
    c.ok("session.stop")
    start(c, project, agent={"command": "echo"})
    m = c.mark()
    r = c.ok("agent.prompt", {"text": "fix the bug"})
    assert r["exit_code"] == 0
    text = "".join(e["payload"]["data"] for e in c.events("event.agent_output", m))
    assert text == "fix the bug\n"
    assert not c.events("event.terminal_output", m)


def test_undo_configure_and_discard(api, project, cmds):
    c = api()
    start(c, project, undo_limits={"max_step_count": 50})
    r = c.ok("undo.configure", {"max_step_count": 2})
    assert r["limits"]["max_step_count"] == 2
    m = c.mark()
    for i in range(3):
        c.ok("agent.execute", {"command": cmds.write(f"f{i}", str(i))})
    assert len(c.ok("undo.history")["steps"]) == 2
    assert any("evicted" in e["payload"]["message"] for e in c.events("event.warning", m))
    c.ok("undo.discard")
    assert c.ok("undo.history")["steps"] == []


# ---------------------------------------------------------------------------- files


def test_fs_list_read_and_containment(api, project, tmp_path):
    (project / "bin.dat").write_bytes(bytes(range(256)))
    os.symlink("/etc/passwd", project / "escape")
    os.mkfifo(project / "fifo")
    (project / "Readme.md").write_text("case\n")
    (tmp_path / "secret").write_text("secret\n")
    c = api()
    start(c, project)
    ls = c.ok("fs.list")
    names = {e["name"]: e for e in ls["entries"]}
    assert ls["path"] == "/mnt/working/0" and names["src"]["type"] == "dir"
    assert names["escape"]["type"] == "symlink" and names["escape"]["target"] == "/etc/passwd"
    assert names["fifo"]["type"] == "other" and names["README.md"]["size"] == len("# project\n")
    assert [e["name"] for e in c.ok("fs.list", {"path": "src"})["entries"]] == ["app.py"]
    r = c.ok("fs.read", {"path": "src/app.py"})
    assert r["data"] == "print('hello')\n" and r["eof"] and r["encoding"] == "utf-8"
    b = c.ok("fs.read", {"path": "bin.dat"})
    assert b["encoding"] == "base64" and base64.b64decode(b["data"]) == bytes(range(256))
    part = c.ok("fs.read", {"path": "/mnt/working/0/bin.dat", "offset": 10, "length": 5, "encoding": "base64"})
    assert base64.b64decode(part["data"]) == bytes(range(10, 15)) and part["eof"] is False
    expect = {"missing.txt": "fs.not_found", "src": "fs.is_a_directory", "escape": "fs.symlink", "fifo": "fs.not_a_file",
              "/etc/passwd": "fs.outside_mounts", "../secret": "fs.outside_mounts", "/mnt/working/0/../../../etc/passwd":
              "fs.outside_mounts", "escape/x": "fs.symlink", "README.md/x": "fs.not_a_directory"}
    for path, code in expect.items():
        e = c.error("fs.read", {"path": path})
        assert e["code"] == code, (path, e)
    assert c.error("fs.read", {"path": "x", "length": (16 << 20) + 1})["code"] == "fs.too_large"
    assert c.error("fs.list", {"path": "README.md"})["code"] == "fs.not_a_directory"
    kinds = {(w["kind"], w["path"]) for w in c.ok("fs.status")["warnings"]}
    assert ("symlink_outside", "escape") in kinds and ("special_file", "fifo") in kinds
    assert any(k == "case_collision" for k, _ in kinds)


def test_in_memory_mounts_and_python_path(api, project, cmds, state_home):
    c = api()
    hello = base64.b64encode(b"#!/bin/sh\necho tool\n").decode()
    start(c, project, mounts=[{"path": "/mnt/tools", "files": {"hello.sh": hello, "lib/mod.py": base64.b64encode(b"X = 1\n").decode()}}],
          python_path=["/mnt/tools/lib", "/opt/other"])
    st = c.ok("session.status")
    assert st["mounts"] == [{"guest_path": "/mnt/tools", "read_only": True, "label": "", "files": 2, "live": False}]
    assert c.ok("fs.read", {"path": "/mnt/tools/lib/mod.py"})["data"] == "X = 1\n"
    assert {e["name"] for e in c.ok("fs.list", {"path": "/mnt/tools"})["entries"]} == {"hello.sh", "lib"}
    m = c.mark()
    r = c.ok("agent.execute", {"command": "cat /mnt/tools/hello.sh; echo $PYTHONPATH"})
    out = "".join(e["payload"]["data"] for e in c.events("event.terminal_output", m) if e["payload"]["stream"] == "stdout")
    assert r["exit_code"] == 0 and out == "#!/bin/sh\necho tool\n/mnt/tools/lib:/opt/other\n"
    assert c.ok("agent.execute", {"command": cmds.write("/mnt/tools/new", "x")})["exit_code"] != 0  # read-only share
    hist = c.ok("undo.history")["steps"]
    assert all(not any(p.startswith("/mnt/tools") or "hello.sh" in p for p in s["paths"]) for s in hist)
    # never exported: nothing of the tree lands in the undo store or the project
    stored = [os.path.join(d, f) for d, _, fs in os.walk(state_home) for f in fs]
    assert not any(open(p, "rb").read().find(b"echo tool") >= 0 for p in stored if os.path.getsize(p) < 1 << 20)
    assert not (project / "hello.sh").exists()


def test_docker_style_root_with_bind_mounts(api, project, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "pkg").write_text("cached\n")
    (project / "cache").mkdir()  # the mount point exists in the root
    c = api()
    r = c.ok("session.start", {"root": str(project), "mounts": [{"source": str(cache), "target": "/cache", "readonly": True}]},
             timeout_s=400)
    assert [(f["guest_path"], f["access"]) for f in r["folders"]] == [("/mnt/working/0", "read_write"),
                                                                       ("/mnt/working/0/cache", "read_only")]
    assert c.ok("fs.read", {"path": "/mnt/working/0/cache/pkg"})["data"] == "cached\n"  # longest prefix wins
    assert c.ok("fs.read", {"path": "cache/pkg"})["data"] == "cached\n"
    c.ok("session.stop")
    e = c.error("session.start", {"root": str(project), "mounts": [{"source": str(cache), "target": "/nomount"}]})
    assert e["code"] == "session.invalid_mounts" and "nomount" in e["message"]


def test_restrict_narrows_and_never_widens(api, project, cmds):
    c = api()
    start(c, project)
    r = c.ok("session.restrict", {"path": "/mnt/working/0/src"})
    assert r == {"view": "/mnt/working/0/src", "read_only": False}
    assert c.ok("fs.read", {"path": "app.py"})["data"] == "print('hello')\n"  # relative to the view
    assert c.error("fs.read", {"path": "/mnt/working/0/README.md"})["code"] == "fs.access_denied"
    assert c.error("session.restrict", {"path": "/mnt/working/0"})["code"] == "session.widen_denied"
    m = c.mark()
    r = c.ok("agent.execute", {"command": "cat /mnt/working/0/src/app.py; cat /mnt/working/0/README.md"})
    out = "".join(e["payload"]["data"] for e in c.events("event.terminal_output", m))
    assert r["exit_code"] != 0 and "print('hello')" in out and "Permission denied" in out  # the guest's view too
    m = c.mark()
    c.ok("agent.execute", {"command": "ls /mnt/working/0"})
    assert "".join(e["payload"]["data"] for e in c.events("event.terminal_output", m)) == "src\n"
    c.ok("session.restrict", {"readonly": True})
    assert c.error("session.restrict", {"readonly": False})["code"] == "session.widen_denied"
    r = c.ok("agent.execute", {"command": cmds.write("/mnt/working/0/src/new.py", "x")})
    assert r["exit_code"] != 0 and not (project / "src" / "new.py").exists()  # the guest is read-only too
    assert c.error("undo.rollback", {})["code"] == "fs.access_denied"


# ---------------------------------------------------------------------------- safeguards


@pytest.mark.parametrize("answer", ["allow", "deny", "timeout"])
def test_safeguard_holds_the_step_until_confirmed(api, project, cmds, answer):
    c = api()
    start(c, project, safeguard={"delete_threshold": 5, "timeout_seconds": 2 if answer == "timeout" else 120})
    before = oracle.snapshot_dir(str(project))
    m = c.mark()
    rid = c.send("agent.execute", {"command": cmds.rm_r("victims")})
    ev = c.wait_event("event.safeguard_triggered", since=m)["payload"]
    assert ev["kind"] == "delete" and ev["count"] == 5 and ev["delete_count"] == 5 and ev["sample_paths"]
    assert ev["message"] and ev["directory"] == 0
    assert ev["timeout_seconds"] == (2 if answer == "timeout" else 120)  # the safeguard's own timeout, defined once
    assert len(os.listdir(project / "victims")) == 20 - 4  # the 5th deletion has not reached the host
    if answer != "timeout":
        st = c.ok("session.status")
        assert [h["safeguard_id"] for h in st["pending_safeguards"]] == [ev["safeguard_id"]]
        c.ok("safeguard.confirm", {"safeguard_id": ev["safeguard_id"], "action": answer})
        if answer == "deny":  # the rollback is done when confirm answers
            assert oracle.snapshot_dir(str(project)) == before
    r = c.response(rid)["payload"]
    if answer == "allow":
        assert r["exit_code"] == 0 and not (project / "victims").exists()
    else:
        assert r["exit_code"] != 0 and oracle.snapshot_dir(str(project)) == before
        assert c.ok("undo.history")["steps"][0]["outcome"] == "denied"
    e = c.error("safeguard.confirm", {"safeguard_id": ev["safeguard_id"], "action": "allow"})
    assert e["code"] == "safeguard.unknown_id"


def test_safeguard_configure(api, project):
    c = api()
    start(c, project)
    r = c.ok("safeguard.configure", {"delete_threshold": 7, "timeout_seconds": 9, "rename_over_threshold": None})
    assert r["config"]["delete_threshold"] == 7 and r["config"]["timeout_seconds"] == 9
    assert c.error("safeguard.configure", {"timeout_seconds": 0})["code"] == "protocol.invalid_request"


# ---------------------------------------------------------------------------- external modifications


def test_external_edit_creates_a_barrier_that_blocks_rollback_unless_forced(api, project, cmds):
    c = api()
    start(c, project)
    c.ok("agent.execute", {"command": cmds.write("README.md", "sandbox edit\n")})
    m = c.mark()
    (project / "README.md").write_text("user edit\n")  # the user, on the host
    ev = c.wait_event("event.external_modification", since=m)["payload"]
    assert ev["paths"] == ["README.md"] and isinstance(ev["barrier_id"], int) and ev["directory"] == 0
    hist = c.ok("undo.history")
    assert hist["steps"][0]["barriers"][0]["id"] == ev["barrier_id"]
    assert hist["barriers"][0]["blocks_rollback_of"] == [hist["steps"][0]["id"]]
    e = c.error("undo.rollback", {"count": 1})
    assert e["code"] == "undo.barrier" and "README.md" in e["message"] and e["data"]["barrier_ids"] == [ev["barrier_id"]]
    assert (project / "README.md").read_text() == "user edit\n"
    c.ok("undo.rollback", {"count": 1, "force": True})
    assert (project / "README.md").read_text() == "# project\n"


def test_own_writes_and_rollback_restores_are_not_external(api, project, cmds):
    c = api()
    start(c, project)
    m = c.mark()
    c.ok("agent.execute", {"command": f"{cmds.rm_r('victims')}; {cmds.write('src/app.py', 'changed')}; mkdir -p a/b/c"})
    c.ok("undo.rollback", {"count": 1})
    (project / "sentinel").write_text("external\n")  # then one real external change
    ev = c.wait_event("event.external_modification", since=m)
    assert ev["payload"]["paths"] == ["sentinel"]
    assert len(c.events("event.external_modification", m)) == 1


def test_warn_policy_reports_without_a_barrier(api, project, cmds):
    c = api()
    start(c, project, external_modification_policy="warn")
    c.ok("agent.execute", {"command": cmds.write("new.txt", "x")})
    m = c.mark()
    (project / "unrelated.txt").write_text("user\n")
    ev = c.wait_event("event.external_modification", since=m)["payload"]
    assert ev["barrier_id"] is None and ev["paths"] == ["unrelated.txt"]
    assert c.ok("undo.history")["barriers"] == []
    c.ok("undo.rollback", {"count": 1})
    assert not (project / "new.txt").exists() and (project / "unrelated.txt").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="the lock policy bind-mounts the folder read-only: needs root")
def test_lock_policy_makes_host_edits_fail(api, project, cmds):
    from sandbox.barriers.lock import is_locked, lock_folder

    lock_folder(str(project))  # as a crashed session would leave it
    c = api()
    start(c, project, external_modification_policy="lock")
    with pytest.raises(OSError) as e:
        (project / "README.md").write_text("user\n")
    assert e.value.errno == 30  # EROFS
    assert c.ok("agent.execute", {"command": cmds.write("README.md", "sandbox\n")})["exit_code"] == 0
    assert (project / "README.md").read_text() == "sandbox\n"
    c.ok("undo.rollback", {})
    c.ok("session.stop")
    assert not is_locked(str(project))
    (project / "README.md").write_text("user again\n")  # unlocked


# ---------------------------------------------------------------------------- recovery and versions


def test_recovery_after_the_agent_is_killed_mid_step(api, project, cmds):
    before = oracle.snapshot_dir(str(project))
    c = api()
    start(c, project)
    m = c.mark()
    c.send("agent.execute", {"command": f"{cmds.write('README.md', 'half done')}; {cmds.rm_r('victims')}; "
                                        f"{cmds.echo('written')}; {cmds.wait()}"})
    c.wait_event("event.terminal_output", lambda p: "written" in p["data"], m)
    assert not (project / "victims").exists()
    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait()
    c2 = api()
    m = c2.mark()
    start(c2, project)
    ev = c2.wait_event("event.recovery", since=m)["payload"]
    assert ev["paths_restored"] >= 2 and ev["directory"] == 0
    assert oracle.snapshot_dir(str(project)) == before


@pytest.mark.parametrize("where", ["inside", "outside", "dangling"])
def test_a_directory_replaced_by_a_symlink_in_one_command_is_an_undoable_step(api, project, cmds, tmp_path, where):
    """`rm -rf src && ln -s TARGET src`: the command, the next command and the rollback all
    answer ok (closing the step used to fail with ELOOP, and every later request with it)."""
    outside = tmp_path / "outside"
    (outside / "app.py").mkdir(parents=True)  # the very name the command removed, behind the link
    target = {"inside": "victims", "outside": str(outside), "dangling": "nowhere/at/all"}[where]
    c = api()
    start(c, project)
    before = oracle.snapshot_dir(str(project))
    m = c.mark()
    r = c.ok("agent.execute", {"command": cmds.replace_by_symlink("src", target)})
    assert r["exit_code"] == 0 and os.readlink(project / "src") == target
    done = c.wait_event("event.step_completed", lambda p: p["step_id"] == r["step_id"], m)["payload"]
    assert "src/app.py" in done["affected_paths"]
    assert c.ok("undo.history")["steps"][0]["id"] == r["step_id"]
    later = c.ok("agent.execute", {"command": cmds.write("later.txt", "x")})
    assert later["exit_code"] == 0
    assert c.ok("undo.rollback", {"count": 2})["step_ids"] == [later["step_id"], r["step_id"]]
    assert oracle.snapshot_dir(str(project)) == before
    assert not c.events("event.error", m) and not c.events("event.warning", m)
    assert c.close() == 0


def test_version_mismatch_refuses_undo_until_discard(api, project, cmds, state_home):
    c = api()
    start(c, project)
    c.ok("agent.execute", {"command": cmds.write("a.txt", "x")})
    c.ok("session.stop")
    versions = [os.path.join(d, "VERSION") for d, _, fs in os.walk(state_home) if "VERSION" in fs]
    assert len(versions) == 1
    with open(versions[0], "w") as f:
        f.write("999\n")
    m = c.mark()
    start(c, project)
    assert c.wait_event("event.undo_version_mismatch", since=m)["payload"]["directory"] == 0
    assert c.error("undo.rollback", {})["code"] == "undo.version_mismatch"
    assert c.ok("undo.history")["undo_available"] is False
    c.ok("undo.discard")
    c.ok("agent.execute", {"command": cmds.write("b.txt", "y")})
    c.ok("undo.rollback", {})
    assert not (project / "b.txt").exists() and (project / "a.txt").exists()


# ---------------------------------------------------------------------------- logs and exit


def test_logs_are_json_lines_with_components_and_request_ids(api, project, cmds):
    c = api()
    rid = c.send("session.status")
    c.response(rid)
    start(c, project)
    c.ok("agent.execute", {"command": cmds.write("x", "y")})
    assert c.close() == 0
    assert any(r.get("request_id") == rid and r["component"] == "stdio_api" for r in c.logs)
    assert {r["level"] for r in c.logs} <= {"error", "warn", "info", "debug", "trace"}
    assert "session" in {r["component"] for r in c.logs}
    assert any(r["component"] == "undo" and isinstance(r.get("step_id"), int) for r in c.logs)


def test_pipelined_requests_then_eof_are_all_carried_out_in_order(api, project, cmds):
    """A script may write every request and close stdin: session.start finishes before the
    requests behind it start, and every request received is answered before the agent exits."""
    c = api()
    before = oracle.snapshot_dir(str(project))
    reqs = [("hello", {"protocol_version": 1}), ("session.start", {"working_directories": [{"path": str(project)}]}),
            ("agent.execute", {"command": cmds.rm_r("victims")}), ("session.stop", {}),
            ("session.start", {"working_directories": [{"path": str(project)}]}), ("undo.rollback", {"count": 1})]
    rids = [c.send(t, p) for t, p in reqs]
    assert c.close() == 0
    assert [c.response(r)["status"] for r in rids] == ["ok"] * len(reqs)
    assert oracle.snapshot_dir(str(project)) == before


def test_sigterm_cancels_the_running_command_stops_the_session_and_exits_zero(api, project, cmds):
    c = api()
    start(c, project)
    m = c.mark()
    rid = c.send("agent.execute", {"command": f"{cmds.write('during.txt', 'x')}; {cmds.echo('started')}; {cmds.wait()}"})
    c.wait_event("event.terminal_output", lambda p: "started" in p["data"], m)
    c.proc.send_signal(signal.SIGTERM)
    assert c.proc.wait(120) == 0
    r = c.response(rid)
    assert r["status"] == "ok" and r["payload"]["cancelled"] is True
    c2 = api()
    start(c2, project)  # the store was unlocked: the session really stopped
    assert c2.ok("undo.history")["steps"][0]["paths"]
    assert stat.S_ISDIR(os.stat(project).st_mode)


# ---------------------------------------------------------------------------- fuzzing


@pytest.mark.timeout(scale(180, 1800))
def test_random_requests_never_kill_the_agent_and_never_hit_a_bug(project):
    """Hypothesis sends well-framed requests with arbitrary payloads (and arbitrary types)
    to one running agent with a session: every one gets exactly one response, none is
    ``protocol.internal`` (that would be a bug), and the agent stays up."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    # no NaN/Infinity: not JSON, refused before the request_id is read (1e400 is in the boundary test)
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=30), st.sampled_from(["", ".", "..", "/", "/mnt/working/0", "src/app.py",
                                                              "../x", "/etc/passwd", "a\x00b", "victims"]))
    values = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                          st.dictionaries(st.text(max_size=10), kids, max_size=4)),
                          max_leaves=10)
    fields = sorted({k for m in schema.REQUESTS.values() for k in m.model_fields})
    payloads = st.dictionaries(st.sampled_from(fields) | st.text(max_size=8), values, max_size=4)
    types = st.sampled_from(sorted(set(schema.REQUESTS) - {"session.start", "session.reset"})) | st.text(max_size=12)
    c = ApiClient(guest="scripted", log_level="warn")
    try:
        start(c, project)
        sent = []

        @settings(max_examples=scale(300, 3000), deadline=None, suppress_health_check=list(HealthCheck))
        @given(types, payloads)
        def one(t, p):
            r = c.request(t, p, timeout_s=60)
            sent.append(r)
            if r["status"] == "error":
                assert r["error"]["code"] != "protocol.internal", (t, p, r["error"])
                assert r["error"]["code"] in errors.CODES

        one()
        assert sent and c.ok("hello", {"protocol_version": 1})
    finally:
        rc = c.close()
    c.check()
    assert rc == 0


def test_a_bad_restrict_option_leaves_no_session_running(api, project):
    c = api()
    e = c.error("session.start", {"working_directories": [{"path": str(project)}], "restrict": {"path": "/elsewhere"}})
    assert e["code"] == "fs.outside_mounts"
    assert c.ok("session.status")["state"] == "not_started"
    start(c, project)  # the undo store was released


# ---------------------------------------------------------------------------- hostile input: nesting, ids, extremes


def _deep(depth: int, leaf: str = '"x"', key: str = "a") -> str:
    """A JSON text of ``depth`` nested objects around ``leaf`` (built as text: no recursion)."""
    return ('{"%s":' % key) * depth + leaf + "}" * depth


def test_a_deeply_nested_request_id_or_payload_never_stops_the_agent(api):
    """Issue 11 item 4: a request_id nested ~990 deep parsed fine but blew the stack while the
    validation error was built, and `sandbox serve` exited 1. Nesting is now measured before
    anything parses the line: every depth over the limit is the same clean refusal."""
    from sandbox.api.stdio import JSON_DEPTH_MAX

    c = api()
    depths = [JSON_DEPTH_MAX, JSON_DEPTH_MAX + 1, 500, *range(960, 1000, 3), 5000, 100_000]
    for n in depths:  # n: the whole line's depth, the request object counting 1
        c.send_raw(('{"type":"hello","request_id":%s,"payload":{"protocol_version":1}}\n' % _deep(n - 1)).encode())
        c.send_raw(('{"type":"hello","request_id":"p%d","payload":{"protocol_version":%s}}\n' % (n, _deep(n - 2))).encode())
        c.send_raw(("[" * n + "]" * n + "\n").encode())
    assert c.ok("hello", {"protocol_version": 1})["protocol_version"] == 1  # alive, and every line above answered
    refusals = [m for m in c.messages if m.get("status") == "error"]
    assert len(refusals) == 3 * len(depths)
    at_limit, over = refusals[:3], refusals[3:]  # answered in order: hello runs inline
    assert [(m["request_id"], m["error"]["code"]) for m in at_limit] == [
        (None, "protocol.invalid_request"), (f"p{JSON_DEPTH_MAX}", "protocol.invalid_request"),
        (None, "protocol.not_an_object")]  # parsed; the deep request_id is not echoed
    assert all(m["request_id"] is None and m["error"]["code"] == "protocol.too_deep" for m in over)
    too_deep = [m["error"] for m in over]
    assert all(e["data"]["limit"] == JSON_DEPTH_MAX for e in too_deep)
    assert c.close() == 0


def test_an_invalid_request_id_is_never_echoed(api):
    c = api()
    for rid in ['"' + "r" * 300_000 + '"', str(2 ** 64), "1.5", "true", "[1]", _deep(40)]:
        c.send_raw(('{"type":"hello","request_id":%s,"payload":{"protocol_version":1}}\n' % rid).encode())
    c.send_raw(b'{"type":"hello","request_id":1e3,"payload":{"protocol_version":1}}\n')  # JSON Schema: an integer
    assert c.response(1000)["status"] == "ok"
    bad = [m for m in c.messages if m.get("status") == "error"]
    assert len(bad) == 6 and all(m["request_id"] is None for m in bad)
    assert all(m["error"]["code"] == "protocol.invalid_request" and m["error"]["data"]["path"] == "$.request_id"
               for m in bad)
    assert all(len(json.dumps(m)) < 2000 for m in bad)  # nothing huge is echoed back
    assert c.close() == 0


def test_commands_and_env_a_process_cannot_receive_are_refused_and_the_session_stays_up(api, project, cmds):
    """A lone surrogate in an env value was protocol.internal with the VM guest (it cannot be
    encoded for the guest), a NUL in the command made the guest refuse it and the session
    fail. Text a process cannot receive (NUL, not valid Unicode, '=' in an env name) is
    refused before it reaches any guest, the same for every guest, and nothing stops."""
    c = api()
    start(c, project)
    bad = [{"command": "echo a\0b"}, {"command": "echo \ud800"},
           {"command": "true", "env": {"A": "\ud800"}}, {"command": "true", "env": {"A": "x\0y"}},
           {"command": "true", "env": {"A=B": "x"}}, {"command": "true", "env": {"\udc80": "x"}},
           {"command": "true", "cwd": "/mnt/\ud800"}]
    for payload in bad:
        e = c.error("agent.execute", payload)
        assert e["code"] in ("protocol.invalid_request", "fs.invalid_path"), (payload, e)
    c.ok("agent.execute", {"command": cmds.write("after.txt", "still up")})
    assert (project / "after.txt").read_text().strip() == "still up"
    assert c.ok("session.status")["state"] in ("idle", "running")
    c.close()
    c.check()


def test_schema_valid_extreme_numbers_are_clean_answers_never_internal(api, project, cmds):
    """Issue 11 item 9: fs.read at offset 2**64 and undo.rollback with count 1e9 (an integer to
    JSON Schema) were answered protocol.internal. Integer fields are bounded in the schema,
    integral floats reach the handlers as ints, and offsets past the end read nothing."""
    c = api()
    start(c, project)
    e = c.error("fs.read", {"path": "README.md", "offset": 2 ** 64})
    assert e["code"] == "protocol.invalid_request" and e["data"]["path"] == "$.payload.offset"
    r = c.ok("fs.read", {"path": "README.md", "offset": 2 ** 63 - 1})
    assert r["data"] == "" and r["eof"] is True and r["offset"] == 2 ** 63 - 1
    r = c.ok("fs.read", {"path": "README.md", "offset": 2 ** 63 - 1, "length": 10})
    assert r["data"] == "" and r["eof"] is True

    def raw(t: str, rid: str, payload: str) -> dict:
        c.send_raw(('{"type":"%s","request_id":"%s","payload":%s}\n' % (t, rid, payload)).encode())
        return c.response(rid)

    e = raw("undo.rollback", "c1", '{"count": 1e9}')["error"]
    assert e["code"] == "protocol.invalid_request" and e["data"]["path"] == "$.payload.count"
    assert raw("undo.history", "h1", '{"limit": 1e9}')["error"]["code"] == "protocol.invalid_request"
    assert raw("fs.read", "f1", '{"path": "README.md", "offset": 2e0, "length": 3.0}')["payload"]["data"] == "pro"
    assert raw("fs.read", "f2", '{"path": "README.md", "length": 1e9}')["error"]["code"] == "fs.too_large"
    assert raw("undo.rollback", "c2", '{"count": 1e2}')["error"]["code"] == "undo.nothing_to_undo"
    c.ok("agent.execute", {"command": cmds.write("made.txt", "x")})
    r = raw("undo.rollback", "c3", '{"count": 1.0}')
    assert r["status"] == "ok" and len(r["payload"]["step_ids"]) == 1 and not (project / "made.txt").exists()
    assert raw("undo.configure", "u1", '{"max_step_count": 5e1}')["payload"]["limits"]["max_step_count"] == 50
    assert raw("safeguard.configure", "s1", '{"timeout_seconds": 1e400}')["error"]["code"] == "protocol.invalid_request"
    c.send_raw(b'{"type": "hello", "request_id": "n1", "payload": {"protocol_version": NaN}}\n')  # not JSON
    assert c.ok("hello", {"protocol_version": 1})
    codes = [m["error"]["code"] for m in c.messages if m.get("status") == "error"]
    assert codes[-1] == "protocol.invalid_json"
    assert "protocol.internal" not in codes
    assert c.close() == 0


def test_nesting_is_measured_on_the_text_before_parsing():
    """The cause of item 4: depth was only noticed when json.loads itself overflowed, so a
    line just under the parser's limit reached the validator and its error rendering."""
    from sandbox.api.errors import ApiError
    from sandbox.api.stdio import JSON_DEPTH_MAX, decode_request, json_depth

    assert json_depth("") == 0 and json_depth('{"a": [1, {"b": []}]}') == 4
    assert json_depth('"[[[{"') == 0 and json_depth(r'["\"[[", "\\", {"]": "}"}]') == 2
    assert decode_request(b"[" * JSON_DEPTH_MAX + b"]" * JSON_DEPTH_MAX) is not None
    for line in [b"[" * (JSON_DEPTH_MAX + 1) + b"]" * (JSON_DEPTH_MAX + 1), b"[" * 100_000, b'{"a":' * 990 + b"1" + b"}" * 990]:
        with pytest.raises(ApiError) as e:
            decode_request(line)
        assert e.value.code == "protocol.too_deep" and e.value.data == {"limit": JSON_DEPTH_MAX}
    for line in [b'"' + b"[" * 5000, b"not json", b"\xff\xfe\x00x", b"[NaN]", b"[-Infinity]", b"1" * 5000]:
        with pytest.raises(ApiError) as e:  # an unterminated string swallows the brackets: invalid, not deep
            decode_request(line)
        assert e.value.code == "protocol.invalid_json", line[:20]
    v = decode_request(b'{"a": 1e9, "b": 2.0, "c": 1.5, "d": -0.0, "e": 1e400, "f": 7}')
    assert v == {"a": 10 ** 9, "b": 2, "c": 1.5, "d": 0, "e": float("inf"), "f": 7}
    assert [type(v[k]) for k in "abcdf"] == [int, int, float, int, int]
    assert decode_request('{"a": [1]}'.encode("utf-16")) == {"a": [1]}  # as json.loads detects it


def test_json_depth_agrees_with_the_parser():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from sandbox.api.stdio import json_depth

    def depth(v) -> int:
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        return 0

    text = st.text(alphabet=st.sampled_from('[]{}"\\,:ab\n\u00e9'), max_size=8)
    values = st.recursive(st.none() | st.integers() | text,
                          lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3), max_leaves=30)

    @settings(max_examples=scale(300, 5000), deadline=None)
    @given(values, st.booleans())
    def agree(v, ascii_only):
        assert json_depth(json.dumps(v, ensure_ascii=ascii_only)) == depth(v)

    agree()


def _serve_in_process(lines: list[bytes]) -> list[dict]:
    """The agent in this process on these input lines until EOF; its output, which must be
    valid UTF-8 whatever came in."""
    import io

    from sandbox.api.stdio import StdioServer

    out = io.BytesIO()
    assert StdioServer(io.BytesIO(b"".join(lines)), out, guest="scripted").serve() == 0
    return [json.loads(x.decode("utf-8", "strict")) for x in out.getvalue().splitlines()]


def test_output_is_valid_utf8_even_when_a_lone_surrogate_is_echoed():
    msgs = _serve_in_process([b'{"type":"hello","request_id":"\\ud800","payload":{"protocol_version":1}}\n',
                              b'{"type":"hello","request_id":"\xc3\xa9","payload":{"protocol_version":1}}\n',
                              b'{"type":"no\\udcff","request_id":1}\n'])
    assert [(m["request_id"], m["status"]) for m in msgs] == [("\ud800", "ok"), ("\u00e9", "ok"), (1, "error")]
    assert msgs[2]["error"]["data"]["type"] == "no\udcff"


def test_handlers_get_integral_floats_as_ints_whoever_parsed_the_payload():
    """The agent's own guard (it may sit behind another transport than the STDIO decoder):
    JSON Schema's ``integer`` accepts 1.0, so the handlers must never see a float for it."""
    from sandbox.api.agent import Agent

    r = Agent(lambda msg: None, guest="scripted").handle("hello", {"protocol_version": 1.0}, "r")
    assert r["protocol_version"] == 1 and type(r["protocol_version"]) is int


def test_a_bug_while_handling_a_line_is_answered_internal_and_the_next_line_is_served(monkeypatch, caplog):
    """Fault injection: whatever raises while a line is handled (here: inside validation)
    becomes protocol.internal for that request, logged with its traceback; serving goes on."""
    import logging

    from sandbox.api import protocol  # what the server validates with (schema re-exports it)

    real = protocol.first_error

    def failing(name, instance):
        if isinstance(instance, dict) and instance.get("request_id") == "boom":
            raise KeyError("injected")
        return real(name, instance)

    monkeypatch.setattr(protocol, "first_error", failing)
    hello = '{"type":"hello","request_id":"%s","payload":{"protocol_version":1}}\n'
    with caplog.at_level(logging.ERROR, logger="sandbox.api"):
        msgs = _serve_in_process([(hello % "boom").encode(), (hello % "after").encode()])
    assert [(m["request_id"], m["status"]) for m in msgs] == [("boom", "error"), ("after", "ok")]
    assert msgs[0]["error"]["code"] == "protocol.internal" and msgs[0]["error"]["data"] == {"exception": "KeyError"}
    assert any(r.exc_info and r.exc_info[0] is KeyError for r in caplog.records)


def test_a_response_that_cannot_be_encoded_still_answers_its_request():
    import io

    from sandbox.api import stdio

    out = io.BytesIO()
    server = stdio.StdioServer(io.BytesIO(), out, guest="scripted")
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    server._writer.start()
    server.send({"type": "response", "request_id": "a", "status": "ok", "payload": {"x": object()}})
    server.send({"type": "response", "request_id": "b", "status": "ok", "payload": {"x": deep}})
    server.send({"type": "event.warning", "payload": {"message": object()}})  # an event: dropped
    server.send({"type": "response", "request_id": "c", "status": "ok", "payload": {}})
    server.send(stdio._STOP)
    server._writer.join()
    msgs = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [(m["request_id"], m["status"]) for m in msgs] == [("a", "error"), ("b", "error"), ("c", "ok")]
    assert [m["error"]["data"]["exception"] for m in msgs[:2]] == ["TypeError", "RecursionError"]
    assert all(schema.first_error("response", m) is None for m in msgs)


class _Raw:
    """A number sent as written (``1e9``, ``2.0``, ``1e400``): json.dumps would spell it otherwise."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _dumps(msg: dict) -> bytes:
    import re

    raws: list[str] = []

    def default(o):
        if isinstance(o, _Raw):
            raws.append(o.text)
            return f"\x00raw{len(raws) - 1}\x00"
        raise TypeError(type(o))

    text = json.dumps(msg, default=default)
    return re.sub(r'"\\u0000raw(\d+)\\u0000"', lambda m: raws[int(m.group(1))], text).encode() + b"\n"


_EDGE_INTS = [0, -1, 1, 2 ** 31, 2 ** 53 + 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63, -2 ** 63 - 1, 10 ** 30]
_EDGE_LITERALS = ["1e9", "1.0", "2e0", "-0.0", "1e400", "-1e400", "9.3e18", "1.5", "1e-400", "5e1"]
_STRING_CHARS_SENT_MAX = (128 << 10) + 1  # longer boundary strings (64 MiB contents) are left to the line limit


def _boundaries(node: dict, defs: dict, depth: int, specials: list[str], wild: bool):
    """Values for one schema node at its boundaries: integers at 0, -1, the edges of 64-bit
    and of the node's own range, integral floats spelt as floats (``1e9``, ``1.0``), the
    longest string, lone surrogates, NULs. Schema-valid ones only unless ``wild``: then also
    just past every bound, ``1e400``, and nesting up to just under the depth limit.
    ``depth``: how deep a value here already is (the request object is 1)."""
    from hypothesis import strategies as st

    from sandbox.api.stdio import JSON_DEPTH_MAX

    def sub(n: dict, d: int):
        return _boundaries(n, defs, d, specials, wild)

    def pick(values: list):
        return st.sampled_from(values) if values else st.nothing()

    if "$ref" in node:
        return sub(defs[node["$ref"].rsplit("/", 1)[1]], depth)
    alts = [sub(n, depth) for n in node.get("oneOf", [])]
    if "enum" in node:
        alts.append(st.sampled_from(node["enum"]))
    types = node.get("type", [])
    for t in [types] if isinstance(types, str) else types:
        lo, hi = node.get("minimum"), node.get("maximum")
        low = node.get("exclusiveMinimum")

        def fits(v: float, lo=lo, hi=hi, low=low, t=t) -> bool:
            return wild or ((lo is None or v >= lo) and (hi is None or v <= hi) and (low is None or v > low)
                            and (t == "number" or float(v).is_integer()))

        if t in ("integer", "number"):
            edges = set(_EDGE_INTS) | {v + d for v in (lo, hi) if v is not None for d in (-1, 0, 1)}
            if t == "number":
                edges |= {1e-300, 0.5, 1e300}
            alts.append(pick(sorted(v for v in edges if fits(v))))
            alts.append(pick([_Raw(x) for x in _EDGE_LITERALS if fits(float(x))]))
        elif t == "string":
            m, m_min = node.get("maxLength", 64), node.get("minLength", 0)
            prefix = "/" if node.get("pattern") == "^/" else ""
            lengths = {0, 1, m} | ({m + 1} if wild else set())
            lengths = sorted(n for n in lengths if n <= _STRING_CHARS_SENT_MAX and (wild or n >= max(m_min, len(prefix))))
            alts.append(pick(lengths).map(lambda n, p=prefix: (p + "a" * n)[:max(n, len(p))]))
            odd = [x for x in specials + ["/", ".", "..", "/mnt/working/0", "src/app.py", "/mnt/working/0/../..",
                                          "\ud800", "a\x00b", "/\udcff\x00", "\U0001f600" * 3, "é" * 300, "sg_001", "d"]
                   if wild or (m_min <= len(x) <= m and x.startswith(prefix))]
            alts.append(pick(odd))
        elif t == "boolean":
            alts.append(st.booleans())
        elif t == "null":
            alts.append(st.none())
        elif t == "array":
            item = sub(node.get("items", {}), depth + 1)
            m = node.get("maxItems", 4)
            alts.append(st.lists(item, min_size=node.get("minItems", 0) if not wild else 0, max_size=min(m, 3)))
            if wild and m < 300:
                alts.append(st.lists(item, min_size=m + 1, max_size=m + 1))
        elif t == "object":
            props = {k: sub(v, depth + 1) for k, v in node.get("properties", {}).items()}
            req = set(node.get("required", []))
            fixed = st.fixed_dictionaries({k: v for k, v in props.items() if k in req},
                                          optional={k: v for k, v in props.items() if k not in req})
            extra = node.get("additionalProperties")
            if isinstance(extra, dict):
                keys = sub(node.get("propertyNames", {"type": "string"}), depth + 1).filter(lambda k: isinstance(k, str))
                fixed = st.tuples(fixed, st.dictionaries(keys, sub(extra, depth + 1), max_size=3)) \
                    .map(lambda ab: {**ab[1], **ab[0]})
            alts.append(fixed)
    room = JSON_DEPTH_MAX - depth  # containers that still fit here
    if wild and room > 0:  # a wrong-typed value nested to just under the limit: its error is rendered
        alts.append(st.sampled_from(sorted({1, room // 2, room})).map(lambda n: json.loads("[" * n + "0" + "]" * n)))
    return st.one_of(alts) if alts else st.nothing()


@pytest.mark.timeout(scale(180, 1800))
def test_boundary_values_of_every_request_field_are_answered_never_internal(api, project, tmp_path):
    """Issue 11 item 9, generalised: for every operation, payloads built from its schema with
    each field at and just past its bounds (0, -1, 2**63-1, 2**63, 2**64, ``1e9``, ``1.0``,
    ``1e400``, the longest string and one more character, lone surrogates, nesting just under
    the depth limit) — every request gets one response, ``ok`` or a documented error code,
    never ``protocol.internal``, and the agent stays up. Session lifecycle requests run on a
    second agent that starts without a session, so session.start's fields are exercised too."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    other = tmp_path / "other"
    (other / "d").mkdir(parents=True)
    (other / "f.txt").write_text("x\n")
    defs = schema.shipped()["$defs"]

    def requests(types, specials, base=None):
        """(type, payload): a quarter wild, a quarter valid, half valid with at most two fields
        (over ``base``: the minimal payload that starts a session), so most reach the handlers."""
        def payloads(t: str):
            valid, wild = (_boundaries(defs[f"request.{t}"], defs, 2, specials, w) for w in (False, True))
            few = valid.flatmap(lambda p: st.sets(st.sampled_from(sorted(p) or [""]), max_size=2).map(
                lambda keys: {**(base if t == "session.start" else {}), **{k: p[k] for k in keys if k in p}}))
            return st.tuples(st.just(t), st.integers(0, 3).flatmap(lambda i: (wild, valid, few, few)[i]))

        return st.sampled_from(sorted(types)).flatmap(payloads)

    lifecycle = {"session.start", "session.stop", "session.reset"}
    a, b = api(log_level="warn"), api(log_level="warn")
    start(a, project)
    seen: list[tuple[str, str]] = []

    def send(c: ApiClient, t: str, payload: dict) -> dict:
        rid = f"x{len(seen)}"
        c.send_raw(_dumps({"type": t, "request_id": rid, "payload": payload}))
        r = c.response(rid, timeout_s=120)
        code = r["error"]["code"] if r["status"] == "error" else "ok"
        seen.append((t, code))
        assert code == "ok" or code in errors.CODES, (t, payload, r)
        assert code != "protocol.internal", (t, payload, r["error"])
        return r

    settings_ = dict(deadline=None, suppress_health_check=list(HealthCheck))

    def with_session_of(types, examples):
        @settings(max_examples=examples, **settings_)
        @given(requests(types, [str(project)]))
        def run(req):
            r = send(a, *req)
            if req[0] == "session.restrict" and r["status"] == "ok":  # restrictions only narrow: start afresh
                a.ok("session.stop")
                start(a, project)

        run()

    def with_session():
        with_session_of(set(schema.REQUESTS) - lifecycle, scale(150, 2000))
        for t in sorted(set(schema.REQUESTS) - lifecycle - {t for t, _ in seen}):  # every type, however many there are
            with_session_of({t}, 5)

    def without_session_of(types, examples):
        @settings(max_examples=examples, **settings_)
        @given(requests(types, [str(other), str(other / "d")], base={"working_directories": [{"path": str(other)}]}))
        def run(req):
            send(b, *req)
            if b.ok("session.status")["state"] != "not_started":
                b.ok("session.stop")

        run()

    def without_session():
        types = lifecycle | {"hello", "session.status"}
        without_session_of(types, scale(40, 400))
        for t in sorted(types - {t for t, _ in seen}):  # a random sample can miss one: each gets its turn
            without_session_of({t}, 5)

    with_session()
    without_session()
    assert {t for t, _ in seen} == set(schema.REQUESTS)
    for c in (a, b):
        assert c.ok("hello", {"protocol_version": 1})
        assert c.close() == 0


def test_a_client_that_never_reads_its_replies_cannot_grow_the_agent_s_memory():
    """A flood of lines from a client that reads nothing: at most ``max_output_bytes`` of
    replies wait for stdout, then the agent stops reading stdin until the client reads —
    and every line is still answered once it does."""
    import threading

    from sandbox.api import stdio

    lines_max, room = 20_000, 4096
    reading = threading.Event()

    class Client:  # both ends: what the agent reads, and a stdout nobody reads until `reading`
        def __init__(self):
            self.sent, self.received = 0, []

        def readline(self, _limit=-1) -> bytes:
            if self.sent == lines_max:
                return b""
            self.sent += 1
            return b"not json\n"

        def write(self, data: bytes) -> None:
            reading.wait()
            self.received.append(data)

        def flush(self) -> None:
            pass

    client = Client()
    server = stdio.StdioServer(client, client, guest="scripted", max_output_bytes=room)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    assert server.output.wait_blocked(timeout=60)  # the reader waits for room: stdin is not read on
    assert client.sent < room // 50 + 3  # each reply is longer than 50 bytes
    assert server.output.queued_bytes <= room
    reading.set()
    serving.join(timeout=120)
    assert not serving.is_alive()
    msgs = [json.loads(x) for x in b"".join(client.received).splitlines()]
    assert len(msgs) == lines_max and {m["error"]["code"] for m in msgs} == {"protocol.invalid_json"}


def test_events_past_the_output_bound_are_dropped_never_waited_for_and_then_reported():
    """An event other than a command's output never waits for a client that does not read
    (its sender may be the filesystem server): past ``max_output_bytes`` it is dropped, and
    one ``event.warning`` says how many once a message gets through again."""
    import threading

    from sandbox.api import stdio

    reading = threading.Event()

    class Out:
        def __init__(self):
            self.received = []

        def write(self, data: bytes) -> None:
            reading.wait()
            self.received.append(data)

        def flush(self) -> None:
            pass

    out = Out()
    server = stdio.StdioServer(io.BytesIO(), out, guest="scripted", max_output_bytes=4096)
    server._writer.start()
    for i in range(1000):  # returns at once each time: nothing here waits
        server.send({"type": "event.step_completed", "payload": {"step_id": i, "note": "x" * 50}})
    assert server.output.queued_bytes <= 4096
    reading.set()
    server.send({"type": "response", "request_id": "r", "status": "ok", "payload": {}})
    server.send(stdio._STOP)
    server._writer.join(timeout=60)
    msgs = [json.loads(x) for x in b"".join(out.received).splitlines()]
    kept = [m["payload"]["step_id"] for m in msgs if m["type"] == "event.step_completed"]
    assert 0 < len(kept) < 1000 and kept == sorted(kept)  # in order, and most dropped
    warned = [int(m["payload"]["message"].split()[0]) for m in msgs if m["type"] == "event.warning"]
    assert sum(warned) == 1000 - len(kept) and msgs[-2]["type"] == "event.warning"  # every drop reported
    assert msgs[-1]["request_id"] == "r"


def test_the_dropped_lines_report_never_takes_the_outbox_past_its_bound():
    """The report of dropped lines counts against ``bytes_max`` like any line: when the
    writer frees room for one line but not for the report too, that line is dropped as well
    (and counted), not queued past the bound; the report and a line go in once both fit."""
    from sandbox.api import stdio

    box = stdio.Outbox(1000, lambda n: b"R" * 90 + b"%03d" % n)
    line = b"x" * 100
    assert all(box.put(line, wait=False) for _ in range(10))  # exactly full
    assert not box.put(line, wait=False) and box.dropped == 1
    assert box.get() == line  # room for one line, not for the line and the 93-byte report
    assert not box.put(line, wait=False)
    assert box.dropped == 2 and box.queued_bytes == 900
    box.get()
    assert box.put(line, wait=False)  # 800 + 93 + 100 fits
    assert box.queued_bytes == 993 <= 1000 and box.dropped == 0
    got = [box.get() for _ in range(len(box._items))]
    assert got[-2:] == [b"R" * 90 + b"002", line]
