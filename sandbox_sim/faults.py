"""Fault injection for MemoryHostFS.

One :class:`FaultInjector` is attached to every simulated filesystem of a world (the
working folder and the undo store), so "the k-th host call" counts across both, as
SQLite's I/O-error tests fail the N-th operation for every N.

Faults:

* ``crash_at=k`` — the k-th call (0-based) raises :class:`SimulatedCrash` *before* it
  runs; so does every later call (the process is dead).
* ``crash_if=predicate`` — the same at the first call for which ``predicate(fs_name, op,
  path)`` holds: a crash at a named host call (e.g. the step's promotion), which stays put
  when the core makes more or fewer calls before it.
* ``torn_at=k`` — the k-th call, if it is a write of more than one byte, writes only a
  prefix of its data and then the process crashes.
* ``error_at=(j, errno)`` — the j-th *mutating call on the undo store* fails with that
  errno (ENOSPC, EIO); the process lives on.
* ``error_if=(predicate, errno)`` — *every* call for which ``predicate(fs_name, op, path)``
  holds fails with that errno, for as long as this injector is armed: a disk that stays
  full, a sector that stays bad (the process lives on).

:class:`SimulatedCrash` derives from ``BaseException`` so that no ``except Exception``
in the code under test can swallow a death.
"""

from __future__ import annotations

import errno as _errno
from typing import Callable
import os
import random

STORE_MUTATIONS = frozenset({"create", "write", "truncate", "unlink", "rmdir", "mkdir", "rename", "symlink", "link",
                             "chmod", "utime", "setxattr", "removexattr", "fallocate", "copy_file_range", "fsync",
                             "exchange"})


class SimulatedCrash(BaseException):
    """The process died at this host call."""


