"""The ``sandbox`` command.

Exit codes: 0 success · 1 nothing to undo / the operation failed · 2 bad usage or input
· 3 refused: an undo barrier or an external change is in the way (``--force``) ·
4 undo unavailable: format version mismatch (``sandbox discard``), unprotected or
corrupt step, or an earlier undo that cannot finish · 5 the undo store is in use by another process.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile

from . import __version__
from .api.logs import LEVELS as LOG_LEVELS, setup_logging
from .core.errors import (BarrierInTheWay, CorruptStep, NothingToUndo, RollbackIncomplete, SandboxError, StepError,
                          StepUnprotected, UndoUnavailable)
from .core.workspace import Workspace, default_state_dir
from .hostfs import PathError, StoreBusy

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_UNAVAILABLE, EXIT_BUSY = 0, 1, 2, 3, 4, 5
#: the sample project `sandbox demo` copies and wrecks (package data)
SAMPLE_PROJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sample-project")


class CliError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _state_dir(args) -> str:
    return args.state_dir or default_state_dir(args.workdir)


def _check_store(args, must_exist: bool = True) -> str:
    if not os.path.isdir(args.workdir):
        raise CliError(f"working folder {args.workdir!r} does not exist or is not a directory", EXIT_USAGE)
    state = _state_dir(args)
    if must_exist and not os.path.exists(os.path.join(state, "VERSION")) and not os.path.exists(os.path.join(state, "steps")):
        raise CliError(f"no undo history for {os.path.realpath(args.workdir)} (looked in {state}); "
                       "pass --state-dir if the store lives elsewhere", EXIT_FAILED)
    return state


def _open(args, must_exist: bool = True, **kwargs) -> Workspace:
    return _recovered(Workspace.open(args.workdir, state_dir=_check_store(args, must_exist), **kwargs))


def _recovered(ws: Workspace) -> Workspace:
    """``ws``, having said on stderr what opening its store recovered."""
    if ws.recovery:
        print(f"sandbox: {describe_recovery(ws.recovery)}", file=sys.stderr)
        r = ws.recovery
        if r.get("message") and r.get("kind") != "rollback_incomplete":
            print(f"sandbox: warning: {r['message']}", file=sys.stderr)
    return ws


def describe_recovery(r: dict) -> str:
    """One line for a recovery report (what opening the store finished, or could not)."""
    step, n = r.get("step_id"), r.get("paths_restored", 0)
    kind = r.get("kind")
    if kind == "rollback_incomplete":
        return f"warning: {r.get('message')}"
    if kind == "rollback_finished":
        return f"recovered: an interrupted undo of step {step} was finished, {n} path(s) restored"
    if kind == "unprotected_step_kept":
        return f"recovered: an interrupted step ({step}) was unprotected: kept as it is, it cannot be undone"
    gone = "some of its changes remain, see below" if r.get("message") else "its changes are gone from the folder"
    return f"recovered: an interrupted step ({step}) never finished and was rolled back, {n} path(s) restored ({gone})"


def _when(ns: int | None) -> str:
    if not ns:
        return "-"
    return _dt.datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def print_history(hist: list[dict]) -> None:
    """The history table (newest first) that `sandbox history` and `sandbox shell` print."""
    if not hist:
        print("no steps in history")
        return
    print(f"{'id':>5}  {'type':8} {'ended':19}  {'exit':>4}  {'paths':>5}  {'notes':24} command")
    for h in hist:
        notes = []
        if h["unprotected"]:
            notes.append("UNPROTECTED")
        if h["outcome"] != "completed":
            notes.append(h["outcome"])
        if h.get("corrupt"):
            notes.append("CORRUPT")
        for b in h["barriers"]:
            notes.append(f"barrier#{b['id']}")
        exit_code = "-" if h["exit_code"] is None else str(h["exit_code"])
        print(f"{h['id']:>5}  {h['type']:8} {_when(h['ended_ns']):19}  {exit_code:>4}  {len(h['paths']):>5}  "
              f"{','.join(notes):24} {h['command']}")
        for b in h["barriers"]:
            print(f"{'':7}^ barrier #{b['id']}: {b['reason']} ({', '.join(b['paths'][:5]) or 'paths unknown'}) — "
                  "undo across it needs --force")
        if h.get("corrupt"):
            print(f"{'':7}! {h['corrupt']}")


def cmd_history(args) -> int:
    with _open(args) as ws:
        hist = ws.history()
        if args.json:
            json.dump({"workdir": os.path.realpath(args.workdir), "steps": hist}, sys.stdout, indent=2)
            print()
            return EXIT_OK
        print_history(hist)
        return EXIT_OK


def cmd_undo(args) -> int:
    if args.n < 1:
        raise CliError("-n must be at least 1", EXIT_USAGE)
    with _open(args) as ws:
        r = ws.recovery or {}
        if r.get("kind") == "rollback_finished":
            # the user is most likely retrying that very undo: finishing it is the whole answer
            print(f"undone: step(s) {r.get('step_id')} (an undo that had stopped part-way); nothing more was "
                  "undone — run `sandbox undo` again for more")
            return EXIT_OK
        if ws.rollback_pending:
            ws.finish_pending()  # RollbackIncomplete (exit 4) if it still cannot finish
        hist = ws.history()
        if not hist:
            raise CliError(f"nothing to undo: no steps in the undo history of {os.path.realpath(args.workdir)}",
                           EXIT_FAILED)
        if len(hist) < args.n:
            raise CliError(f"nothing undone: only {len(hist)} step(s) in history, cannot undo {args.n}", EXIT_FAILED)
        todo = hist[: args.n]
        print(f"undoing {len(todo)} step(s): " + ", ".join(f"{h['id']} ({h['command'] or h['type']})" for h in todo),
              file=sys.stderr, flush=True)
        try:
            result = ws.rollback(args.n, force=args.force)
        except OSError as e:
            if isinstance(e, RollbackIncomplete) or not ws.rollback_pending:
                raise
            where = f" on {e.filename}" if e.filename else ""
            raise CliError(f"the undo stopped part-way: {e.strerror or e}{where}. It is finished by the next "
                           "`sandbox undo` or open once the cause is fixed; or start over with "
                           f"`{_discard_command(args)} --yes` (the folder stays as it is now)", EXIT_FAILED) from None
        print(f"undone: step(s) {', '.join(str(i) for i in result['step_ids'])}; "
              f"{result['paths_restored']} path(s) restored")
        return EXIT_OK


# -- step diffs (issue 14): `sandbox diff`
def cmd_diff(args) -> int:
    """What one step changed, preimage vs now, from the folder's undo store (no VM, reads only)."""
    from .core.diff import step_diff

    if args.step is None and args.n < 1:
        raise CliError("-n must be at least 1", EXIT_USAGE)
    with _open(args) as ws:
        step_id = args.step
        if step_id is None:
            hist = ws.history()
            if len(hist) < args.n:
                raise CliError(f"only {len(hist)} step(s) in the undo history of {os.path.realpath(args.workdir)}",
                               EXIT_FAILED)
            step_id = hist[args.n - 1]["id"]
        d = step_diff(ws, step_id)
    if args.json:
        json.dump(d, sys.stdout, indent=2)
        print()
        return EXIT_OK
    more = f", {len(d['paths'])} listed" if d["paths_truncated"] else ""
    print(f"step {d['step_id']} ({d['type']}): {d['command']}\n{d['paths_total']} path(s) changed{more}"
          + (" (approximate: the folder has changed a lot since)" if d.get("approximate") else ""))
    for e in d["paths"]:
        print(f"{e['change']:9} {e['kind']:8} {e['path']}" + (f"  ({e['summary']})" if e["summary"] else ""))
        if e["diff"]:
            sys.stdout.write(e["diff"])
        if e["diff_truncated"] and e["diff"]:
            print("[diff truncated]")
    return EXIT_OK
# -- end step diffs


def cmd_discard(args) -> int:
    if not args.yes:
        raise CliError("discarding deletes all undo history for this folder; confirm with --yes", EXIT_USAGE)
    # not _open: nothing is recovered or read first, so this works whatever state the store is in
    Workspace.discard_store(args.workdir, _check_store(args))
    print(f"undo history discarded; a fresh store is ready at {_state_dir(args)}")
    return EXIT_OK


