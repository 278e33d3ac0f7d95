"""The ``Guest`` protocol: what a session needs from the machine its commands run in.

A guest mounts the session's shares (one export each, reached through the server's unix
socket, selected by attach name) at their guest paths and runs commands, relaying output
and exit codes. Implementations:

* :class:`sandbox.vm.guest.VmGuest` — a Linux VM in QEMU (SPEC §5), ``guest="vm"``;
* :class:`sandbox.scripted.guest.ScriptedGuest` — real 9P clients running small
  file-operation scripts, no VM (``guest="scripted"``): the documented guest for frontend
  development and tests;
* :class:`sandbox.local.guest.LocalGuest` — commands on the host against FUSE mounts of the
  shares in a private mount namespace (``guest="local"``; undo, not isolation): it serves
  the session's exports itself, so it is given the export table, not the socket;
* anything else a caller passes as ``guest=factory`` (``factory(run_dir) -> Guest``).

Threading contract: :meth:`Guest.boot` and :meth:`Guest.stop` are blocking and called from
a plain thread (never the server's loop); every coroutine is run on the 9P server's loop
(the ``loop`` given to ``boot``) — so a guest must never block that loop on a reply from
the server (a scripted guest attaches its 9P clients from a worker thread).

Invariants a guest keeps: ``stop`` releases everything ``boot`` acquired, whatever point
boot reached, and is idempotent; ``exec`` returns an execution whose ``completed`` future
resolves exactly once to ``{"exit_code": int, "signal": int | None, …}`` (a guest that dies
never resolves it: the session watches :meth:`alive`); ``mount`` either mounts the export
at the target and returns, or raises and leaves nothing mounted.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol, runtime_checkable

from ..vm.guest import GuestMount

__all__ = ["Guest", "GuestMount", "SHARES", "SHARES_LATER", "check_share", "missing_members"]

#: share transports a session can use today, and those that are planned (a clear "not yet").
#: "local": FUSE on the host, with guest="local" (sandbox.local); "virtiofs": a VM's shares as
#: virtio-fs devices (issue 17; a VM guest's default where QEMU offers it, else "9p")
SHARES = ("9p", "local", "virtiofs")
SHARES_LATER: tuple[str, ...] = ()

OutputCallback = Callable[[str, str], None]  # (stream "stdout"|"stderr", text)


@runtime_checkable
class Guest(Protocol):
    """See the module docstring. Attributes: ``accel``, ``accel_reason``, ``boot_s``."""

    accel: str | None
    accel_reason: str | None
    boot_s: float | None

    def boot(self, *, socket_path: str, mounts: list[GuestMount], loop: asyncio.AbstractEventLoop,
             timeout_s: float) -> None:
        """Mount every share (in the order given: shallowest first) and get ready to run
        commands. Blocking; raises on failure with nothing left running."""

    async def exec(self, exec_id: int, command: str, cwd: str, env: dict[str, str],
                   on_output: OutputCallback | None) -> Any:
        """Start ``command``; returns an object whose ``completed`` future resolves to the
        ``step_completed`` dict. Raises ``RuntimeError`` if the guest refuses it."""

    async def cancel(self, exec_id: int) -> None:
        """SIGTERM (then SIGKILL) the command ``exec_id``; a no-op if it is not running."""

    async def rollback_notify(self, step_id: int, paths: list[dict] | None = None, *, step_ids: list[int] | None = None,
                              folder: str | None = None, paths_truncated: bool = False) -> None:
        """Tell the guest an undo happened (its caches may be stale; its processes read it
        from the undo events file): ``step_ids`` undone, newest first (default
        ``[step_id]``), ``folder`` the working folder's guest path, ``paths`` the
        rollback's ``[{path, change}]`` relative to it."""

    async def pause(self) -> bool:
        """Freeze the guest while a safeguard is decided; False if it cannot."""

    async def resume(self) -> None: ...

    async def vm_status(self) -> str:
        """``"running"``, ``"paused"``, ``"stopped"``, … (QMP's words for a VM)."""

    def alive(self) -> bool: ...

    def tail(self, n: int = 20) -> list[str]:
        """The last ``n`` lines of the guest's console (or what it did)."""

    def stop(self) -> None: ...

    async def mount(self, mount: GuestMount) -> None:
        """Live mount (seed 000): attach the export ``mount.aname`` at ``mount.target``
        (read-only if asked) while the guest runs."""

    async def unmount(self, target: str) -> None:
        """Undo :meth:`mount` of ``target``."""


def missing_members(obj_or_cls) -> list[str]:
    """The :class:`Guest` members ``obj_or_cls`` lacks (``[]`` when it implements the protocol)."""
    names = [n for n in dir(Guest) if not n.startswith("_")] + list(Guest.__annotations__)
    return sorted({n for n in names if n not in Guest.__annotations__ and not hasattr(obj_or_cls, n)})


def check_share(share: str) -> str:
    """``share`` if it is a transport a session can use; a clear error otherwise."""
    if share in SHARES:
        return share
    if share in SHARES_LATER:
        raise NotImplementedError(f"share={share!r} is not available yet: the share transports today are "
                                  f"{', '.join(map(repr, SHARES))}")
    raise ValueError(f"share must be one of {', '.join(SHARES + SHARES_LATER)}, not {share!r}")
