"""One MCP connection's state and the tools' implementations: :class:`McpClient`.

A client is made for each connection (``tools/call`` finds it in the connection's state)
and acts on its host's session (:class:`~.host.McpHost`). Invariants:

* **its own view and file service**: the connection gets a
  :class:`~sandbox.files.FileService` (``client="mcp"``) over the session, within the
  server's view (``build_server(view=…)``, default: the session's whole mount table).
  The client's MCP **roots only narrow** it: each root is mapped to a guest path (a
  host path inside a working folder → that folder's guest path), the view becomes the
  roots' common subtree *within the server's view*; a root outside it is refused
  (listed in ``get_session_status.roots_refused``) and never widens anything;
* **every file call is the file service's** (allowlists, bounds, API steps): a
  ``write_file`` or ``edit_file`` outside a command is one undoable API step;
* **nothing blocks the event loop**: session and file calls run in worker threads;
* **a command belongs to its call**: ``execute_command`` runs through
  :meth:`Session.run <sandbox.session.runtime.Session.run>` with a ``cancel`` event that
  is set when its ``timeout_s`` passes, when the call is cancelled, when the client
  disconnects (the handler is cancelled), or when another client of a shared session
  cancels it (the host registers it: :meth:`McpHost.claim_command <.host.McpHost.claim_command>`;
  the result then says ``cancelled``) — the call then waits for the guest to finish
  the command, so its step is always closed before the result (or the cancellation)
  goes out;
* **safeguards are answered through the session's hold broker only**: while this
  connection's command runs (and the host does not leave holds to a frontend), each
  hold is put to the user by MCP elicitation if the client declared it, else decided
  by the host's ``on_hold`` policy; a failed or unanswered elicitation applies the
  policy too. Bounded: :data:`~sandbox.limits.HOLDS_PENDING_PER_SESSION_MAX` holds
  queued per command (one more is decided by the policy at once);
* **bounded results**: command output per stream (:data:`~.limits.COMMAND_OUTPUT_CHARS_MAX`,
  head and tail kept, a marker between), progress notifications
  (:data:`~.limits.PROGRESS_CHUNK_CHARS_MAX` each, at most
  :data:`~.limits.PROGRESS_PENDING_MAX` chunks pending — older pending output is
  dropped with a marker), paths sampled per result (:mod:`.limits`).
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import os
import threading
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.shared.message import ServerMessageMetadata

from ... import __version__
from ...files import READ_FILE_BYTES_MAX, FileService
from ...limits import HOLDS_PENDING_PER_SESSION_MAX
from ...mounts.table import MountTable, PathDenied, guest_path
from ...session.runtime import Session, SessionError
from ..errors import ApiError
from ..payloads import check_exec_text, decode_data, default_cwd, diff_in_view, encode_data, folder_index
from . import models as m
from .errors import McpToolError, tool_error
from .host import McpHost
from .limits import (COMMAND_OUTPUT_CHARS_MAX, DIFF_PATHS_LISTED_MAX, DIFF_TEXT_CHARS_MAX, EDIT_DIFF_CHARS_MAX, ELICITATION_TIMEOUT_S, HISTORY_STEPS_MAX,
                     LIST_ENTRIES_MAX, PROGRESS_CHUNK_CHARS_MAX, PROGRESS_PENDING_MAX, READ_DEFAULT_BYTES, ROOTS_MAX,
                     ROOTS_TIMEOUT_S, STEP_PATHS_SAMPLE_MAX, UNDO_PATHS_LISTED_MAX)

log = logging.getLogger("sandbox.mcp")
Ctx = ServerRequestContext
#: seconds a cancelled command's call waits for the guest to end it (SIGTERM, then SIGKILL) before giving up
CANCEL_WAIT_S = 30.0
UNDO_HINT = "It can be undone with the undo tool (undo count=1 undoes the newest step)."
ELICIT_SCHEMA = {"type": "object", "properties": {"decision": {
    "type": "string", "title": "Allow or deny", "enum": ["allow", "deny"],
    "description": "allow: the command goes on; deny: its changes so far are rolled back"}},
    "required": ["decision"]}


class BoundedText:
    """Text kept within ``limit`` characters: the first half and the newest half; what lies
    between is counted and replaced by a marker line in :meth:`text`."""

    def __init__(self, limit: int):
        self.half = max(1, limit // 2)
        self.head: list[str] = []
        self.head_len = 0
        self.tail: deque[str] = deque()
        self.tail_len = 0
        self.omitted = 0

    def add(self, text: str) -> None:
        room = self.half - self.head_len
        if room > 0:
            self.head.append(text[:room])
            self.head_len += min(room, len(text))
            text = text[room:]
        if not text:
            return
        self.tail.append(text)
        self.tail_len += len(text)
        while self.tail_len > self.half:
            excess = self.tail_len - self.half
            first = self.tail[0]
            if len(first) <= excess:
                self.tail.popleft()
                self.tail_len -= len(first)
                self.omitted += len(first)
            else:
                self.tail[0] = first[excess:]
                self.tail_len -= excess
                self.omitted += excess

    @property
    def truncated(self) -> bool:
        return self.omitted > 0

    def text(self) -> str:
        mid = f"\n[… {self.omitted} characters omitted …]\n" if self.omitted else ""
        return "".join(self.head) + mid + "".join(self.tail)


class _ProgressPump:
    """Command output → progress notifications, from the session's I/O thread to the loop.
    At most :data:`PROGRESS_PENDING_MAX` chunks wait; older ones are dropped (counted).
    A chunk leaves the pump only once its send returned: a send cancelled half-way (the call
    cancels its sender when the command ends) leaves it, and the rest, for the next drain."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: deque[str] = deque()
        self.dropped = 0
        self.wake = asyncio.Event()

    def put(self, text: str) -> None:  # any thread
        with self.lock:
            for i in range(0, len(text), PROGRESS_CHUNK_CHARS_MAX):
                self.pending.append(text[i:i + PROGRESS_CHUNK_CHARS_MAX])
            while len(self.pending) > PROGRESS_PENDING_MAX:
                self.dropped += len(self.pending.popleft())
        try:
            self.loop.call_soon_threadsafe(self.wake.set)
        except RuntimeError:  # the loop is closed: the connection is gone
            pass

    def take(self) -> list[str]:
        with self.lock:
            out = list(self.pending)
            self.pending.clear()
            if self.dropped:
                out.insert(0, f"[… {self.dropped} characters of output not sent as progress …]\n")
                self.dropped = 0
            return out

    def _give_back(self, chunks: list[str]) -> None:
        """Chunks taken but not sent go back in front, oldest first (within the bound)."""
        with self.lock:
            self.pending.extendleft(reversed(chunks))
            while len(self.pending) > PROGRESS_PENDING_MAX:
                self.dropped += len(self.pending.popleft())

    async def drain(self, send: Callable[[str], Awaitable[None]]) -> None:
        """Send every waiting chunk, in order (loop thread). Whatever ``send`` raises —
        cancellation above all — the chunk it was sending and those after it stay."""
        chunks = self.take()
        for i, chunk in enumerate(chunks):
            try:
                await send(chunk)
            except BaseException:
                self._give_back(chunks[i:])
                raise