def cmd_demo(args) -> int:
    """A sandbox session on the sample project: a destructive step, then its undo."""
    from .hostfs.real import RealHostFS

    sample = args.sample or SAMPLE_PROJECT
    if not os.path.isdir(sample):
        raise CliError(f"sample project not found at {sample}", EXIT_USAGE)
    base = tempfile.mkdtemp(prefix="sandbox-demo-")
    try:
        work = os.path.join(base, "project")
        shutil.copytree(sample, work, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))  # pip byte-compiles package data
        state = os.path.join(base, "undo-store")
        print(f"working folder: {work}\nundo store:     {state}\n")

        def listing() -> dict:
            fs = RealHostFS(work)
            out = {}

            def walk(p):
                for name in sorted(fs.listdir(p)):
                    c = f"{p}/{name}" if p else name
                    st = fs.lstat(c)
                    out[c] = (st.kind, st.mode, st.mtime_ns, fs.read_all(c) if st.kind == "reg" else None)
                    if st.kind == "dir":
                        walk(c)
            walk("")
            fs.close()
            return out

        before = listing()
        print(f"before: {len(before)} entries — " + ", ".join(sorted(k for k in before if "/" not in k)))
        destructive = "rm -rf * && echo 'oops' > README.md"
        if args.in_process:
            print("(in process: the step is made through the undo core directly, no VM)\n")
            with Workspace.open(work, state_dir=state) as ws:
                with ws.step(destructive):
                    for name in sorted(os.listdir(work)):
                        ws.fs.remove_tree(name)
                    ws.fs.write_file("README.md", b"oops\n")
        else:
            from .session.runtime import Folder, Session, SessionError

            progress = lambda msg: print(f"sandbox: {msg}", flush=True)  # noqa: E731
            try:
                with Session([Folder(work)], state_dirs=[state], progress=progress, as_root=args.as_root,
                             guest_root=args.guest_root, guest_packages=_guest_packages(args)) as session:
                    print(f"\nguest$ cd /mnt/working/0 && {destructive} && ls -la", flush=True)
                    r = session.run(destructive + " && ls -la", _stream)
                    print(f"(step {r.step_id}, exit {r.exit_code}; the VM is stopped now)", flush=True)
            except SessionError as e:
                raise CliError(f"{e}\n(`sandbox demo --in-process` shows the undo core without a VM)", EXIT_FAILED) from None
        print(f"\non the host after `{destructive}`: {sorted(os.listdir(work))}\n")
        rc = cmd_history(argparse.Namespace(workdir=work, state_dir=state, json=False))
        print()
        rc = rc or cmd_undo(argparse.Namespace(workdir=work, state_dir=state, n=1, force=False))
        after = listing()
        same = before == after
        print(f"after undo: {len(after)} entries — tree {'IDENTICAL to the original (bytes, modes, mtimes)' if same else 'DIFFERS'}")
        return EXIT_OK if same and rc == 0 else EXIT_FAILED
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"kept {base}")


def _guest_root_args(sp, build: bool = False) -> None:
    """--guest-root/--guest-packages (issue 13) on the session commands and `guest build`."""
    sp.add_argument("--guest-root", choices=["host-usr", "image"], default="host-usr",
                    help=("also build (or locate) this guest root: image builds the Debian root a session with "
                          "--guest-root image uses (default host-usr: nothing to build)" if build else
                          "the guest's userland: host-usr (default; the host's /usr read-only and an allowlisted /etc) "
                          "or image (a Debian root built once by mmdebstrap from the host's apt sources, cached)"))
    sp.add_argument("--guest-packages", metavar="PKG,…",
                    help="the image root's Debian packages (default: " + ",".join(_default_packages())
                         + "; python3 is always added)")


def _default_packages():
    from .vm.imageroot import DEFAULT_PACKAGES
    return DEFAULT_PACKAGES


def _guest_packages(args) -> list[str] | None:
    """The --guest-packages list (None when not given); a usage error without --guest-root image."""
    from .vm.imageroot import parse_packages

    if args.guest_packages is None:
        return None
    if args.guest_root != "image":
        raise CliError("--guest-packages needs --guest-root image", EXIT_USAGE)
    return parse_packages(args.guest_packages)


def _session(args, *, ask: bool = True, progress=None, **session_kw):
    """A vm.Session from run/shell/mcp arguments (imported lazily: history/undo need no VM code).
    ``ask``: holds are decided here by --on-hold (False: the caller answers them through
    the session's hold broker); ``progress``: boot messages (default: plain lines on stderr);
    ``session_kw``: more Session options (``guest``, ``external_policy``)."""
    from .core.safeguard import SafeguardConfig
    from .session.runtime import Folder, Session

    folders = [Folder.parse(w) for w in args.workdir]
    if getattr(args, "local", False):  # -- local guest (issue 16)
        session_kw["guest"] = "local"
    if getattr(args, "share", None) is not None:  # -- virtio-fs (issue 17)
        if session_kw.get("guest") == "local" and args.share != "9p":
            raise CliError("--share virtiofs is for a VM guest (--local serves the folders over FUSE on the host)",
                           EXIT_USAGE)
        session_kw["share"] = args.share
    if getattr(args, "virtiofs_direct_io", None) is not None:  # -- virtio-fs (issue 17)
        session_kw["virtiofs_direct_io"] = args.virtiofs_direct_io
    for f in folders:
        if not os.path.isdir(f.path):
            raise CliError(f"working folder {f.path!r} does not exist or is not a directory", EXIT_USAGE)
    safeguard = SafeguardConfig(delete_threshold=args.delete_threshold) if args.delete_threshold else None
    decide = None
    if args.delete_threshold and ask:
        decide = _hold_decider(args.on_hold)
    network, _, allow = args.network.partition(":")
    if network not in ("disabled", "open", "allowlist") or (network == "allowlist") != bool(allow):
        raise CliError(f"--network wants disabled, open or allowlist:CIDR|DOMAIN,…, not {args.network!r}", EXIT_USAGE)
    try:
        return Session(folders, network=network, allow=allow.split(",") if allow else None, vm_mode=args.vm_mode,
                       memory_mb=args.memory, safeguard=safeguard, decide=decide,
                       state_dirs=[args.state_dir] + [None] * (len(folders) - 1),
                       as_root=args.as_root,  # -- the guest user (issue 13)
                       guest_root=args.guest_root, guest_packages=_guest_packages(args),  # -- guest root (issue 13)
                       share_servers=args.share_servers,  # -- confined share servers (issue 13)
                       **session_kw,
                       progress=progress or (lambda msg: print(f"sandbox: {msg}", file=sys.stderr, flush=True)))
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None


def _hold_decider(policy: str):
    def decide(hold) -> str:
        print(f"\nsandbox: SAFEGUARD {hold.id}: {hold.message}\n  e.g. {', '.join(hold.sample_paths[:5])}",
              file=sys.stderr, flush=True)
        if policy in ("allow", "deny"):
            print(f"sandbox: {policy} (--on-hold {policy})", file=sys.stderr, flush=True)
            return policy
        try:
            with open("/dev/tty", "r+b", buffering=0) as tty:  # unbuffered: a text "r+" tty is refused as unseekable
                tty.write(b"sandbox: allow it? [y/N] ")
                return "allow" if tty.readline().strip().lower() in (b"y", b"yes") else "deny"
        except OSError:
            print("sandbox: no terminal to ask on: denied", file=sys.stderr, flush=True)
            return "deny"
    return decide


