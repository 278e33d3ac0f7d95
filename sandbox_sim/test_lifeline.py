"""A process the agent starts never outlives it (sandbox/lifeline.py, Console's spawn).

Real processes, no QEMU: the "QEMU" here is a small Python program that ignores SIGHUP and
SIGTERM (so the pty hang-up that follows the agent's death cannot be what ends it). Every
wait is an event: a line on a pipe, a pidfd becoming readable, a console marker.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from sandbox import lifeline
from sandbox.vm.console import BootError, Console

EXIT_WAIT_S = 30.0  # how long a process that must die may take to be seen dead (never reached when it works)

#: a child that survives a hang-up and a SIGTERM; prints READY, then "pong" per SIGUSR1
STUBBORN = textwrap.dedent("""
    import os, signal, sys
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    def pong(signum, frame):
        os.write(1, b"pong\\n")
    signal.signal(signal.SIGUSR1, pong)
    os.write(1, b"READY\\n")
    while True:
        signal.pause()
""")

#: an "agent": starts a Console running STUBBORN, prints its pid, waits to be killed
AGENT = textwrap.dedent("""
    import sys, threading
    from sandbox.vm.console import Console
    box = []
    def start():
        box.append(Console([sys.executable, "-c", sys.argv[1]]))
    t = threading.Thread(target=start)  # a short-lived thread forks, as a STDIO worker would
    t.start(); t.join()
    con = box[0]
    con.wait_for("READY", 60)
    print(con.pid, flush=True)
    sys.stdin.read()
""")


def _pidfd(pid: int) -> int:
    return os.pidfd_open(pid)


def _exited(pidfd: int, timeout_s: float) -> bool:
    ready, _, _ = select.select([pidfd], [], [], timeout_s)
    return bool(ready)


def _thread_gone(native_id: int, timeout_s: float) -> None:
    """Wait until the OS thread has really exited (Thread.join returns a little before)."""
    try:
        fd = os.pidfd_open(native_id, os.O_EXCL)  # PIDFD_THREAD (Linux 6.9)
    except ProcessLookupError:
        return  # already gone
    try:
        assert _exited(fd, timeout_s), f"thread {native_id} did not exit"
    finally:
        os.close(fd)


def test_the_child_dies_with_a_sigkilled_agent_even_ignoring_sighup():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    agent = subprocess.Popen([sys.executable, "-c", AGENT, STUBBORN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=env)
    try:
        line = agent.stdout.readline()
        assert line, f"the agent ended (rc={agent.wait()}) before starting its child"
        child = int(line)
        fd = _pidfd(child)
        try:
            assert not _exited(fd, 0), "the child is not running"
            agent.send_signal(signal.SIGKILL)
            assert agent.wait() == -signal.SIGKILL
            died = _exited(fd, EXIT_WAIT_S)
            if not died:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            assert died, f"child {child} outlived the SIGKILLed agent"
        finally:
            os.close(fd)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        agent.stdin.close()
        agent.stdout.close()


def test_the_child_outlives_the_thread_that_started_it():
    """PR_SET_PDEATHSIG fires when the forking *thread* exits: the spawner thread forks instead."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(Console([sys.executable, "-c", STUBBORN])))
    t.start()
    t.join()
    con = box[0]
    try:
        con.wait_for("READY", 60)
        _thread_gone(t.native_id, EXIT_WAIT_S)
        os.kill(con.pid, signal.SIGUSR1)
        con.wait_for("pong", 60)  # a BootError here: the child was killed with its starting thread
    finally:
        os.kill(con.pid, signal.SIGKILL)  # it ignores SIGTERM
        con.terminate(timeout_s=0)


def test_a_child_orphaned_before_it_was_tied_exits_at_once():
    """The agent died between fork and prctl: the child sees another parent and exits."""
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", "print('ran')"], preexec_fn=lifeline.child_setup(os.getpid() + 10**7),
                         stdout=w)
    os.close(w)
    try:
        assert p.wait() == lifeline.EXIT_ORPHANED
        assert os.read(r, 100) == b"", "the orphaned child ran its program"
    finally:
        os.close(r)


def test_spawner_errors_reach_the_caller():
    def fail():
        raise FileNotFoundError("no such program")

    with pytest.raises(FileNotFoundError):
        lifeline.run_in_spawner(fail)
    with pytest.raises(BootError):
        with Console([sys.executable, "-c", "pass"]) as con:
            con.wait_for("never", 60)