class _Progress:
    """One call's progress notifications (no-ops unless the client sent a progress token);
    ``progress`` increases with each, as the protocol requires — boot news, then output."""

    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.n = 0

    async def __call__(self, message: str) -> None:
        self.n += 1
        await self.ctx.session.report_progress(self.n, None, message)


class McpClient:
    """One connection: its view, file service, roots, and the tools (module docstring)."""

    def __init__(self, host: McpHost, view: MountTable | None = None):
        self.host = host
        self.base_view = view  # the server's view; None: the session's table
        self.view: MountTable | None = None
        self._base: MountTable | None = None  # the view roots narrow: base_view, else the host's view_of
        self.files: FileService | None = None
        self.session: Session | None = None
        self.roots: list[str] = []
        self.roots_refused: list[str] = []
        self.roots_dirty = True
        self._setup = anyio.Lock()
        self._commands = 0

    # ------------------------------------------------------------------ session, view, roots

    async def ready(self, ctx: Ctx, progress: _Progress | None = None) -> Session:
        """The started session, this connection's file service over it, and its roots applied."""
        s = await self.host.wait_session(progress or _Progress(ctx))
        async with self._setup:
            base = self.base_view if self.base_view is not None else self.host.view_of(s)
            if self.session is not s:
                self.session, self.view, self._base = s, base, base
                self.files = FileService(s, base, client="mcp")
                self.roots_dirty = True
            elif base is not self._base:  # a frontend narrowed the shared session: so does this client
                self.view = self._base = base
                self.files.narrow(base)
                self.roots_dirty = True
            if self.roots_dirty and _declares_roots(ctx):
                self.roots_dirty = False
                await self._apply_roots(ctx)
        return s

    async def _apply_roots(self, ctx: Ctx) -> None:
        try:
            with anyio.fail_after(ROOTS_TIMEOUT_S):
                result = await ctx.session.send_request(
                    types.ListRootsRequest(), types.ListRootsResult,
                    metadata=ServerMessageMetadata(related_request_id=ctx.request_id))
        except Exception as e:  # the client did not answer (in time): the view stays as it is
            log.warning("roots/list failed: %s; the view stays %s", e, self.view.view, extra={"component": "mcp"})
            self.roots_dirty = True
            return
        uris = [str(r.uri) for r in result.roots]
        if len(uris) > ROOTS_MAX:
            log.warning("the client listed %d roots (more than %d): ignored", len(uris), ROOTS_MAX,
                        extra={"component": "mcp"})
            return
        self.apply_roots(uris)

    def apply_roots(self, uris: list[str]) -> None:
        """Narrow this connection's view to ``uris``' common subtree within the base view
        (module docstring); refused roots are remembered, never applied."""
        base = self._base
        inside, refused = [], []
        for uri in uris:
            g = _root_guest_path(base, uri)
            try:
                if g is None:
                    raise PathDenied(f"root {uri} is not in any working folder")
                base.restrict(g)
                inside.append(g)
            except PathDenied:
                refused.append(uri)
        view = base
        if inside:
            common = os.path.commonpath(inside)
            try:
                view = base.restrict(common)
            except PathDenied:  # the roots lie in different mounts: no one subtree holds them all
                log.warning("roots %s share no subtree inside a mount: the view stays %s", inside, base.view,
                            extra={"component": "mcp"})
        if refused:
            log.warning("roots outside the session's view refused (roots only narrow): %s", refused,
                        extra={"component": "mcp"})
        self.roots, self.roots_refused = (inside, refused)
        self.view = view
        self.files.narrow(view)
        self.host.narrow_guest(view)
        log.info("view %s (roots %s)", view.view, inside, extra={"component": "mcp"})

    async def close(self) -> None:
        files, self.files = self.files, None
        if files is not None:
            await anyio.to_thread.run_sync(files.close_all)

    def _folder(self, s: Session, key=None, *, write: bool = False) -> int:
        """The working folder an undo tool acts on (its ``folder`` argument, resolved as STDIO's
        ``directory``: :func:`~sandbox.api.payloads.folder_index`). None: the first folder with
        undo in the view. A named folder must overlap this connection's view (else
        ``fs.access_denied``, reason ``outside_view``: roots only narrow) and have undo (else
        ``session.read_only_directory``). ``write`` (undo): a read-only view is refused."""
        if write and self.view.read_only:
            raise ApiError("fs.access_denied", "this connection's view is read-only: undo would write")
        if key is None:
            for i, (mnt, ws) in enumerate(zip(s.table.folders, s.workspaces)):
                if ws is not None and self.view.view_within(mnt) is not None:
                    return i
            raise ApiError("session.read_only_directory", "no read-write working folder is in view: nothing has undo")
        i = folder_index(s.table, self.view, key)
        mnt = s.table.folders[i]
        if self.view.view_within(mnt) is None:
            raise ApiError("fs.access_denied", f"folder {key!r} is outside this connection's view {self.view.view}",
                           folder=key, view=self.view.view, reason="outside_view")
        if s.workspaces[i] is None:
            raise ApiError("session.read_only_directory", f"folder {mnt.target} is read-only: it has no undo history",
                           folder=mnt.target)
        return i

    # ------------------------------------------------------------------ execute_command

    async def execute_command(self, ctx: Ctx, a: m.ExecuteCommandIn) -> tuple[m.ExecuteCommandOut, str]:
        prog = _Progress(ctx)
        s = await self.ready(ctx, prog)
        check_exec_text("command", a.command)
        if self._commands or s.command_lock.locked():
            raise ApiError("agent.busy", "a command is already running; one runs at a time")
        cwd = default_cwd(self.view)
        cancel, finished = threading.Event(), threading.Event()
        out = {"stdout": BoundedText(COMMAND_OUTPUT_CHARS_MAX), "stderr": BoundedText(COMMAND_OUTPUT_CHARS_MAX)}
        out_lock = threading.Lock()
        pump = _ProgressPump(asyncio.get_running_loop())
        decisions: list[m.SafeguardDecision] = []
        box: dict = {}
        timed_out = False

        def on_output(stream: str, text: str) -> None:  # the session's I/O thread
            with out_lock:
                out["stderr" if stream == "stderr" else "stdout"].add(text)
            pump.put(text)

        def run() -> None:
            try:
                box["result"] = s.run(a.command, on_output, cwd=cwd, cancel=cancel)
            except BaseException as e:  # noqa: BLE001 — handed to the awaiting call
                box["error"] = e
            finally:
                finished.set()

        held: set[str] = set()  # this command's holds (a cancelled command cannot end while one holds it)

        def deny_held() -> None:
            for hid in list(held):
                s.holds.answer(hid, "deny")  # False if it was decided already

        async def timer() -> None:
            nonlocal timed_out
            await anyio.sleep(a.timeout_s)
            timed_out = True
            cancel.set()
            await anyio.to_thread.run_sync(deny_held)
            log.info("command timed out after %g s: cancelled", a.timeout_s, extra={"component": "mcp"})

        async def send_progress() -> None:
            while True:
                await pump.wake.wait()
                pump.wake.clear()
                await pump.drain(prog)

        release = self.host.claim_command(a.command, cancel)  # agent.busy while another client's runs
        self._commands += 1
        unsubscribe = None
        try:
            async with anyio.create_task_group() as tg:
                if not self.host.decides_holds_elsewhere():
                    unsubscribe = self._answer_holds(ctx, s, tg, a.command, decisions, held, cancel)
                tg.start_soon(send_progress)
                if a.timeout_s is not None:
                    tg.start_soon(timer)
                try:
                    await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
                except anyio.get_cancelled_exc_class():
                    cancel.set()  # the client cancelled or went away: so does the command
                    with anyio.CancelScope(shield=True):
                        await anyio.to_thread.run_sync(deny_held)
                        await anyio.to_thread.run_sync(finished.wait, CANCEL_WAIT_S)
                    log.info("command cancelled: the call was cancelled", extra={"component": "mcp"})
                    raise
                tg.cancel_scope.cancel()
            await pump.drain(prog)  # the output's tail (and any a cancelled send left) goes out before the result
        finally:
            self._commands -= 1
            release()
            if unsubscribe is not None:
                unsubscribe()
        if "error" in box:
            e = box["error"]
            if isinstance(e, SessionError):
                raise ApiError("session.guest_failed", f"the guest failed while running the command: {e}") from None
            raise e
        r = box["result"]
        changes = await anyio.to_thread.run_sync(_step_changes, s, r.step_ids)
        with out_lock:
            so, se = out["stdout"], out["stderr"]
            result = m.ExecuteCommandOut(
                exit_code=r.exit_code, signal=r.signal, cancelled=r.cancelled, timed_out=timed_out, step_id=r.step_id,
                stdout=so.text(), stderr=se.text(), stdout_truncated=so.truncated, stderr_truncated=se.truncated,
                changes=changes, safeguards=decisions,
                undo_hint=UNDO_HINT if r.step_id is not None else "No read-write folder: nothing to undo.")
        return result, _command_text(result)

    def _answer_holds(self, ctx: Ctx, s: Session, tg, command: str, decisions: list[m.SafeguardDecision],
                      held: set[str], cancel: threading.Event) -> Callable[[], None]:
        """Subscribe to the session's holds for this command: each is decided in ``tg``
        (and its id kept in ``held``, so a cancelled command's holds can be denied); once
        the command is cancelled, a new hold is denied at once (from a thread of its own:
        a subscriber must not answer synchronously)."""
        loop = asyncio.get_running_loop()
        send, receive = anyio.create_memory_object_stream[dict](HOLDS_PENDING_PER_SESSION_MAX)

        def queue(payload: dict) -> None:  # on the loop
            try:
                send.send_nowait(payload)
            except anyio.WouldBlock:
                tg.start_soon(self._decide, ctx, s, payload, command, decisions, False)

        def on_hold(kind: str, payload: dict) -> None:  # any thread; must not block nor answer here
            if kind == "triggered":
                held.add(payload["safeguard_id"])
                if cancel.is_set():
                    threading.Thread(target=s.holds.answer, args=(payload["safeguard_id"], "deny"),
                                     name="mcp-deny-hold", daemon=True).start()
                    return
                try:
                    loop.call_soon_threadsafe(queue, payload)
                except RuntimeError:
                    pass

        async def dispatch() -> None:
            async with receive:
                async for payload in receive:
                    tg.start_soon(self._decide, ctx, s, payload, command, decisions, True)

        tg.start_soon(dispatch)
        unsubscribe = s.holds.subscribe(on_hold)

        def stop() -> None:
            unsubscribe()
            send.close()

        return stop

    async def _decide(self, ctx: Ctx, s: Session, p: dict, command: str, decisions: list, may_ask: bool) -> None:
        hid = p["safeguard_id"]
        action, by = self.host.on_hold, "policy"
        if may_ask and _declares_elicitation(ctx):
            sample = ", ".join(p.get("sample_paths", [])[:5])
            msg = (f"Safeguard: the command `{command[:200]}` is about to {p.get('kind', 'change')} "
                   f"{p.get('count', '?')} file(s) under {p.get('path') or '/'}"
                   + (f" (e.g. {sample})" if sample else "") + ". Allow it? Deny rolls its changes back."
                   + (f" ({p['message']})" if p.get("message") else ""))
            try:
                with anyio.fail_after(ELICITATION_TIMEOUT_S):
                    r = await ctx.session.elicit_form(msg, ELICIT_SCHEMA, related_request_id=ctx.request_id)
                decision = (r.content or {}).get("decision") if r.action == "accept" else None
                action, by = ("allow" if decision == "allow" else "deny"), "user"
            except TimeoutError:
                by = "timeout"
            except Exception as e:  # the client could not ask: the policy decides
                log.warning("elicitation for safeguard %s failed: %s; --on-hold %s applies", hid, e, action,
                            extra={"component": "safeguard"})
        answered = await anyio.to_thread.run_sync(s.holds.answer, hid, action)
        log.info("safeguard %s: %s (%s)%s", hid, action, by, "" if answered else ": already decided",
                 extra={"component": "safeguard"})
        decisions.append(m.SafeguardDecision(safeguard_id=hid, message=str(p.get("message", "")), action=action,
                                             decided_by=by if answered else "elsewhere"))

    # ------------------------------------------------------------------ files

    async def _files(self, ctx: Ctx) -> FileService:
        await self.ready(ctx)
        return self.files

    async def read_file(self, ctx: Ctx, a: m.ReadFileIn) -> tuple[m.ReadFileOut, str]:
        files = await self._files(ctx)
        length = READ_DEFAULT_BYTES if a.length is None else a.length
        guest, size, data = await anyio.to_thread.run_sync(files.read_range, a.path, a.offset, length)
        text, enc = encode_data(data, "utf-8")
        eof = a.offset + len(data) >= size
        r = m.ReadFileOut(path=guest, size=size, offset=a.offset, length=len(data), content=text, encoding=enc, eof=eof)
        more = "" if eof else f"\n[… {size - a.offset - len(data)} more bytes: read on with offset={a.offset + len(data)} …]"
        head = f"{guest} ({size} bytes" + (", base64" if enc == "base64" else "") + ")\n"
        return r, head + text + more

    async def write_file(self, ctx: Ctx, a: m.WriteFileIn) -> tuple[m.WriteFileOut, str]:
        files = await self._files(ctx)
        data = decode_data(a.content, a.encoding)
        guest = await anyio.to_thread.run_sync(files.write_file, a.path, data)
        r = m.WriteFileOut(path=guest, bytes_written=len(data), undo_hint=UNDO_HINT)
        return r, f"wrote {len(data)} bytes to {guest}. {UNDO_HINT}"

    async def edit_file(self, ctx: Ctx, a: m.EditFileIn) -> tuple[m.EditFileOut, str]:
        files = await self._files(ctx)
        guest, size, data = await anyio.to_thread.run_sync(files.read_range, a.path, 0, None)
        if size > READ_FILE_BYTES_MAX:
            raise ApiError("fs.too_large", f"{guest} is larger than {READ_FILE_BYTES_MAX} bytes: edit it with a command",
                           limit_bytes=READ_FILE_BYTES_MAX)
        try:
            old = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError("fs.invalid_argument", f"{guest} is not UTF-8 text: edit_file edits text files",
                           errno="EINVAL", field="path") from None
        n = old.count(a.old_text)
        if n == 0:
            raise McpToolError("edit.no_match", f"old_text does not occur in {guest}; read the file and copy the "
                               "text exactly (whitespace included)", path=guest)
        if n > 1:
            raise McpToolError("edit.ambiguous", f"old_text occurs {n} times in {guest}; include more surrounding "
                               "text so it occurs exactly once", path=guest, occurrences=n)
        new = old.replace(a.old_text, a.new_text, 1)
        diff = "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                            fromfile="a" + guest, tofile="b" + guest))
        cut = len(diff) > EDIT_DIFF_CHARS_MAX
        if cut:
            diff = diff[:EDIT_DIFF_CHARS_MAX] + f"\n[… diff cut at {EDIT_DIFF_CHARS_MAX} characters …]\n"
        if not a.dry_run:
            await anyio.to_thread.run_sync(files.write_file, guest, decode_data(new, "utf-8"))
        r = m.EditFileOut(path=guest, applied=not a.dry_run, diff=diff, diff_truncated=cut,
                          undo_hint="" if a.dry_run else UNDO_HINT)
        return r, ("dry run, nothing written:\n" if a.dry_run else f"edited {guest}. {UNDO_HINT}\n") + diff

    async def list_directory(self, ctx: Ctx, a: m.ListDirectoryIn) -> tuple[m.ListDirectoryOut, str]:
        files = await self._files(ctx)
        d = await anyio.to_thread.run_sync(files.list, a.path)
        entries = d["entries"]
        shown = [m.DirEntry(**e) for e in entries[:LIST_ENTRIES_MAX]]
        r = m.ListDirectoryOut(path=d["path"], entries=shown, entries_total=len(entries),
                               truncated=d["truncated"] or len(entries) > LIST_ENTRIES_MAX)
        lines = [e.name + ("/" if e.type == "dir" else "@" if e.type == "symlink" else "") for e in shown]
        return r, f"{d['path']}:\n" + "\n".join(lines) + ("\n[… more entries …]" if r.truncated else "")

    # ------------------------------------------------------------------ undo

    async def undo(self, ctx: Ctx, a: m.UndoIn) -> tuple[m.UndoOut, str]:
        s = await self.ready(ctx)
        i = self._folder(s, a.folder, write=True)
        if a.force:
            log.warning("undo forced across barriers in folder %d: external edits will be lost", i,
                        extra={"component": "undo"})
        try:
            result = await anyio.to_thread.run_sync(s.undo, a.count, a.force, i)
        except Exception as e:
            err = tool_error(e)
            if err.code == "undo.barrier":
                paths = err.data.get("paths") or []
                err.message = (f"{err.message} — someone (the user, or a program outside the sandbox) changed "
                               f"{', '.join(map(str, paths[:10])) or 'files'} after that step; undoing would overwrite "
                               "their edit. Ask the user; retry with force=true only if they agree.")
            raise err from e
        target = s.table.folders[i].target
        listed = result.get("paths", []) or []
        paths = [m.RestoredPath(path=_guest_of(target, p["path"]), change=str(p.get("change", "restored")))
                 for p in listed[:UNDO_PATHS_LISTED_MAX]]
        cut = bool(result.get("paths_truncated")) or len(listed) > UNDO_PATHS_LISTED_MAX
        r = m.UndoOut(folder=target, step_ids=list(result.get("step_ids", [])), paths_restored=int(result.get("paths_restored", 0)),
                      paths=paths, paths_truncated=cut, forced=a.force,
                      reread_hint="Files changed under you: re-read the listed paths before editing them again.")
        names = "\n".join(f"  {p.change}: {p.path}" for p in paths) or "  (see paths_restored)"
        return r, (f"undid step(s) {r.step_ids} of {target}: {r.paths_restored} path(s) restored\n{names}\n"
                   f"{r.reread_hint}")

    async def get_undo_history(self, ctx: Ctx, a: m.GetUndoHistoryIn) -> tuple[m.GetUndoHistoryOut, str]:
        s = await self.ready(ctx)
        i = self._folder(s, a.folder)
        ws = s.workspaces[i]
        target = s.table.folders[i].target
        if not ws.undo_available:
            r = m.GetUndoHistoryOut(folder=target, undo_available=False, steps=[], steps_total=0, truncated=False)
            return r, f"{target}: undo is not available"
        steps = await anyio.to_thread.run_sync(ws.history)
        out = [m.HistoryStep(step_id=st["id"], type=str(st.get("type", "command")), command=str(st.get("command", "")),
                             exit_code=st.get("exit_code"), outcome=st.get("outcome"), paths_total=len(st["paths"]),
                             paths_sample=[_guest_of(target, p) for p in st["paths"][:5]],
                             started_ns=st.get("started_ns"), ended_ns=st.get("ended_ns"),
                             barriers_after=len(st.get("barriers", [])))
               for st in steps[:HISTORY_STEPS_MAX]]
        r = m.GetUndoHistoryOut(folder=target, undo_available=True, steps=out, steps_total=len(steps),
                                truncated=len(steps) > HISTORY_STEPS_MAX)
        lines = [f"  step {h.step_id} [{h.type}] {h.command[:80]!r}: {h.paths_total} path(s)"
                 + (f", exit {h.exit_code}" if h.exit_code is not None else "") for h in out]
        return r, f"{target}, newest first:\n" + ("\n".join(lines) or "  (no steps)")

    async def diff_step(self, ctx: Ctx, a: m.DiffStepIn) -> tuple[m.DiffStepOut, str]:
        s = await self.ready(ctx)
        i = self._folder(s, a.folder)
        folder = s.table.folders[i]
        d = await anyio.to_thread.run_sync(diff_in_view, s.workspaces[i], a.step_id, self.view, folder)
        paths, budget = [], DIFF_TEXT_CHARS_MAX
        for e in d["paths"][:DIFF_PATHS_LISTED_MAX]:
            diff = e.get("diff")
            cut = bool(e.get("diff_truncated"))
            if diff is not None and len(diff) > budget:
                diff, cut = None, True
            budget -= len(diff or "")
            paths.append(m.DiffPath(path=_guest_of(folder.target, e["path"]), change=e["change"], kind=e["kind"],
                                    diff=diff, binary=bool(e["binary"]), summary=str(e.get("summary", "")),
                                    diff_truncated=cut))
        r = m.DiffStepOut(folder=folder.target, step_id=d["step_id"], command=str(d.get("command", "")),
                          type=str(d.get("type", "command")), paths=paths, paths_total=d["paths_total"],
                          paths_truncated=bool(d["paths_truncated"]) or len(d["paths"]) > len(paths),
                          approximate=bool(d.get("approximate")))
        lines = [f"{r.folder} step {r.step_id} [{r.type}] {r.command[:80]!r}: {r.paths_total} path(s)"
                 + (" (approximate: changed since)" if r.approximate else "")]
        for p in paths:
            lines.append(f"{p.change}: {p.path}" + (f" — {p.summary}" if p.summary else ""))
            if p.diff:
                lines.append(p.diff.rstrip("\n"))
            elif p.diff_truncated:
                lines.append("  (diff left out: too long here; `sandbox diff` shows it)")
        if r.paths_truncated:
            lines.append(f"… {r.paths_total - len(paths)} more path(s)")
        return r, "\n".join(lines)

    async def get_session_status(self, ctx: Ctx, a: m.NoArgsIn) -> tuple[m.GetSessionStatusOut, str]:
        s = await self.ready(ctx)
        st = await anyio.to_thread.run_sync(s.status)
        folders = [m.FolderOut(index=i, guest_path=mnt.target, host_path=os.path.realpath(f.path),
                               access="read_only" if f.read_only else "read_write",
                               undo_available=bool(ws is not None and ws.undo_available))
                   for i, (f, mnt, ws) in enumerate(zip(s.folders, s.table.folders, s.workspaces))]
        r = m.GetSessionStatusOut(state="running" if s.command_lock.locked() else "idle", vm=str(st["vm"]),
                                  guest=st["guest"], network=st["network"], folders=folders, view=self.view.view,
                                  read_only=self.view.read_only, roots=self.roots, roots_refused=self.roots_refused,
                                  pending_safeguards=len(s.holds.pending()), server_version=__version__)
        lines = [f"  {f.guest_path} ← {f.host_path} ({f.access})" for f in folders]
        return r, (f"{r.state}, VM {r.vm}, network {r.network}, view {r.view}"
                   + (" (read-only)" if r.read_only else "") + "\n" + "\n".join(lines))