def _stream(stream: str, text: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(text)
    out.flush()


def cmd_run(args) -> int:
    """Boot a guest, run COMMAND as one step, stream its output, exit with its exit code."""
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    command = _command_line(words)
    if not command:
        raise CliError("give the command after --, e.g. sandbox run --workdir . -- make test", EXIT_USAGE)
    from .session.runtime import SessionError

    try:
        with _session(args) as session:
            result = session.run(command, _stream)
    except SessionError as e:
        raise CliError(str(e), EXIT_FAILED) from None
    how = f"signal {result.signal}" if result.signal else f"exit {result.exit_code}"
    if result.step_id is not None:
        first = _folder_path(args.workdir[0])
        state = f" --state-dir {args.state_dir}" if args.state_dir else ""
        print(f"sandbox: step {result.step_id} ({how}{', cancelled' if result.cancelled else ''}); "
              f"undo it with: sandbox undo --workdir {first}{state}", file=sys.stderr)
    return result.exit_code


def _command_line(words: list[str]) -> str:
    """One word is a shell command line as it is (``-- 'rm -rf build && make'``); several are an
    argv, quoted for the shell so each stays one word (``-- sh -c 'rm -rf src && echo gone'``)."""
    import shlex

    return (words[0] if len(words) == 1 else shlex.join(words)).strip()


def _folder_path(spec: str) -> str:
    """The path part of a --workdir spec (DIR or DIR:ro)."""
    from .session.runtime import Folder

    return Folder.parse(spec).path


SHELL_HELP = """\
each line runs in the guest as one step (cwd: /mnt/working/0). Built in:
  :history        the undo history of the first working folder
  :undo [N]       undo the newest N steps (default 1); the guest sees it at once
  :help           this text
  :quit           stop the VM (or Ctrl-D)"""


def cmd_shell(args) -> int:
    """An interactive loop: each line is one step; :undo and :history built in."""
    from .core.errors import SandboxError
    from .session.runtime import SessionError

    try:
        with _session(args) as session:
            print(SHELL_HELP, file=sys.stderr)
            while True:
                try:
                    line = input("sandbox> ")
                except EOFError:
                    print(file=sys.stderr)
                    return EXIT_OK
                except KeyboardInterrupt:
                    print(file=sys.stderr)
                    continue
                line = line.strip()
                if not line:
                    continue
                if line in (":quit", ":q", ":exit"):
                    return EXIT_OK
                if line == ":help":
                    print(SHELL_HELP)
                elif line == ":history":
                    print_history(session.history())
                elif line.split()[0] == ":undo":
                    parts = line.split()
                    try:
                        n = int(parts[1]) if len(parts) > 1 else 1
                        r = session.undo(n)
                        print(f"undone: step(s) {', '.join(str(i) for i in r['step_ids'])}; "
                              f"{r['paths_restored']} path(s) restored")
                    except (ValueError, SandboxError) as e:
                        print(f"sandbox: {getattr(e, 'message', e)}", file=sys.stderr)
                elif line.startswith(":"):
                    print(f"sandbox: unknown command {line.split()[0]} (:help lists them)", file=sys.stderr)
                else:
                    r = session.run(line, _stream)
                    if r.exit_code:
                        print(f"[step {r.step_id}: exit {r.exit_code}]", file=sys.stderr)
    except SessionError as e:
        raise CliError(str(e), EXIT_FAILED) from None


def cmd_guest(args) -> int:
    """Build (or locate) the guest image; or forget a persistent VM's disk."""
    from .vm import image as vm_image
    from .session.runtime import Folder, Session

    if args.action == "build":
        if args.guest_root == "image":  # refuse a bad package list before any download
            from .vm.imageroot import validate_packages
            try:
                validate_packages(_guest_packages(args))
            except ValueError as e:
                raise CliError(str(e), EXIT_USAGE) from None
        print("sandbox: fetching Debian's kernel package and building the initramfs (cached) …", file=sys.stderr)
        try:
            img = vm_image.guest_image()
        except vm_image.ImageError as e:
            raise CliError(str(e), EXIT_FAILED) from None
        print(f"kernel:    {img.vmlinuz}\ninitramfs: {img.initrd}")
        if args.guest_root == "image":  # -- guest root (issue 13)
            from .vm import imageroot

            try:
                root = imageroot.ensure_root(_guest_packages(args),
                                             progress=lambda m: print(f"sandbox: {m}", file=sys.stderr, flush=True))
            except (ValueError, imageroot.ImageRootError) as e:
                raise CliError(str(e), EXIT_FAILED if isinstance(e, imageroot.ImageRootError) else EXIT_USAGE) from None
            print(f"image root: {root}")
        return EXIT_OK
    if not args.workdir:
        raise CliError("guest reset needs --workdir DIR (the first working folder of the persistent VM)", EXIT_USAGE)
    Session([Folder(args.workdir)]).reset()
    print(f"sandbox: the persistent VM of {os.path.realpath(args.workdir)} was reset; the next session boots a fresh one")
    return EXIT_OK


def cmd_serve(args) -> int:
    """The STDIO API until stdin closes."""
    from .api.protocol import SCHEMA_PATH
    from .api.stdio import StdioServer

    if args.print_schema:
        with open(SCHEMA_PATH) as f:
            sys.stdout.write(f.read())
        return EXIT_OK
    if args.max_line_bytes < 1024:
        raise CliError("--max-line-bytes must be at least 1024", EXIT_USAGE)
    import signal

    handler = setup_logging(args.log_level)
    if args.share_servers:  # -- confined share servers (issue 13): the sessions' default (Session reads it)
        os.environ["SANDBOX_SHARE_SERVERS"] = args.share_servers
    # The protocol stream gets a private descriptor; fd 1 becomes stderr, so nothing else —
    # a stray print, a library, a child process — can ever write into the protocol.
    sys.stdout.flush()
    protocol_out = os.fdopen(os.dup(1), "wb")  # os.dup: not inherited by children
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # -- MCP socket (issue 14): the STDIO agent's session shared with MCP clients on a unix socket
    mcp_socket = None
    if args.mcp_socket:
        from .api.logs import level_number
        from .api.mcp.server import route_sdk_logs
        from .api.mcp.shared import SharedMcpSocket, SharedSessionAgent

        route_sdk_logs(handler, level_number(args.log_level))

        server = StdioServer(sys.stdin.buffer, protocol_out, guest=args.guest, max_line_bytes=args.max_line_bytes,
                             as_root=args.as_root, agent_class=SharedSessionAgent)
        try:
            mcp_socket = SharedMcpSocket(args.mcp_socket, server.agent)
        except (ValueError, OSError) as e:
            raise CliError(f"--mcp-socket {args.mcp_socket}: {e}", EXIT_USAGE) from None
    else:
        server = StdioServer(sys.stdin.buffer, protocol_out, guest=args.guest, max_line_bytes=args.max_line_bytes,
                             as_root=args.as_root)
    # -- end MCP socket

    page = _serve_page(server.agent) if args.ui else None  # -- web page (issue 18)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # cancel the running command, stop the session, exit 0
    try:
        return server.serve()
    finally:
        if mcp_socket is not None:  # -- MCP socket (issue 14)
            mcp_socket.close()
        if page is not None:  # -- web page (issue 18)
            page.stop()


# -- MCP server (issue 14)
def cmd_mcp(args) -> int:
    """MCP over stdio until the client closes stdin (or SIGTERM): its own session, booted at once."""
    import logging
    import signal

    import anyio
    import anyio.to_thread

    from .api.mcp.server import serve_stdio

    host = _mcp_own_host(args)
    page = _mcp_page(host, args) if args.ui else None  # -- web page (issue 18)

    async def serve() -> None:
        async with anyio.create_task_group() as tg:
            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _signum in signals:
                        # stop the session (its command is cancelled, holds denied), then leave at
                        # once: the stdin reader sits in a read no cancellation can interrupt
                        await anyio.to_thread.run_sync(host.stop)
                        logging.shutdown()
                        os._exit(EXIT_OK)

            tg.start_soon(on_signal)
            await serve_stdio(host)
            tg.cancel_scope.cancel()

    try:
        anyio.run(serve)
    finally:
        host.stop()
        if page is not None:
            page.stop()
    return EXIT_OK


# -- web page (issue 18)
def _ui_start_payload(args) -> dict:
    """``session.start``'s payload from `sandbox ui`'s session options (the page's session is an
    ordinary STDIO API session, started by this process)."""
    from .session.runtime import Folder

    if args.on_hold != "ask":
        raise CliError("sandbox ui does not take --on-hold: the page answers safeguard holds", EXIT_USAGE)
    wds = []
    for spec in args.workdir:
        f = Folder.parse(spec)
        if not os.path.isdir(f.path):
            raise CliError(f"working folder {f.path!r} does not exist or is not a directory", EXIT_USAGE)
        wds.append({"path": os.path.abspath(f.path), "access": "read_only" if f.read_only else "read_write"})
    if args.state_dir:  # like `sandbox run`: the first working folder's undo store
        wds[0]["state_dir"] = os.path.abspath(args.state_dir)
    network, _, allow = args.network.partition(":")
    if network not in ("disabled", "open", "allowlist") or (network == "allowlist") != bool(allow):
        raise CliError(f"--network wants disabled, open or allowlist:CIDR|DOMAIN,…, not {args.network!r}", EXIT_USAGE)
    p = {"working_directories": wds, "network_policy": network, "vm_mode": args.vm_mode, "memory_mb": args.memory,
         "as_root": args.as_root, "guest_root": args.guest_root, "external_modification_policy": "barrier",
         "guest": "local" if args.local else args.guest}
    if allow:
        p["network_allowlist"] = allow.split(",")
    if args.share is not None:
        p["share"] = args.share
    if args.virtiofs_direct_io is not None:
        p["virtiofs_direct_io"] = args.virtiofs_direct_io
    if _guest_packages(args):
        p["guest_packages"] = _guest_packages(args)
    if args.delete_threshold:
        p["safeguard"] = {"delete_threshold": args.delete_threshold}
    return p


def _serve_page(agent):
    """`sandbox serve --ui`: the page over the STDIO agent's session (api.ui.run.page_for_agent)."""
    from .api.ui.run import page_for_agent

    page = page_for_agent(agent)
    print(f"sandbox: the page is at {page.url}", file=sys.stderr, flush=True)
    return page


def _mcp_page(host, args):
    """`sandbox mcp --ui`: the page over the MCP host's own session (api.ui.run.page_for_mcp_host)."""
    from .api.ui.run import page_for_mcp_host

    page = page_for_mcp_host(host, guest=args.guest)
    print(f"sandbox: the page is at {page.url}", file=sys.stderr, flush=True)
    return page


def cmd_ui(args) -> int:
    """`sandbox ui`: a session of its own and the page over it, until SIGINT/SIGTERM."""
    import signal

    from .api.agent import Agent
    from .api.errors import ApiError
    from .api.ui.hub import Hub
    from .api.ui.run import PageServer

    setup_logging(args.log_level)
    if args.share_servers:
        os.environ["SANDBOX_SHARE_SERVERS"] = args.share_servers
    payload = _ui_start_payload(args)
    hub = Hub()
    agent = Agent(hub.publish, guest=payload["guest"], as_root=args.as_root,
                  progress=lambda msg: print(f"sandbox: {msg}", file=sys.stderr, flush=True))

    class _Stopped(Exception):
        pass

    def stop(signum, frame):  # until the page serves (it handles both signals itself): stop cleanly
        raise _Stopped

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        try:
            agent.handle("session.start", payload, "ui-start")
        except ApiError as e:
            raise CliError(f"{e.code}: {e.message}", EXIT_FAILED) from None
        page = PageServer(agent, hub)
        print(f"sandbox: the page is at {page.url}", flush=True)
        print("sandbox: (the link carries this session's token; Ctrl-C stops the session)", file=sys.stderr, flush=True)
        page.serve(open_browser=not args.no_browser)
    except* _Stopped:  # also from inside one of the page loop's tasks, before its own handlers: a group
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the shutdown is not cut short by a second signal
        agent.shutdown()
    return EXIT_OK
# -- end web page


def _mcp_on_hold(sp) -> None:
    """`sandbox mcp`'s --on-hold: what a hold gets when the client cannot be asked (no elicitation)."""
    for action in sp._actions:
        if action.dest == "on_hold":
            action.choices, action.default = ["deny", "allow"], "deny"
            action.help = ("a safeguard hold is put to the user through the MCP client (elicitation) when it "
                           "supports that; otherwise, or if the user does not answer: deny (default; the "
                           "command's changes are rolled back) or allow")
# -- end MCP server


# -- MCP transports (issue 14): `mcp --attach PATH` (to `serve --mcp-socket`), `mcp --http HOST:PORT`
def cmd_mcp_net(args) -> int:
    """`sandbox mcp`: --attach bridges to a shared session's socket; --http serves streamable HTTP;
    otherwise MCP on stdio (cmd_mcp)."""
    if args.attach:
        given = sorted(d for d, default in args.mcp_session_defaults.items() if getattr(args, d) != default)
        if given or args.http:
            names = ", ".join("--" + d.replace("_", "-") for d in given + (["http"] if args.http else []))
            raise CliError(f"--attach joins the session of `sandbox serve --mcp-socket`: no {names} with it",
                           EXIT_USAGE)
        from .api.mcp.attach import attach

        return attach(args.attach)
    if not args.workdir:
        raise CliError("give --workdir DIR (a session of its own) or --attach PATH (a shared session)", EXIT_USAGE)
    if not args.http:
        return cmd_mcp(args)
    from .api.mcp.http import HttpBindError, parse_bind, run

    try:
        parse_bind(args.http)  # refused before anything boots
    except HttpBindError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    host = _mcp_own_host(args)
    page = _mcp_page(host, args) if args.ui else None  # -- web page (issue 18)
    try:
        run(host, args.http)  # until SIGINT/SIGTERM
    except OSError as e:
        raise CliError(f"--http {args.http}: {e.strerror or e}", EXIT_FAILED) from None
    finally:
        host.stop()
        if page is not None:
            page.stop()
    return EXIT_OK


def _mcp_own_host(args):
    """`sandbox mcp`'s (stdio or --http) logging set up, and the host of its own session, booting."""
    import logging

    from .api.logs import level_number
    from .api.mcp.host import OwnSessionHost
    from .api.mcp.server import route_sdk_logs

    handler = setup_logging(args.log_level)
    route_sdk_logs(handler, level_number(args.log_level))
    boot_log = logging.getLogger("sandbox.mcp")
    # external edits (the user's editor) become barriers: undo will not silently overwrite them
    session = _session(args, guest=args.guest, external_policy="barrier", ask=False,
                       progress=lambda msg: boot_log.info("%s", msg))
    return OwnSessionHost(session, on_hold=args.on_hold)
# -- end MCP transports


def _served_folder(args):
    """What ``serve-9p``/``serve-virtiofs`` serve: ``(workspace or None, provider, what)`` —
    ``--root`` read-only, or intercepted through its undo store (opened, recovered)."""
    import logging

    from .mounts import Provider

    if args.read_only:
        return None, Provider.read_only_dir(args.root), "read-only"
    args.workdir = args.root
    undo_log = logging.getLogger("sandbox.undo")

    def on_event(event: dict) -> None:
        """The undo core's warnings (a step that cannot be recorded, a rollback that cannot
        finish, evictions) are log lines: nobody else would hear of them."""
        if event.get("type") == "event.warning":
            undo_log.warning("%s", event.get("message"), extra={"step_id": event.get("step_id")})

    ws = _open(args, must_exist=False, on_event=on_event)
    return ws, Provider.intercepted(ws), f"intercepted; undo store {_state_dir(args)}"


def _confine_server(args, provider, ws, *, socket_dirs: list[str], tcp_bind_ports) -> None:
    """Confine a standalone server (issue 13) to ``--root`` and its undo store: call it before
    ``asyncio.run``, while this is the only thread (Landlock confines the calling thread and
    what it starts later); sockets are bound afterwards."""
    from . import confine

    try:
        confine.confine(read_write=[] if args.read_only else [os.path.realpath(_state_dir(args)),
                                                             os.path.realpath(args.root)],
                        read_only=[os.path.realpath(args.root)] if args.read_only else [],
                        socket_dirs=socket_dirs, tcp_bind_ports=tcp_bind_ports)
    except (confine.ConfineError, OSError) as e:
        provider.close()
        if ws is not None:
            ws.close()
        raise CliError(f"cannot confine the server: {e}", EXIT_FAILED) from None


def cmd_serve_9p(args) -> int:
    """Serve a folder over 9P2000.L until SIGTERM/SIGINT; intercepted unless --read-only."""
    import asyncio
    import signal

    from .limits import ServerLimits
    from .ninep.server import NinePServer, ServerConfig

    setup_logging(args.log_level)
    if not os.path.isdir(args.root):
        raise CliError(f"--root {args.root!r} does not exist or is not a directory", EXIT_USAGE)
    if not args.socket and not args.tcp:
        raise CliError("give --socket PATH (and/or --tcp [HOST:]PORT)", EXIT_USAGE)
    tcp_host, tcp_port = "127.0.0.1", None
    if args.tcp:
        host, _, port = args.tcp.rpartition(":")
        try:
            tcp_host, tcp_port = host or tcp_host, int(port)
        except ValueError:
            raise CliError(f"--tcp wants [HOST:]PORT, not {args.tcp!r}", EXIT_USAGE) from None
    config = ServerConfig(ServerLimits(msize_bytes_max=args.msize_max))
    ws, provider, what = _served_folder(args)

    # -- confinement (issue 13): before asyncio.run, while this is the only thread
    _confine_server(args, provider, ws, socket_dirs=[os.path.dirname(os.path.abspath(args.socket))] if args.socket else [],
                    tcp_bind_ports=None if tcp_port == 0 else ([tcp_port] if tcp_port else []))
    # -- end confinement

    async def serve() -> None:
        server = NinePServer(provider, config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            where = []
            if args.socket:
                await server.start_unix(args.socket)
                where.append(f"unix:{args.socket}")
            if tcp_port is not None:
                port = await server.start_tcp(tcp_host, tcp_port)
                where.append(f"tcp:{tcp_host}:{port}")
            print(f"sandbox: serving {os.path.realpath(args.root)} over 9P2000.L ({what}) on {', '.join(where)}; "
                  f"msize up to {config.limits.msize_bytes_max}. SIGTERM or Ctrl-C stops.", file=sys.stderr,
                  flush=True)
            await stop.wait()
        finally:
            await server.close()

    try:
        asyncio.run(serve())
    finally:
        provider.close()
        if ws is not None:
            ws.close()  # closes the open ambient step: it is in `sandbox history` from now on
    return _served_exit(ws, "server stopped")


def _served_exit(ws, stopped: str) -> int:
    """The exit of a server of a working folder once its workspace is closed: whether the
    last (ambient) step was saved."""
    if ws is not None and ws.unrecorded_step_id is not None:
        print(f"sandbox: {stopped}, but step {ws.unrecorded_step_id} could not be recorded in the undo store "
              "(see the warning above); it will be rolled back when the folder is next opened", file=sys.stderr)
        return EXIT_FAILED
    print(f"sandbox: {stopped}", file=sys.stderr)
    return EXIT_OK


# -- virtio-fs (issue 17): `sandbox serve-virtiofs`
def cmd_serve_virtiofs(args) -> int:
    """Serve a folder as a vhost-user-fs device (virtio-fs) until SIGTERM/SIGINT."""
    import asyncio
    import signal

    from .fuse.dispatcher import Dispatcher
    from .fuse.virtiofs import VirtioFsServer
    from .limits import ServerLimits
    from .serving import Export, HoldBroker

    setup_logging(args.log_level)
    if not os.path.isdir(args.root):
        raise CliError(f"--root {args.root!r} does not exist or is not a directory", EXIT_USAGE)
    ws, provider, what = _served_folder(args)
    limits = ServerLimits()
    export = Export(provider, HoldBroker(), limits)

    _confine_server(args, provider, ws, socket_dirs=[os.path.dirname(os.path.abspath(args.socket))], tcp_bind_ports=[])

    async def serve() -> None:
        server = VirtioFsServer(lambda: Dispatcher(export, limits), limits, direct_io=args.direct_io)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)

        def ready() -> None:
            print(f"sandbox: serving {os.path.realpath(args.root)} as virtio-fs ({what}; direct I/O: "
                  f"{args.direct_io}) on vhost-user socket "
                  f"{args.socket}. QEMU: -object memory-backend-memfd,id=mem,size=RAM,share=on -numa node,memdev=mem "
                  f"-chardev socket,id=vfs,path={args.socket} -device vhost-user-fs-pci,chardev=vfs,tag=TAG,queue-size=1024. "
                  "SIGTERM or Ctrl-C stops.", file=sys.stderr, flush=True)
        try:
            await server.serve(args.socket, ready)
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(serve())
    except OSError as e:
        raise CliError(f"cannot serve on {args.socket}: {e.strerror or e}", EXIT_FAILED) from None
    finally:
        provider.close()
        if ws is not None:
            ws.close()  # closes the open ambient step: it is in `sandbox history` from now on
    return _served_exit(ws, "server stopped")


def _serve_virtiofs_parser(command, log_levels, mismatch) -> None:
    sv = command(
        "serve-virtiofs", "serve a folder as a virtio-fs device (vhost-user) to QEMU; every write is undoable",
        "Serve the folder --root DIR as a vhost-user-fs device on the unix socket --socket PATH\n"
        "(created 0600), until SIGTERM or Ctrl-C. QEMU connects with\n"
        "  -object memory-backend-memfd,id=mem,size=RAM,share=on -numa node,memdev=mem\n"
        "  -chardev socket,id=vfs,path=PATH -device vhost-user-fs-pci,chardev=vfs,tag=TAG,queue-size=1024\n"
        "(queue-size=1024 lets the guest send 1 MiB requests; QEMU's default 128 caps them at 496 KiB)\n"
        "and the guest mounts it with: mount -t virtiofs TAG /mnt. One QEMU at a time; after it\n"
        "disconnects the next one is served. Every mutation the guest makes is intercepted: it lands\n"
        "in ambient steps (closed after 5 s without writes) that `sandbox history --workdir DIR` lists\n"
        "and `sandbox undo --workdir DIR` undoes once the server has stopped. --read-only refuses\n"
        "every mutation (EROFS). --direct-io all opens every file FOPEN_DIRECT_IO, as C virtiofsd's\n"
        "cache=none: large reads skip the guest's page-cache copy (under TCG a 32 MiB read took\n"
        "0.09 s instead of 0.14), but a Linux 6.1 guest then refuses shared mmap of any file (ENODEV) and each\n"
        "small read(2) is a request; the default, write-only, keeps shared maps working.\n"
        "See docs/virtiofs.md.",
        [(0, "stopped cleanly"), (1, "failed to start (e.g. the socket path is taken), or the last step could "
                                     "not be saved"),
         (2, "bad usage (--root is not a directory)"), mismatch,
         (5, "the undo store is in use by another process (another server or an undo)")])
    sv.add_argument("--root", required=True, metavar="DIR", help="the folder to serve")
    sv.add_argument("--socket", required=True, metavar="PATH", help="the vhost-user unix socket to listen on")
    sv.add_argument("--read-only", action="store_true", help="refuse every mutation; no interception, no undo store")
    sv.add_argument("--state-dir", metavar="DIR", help="where the undo store lives (default: under "
                    "$XDG_STATE_HOME/sandbox/undo/, keyed by the folder's real path)")
    from .fuse import DIRECT_IO_MODES

    sv.add_argument("--direct-io", choices=DIRECT_IO_MODES, default="write-only",
                    help="which opens skip the guest's page cache: write-only (default: write-only opens of a "
                         "file open nowhere else, and every open beside them) or all (every open; shared mmap "
                         "then fails with ENODEV in 6.1 guests)")
    sv.add_argument("--log-level", default="warn", type=str.lower, choices=log_levels)
    sv.set_defaults(fn=cmd_serve_virtiofs)
# -- end virtio-fs


# -- FUSE mount (issue 16): `sandbox mount`
#: seconds after SIGTERM/Ctrl-C for files still open on the mount to be closed before serving stops
UNMOUNT_GRACE_S = 5.0


def cmd_mount(args) -> int:
    """Mount --workdir DIR at MOUNTPOINT through FUSE until SIGTERM/SIGINT or an unmount."""
    import asyncio
    import logging
    import signal

    from .fuse.dispatcher import Dispatcher
    from .fuse.notify import watch
    from .fuse.transport import FuseServer, mount, unmount
    from .limits import ServerLimits
    from .mounts import Provider
    from .serving import Export, HoldBroker
    from .serving.workspaces import open_workspace

    setup_logging(args.log_level)
    for what, path in (("--workdir", args.workdir), ("MOUNTPOINT", args.mountpoint)):
        if not os.path.isdir(path):
            raise CliError(f"{what} {path!r} does not exist or is not a directory", EXIT_USAGE)
    work, point = os.path.realpath(args.workdir), os.path.realpath(args.mountpoint)
    if os.path.commonpath([work, point]) in (work, point):
        raise CliError("the mount point and the working folder must not contain each other "
                       "(the server would serve its own mount)", EXIT_USAGE)
    ws = own_writes = None
    if args.read_only:
        provider = Provider.read_only_dir(args.workdir)
        what = "read-only, no undo"
    elif args.no_undo:  # benchmarks only (bench/fuse_local.py): the mount's cost without the undo core's
        from .barriers.journal import OwnWrites, RecordingHostFS
        from .hostfs.real import RealHostFS

        host = RealHostFS(work)
        own_writes = OwnWrites.for_fs(host)  # journaled as an intercepted mount's: the watcher skips them
        provider = Provider(RecordingHostFS(host, own_writes), None, read_only=False)
        what = "read-write, NO UNDO (--no-undo: for benchmarks)"
    else:
        undo_log = logging.getLogger("sandbox.undo")

        def on_event(event: dict) -> None:
            if event.get("type") == "event.warning":
                undo_log.warning("%s", event.get("message"), extra={"step_id": event.get("step_id")})

        from .core.safeguard import SafeguardConfig

        safeguard = SafeguardConfig(delete_threshold=args.delete_threshold) if args.delete_threshold else None
        # watched: the workspace journals its own writes, so the watcher reports only the
        # changes made beside the mount, which the kernel is then told to forget
        ws, own_writes = open_workspace(args.workdir, watched=True, state_dir=_check_store(args, False),
                                        on_event=on_event, safeguard=safeguard)
        _recovered(ws)
        provider = Provider.intercepted(ws)
        what = f"intercepted; undo store {_state_dir(args)}"
    limits = ServerLimits()
    holds = HoldBroker()
    unask = holds.ask(_hold_decider(args.on_hold))
    export = Export(provider, holds, limits)
    try:
        fd, via_fusermount = mount(point, read_only=args.read_only)
    except OSError as e:
        unask()
        provider.close()
        if ws is not None:
            ws.close()
        raise CliError(f"cannot mount {point}: {e.strerror}", EXIT_FAILED) from None

    async def serve() -> None:
        server = FuseServer(Dispatcher(export, limits), fd, limits)
        loop = asyncio.get_running_loop()
        try:
            watching.append(watch(server, work, own_writes))
        except OSError as e:  # e.g. no inotify instance left: short timeouts, no invalidation
            print(f"sandbox: warning: cannot watch {work} for changes made beside the mount ({e}); "
                  "they show within a second", file=sys.stderr)

        def stop() -> None:
            """Detach the mount: once its last open file is closed the kernel ends the
            connection and the loop reads ENODEV; after UNMOUNT_GRACE_S, or a second signal,
            the loop stops anyway (files still open there then fail with ENOTCONN)."""
            if unmounting:
                server.stop()
                return
            unmounting.append(loop.run_in_executor(None, unmount, point, via_fusermount))  # fusermount3 may stat it
            loop.call_later(UNMOUNT_GRACE_S, server.stop)

        unmounting: list = []

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        if args.op_counts:  # bench/fuse_local.py --counts: SIGUSR1 appends the requests read so far
            loop.add_signal_handler(signal.SIGUSR1, _dump_op_counts, server, args.op_counts)
        print(f"sandbox: {work} mounted at {point} through FUSE ({what}). This gives undo, not isolation: "
              "programs on the mount run on the host as you. SIGTERM or Ctrl-C unmounts.", file=sys.stderr,
              flush=True)
        await server.serve()

    watching: list = []
    try:
        asyncio.run(serve())
    finally:
        for stop_watching in watching:
            stop_watching()  # before the workspace closes (the watcher reads through it)
        try:
            unmount(point, via_fusermount)  # nothing to do unless the loop ended another way
        except OSError as e:
            print(f"sandbox: unmount failed: {e}", file=sys.stderr)
        os.close(fd)
        unask()
        provider.close()
        if ws is not None:
            ws.close()  # closes the open ambient step: it is in `sandbox history` from now on
    return _served_exit(ws, "unmounted")


def _dump_op_counts(server, path: str) -> None:
    """One JSON line appended to ``path``: the requests ``server`` has read, by opcode, and
    the invalidation notifications it has written (for benchmarks: hidden ``--op-counts``)."""
    import json

    with open(path, "a") as f:
        f.write(json.dumps({"ops": dict(server.op_counts), "notified": server.notifier.written}) + "\n")


def _mount_parser(command, with_workdir, log_levels) -> None:
    mt = with_workdir(command(
        "mount", "mount a folder through FUSE: every write on the mount lands in an undoable step (undo, not isolation)",
        "Mount the working folder --workdir DIR at MOUNTPOINT through FUSE, in the foreground, until\n"
        "SIGTERM or Ctrl-C (which unmount cleanly) or `umount MOUNTPOINT`. Every change a program makes\n"
        "on the mount is intercepted: it lands in ambient steps (closed after 5 s without writes) that\n"
        "`sandbox history --workdir DIR` lists and `sandbox undo --workdir DIR` undoes once the mount\n"
        "is gone (the undo store is locked while it runs). --read-only refuses every change (EROFS).\n"
        "Changes made to DIR directly, beside the mount, show through it at once (a watcher tells the\n"
        "kernel to forget what it cached). A program blocked by a safeguard hold can be interrupted\n"
        "(Ctrl-C, kill): its call fails with EINTR and the hold stays to be answered.\n\n"
        "This gives UNDO, NOT ISOLATION: programs on the mount run on the host, as you, and can do\n"
        "anything you can elsewhere. Only what they change on the mount can be undone.\n\n"
        "As root the mount uses mount(2) (allow_other); otherwise fusermount3 (package fuse3). Always\n"
        "nosuid,nodev,default_permissions. See docs/fuse.md.",
        [(0, "unmounted cleanly"), (1, "the mount failed (no /dev/fuse, not root and no fusermount3), or the "
                                       "last step could not be saved"),
         (2, "bad usage (not a directory; the mount point and the folder contain each other)"),
         (4, "undo unavailable: the store's format version is not this one's (run `sandbox discard`)"),
         (5, "the undo store is in use by another process")]))
    mt.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing directory to mount on")
    mt.add_argument("--read-only", action="store_true", help="refuse every change; no interception, no undo store")
    mt.add_argument("--no-undo", action="store_true", help=argparse.SUPPRESS)  # bench/fuse_local.py: interception off
    mt.add_argument("--op-counts", metavar="FILE", help=argparse.SUPPRESS)  # bench/fuse_local.py --counts
    mt.add_argument("--delete-threshold", type=int, metavar="N",
                    help="safeguard: the N-th deletion of a step waits for a decision, the deleting program blocked "
                         "mid-syscall (default: off)")
    mt.add_argument("--on-hold", choices=["ask", "allow", "deny"], default="ask",
                    help="when a safeguard holds a mass change: ask on the terminal (default; no terminal = deny), "
                         "allow, or deny (the step is rolled back)")
    mt.add_argument("--log-level", default="warn", type=str.lower, choices=log_levels)
    mt.set_defaults(fn=cmd_mount)
# -- end FUSE mount


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="sandbox", formatter_class=raw,
        description="Let an AI coding agent loose on a real project without fear: every write is intercepted and\n"
                    "every step can be undone exactly. These commands work on a working folder (--workdir DIR)\n"
                    "and its undo store (by default under $XDG_STATE_HOME/sandbox/undo/; --state-dir DIR overrides).",
        epilog="examples:\n"
               "  sandbox history --workdir DIR [--json]\n"
               "  sandbox undo --workdir DIR [-n N] [--force]\n"
               "  sandbox discard --workdir DIR --yes\n"
               "  sandbox run --workdir DIR [--workdir DIR2:ro] [--network open] -- COMMAND\n"
               "  sandbox shell --workdir DIR\n"
               "  sandbox serve-9p --root DIR --socket PATH [--read-only]\n"
               "  sandbox serve-virtiofs --root DIR --socket PATH [--read-only]\n"
               "  sandbox mount --workdir DIR MOUNTPOINT [--read-only]\n"
               "  sandbox demo\n\n"
               "exit codes:\n"
               "  0  success\n"
               "  1  failed, nothing to undo, or no undo history for the folder\n"
               "  2  bad usage or input (e.g. the folder does not exist)\n"
               "  3  refused: an undo barrier or an external change is in the way (undo --force overrides)\n"
               "  4  undo unavailable: format version mismatch (sandbox discard), unprotected or corrupt step,\n"
               "     or an earlier undo that could not finish\n"
               "  5  the undo store is in use by another process")
    p.add_argument("--version", action="version", version=f"sandbox {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, help, description, exit_codes):
        epilog = "exit codes:\n" + "\n".join(f"  {'N' if code is None else code}  {what}" for code, what in exit_codes)
        return sub.add_parser(name, help=help, description=description, epilog=epilog, formatter_class=raw)

    def with_workdir(sp):
        sp.add_argument("--workdir", required=True, metavar="DIR", help="the working folder")
        sp.add_argument("--state-dir", metavar="DIR", help="where its undo store lives (default: under "
                        "$XDG_STATE_HOME/sandbox/undo/, keyed by the folder's real path)")
        return sp

    from .limits import DESCRIPTORS_RESERVED, ServerLimits

    lim = ServerLimits()
    no_history = (1, "no undo history for the folder")
    bad_usage = (2, "bad usage (e.g. --workdir is not a directory)")
    mismatch = (4, "undo unavailable: the store's format version is not this one's (run `sandbox discard`)")
    busy = (5, "the undo store is in use by another process")

    h = with_workdir(command(
        "history", "list the undoable steps, newest first",
        "List the undoable steps of the working folder --workdir DIR, newest first: id, type, when it\n"
        "ended, exit code, number of paths touched, notes (UNPROTECTED, barriers) and the command.",
        [(0, "ok (also when the history is empty)"), no_history, bad_usage, mismatch, busy]))
    h.add_argument("--json", action="store_true", help="machine-readable output")
    h.set_defaults(fn=cmd_history)
    u = with_workdir(command(
        "undo", "undo the newest step(s) exactly (rollback is pop: no redo)",
        "Undo the newest -n N steps of the working folder --workdir DIR exactly, newest first\n"
        "(bytes, modes, mtimes). Undone steps leave the history: there is no redo.\n"
        "Undo is refused, before anything is touched, if an undo barrier (a recorded external\n"
        "modification) or a change made outside the sandbox is in the way; --force undoes anyway,\n"
        "overwriting those changes.",
        [(0, "undone"), (1, "nothing (or not enough) to undo, no undo history, or the undo failed"),
         (2, "bad usage (-n below 1, --workdir is not a directory)"),
         (3, "refused: an undo barrier or an external change is in the way (--force overrides)"),
         (4, "undo unavailable: format version mismatch (run `sandbox discard`), unprotected or corrupt step, or an "
             "earlier undo that stopped part-way cannot finish (fix the cause, or `sandbox discard`)"),
         busy]))
    u.add_argument("-n", type=int, default=1, metavar="N", help="number of steps to undo (default 1)")
    u.add_argument("--force", action="store_true", help="undo even across barriers, overwriting changes made outside the sandbox")
    u.set_defaults(fn=cmd_undo)
    d = with_workdir(command(
        "discard", "delete all undo history (e.g. after a format version mismatch)",
        "Delete all undo history of the working folder --workdir DIR and start a fresh store; the\n"
        "way out of a format version mismatch. The working folder itself is not touched. Needs --yes.",
        [(0, "discarded"), no_history, (2, "bad usage (--yes missing, --workdir is not a directory)"), busy]))
    d.add_argument("--yes", action="store_true", help="confirm")
    d.set_defaults(fn=cmd_discard)
    # -- step diffs (issue 14): `sandbox diff`
    df = with_workdir(command(
        "diff", "show what a step changed (unified diffs of text files, preimage vs now)",
        "Show what the N-th newest step (-n, default 1) or step --step ID of the working folder\n"
        "--workdir DIR changed, from its undo store, without a VM and without changing anything:\n"
        "each path created, modified, deleted or with only its metadata changed; a unified diff\n"
        "for text files (the preimage against the file as it is now), a summary otherwise.",
        [(0, "shown"), (1, "no such step, or no undo history for the folder"), bad_usage,
         (4, "undo unavailable (format version mismatch) or the step's journal is corrupt"), busy]))
    df.add_argument("-n", type=int, default=1, metavar="N", help="the N-th newest step (default 1: the newest)")
    df.add_argument("--step", type=int, metavar="ID", help="the step with this id (as `sandbox history` lists it)")
    df.add_argument("--json", action="store_true", help="machine-readable output (the undo.diff result)")
    df.set_defaults(fn=cmd_diff)
    # -- end step diffs
    def with_session(sp):
        sp.add_argument("--workdir", action="append", required=True, metavar="DIR[:ro]",
                        help="a working folder, mounted at /mnt/working/0, /1, … (repeatable, up to 8; "
                             ":ro = read-only, no undo)")
        # -- network allowlist (issue 13)
        sp.add_argument("--network", default="disabled", metavar="disabled|open|allowlist:CIDR|DOMAIN,…",
                        help="guest networking: disabled (default; QEMU restrict=on), open, or "
                             "allowlist:example.org,10.0.0.0/8 (the guest's only way out is a proxy on the host "
                             "that allows those networks and domains and their subdomains, and answers DNS "
                             "for allowed names only)")
        sp.add_argument("--vm-mode", choices=["ephemeral", "persistent"], default="ephemeral",
                        help="ephemeral: a fresh guest root each time (tmpfs); persistent: changes outside the working "
                             "folders (installed packages …) are kept on a disk beside the undo state")
        sp.add_argument("--memory", type=int, default=1024, metavar="MB", help="guest memory (default 1024)")
        # -- the guest user (issue 13)
        sp.add_argument("--as-root", action="store_true",
                        help="run commands as root in the guest (default: as the unprivileged user `agent`, "
                             "uid/gid of the first working folder's owner, 1000 if root owns it)")
        _guest_root_args(sp)
        _share_servers_arg(sp)  # -- confined share servers (issue 13)
        sp.add_argument("--share", choices=["9p", "virtiofs"], default=None,  # -- virtio-fs (issue 17)
                        help="how a VM guest reaches the working folders: virtiofs (default where QEMU has "
                             "vhost-user-fs-pci: a device per folder, served by the folder's share server) or 9p "
                             "(through QEMU's guestfwd; the fallback, logged, elsewhere)")
        from .fuse import DIRECT_IO_MODES

        sp.add_argument("--virtiofs-direct-io", choices=DIRECT_IO_MODES, default=None,
                        help="with virtio-fs, which opens skip the guest's page cache: write-only (default; shared "
                             "mmap works) or all (every open, as C virtiofsd cache=none: large reads are faster "
                             "under TCG, but a shared mmap of any file on the folders fails with ENODEV)")
        sp.add_argument("--state-dir", metavar="DIR", help="the first working folder's undo store (default: under "
                        "$XDG_STATE_HOME/sandbox/undo/; pass the same to history/undo)")
        sp.add_argument("--delete-threshold", type=int, metavar="N",
                        help="safeguard: the N-th deletion of a step waits for a decision (default: off)")
        sp.add_argument("--on-hold", choices=["ask", "allow", "deny"], default="ask",
                        help="how a safeguard hold is decided: ask on the terminal (default; no terminal = deny), "
                             "allow, or deny (the step is rolled back)")
        # -- local guest (issue 16)
        sp.add_argument("--local", action="store_true",
                        help="no VM: run on the host against a FUSE mount of each folder at its own path, in a private "
                             "mount namespace. UNDO, NOT ISOLATION: the command runs as you and can reach everything "
                             "you can outside the folders. --network disabled (default) = loopback only, open = the "
                             "host's; the VM options are ignored")
        return sp

    vm_codes = [(1, "the VM could not start (the message says why)"), (2, "bad usage"),
                (5, "a working folder's undo store is in use by another process")]
    r = with_session(command(
        "run", "boot a VM, run COMMAND on your folder as one undoable step",
        "Boot a Linux guest (Debian's kernel; the host's userland read-only under an overlay), mount\n"
        "each --workdir at /mnt/working/0, /1, … through the intercepting 9P server, run COMMAND\n"
        "there in a shell as one step, stream its output and exit with its exit code. Every write it\n"
        "makes is undoable: `sandbox undo --workdir DIR`. Ctrl-C cancels the command (SIGTERM, then\n"
        "SIGKILL). KVM is used when it works, TCG otherwise (slower; the choice is printed).\n\n"
        "--local: no VM. COMMAND runs on the host (sh -c, your environment) against a FUSE mount of\n"
        "each --workdir at the folder's own path, made in a private mount namespace (the rest of the\n"
        "system never sees it); every write it makes there is undoable the same way. This gives UNDO,\n"
        "NOT ISOLATION: the command runs as you and can do anything you can outside the folders.\n"
        "Needs /dev/fuse and nsenter; as root, or unprivileged where the kernel allows FUSE in a user\n"
        "namespace. See docs/fuse.md \"Local guest\".",
        [(0, "the command exited 0"), (None, "otherwise the command's own exit code")] + vm_codes))
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command line to run")
    r.set_defaults(fn=cmd_run)
    sh = with_session(command(
        "shell", "an interactive loop in a VM: each line is one undoable step (:undo, :history)",
        "Boot a guest like `sandbox run` and read command lines: each runs as one step. Built in:\n"
        ":history, :undo [N] (the guest sees the restored files at once), :help, :quit or Ctrl-D.",
        [(0, "ended with :quit or Ctrl-D")] + vm_codes))
    sh.set_defaults(fn=cmd_shell)
    g = command(
        "guest", "build the guest image, or reset a persistent VM",
        "build: fetch Debian's kernel package (apt-get download) and build the guest initramfs into\n"
        "~/.cache/sandbox/guest/ (a session does this on demand; rebuilt when an input changes).\n"
        "reset --workdir DIR: delete the persistent VM disk of that folder's sessions.",
        [(0, "done"), (1, "the image cannot be built here (the message says why)"), (2, "bad usage")])
    g.add_argument("action", choices=["build", "reset"])
    g.add_argument("--workdir", metavar="DIR", help="for reset: the session's first working folder")
    _guest_root_args(g, build=True)
    g.set_defaults(fn=cmd_guest)
    s9 = command(
        "serve-9p", "serve a folder to 9P2000.L clients; every write lands in an undoable step",
        "Serve the folder --root DIR over 9P2000.L on a unix socket (what QEMU's guestfwd connects\n"
        "to) and/or TCP on loopback, until SIGTERM or Ctrl-C. Every mutation a client makes is\n"
        "intercepted: it lands in ambient steps (closed after 5 s without writes) that\n"
        "`sandbox history --workdir DIR` lists and `sandbox undo --workdir DIR -n N` undoes once the\n"
        "server has stopped (the undo store is locked while it runs). --read-only serves without\n"
        "interception and refuses every mutation (EROFS).\n\n"
        "Linux client: mount -t 9p -o trans=unix,version=9p2000.L,msize=1048576 PATH /mnt\n"
        "(or trans=tcp,port=PORT 127.0.0.1 /mnt with --tcp).\n\n"
        f"Limits (sandbox/limits.py), so one client cannot starve the others or the undo core:\n"
        f"{lim.connections_max} connections (one more is closed at once, logged); per connection\n"
        f"{lim.fids_per_connection_max:,} fids (ENFILE), {lim.open_files_per_connection_max:,} open files "
        f"(EMFILE; at most a quarter of the process's),\n"
        f"{lim.xattr_bytes_per_connection_max >> 20} MiB of xattr values held (ENOMEM), "
        f"{lim.dir_listing_bytes_per_connection_max >> 20} MiB of directory listings kept; unread\n"
        f"replies over {lim.write_buffer_bytes_max >> 20} MiB or requests held by a safeguard over "
        f"{lim.held_request_bytes_per_connection_max >> 20} MiB stop reading the\n"
        f"connection until they drain; a frame incomplete for {lim.frame_incomplete_timeout_s:g} s closes it. "
        f"The soft\nopen-file limit is raised to the hard one; all clients' open files share it, minus\n"
        f"{DESCRIPTORS_RESERVED} descriptors kept for the undo core (ENFILE).",
        [(0, "stopped cleanly"), (1, "failed to start (e.g. the socket path is taken), or the last step could not be saved (undo store disk full: it is rolled back when the folder is next opened)"),
         (2, "bad usage (--root is not a directory, no --socket/--tcp)"), mismatch,
         (5, "the undo store is in use by another process (another server or an undo)")])
    s9.add_argument("--root", required=True, metavar="DIR", help="the folder to serve")
    s9.add_argument("--socket", metavar="PATH", help="unix socket to listen on (created 0600)")
    s9.add_argument("--tcp", metavar="[HOST:]PORT", help="also listen on TCP (default host 127.0.0.1; port 0 = any)")
    s9.add_argument("--read-only", action="store_true", help="refuse every mutation; no interception, no undo store")
    s9.add_argument("--state-dir", metavar="DIR", help="where the undo store lives (default: under "
                    "$XDG_STATE_HOME/sandbox/undo/, keyed by the folder's real path)")
    s9.add_argument("--msize-max", type=int, default=1 << 20, metavar="BYTES",
                    help="largest message size granted to clients (default 1 MiB; at least 8192)")
    s9.add_argument("--log-level", default="warn", type=str.lower, choices=LOG_LEVELS)
    s9.set_defaults(fn=cmd_serve_9p)
    _serve_virtiofs_parser(command, LOG_LEVELS, mismatch)  # -- virtio-fs (issue 17)
    sv = command(
        "serve", "the STDIO API: a frontend drives sessions with JSON Lines on stdin/stdout",
        "Run the host agent for a frontend (GUI, IDE plugin, script): one JSON request per line on\n"
        "stdin, responses and events as JSON lines on stdout, logs as JSON lines on stderr. Start with\n"
        '{"type":"hello","request_id":"1","payload":{"protocol_version":1}}, then session.start.\n'
        "The protocol (every operation, event and error code) is in docs/stdio-api.md; the JSON Schemas are\n"
        "printed by --print-schema. When stdin closes, the requests received are finished, the\n"
        "session is stopped and it exits; SIGTERM/Ctrl-C cancels the running command first.\n\n"
        "Try it without a VM:\n"
        "  printf '%s\\n' '{\"type\":\"session.start\",\"request_id\":1,\"payload\":{\"working_directories\":[{\"path\":\"'$PWD'\"}]}}' \\\n"
        "    '{\"type\":\"agent.execute\",\"request_id\":2,\"payload\":{\"command\":\"ls\"}}' | sandbox serve --guest scripted",
        [(0, "stdin closed (or SIGTERM): session stopped"), (2, "bad usage")])
    sv.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                    help="least severe log level written to stderr (default info)")
    sv.add_argument("--guest", default="vm", choices=["vm", "scripted", "local"],
                    help="vm: a QEMU guest (default); scripted: no VM — commands are file-operation scripts "
                         "applied over the real 9P server (sandbox/scripted/guest.py; for tests and frontend development); "
                         "local: no VM — commands run on the host against FUSE mounts of the folders at their own paths "
                         "(undo, not isolation; docs/fuse.md)")
    sv.add_argument("--max-line-bytes", type=int, default=64 << 20, metavar="N",
                    help="longest request line accepted (default 64 MiB)")
    sv.add_argument("--print-schema", action="store_true", help="print the protocol's JSON Schema document and exit")
    # -- the guest user (issue 13)
    sv.add_argument("--as-root", action="store_true",
                    help="sessions run commands as root in the guest unless session.start says as_root: false "
                         "(default: as the unprivileged user `agent`)")
    # -- MCP socket (issue 14)
    sv.add_argument("--mcp-socket", metavar="PATH",
                    help="also serve MCP on this unix socket, over the session the STDIO client starts "
                         "(`sandbox mcp --attach PATH` connects an MCP client). The socket is 0600 in a 0700 "
                         "directory of yours (created if missing), its token in PATH.token (0600); see docs/mcp.md")
    # -- end MCP socket
    sv.add_argument("--ui", action="store_true",  # -- web page (issue 18)
                    help="also serve the web page (docs/ui.md) over the session the STDIO client starts; its URL "
                         "(with this run's token) is logged on stderr")
    _share_servers_arg(sv)  # -- confined share servers (issue 13)
    sv.set_defaults(fn=cmd_serve)
    # -- MCP server (issue 14)
    mc = with_session(command(
        "mcp", "an MCP server on stdio: an MCP client (Claude Code, Cursor, …) drives a sandbox session",
        "Serve the Model Context Protocol on stdin/stdout for one client, with a session of its own on the\n"
        "--workdir folders (booted at once, in the background; the first tool call waits for it). Tools:\n"
        "execute_command, read_file, write_file, edit_file, list_directory, undo, get_undo_history,\n"
        "get_session_status — every command and every file write is one undoable step. stdout carries\n"
        "only JSON-RPC; logs are JSON lines on stderr. The session stops when the client closes stdin.\n\n"
        "Claude Code:  claude mcp add sandbox -- sandbox mcp --workdir .\n"
        "Reference (tools, results, limits, errors, elicitation, roots): docs/mcp.md.",
        [(0, "the client closed stdin (or SIGTERM): session stopped"), (2, "bad usage")]))
    mc.add_argument("--guest", default="vm", choices=["vm", "scripted"],
                    help="vm: a QEMU guest (default); scripted: no VM — commands are file-operation scripts "
                         "(sandbox/scripted/script.py; for tests)")
    mc.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                    help="least severe log level written to stderr (default info)")
    _mcp_on_hold(mc)
    mc.set_defaults(fn=cmd_mcp)
    # -- end MCP server
    # -- MCP transports (issue 14)
    mc.add_argument("--attach", metavar="PATH",
                    help="instead of a session of its own, join the session of `sandbox serve --mcp-socket PATH` "
                         "(a frontend's, which answers its safeguards): bridges this stdio client to that socket, "
                         "with the token from PATH.token; no session options. Exit 1: no socket there, or the "
                         "server closed the connection; 3: refused (token, user, too many connections)")
    mc.add_argument("--http", metavar="127.0.0.1:PORT",
                    help="serve MCP over streamable HTTP on this loopback address instead of stdio (port 0: any; "
                         "the URL and a bearer token for this run are logged on stderr). Host and Origin headers "
                         "are checked; only loopback binds are accepted")
    mc.add_argument("--ui", action="store_true",  # -- web page (issue 18)
                    help="also serve the web page (docs/ui.md) over this session, so a person watches and steers "
                         "what the LLM does: its URL (with this run's token) is printed on stderr; while a page is "
                         "open it answers safeguard holds")
    session_dests = [a.dest for a in mc._actions if a.dest not in ("help", "attach", "http", "log_level", "guest")]
    for a in mc._actions:
        if a.dest == "workdir":
            a.required = False  # --attach takes none; cmd_mcp_net asks for it otherwise
    mc.set_defaults(fn=cmd_mcp_net, mcp_session_defaults={d: mc.get_default(d) for d in session_dests})
    # -- end MCP transports
    # -- web page (issue 18)
    ui = with_session(command(
        "ui", "a local web page over a session: live terminal, step timeline with diffs, undo by click",
        "Start a session on the --workdir folders (like `sandbox serve` would for a frontend) and serve a\n"
        "page for it on 127.0.0.1 (a random port): a terminal with the live output of every command and a\n"
        "command box, the steps newest first with their diffs, Undo to here, safeguard dialogs with Allow /\n"
        "Deny, notices and the session's status. The URL printed carries a per-session token (no page\n"
        "without it); it is opened in your browser when there is a display ($BROWSER, $DISPLAY). Ctrl-C\n"
        "stops the session. Reference: docs/ui.md.",
        [(0, "stopped by Ctrl-C or SIGTERM"), (1, "the session could not start"), (2, "bad usage")]))
    ui.add_argument("--guest", default="vm", choices=["vm", "scripted", "local"],
                    help="vm: a QEMU guest (default); scripted: no VM — commands are file-operation scripts "
                         "(sandbox/scripted/script.py; for tests and trying the page); local: like --local")
    ui.add_argument("--no-browser", action="store_true", help="only print the URL")
    ui.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS,
                    help="least severe log level written to stderr (default info)")
    for a in ui._actions:  # session options the page's session does not take (refused if given)
        if a.dest == "on_hold":
            a.help = argparse.SUPPRESS
    ui.set_defaults(fn=cmd_ui)
    # -- end web page
    demo = command(
        "demo", "run a session on a copy of the sample project: `rm -rf *`, history, undo, verify",
        "Copy the sample project to a temporary folder, boot a VM on it and run a destructive command\n"
        "in the guest (`rm -rf * && echo oops > README.md`), show the history, undo the step and check\n"
        "that the tree is identical to the original (bytes, modes, mtimes). Needs no --workdir.\n"
        "--in-process makes the same step through the undo core without a VM.",
        [(0, "the tree is identical after undo"), (1, "it is not (a bug), or the VM could not start"),
         (2, "the sample project was not found")])
    demo.add_argument("--sample", metavar="DIR", help="project to copy (default: the sample project shipped in the package)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary copy")
    demo.add_argument("--in-process", action="store_true", help="make the step through the undo core directly "
                      "instead of in a VM (no QEMU needed)")
    demo.add_argument("--as-root", action="store_true",  # -- the guest user (issue 13)
                      help="run the destructive command as root in the guest (default: as the user `agent`)")
    _guest_root_args(demo)
    demo.set_defaults(fn=cmd_demo)
    _mount_parser(command, with_workdir, LOG_LEVELS)  # -- FUSE mount (issue 16)
    return p


