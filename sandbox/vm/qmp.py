"""QMP — QEMU's control protocol — through the ``qemu.qmp`` library (asyncio).

A thin, bounded wrapper: every command has a timeout, and every failure — connection,
protocol, a command's error reply — surfaces as :class:`QmpError` carrying QMP's error
class and description when QEMU sent one. The library client is created in
:meth:`Qmp.connect`, so the object belongs to the event loop it was connected on.

QMP events (STOP, RESUME, …) are not consumed here, so the library's default
all-events listener (which cannot be removed) is given a filter that refuses every
event: it would otherwise keep each one in its queue and its history forever.
"""

from __future__ import annotations

import asyncio
import time

from qemu.qmp import ConnectError, ExecInterruptedError, ExecuteError, QMPClient, QMPError

COMMAND_TIMEOUT_S = 10.0
CONNECT_RETRY_S = 0.05  # QEMU creates the socket at start-up: retry until it is there


class QmpError(RuntimeError):
    """A QMP command or connection failed; ``error_class``/``desc`` as QEMU reported them."""

    def __init__(self, message: str, error_class: str | None = None, desc: str | None = None):
        super().__init__(message)
        self.error_class = error_class
        self.desc = desc


class Qmp:
    def __init__(self, name: str = "sandbox", command_timeout_s: float = COMMAND_TIMEOUT_S):
        self.name = name
        self.command_timeout_s = command_timeout_s
        self._client: QMPClient | None = None

    async def connect(self, socket_path: str, timeout_s: float = 10.0) -> None:
        """Connect and negotiate capabilities, retrying while the socket is not there yet."""
        if self._client is not None:
            raise QmpError("already connected")
        deadline = time.monotonic() + timeout_s
        last: BaseException | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise QmpError(f"no QMP session on {socket_path} within {timeout_s:g} s: {last}")
            client = QMPClient(self.name)
            client.events.event_filter = _no_events  # see the module docstring
            try:
                await asyncio.wait_for(client.connect(socket_path), remaining)
            except ConnectError as e:
                last = e.exc
                if not isinstance(e.exc, (FileNotFoundError, ConnectionRefusedError)):
                    raise QmpError(f"cannot connect to QMP on {socket_path}: {e}") from e
                await asyncio.sleep(min(CONNECT_RETRY_S, max(0.0, deadline - time.monotonic())))
                continue
            except TimeoutError:
                await _quietly_disconnect(client)
                last = TimeoutError("no QMP greeting")
                continue
            self._client = client
            return

    async def execute(self, cmd: str, args: dict | None = None) -> object:
        """Run one QMP command; its ``return`` value."""
        client = self._client
        if client is None:
            raise QmpError(f"{cmd}: not connected")
        try:
            return await asyncio.wait_for(client.execute(cmd, args), self.command_timeout_s)
        except ExecuteError as e:
            raise QmpError(f"{cmd}: {e.error_class}: {e}", e.error_class, str(e)) from e
        except TimeoutError:
            raise QmpError(f"{cmd}: no reply within {self.command_timeout_s:g} s") from None
        except (QMPError, OSError, EOFError) as e:
            raise QmpError(f"{cmd}: {type(e).__name__}: {e}") from e

    async def status(self) -> str:
        """The run state (``query-status``): "running", "paused", "shutdown", …"""
        result = await self.execute("query-status")
        if not isinstance(result, dict) or "status" not in result:
            raise QmpError(f"query-status: unexpected reply {result!r}")
        return str(result["status"])

    async def stop(self) -> None:
        await self.execute("stop")

    async def cont(self) -> None:
        await self.execute("cont")

    async def powerdown(self) -> None:
        """ACPI power button: the guest decides whether to shut down."""
        await self.execute("system_powerdown")

    async def quit(self) -> None:
        """QEMU exits at once. QEMU may hang up before its reply is read; that counts as done."""
        client = self._client
        if client is None:
            raise QmpError("quit: not connected")
        try:
            await asyncio.wait_for(client.execute("quit"), self.command_timeout_s)
        except ExecInterruptedError:
            pass
        except ExecuteError as e:
            raise QmpError(f"quit: {e.error_class}: {e}", e.error_class, str(e)) from e
        except TimeoutError:
            raise QmpError(f"quit: no reply within {self.command_timeout_s:g} s") from None
        await self.close()

    async def close(self) -> None:
        """Disconnect (idempotent); a connection QEMU already dropped is not an error."""
        client, self._client = self._client, None
        if client is not None:
            await _quietly_disconnect(client)


def _no_events(_event: object) -> bool:
    return False


async def _quietly_disconnect(client: QMPClient) -> None:
    try:
        await asyncio.wait_for(client.disconnect(), COMMAND_TIMEOUT_S)
    except (QMPError, OSError, EOFError, TimeoutError):
        pass
