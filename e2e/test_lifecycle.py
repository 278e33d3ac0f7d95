"""A SIGKILLed agent leaves no QEMU and no socket behind; the next start recovers its step.

Real guests (each test boots two: about 20 s under TCG). The agent — ``sandbox run``,
``sandbox serve`` or ``sandbox mcp`` with a VM session — is SIGKILLed in the middle of a command that has
written to the working folder. Then:

* its QEMU (found by pid among the agent's children before the kill, watched through a
  pidfd) is gone — the parent-death signal, not the pty hang-up, guarantees it;
* its run directory (sockets, mount table) is still in the temp dir until the next start,
  which removes it;
* the next start rolls the interrupted step back: the folder is what it was before.

Waits are events: a line of output, a pidfd becoming readable.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from sandbox_sim import oracle
from sandbox_sim.api_client import ApiClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

EXIT_WAIT_S = 60.0  # how long QEMU may take to be seen dead after the agent (never reached when it works)
RUN_DIR_PREFIX = "sandbox-vm-"


def _children(pid: int, want) -> list[int]:
    """The pids of ``pid``'s children for which ``want(comm, cmdline)`` is true."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(rest[1]) == pid and want(comm, cmdline):
            found.append(int(name))
    return found


def _qemu_children(pid: int) -> list[int]:
    return _children(pid, lambda comm, _cmdline: comm.startswith("qemu"))


def _share_server_children(pid: int) -> list[int]:  # -- confined share servers (issue 13)
    return _children(pid, lambda _comm, cmdline: "sandbox.serving.shareserver" in cmdline)


def _run_dirs(tmp: str) -> list[str]:
    return sorted(n for n in os.listdir(tmp) if n.startswith(RUN_DIR_PREFIX))


def _kill_and_watch_qemu(agent_pid: int, kill, share_servers: int | None = None) -> None:
    """SIGKILL the agent (``kill()``); its QEMU and its share-server processes (exactly
    ``share_servers`` of them, unless None: the mode's default) must end on their own."""
    qemus = _qemu_children(agent_pid)
    assert len(qemus) == 1, f"expected one QEMU child of the agent {agent_pid}, found {qemus}"
    shares = _share_server_children(agent_pid)
    assert share_servers is None or len(shares) == share_servers, f"expected {share_servers} share server(s) of {agent_pid}, found {shares}"
    fds = {os.pidfd_open(pid): pid for pid in qemus + shares}
    try:
        kill()
        waiting = set(fds)
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], EXIT_WAIT_S)
            if not ready:
                break
            waiting -= set(ready)
        for fd in waiting:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        assert not waiting, f"{sorted(fds[fd] for fd in waiting)} outlived the SIGKILLed agent"
    finally:
        for fd in fds:
            os.close(fd)


def _sigkill(agent: subprocess.Popen, share_servers: int) -> None:
    def kill():
        agent.send_signal(signal.SIGKILL)
        assert agent.wait() == -signal.SIGKILL

    _kill_and_watch_qemu(agent.pid, kill, share_servers=share_servers)


def _reap(agent: subprocess.Popen) -> None:
    if agent.poll() is None:
        agent.kill()
        agent.wait()
    for f in (agent.stdin, agent.stdout, agent.stderr):
        if f is not None:
            f.close()


def _next_run_recovers(project, tmp: str, env: dict, before) -> None:
    """The killed agent left its run directory; the next ``sandbox run`` removes it and rolls the
    interrupted step back before its own command runs."""
    left = _run_dirs(tmp)
    assert len(left) == 1, f"the killed agent's run directory: {left}"
    again = subprocess.run([sys.executable, "-m", "sandbox", "run", "--workdir", str(project), "--", "cat README.md"],
                           stdin=subprocess.DEVNULL, capture_output=True, env=env, text=True, timeout=800)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout == "# project\n", "the interrupted step was not rolled back before the next command"
    assert oracle.snapshot_dir(str(project)) == before
    assert _run_dirs(tmp) == [], "the killed agent's run directory (and its sockets) survived the next start"