# ---------------------------------------------------------------------------- helpers


def _declares(ctx: Ctx, what: str) -> bool:
    caps = ctx.session.client_capabilities
    return caps is not None and getattr(caps, what, None) is not None


def _declares_roots(ctx: Ctx) -> bool:
    return _declares(ctx, "roots")


def _declares_elicitation(ctx: Ctx) -> bool:
    return _declares(ctx, "elicitation")


def _root_guest_path(table: MountTable, uri: str) -> str | None:
    """A root's guest path: a host path inside a working folder → the folder's guest path
    below; a guest path inside a mount → itself; else None."""
    u = urllib.parse.urlparse(uri)
    if u.scheme != "file" or u.netloc not in ("", "localhost"):
        return None
    path = urllib.parse.unquote(u.path)
    if not path.startswith("/") or "\0" in path:
        return None
    real = os.path.realpath(path)
    for mnt in table.folders:
        src = mnt.source
        if src and (real == src or real.startswith(src.rstrip("/") + "/")):
            return mnt.target + real[len(src):]
    try:
        table.resolve(path)
        return guest_path(path)
    except Exception:
        return None


def _guest_of(target: str, rel: str) -> str:
    rel = str(rel)
    return rel if rel.startswith("/") else (target.rstrip("/") + "/" + rel if rel not in ("", ".") else target)


