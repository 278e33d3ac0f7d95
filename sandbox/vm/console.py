"""QEMU's serial console on a pty (pexpect), drained by one reader thread.

:class:`Console` spawns QEMU with pexpect — a pty, and the child a session and process
group leader of its own — and starts a reader thread at once. The reader is the only
code that reads the pty: it decodes the bytes, feeds an optional log file, a ring of the
last :data:`LINES_MAX` lines (for :meth:`Console.tail` and error messages) and a bounded
search window that :meth:`Console.wait_for` scans for markers. QEMU therefore never
blocks on a full pty, whether or not anyone is waiting for a marker.

Invariants: every wait has a timeout; the search window and the line ring are bounded;
the child is reaped in exactly one place (:meth:`Console._reap`, under the lock) so no
two threads race on ``waitpid``; signals go to the process group only while the leader
is unreaped (its pid, hence the group id, cannot have been reused); :meth:`terminate`
always ends with the child reaped (SIGTERM, then SIGKILL), the reader joined and the pty
closed, and may be called any number of times. QEMU never outlives the agent: it is
forked by :mod:`sandbox.lifeline`'s spawner thread with ``PR_SET_PDEATHSIG=SIGKILL``, so
even a SIGKILLed agent (no ``finally``, no ``__del__``) takes it along — a pty hang-up
alone would not: QEMU may ignore SIGHUP, and another holder of the pty keeps it open.
"""

from __future__ import annotations

import codecs
import collections
import os
import select
import signal
import threading
import time

import pexpect

from .. import lifeline

LINES_MAX = 1000
TAIL_IN_ERRORS = 40
WINDOW_CHARS_MAX = 1 << 20  # text kept for wait_for between markers
READ_CHUNK_BYTES = 65536
READ_POLL_S = 0.2  # how often the reader looks at its stop flag
KILL_WAIT_S = 5.0  # after SIGKILL, the longest we wait for the kernel to let the child go


class BootError(RuntimeError):
    """The guest did not print the marker: QEMU died, or the timeout passed.

    The message carries the last console lines (QEMU's own stderr shares the pty) and
    QEMU's exit status when it died. ``returncode`` is that status (negative: killed by
    that signal) or None when QEMU was still running; ``timed_out`` tells the two apart."""

    def __init__(self, message: str, returncode: int | None = None, timed_out: bool = False):
        super().__init__(message)
        self.returncode = returncode
        self.timed_out = timed_out


def describe_status(returncode: int | None) -> str:
    if returncode is None:
        return "QEMU is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"QEMU was killed by signal {-returncode} ({name})"
    return f"QEMU exited with status {returncode}"