@pytest.fixture
def world(tmp_path, vm_guest):
    project = tmp_path / "project"
    (project / "victims").mkdir(parents=True)
    (project / "README.md").write_text("# project\n")
    for i in range(5):
        (project / "victims" / f"v{i}").write_text(f"victim {i}\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "XDG_STATE_HOME": str(state),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return project, str(tmp), env


def _sandbox_run(env, project, command: str, *options: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sandbox", "run", *options, "--workdir", str(project), "--", command],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            text=True)


@pytest.mark.parametrize("share_servers", ["thread", "process"])
def test_sigkilled_sandbox_run_leaves_no_qemu_and_the_next_run_recovers(world, share_servers):
    """In process mode the folders' share server dies with the agent too (PDEATHSIG)."""
    project, tmp, env = world
    before = oracle.snapshot_dir(str(project))
    agent = _sandbox_run(env, project, "echo half > README.md; rm -r victims; echo WRITTEN; sleep 600",
                         "--share-servers", share_servers)
    try:
        for line in agent.stdout:
            if "WRITTEN" in line:
                break
        else:
            raise AssertionError(f"sandbox run ended (rc={agent.wait()}): {agent.stderr.read()[-3000:]}")
        assert not (project / "victims").exists()

        _sigkill(agent, share_servers=1 if share_servers == "process" else 0)
    finally:
        _reap(agent)
    _next_run_recovers(project, tmp, env, before)


def test_sigkilled_sandbox_serve_leaves_no_qemu_and_the_next_start_recovers(world):
    project, tmp, env = world
    before = oracle.snapshot_dir(str(project))
    c = ApiClient(guest="vm", env=env)
    try:
        c.ok("session.start", {"working_directories": [{"path": str(project)}]}, timeout_s=400)
        m = c.mark()
        c.send("agent.execute", {"command": "echo half > README.md; rm -r victims; echo WRITTEN; sleep 600"})
        c.wait_event("event.terminal_output", lambda p: "WRITTEN" in p["data"], m, timeout_s=120)
        assert not (project / "victims").exists()

        def kill():
            os.kill(c.proc.pid, signal.SIGKILL)
            c.proc.wait()

        _kill_and_watch_qemu(c.proc.pid, kill)
    finally:
        if c.proc.poll() is None:
            c.proc.kill()
            c.proc.wait()
    left = _run_dirs(tmp)
    assert len(left) == 1, f"the killed agent's run directory: {left}"
    c2 = ApiClient(guest="vm", env=env)
    try:
        m = c2.mark()
        c2.ok("session.start", {"working_directories": [{"path": str(project)}]}, timeout_s=400)
        ev = c2.wait_event("event.recovery", since=m)["payload"]
        assert ev["paths_restored"] >= 2 and ev["directory"] == 0
        assert oracle.snapshot_dir(str(project)) == before
        assert [d for d in _run_dirs(tmp) if d in left] == [], "the killed agent's run directory survived the next start"
        c2.ok("session.stop", timeout_s=120)
    finally:
        c2.close()
    c2.check()
    assert _run_dirs(tmp) == []


def test_sigkilled_sandbox_mcp_leaves_no_qemu_and_no_share_server_and_the_next_run_recovers(world):
    """``sandbox mcp`` (its own session, process mode by default): SIGKILLed mid-``execute_command``."""
    import json

    project, tmp, env = world
    before = oracle.snapshot_dir(str(project))
    agent = subprocess.Popen([sys.executable, "-m", "sandbox", "mcp", "--workdir", str(project)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        for msg in ({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                     "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                                "clientInfo": {"name": "lifecycle", "version": "1"}}},
                    {"jsonrpc": "2.0", "method": "notifications/initialized"},
                    {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                     "params": {"name": "execute_command", "_meta": {"progressToken": "p"},
                                "arguments": {"command": "echo half > README.md; rm -r victims; echo WRITTEN; "
                                                         "sleep 600"}}}):
            agent.stdin.write(json.dumps(msg) + "\n")
        agent.stdin.flush()
        for line in agent.stdout:  # the command's output arrives as progress notifications
            if "WRITTEN" in line:
                break
        else:
            raise AssertionError(f"sandbox mcp ended (rc={agent.wait()}) before the command wrote")
        assert not (project / "victims").exists()

        _sigkill(agent, share_servers=1)
    finally:
        _reap(agent)
    _next_run_recovers(project, tmp, env, before)