# -- confined share servers (issue 13)
def _share_servers_arg(sp) -> None:
    sp.add_argument("--share-servers", choices=["thread", "process"], default=None,
                    help="where the working folders are served: process (a confined child process owns their undo "
                         "stores and 9P server) or thread (in this process); default: $SANDBOX_SHARE_SERVERS, "
                         "else process for a VM guest, thread for the scripted one")
# -- end confined share servers


def _discard_command(args) -> str:
    import shlex
    cmd = f"sandbox discard --workdir {shlex.quote(getattr(args, 'workdir', None) or 'DIR')}"
    if getattr(args, "state_dir", None):
        cmd += f" --state-dir {shlex.quote(args.state_dir)}"
    return cmd


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:  # `sandbox history | head`: the reader left; not an error of ours
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_OK
    except CliError as e:
        print(f"sandbox: {e}", file=sys.stderr)
        return e.code
    except StoreBusy as e:
        print(f"sandbox: {e.strerror or e}; try again when that process has finished", file=sys.stderr)
        return EXIT_BUSY
    except BarrierInTheWay as e:
        msg = e.message
        core_hint = "use force to do it anyway"
        msg = msg.replace(core_hint, "use --force to do it anyway") if core_hint in msg else f"{msg}; use --force to do it anyway"
        print(f"sandbox: refused: {msg}", file=sys.stderr)
        return EXIT_REFUSED
    except (UndoUnavailable, RollbackIncomplete) as e:
        print(f"sandbox: {e.code}: {e.message}" if isinstance(e, RollbackIncomplete) else f"sandbox: {e.message}",
              file=sys.stderr)
        print(f"sandbox: to start a fresh undo history (deleting the old one): {_discard_command(args)}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (StepUnprotected, CorruptStep) as e:
        print(f"sandbox: {e.message}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except (NothingToUndo, StepError) as e:
        print(f"sandbox: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    except (PathError, ValueError) as e:
        print(f"sandbox: {e}", file=sys.stderr)
        return EXIT_USAGE
    except SandboxError as e:
        print(f"sandbox: {e.code}: {e.message}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:
        print(f"sandbox: {e.strerror or e}{': ' + str(e.filename) if e.filename else ''}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