def _step_changes(s: Session, step_ids: list) -> m.StepChanges | None:
    """Counts and a sample of the paths the command's steps changed, per kind of change
    (``Workspace.step_diff``, in the share server's process when the folder is served there)."""
    counts = {"created": 0, "modified": 0, "deleted": 0, "metadata": 0}
    sample: list[m.PathChange] = []
    total, any_step = 0, False
    for i, sid in enumerate(step_ids or []):
        ws = s.workspaces[i] if i < len(s.workspaces) else None
        if sid is None or ws is None:
            continue
        target = s.table.folders[i].target
        try:
            changed = _changed_paths(ws, sid)
        except Exception as e:  # a denied step is gone from history; a damaged one cannot be listed
            log.info("no change list for step %s: %s", sid, e, extra={"component": "mcp"})
            continue
        any_step = True
        total += len(changed)
        for path, change in changed:
            counts[change] += 1
            if len(sample) < STEP_PATHS_SAMPLE_MAX:
                sample.append(m.PathChange(path=_guest_of(target, path), change=change))
    if not any_step:
        return None
    return m.StepChanges(**counts, paths_total=total, sample=sample, sample_truncated=total > len(sample))


def _changed_paths(ws, step_id: int) -> list[tuple[str, str]]:
    d = ws.step_diff(step_id)
    return [(p["path"], p["change"]) for p in d["paths"]]


def _command_text(r: m.ExecuteCommandOut) -> str:
    how = f"signal {r.signal}" if r.signal else f"exit code {r.exit_code}"
    flags = ", timed out" if r.timed_out else ", cancelled" if r.cancelled else ""
    lines = [f"{how}{flags}" + (f", step {r.step_id}" if r.step_id is not None else "")]
    c = r.changes
    if c is not None:
        parts = [f"{c.created} created", f"{c.modified} modified", f"{c.deleted} deleted"]
        if c.metadata:
            parts.append(f"{c.metadata} metadata")
        lines.append("paths: " + ", ".join(parts) + (": " + ", ".join(p.path for p in c.sample[:10]) if c.sample else ""))
    for d in r.safeguards:
        lines.append(f"safeguard {d.safeguard_id}: {d.action} ({d.decided_by})")
    if r.stdout:
        lines.append("--- stdout ---\n" + r.stdout.rstrip("\n"))
    if r.stderr:
        lines.append("--- stderr ---\n" + r.stderr.rstrip("\n"))
    lines.append(r.undo_hint)
    return "\n".join(lines)