class Console:
    """A running QEMU whose stdio is the guest's serial console (``-serial stdio``)."""

    def __init__(self, cmd: list[str], *, timeout_s: float = 30.0, log_path: str | None = None,
                 env: dict[str, str] | None = None):
        """Spawn ``cmd`` on a pty now. ``timeout_s`` is pexpect's default timeout; every wait
        here takes its own. ``log_path``: the whole console is appended there as it arrives."""
        if not cmd:
            raise ValueError("empty command")
        self.cmd = list(cmd)
        self._lock = threading.Condition()
        self._lines: collections.deque[str] = collections.deque(maxlen=LINES_MAX)
        self._partial = ""  # the current, unterminated line
        self._window = ""  # text not yet consumed by wait_for (bounded)
        self._scan_from = 0  # where the next marker search may start in _window
        self._eof = False
        self._stop = False
        self._returncode: int | None = None
        self._reaped = False
        self._closed = False
        self._log = open(log_path, "a", encoding="utf-8") if log_path else None
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            # from the spawner thread, with the parent-death signal: QEMU dies with the agent
            preexec = lifeline.child_setup(os.getpid())
            self._child = lifeline.run_in_spawner(lambda: pexpect.spawn(
                cmd[0], cmd[1:], encoding="utf-8", codec_errors="replace", timeout=timeout_s, env=env, echo=False,
                preexec_fn=preexec))
        except BaseException:
            if self._log:
                self._log.close()
            raise
        self._child.ptyproc.delayafterclose = 0.0
        self.pid: int = self._child.pid
        # ptyprocess makes the child a session leader, so its process group is its pid
        self._pgid = self.pid
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._pidfd = None
        self._reader = threading.Thread(target=self._read_loop, name=f"qemu-console-{self.pid}", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ reader thread

    def _read_loop(self) -> None:
        fd = self._child.child_fd
        while not self._stop:
            try:
                ready, _, _ = select.select([fd], [], [], READ_POLL_S)
                if not ready:
                    continue
                data = os.read(fd, READ_CHUNK_BYTES)
            except (OSError, ValueError):  # EIO: the child side is gone
                data = b""
            if not data:
                self._feed(self._decoder.decode(b"", final=True), eof=True)
                return
            self._feed(self._decoder.decode(data))

    def _feed(self, text: str, eof: bool = False) -> None:
        text = text.replace("\r", "")
        if self._log and text:
            try:
                self._log.write(text)
                self._log.flush()
            except (OSError, ValueError):
                pass  # a full disk must not stop the draining
        with self._lock:
            if text:
                parts = (self._partial + text).split("\n")
                self._partial = parts.pop()
                self._lines.extend(parts)
                if len(self._partial) > WINDOW_CHARS_MAX:  # a line without end: keep it bounded too
                    self._lines.append(self._partial)
                    self._partial = ""
                self._window += text
                if len(self._window) > WINDOW_CHARS_MAX:
                    cut = len(self._window) - WINDOW_CHARS_MAX
                    self._window = self._window[cut:]
                    self._scan_from = max(0, self._scan_from - cut)
            if eof:
                self._eof = True
            self._lock.notify_all()

    # ------------------------------------------------------------------ waiting

    def wait_for(self, marker: str, timeout_s: float) -> str:
        """The console text since the previous marker up to and including ``marker``.

        Raises :class:`BootError` if QEMU ends first or ``timeout_s`` passes."""
        if not marker:
            raise ValueError("empty marker")
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                i = self._window.find(marker, self._scan_from)
                if i >= 0:
                    end = i + len(marker)
                    text, self._window, self._scan_from = self._window[:end], self._window[end:], 0
                    return text
                self._scan_from = max(0, len(self._window) - len(marker) + 1)
                if self._eof:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(remaining)
            eof = self._eof
        if eof:
            returncode = self.wait(KILL_WAIT_S)  # the pty closes as QEMU exits: reap it
            raise BootError(self._error(f"{describe_status(returncode)} before {marker!r} appeared"), returncode)
        raise BootError(self._error(f"{marker!r} did not appear within {timeout_s:g} s ({describe_status(None)})"),
                        None, timed_out=True)

    def _error(self, headline: str) -> str:
        lines = self.tail(TAIL_IN_ERRORS)
        return f"{headline}; last {len(lines)} console lines:\n" + "\n".join(lines)

    def tail(self, n: int = TAIL_IN_ERRORS) -> list[str]:
        """The last ``n`` console lines (at most :data:`LINES_MAX`), the unfinished one included."""
        with self._lock:
            lines = list(self._lines)
            if self._partial:
                lines.append(self._partial)
        return lines[-n:] if n > 0 else []

    # ------------------------------------------------------------------ process

    def _reap(self) -> bool:
        """Collect the child's status if it has exited (never blocks); True once reaped."""
        with self._lock:
            if self._reaped:
                return True
            if self._child.isalive():  # waitpid(WNOHANG) inside ptyprocess
                return False
            self._reaped = True
            status = self._child.exitstatus
            self._returncode = status if status is not None else -(self._child.signalstatus or 0)
            return True

    def _wait_exit(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self._reap():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            pidfd = self._pidfd
            if pidfd is not None:
                try:
                    select.select([pidfd], [], [], remaining)  # readable once the child has exited
                    continue
                except (OSError, ValueError):
                    pass
            time.sleep(min(0.01, remaining))  # no pidfd (old kernel): a short poll
        return True

    def alive(self) -> bool:
        return not self._reap()

    @property
    def returncode(self) -> int | None:
        """QEMU's exit status once it has ended and been reaped (negative: killed by that signal)."""
        self._reap()
        return self._returncode

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for QEMU to end on its own; its returncode, or None if it still runs."""
        self._wait_exit(timeout_s)
        return self._returncode

    def _signal(self, sig: int) -> None:
        with self._lock:
            if self._reaped:
                return
            try:
                os.killpg(self._pgid, sig)
            except ProcessLookupError:
                pass

    def terminate(self, timeout_s: float = 5.0) -> int | None:
        """End QEMU: SIGTERM to its process group, SIGKILL after ``timeout_s``; reap it, stop
        the reader and close the pty. Idempotent. Returns QEMU's returncode."""
        if not self._reap():
            self._signal(signal.SIGTERM)
            if not self._wait_exit(timeout_s):
                self._signal(signal.SIGKILL)
                if not self._wait_exit(KILL_WAIT_S):
                    raise RuntimeError(f"QEMU (pid {self.pid}) survived SIGKILL for {KILL_WAIT_S:g} s")
        self._close()
        return self._returncode

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop = True
        if self._reader is not threading.current_thread():
            self._reader.join(READ_POLL_S * 10)
        self._child.close(force=True)
        with self._lock:
            self._eof = True  # the reader may have stopped before it saw EOF: no wait_for may hang now
            self._lock.notify_all()
            pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            os.close(pidfd)
        if self._log:
            self._log.close()

    def __enter__(self) -> Console:
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()

    def __del__(self) -> None:  # last resort: never leave a QEMU running behind a lost Console
        try:
            if not self._closed:
                self.terminate(timeout_s=1.0)
        except Exception:
            pass