class FaultInjector:
    """Counts host calls (``calls``, and ``store_mutations``: mutating calls on the store)
    and injects the faults planned. With nothing planned, no trace and the process alive
    (``_quiet``) a call is only counted, by the same rules as when a fault is planned, so
    positions mean the same whether or not anything is armed.

    Any disk may call the injector as its fault hook. A simulated disk can instead be
    :meth:`attach`-ed: while the injector is quiet the disk has no hook and counts each call
    into the injector itself (``MemoryHostFS.tally``: the same two counts, by the same rules,
    without a Python call per host call); the moment anything is planned, traced or the
    process dies, every attached disk calls the injector again, from its next call on. A
    subclass that defines its own ``__call__`` is always called."""

    def __init__(self, crash_at: int | None = None, torn_at: int | None = None,
                 error_at: tuple[int, int] | None = None, seed: int = 0,
                 error_if: tuple[Callable[[str, str, str], bool], int] | None = None,
                 crash_if: Callable[[str, str, str], bool] | None = None):
        self._crash_at, self._torn_at, self._error_at, self._error_if = crash_at, torn_at, error_at, error_if
        self._crash_if = crash_if
        self._trace: list[tuple[str, str, str]] | None = None
        self._crashed = False
        self._quiet = False
        self._disks: list = []  # the attached simulated disks (attach)
        self.rng = random.Random(seed)
        self.calls = 0
        self.store_mutations = 0
        self.crashed = False  # derives _quiet
        self.injected: list[str] = []

    # The fields that decide whether a call may be faulted: setting one re-derives ``_quiet``
    # (nothing planned, no trace, not dead). Written out, not made by a property factory: a
    # campaign's build compiles this class (sandbox_sim/compiled.py), and a compiled class
    # reads a property only if the class body defines it.

    @property
    def crash_at(self) -> int | None:
        return self._crash_at

    @crash_at.setter
    def crash_at(self, value: int | None) -> None:
        self._crash_at = value
        self._requiet()

    @property
    def crash_if(self) -> Callable[[str, str, str], bool] | None:
        return self._crash_if

    @crash_if.setter
    def crash_if(self, value: Callable[[str, str, str], bool] | None) -> None:
        self._crash_if = value
        self._requiet()

    @property
    def torn_at(self) -> int | None:
        return self._torn_at

    @torn_at.setter
    def torn_at(self, value: int | None) -> None:
        self._torn_at = value
        self._requiet()

    @property
    def error_at(self) -> tuple[int, int] | None:
        return self._error_at

    @error_at.setter
    def error_at(self, value: tuple[int, int] | None) -> None:
        self._error_at = value
        self._requiet()

    @property
    def error_if(self) -> tuple[Callable[[str, str, str], bool], int] | None:
        return self._error_if

    @error_if.setter
    def error_if(self, value: tuple[Callable[[str, str, str], bool], int] | None) -> None:
        self._error_if = value
        self._requiet()

    @property
    def trace(self) -> list[tuple[str, str, str]] | None:
        return self._trace

    @trace.setter
    def trace(self, value: list[tuple[str, str, str]] | None) -> None:
        self._trace = value
        self._requiet()

    @property
    def crashed(self) -> bool:
        return self._crashed

    @crashed.setter
    def crashed(self, value: bool) -> None:
        self._crashed = value
        self._requiet()

    def _requiet(self) -> None:
        quiet = (self._crash_at is None and self._crash_if is None and self._torn_at is None and self._error_at is None
                 and self._error_if is None and self._trace is None and not self._crashed)
        if quiet != self._quiet:
            self._quiet = quiet
            for fs in self._disks:
                self._point(fs)

    def attach(self, fs) -> None:
        """Count (and fault) the calls of the simulated disk ``fs`` (a ``MemoryHostFS``): it
        calls this injector as its fault hook while anything is armed, and only counts into
        it (``fs.tally``) while it is quiet. The same counts either way."""
        if fs not in self._disks:
            self._disks.append(fs)
        self._point(fs)

    def detach(self, fs) -> None:
        """Stop counting ``fs``'s calls: it has no hook and no tally any more."""
        if fs in self._disks:
            self._disks.remove(fs)
            fs.fault_hook = fs.tally = None

    def _point(self, fs) -> None:
        if self._quiet and type(self).__call__ is FaultInjector.__call__:  # a subclass's own __call__ always runs
            fs.fault_hook, fs.tally = None, self
            fs.tally_mutations = STORE_MUTATIONS if fs.name == "store" else frozenset()
        else:
            fs.fault_hook, fs.tally = self, None

    def disarm(self) -> None:
        """After a crash: the next process starts with no faults planned."""
        self.crash_at = self.crash_if = self.torn_at = self.error_at = self.error_if = None
        self.crashed = False

    def __call__(self, fs, op: str, path: str, nbytes: int):
        if self._quiet:
            self.calls += 1
            if op in STORE_MUTATIONS and fs.name == "store":
                self.store_mutations += 1
            return None
        if self.crashed:
            raise SimulatedCrash(f"process already dead ({fs.name}.{op} {path!r})")
        k = self.calls
        self.calls += 1
        if self.trace is not None:
            self.trace.append((fs.name, op, path))
        crash_if = self._crash_if  # called from a local: a compiled build calls self.crash_if(...) as a method
        if self.crash_at == k or (crash_if is not None and crash_if(fs.name, op, path)):
            self.crashed = True
            self.injected.append(f"crash before call {k} ({fs.name}.{op} {path!r})")
            raise SimulatedCrash(f"crash at call {k}: {fs.name}.{op} {path!r}")
        if self.torn_at == k and op == "write" and nbytes > 1:
            n = self.rng.randrange(1, nbytes)
            self.injected.append(f"torn write at call {k} ({fs.name} {path!r}: {n}/{nbytes} bytes)")
            return n
        if self.error_if is not None and self.error_if[0](fs.name, op, path):
            code = self.error_if[1]
            self.injected.append(f"{_errno.errorcode[code]} on {fs.name}.{op} {path!r} (persistent)")
            raise OSError(code, os.strerror(code), path)
        if fs.name == "store" and op in STORE_MUTATIONS:
            j = self.store_mutations
            self.store_mutations += 1
            if self.error_at is not None and self.error_at[0] == j:
                code = self.error_at[1]
                self.injected.append(f"{_errno.errorcode[code]} on store call {j} ({op} {path!r})")
                raise OSError(code, os.strerror(code), path)
        return None

    def after_torn_write(self, fs, path: str, written: int) -> None:
        self.crashed = True
        raise SimulatedCrash(f"crash after a torn write of {written} bytes to {fs.name}:{path!r}")
