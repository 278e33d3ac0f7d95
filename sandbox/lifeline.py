"""Child processes that never outlive the agent: ``PR_SET_PDEATHSIG=SIGKILL``, set right.

Every process the agent starts for a session (QEMU, a file server) must die with the agent,
however the agent dies — SIGKILL included, where no ``finally`` and no ``atexit`` runs. The
kernel offers exactly that: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` in the child, between fork
and exec, makes the kernel SIGKILL the child when its parent goes away. Two traps, and how
this module avoids them:

* The signal fires when the **thread** that forked the child exits, not the process (the
  kernel reparents the child to a sibling thread and still sends it). A session may be
  started from a short-lived thread (a STDIO API worker), so every fork goes through
  :func:`run_in_spawner`: one daemon thread, started once, that lives as long as the
  process and does nothing but fork.
* If the agent dies between fork and the ``prctl``, the child is already an orphan and
  no signal will ever come: the child compares ``getppid()`` with the agent's pid after the
  ``prctl`` and exits at once when they differ (:func:`child_setup`).

Invariants: :func:`child_setup` runs only in a freshly forked child, calls nothing but
``prctl``/``getppid``/``_exit`` (all async-signal-safe; the ``prctl`` pointer is resolved
before any fork); the spawner thread never ends while the process lives; a spawn request
waits at most ``SPAWN_TIMEOUT_S`` for the spawner (it is raised as TimeoutError).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

PR_SET_PDEATHSIG = 1
SPAWN_TIMEOUT_S = 60.0  # a fork + exec of QEMU takes milliseconds; the spawner is never busy for long
EXIT_ORPHANED = 125  # the child's status when the agent died before it was tied to the agent

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
    _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _prctl.restype = ctypes.c_int
except (OSError, AttributeError):  # not Linux: there is no parent-death signal to set
    _prctl = None


def child_setup(parent_pid: int) -> Callable[[], None]:
    """The ``preexec_fn`` that ties a child to ``parent_pid`` (the agent's pid, read before the fork)."""
    prctl = _prctl

    def setup() -> None:
        if prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(EXIT_ORPHANED)  # cannot be tied to the agent: never run untied
        if os.getppid() != parent_pid:  # the agent died before the prctl: nobody would kill us
            os._exit(EXIT_ORPHANED)

    return setup


_requests: queue.SimpleQueue = queue.SimpleQueue()
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _serve() -> None:
    while True:
        fn, done, box = _requests.get()
        try:
            box.append((True, fn()))
        except BaseException as e:  # handed to the caller, who re-raises it
            box.append((False, e))
        done.set()


def _ensure_spawner() -> None:
    global _spawner
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_serve, name="sandbox-spawner", daemon=True)
            _spawner.start()


def run_in_spawner(fn: Callable[[], T]) -> T:
    """Run ``fn`` (something that forks, with :func:`child_setup` as its preexec) on the
    spawner thread and return its result or raise its exception. Called from the spawner
    thread itself, it just runs ``fn``."""
    if threading.current_thread() is _spawner:
        return fn()
    _ensure_spawner()
    done = threading.Event()
    box: list = []
    _requests.put((fn, done, box))
    if not done.wait(SPAWN_TIMEOUT_S):
        raise TimeoutError(f"the spawner thread did not answer within {SPAWN_TIMEOUT_S:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value
