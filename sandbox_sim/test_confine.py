"""The file server is confined: a read outside its share, made from inside the server
process, fails with EACCES while the share works over 9P (sandbox/confine.py, serve-9p).

Confinement is irreversible, so every test confines a child process, never pytest's. The
injection: the child runs ``sandbox serve-9p`` through ``sandbox.cli.main`` with
``sandbox.confine.confine`` wrapped — right after the server confined itself, the wrapper
reads a secret outside the share (directly, and through a symlink planted in the share)
and a file inside it, and reports each outcome on stderr before serving goes on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from sandbox import confine
from sandbox.ninep.client import Client
from sandbox.ninep.wirefs import WireFS

pytestmark = pytest.mark.timeout(120)

needs_landlock = pytest.mark.skipif(confine.landlock_abi() == 0, reason="Landlock is not available on this kernel")

INJECTED = textwrap.dedent("""
    import errno, sys
    from sandbox import cli, confine
    real = confine.confine
    def probe(path):
        try:
            with open(path, "rb") as f:
                return "READ:" + f.read().decode().strip()
        except OSError as e:
            return errno.errorcode[e.errno]
    def injected(**kw):
        applied = real(**kw)
        for path in sys.argv[1:4]:
            print(f"PROBE {path} {probe(path)}", file=sys.stderr, flush=True)
        return applied
    confine.confine = injected
    sys.exit(cli.main(sys.argv[4:]))
""")


def _env(tmp_path) -> dict:
    return {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg"), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@needs_landlock
@pytest.mark.parametrize("read_only", [False, True], ids=["intercepted", "read-only"])
def test_a_read_outside_the_share_from_inside_the_server_is_eacces_while_the_share_works(tmp_path, read_only):
    work = tmp_path / "work"
    work.mkdir()
    (work / "inside.txt").write_text("shared\n")
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key").write_text("do not read\n")
    os.symlink(secret / "key", work / "link")
    sock = str(tmp_path / "sock" / "9p.sock")
    os.mkdir(os.path.dirname(sock))
    argv = [sys.executable, "-c", INJECTED, str(secret / "key"), str(work / "link"), str(work / "inside.txt"),
            "serve-9p", "--root", str(work), "--socket", sock] + (["--read-only"] if read_only else [])
    p = subprocess.Popen(argv, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=_env(tmp_path))
    try:
        probes = {}
        for line in p.stderr:
            if line.startswith("PROBE "):
                _, path, outcome = line.split()
                probes[path] = outcome
            if "serving" in line:
                break
        else:
            raise AssertionError(f"serve-9p ended (rc={p.wait()}) before serving; probes {probes}")
        assert probes == {str(secret / "key"): "EACCES", str(work / "link"): "EACCES",
                          str(work / "inside.txt"): "READ:shared"}
        with Client.connect_unix(sock) as c:
            fs = WireFS(c)
            assert fs.read_file("inside.txt") == b"shared\n"
            if not read_only:
                fs.write_file("new.txt", b"written over 9P\n")
    finally:
        p.send_signal(signal.SIGTERM)
        _, rest = p.communicate(timeout=60)
    assert p.returncode == 0, rest
    assert "server stopped" in rest
    assert not os.path.exists(sock), "the socket was not removed (its directory is writable for sockets only)"
    if not read_only:
        assert (work / "new.txt").read_text() == "written over 9P\n"
        hist = subprocess.run([sys.executable, "-m", "sandbox", "history", "--workdir", str(work)], capture_output=True,
                              text=True, env=_env(tmp_path), stdin=subprocess.DEVNULL)
        assert hist.returncode == 0 and "ambient" in hist.stdout, hist  # the undo store was written while confined


CHILD = textwrap.dedent("""
    import json, os, sys, threading
    from sandbox import confine
    mode = sys.argv[1]
    out = {}
    if mode == "thread":
        ev = threading.Event()
        t = threading.Thread(target=ev.wait); t.start()
        try:
            confine.confine(read_write=[sys.argv[2]])
        except confine.ConfineError as e:
            out["error"] = str(e)
        ev.set(); t.join()
    elif mode == "missing":
        try:
            confine.confine(read_write=[sys.argv[2] + "/nope"])
        except confine.ConfineError as e:
            out["error"] = str(e)
    elif mode == "no-landlock":
        confine.landlock_abi = lambda: 0
        out["abi"] = confine.confine(read_write=[sys.argv[2]]).abi
    out["nnp"] = [l.split()[1] for l in open("/proc/self/status") if l.startswith("NoNewPrivs")][0]
    try:
        open(sys.argv[3]).read(); out["outside"] = "read"
    except PermissionError:
        out["outside"] = "EACCES"
    print(json.dumps(out))
""")


def _child(tmp_path, mode) -> dict:
    import json

    (tmp_path / "outside").write_text("x")
    p = subprocess.run([sys.executable, "-c", CHILD, mode, str(tmp_path), str(tmp_path / "outside")],
                       capture_output=True, text=True, env=_env(tmp_path), timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_confine_refuses_while_other_threads_run_and_applies_nothing(tmp_path):
    out = _child(tmp_path, "thread")
    assert "other threads would stay unconfined" in out["error"]
    assert out["nnp"] == "0" and out["outside"] == "read"


def test_confine_refuses_a_missing_read_write_path(tmp_path):
    out = _child(tmp_path, "missing")
    assert "does not exist" in out["error"] and out["nnp"] == "0"


def test_without_landlock_it_is_skipped_but_no_new_privs_is_set(tmp_path):
    out = _child(tmp_path, "no-landlock")
    assert out == {"abi": 0, "nnp": "1", "outside": "read"}
