"""The ``sandbox`` command.

Exit codes: 0 success · 1 nothing to undo / the operation failed · 2 bad usage or input
· 3 refused: an undo barrier or an external change is in the way (``--force``) ·
4 undo unavailable: format version mismatch (``sandbox discard``), unprotected or
corrupt step · 5 the undo store is in use by another process.
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
from .core.errors import (BarrierInTheWay, CorruptStep, NothingToUndo, SandboxError, StepError, StepUnprotected,
                          UndoUnavailable)
from .core.workspace import Workspace, default_state_dir
from .hostfs import PathError, StoreBusy

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_REFUSED, EXIT_UNAVAILABLE, EXIT_BUSY = 0, 1, 2, 3, 4, 5


class CliError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _state_dir(args) -> str:
    return args.state_dir or default_state_dir(args.workdir)


def _open(args, must_exist: bool = True) -> Workspace:
    if not os.path.isdir(args.workdir):
        raise CliError(f"working folder {args.workdir!r} does not exist or is not a directory", EXIT_USAGE)
    state = _state_dir(args)
    if must_exist and not os.path.exists(os.path.join(state, "VERSION")) and not os.path.exists(os.path.join(state, "steps")):
        raise CliError(f"no undo history for {os.path.realpath(args.workdir)} (looked in {state}); "
                       "pass --state-dir if the store lives elsewhere", EXIT_FAILED)
    ws = Workspace.open(args.workdir, state_dir=state)
    if ws.recovery:
        r = ws.recovery
        print(f"recovered: an interrupted step ({r.get('step_id')}) was rolled back, "
              f"{r.get('paths_restored', 0)} path(s) restored", file=sys.stderr)
    return ws


def _when(ns: int | None) -> str:
    if not ns:
        return "-"
    return _dt.datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S")


def cmd_history(args) -> int:
    with _open(args) as ws:
        hist = ws.history()
        if args.json:
            json.dump({"workdir": os.path.realpath(args.workdir), "steps": hist}, sys.stdout, indent=2)
            print()
            return EXIT_OK
        if not hist:
            print("no steps in history")
            return EXIT_OK
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
        return EXIT_OK


def cmd_undo(args) -> int:
    if args.n < 1:
        raise CliError("-n must be at least 1", EXIT_USAGE)
    with _open(args) as ws:
        hist = ws.history()
        if not hist:
            raise CliError(f"nothing to undo: no steps in the undo history of {os.path.realpath(args.workdir)}",
                           EXIT_FAILED)
        if len(hist) < args.n:
            raise CliError(f"nothing undone: only {len(hist)} step(s) in history, cannot undo {args.n}", EXIT_FAILED)
        todo = hist[: args.n]
        print(f"undoing {len(todo)} step(s): " + ", ".join(f"{h['id']} ({h['command'] or h['type']})" for h in todo),
              file=sys.stderr, flush=True)
        result = ws.rollback(args.n, force=args.force)
        print(f"undone: step(s) {', '.join(str(i) for i in result['step_ids'])}; "
              f"{result['paths_restored']} path(s) restored")
        return EXIT_OK


def cmd_discard(args) -> int:
    if not args.yes:
        raise CliError("discarding deletes all undo history for this folder; confirm with --yes", EXIT_USAGE)
    with _open(args) as ws:
        ws.discard()
    print(f"undo history discarded; a fresh store is ready at {_state_dir(args)}")
    return EXIT_OK


def cmd_demo(args) -> int:
    """A sandbox session on the sample project: a destructive step, then its undo."""
    from .hostfs.real import RealHostFS

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sample = args.sample or os.path.join(here, "fixtures", "sample-project")
    if not os.path.isdir(sample):
        raise CliError(f"sample project not found at {sample}", EXIT_USAGE)
    base = tempfile.mkdtemp(prefix="sandbox-demo-")
    try:
        work = os.path.join(base, "project")
        shutil.copytree(sample, work, symlinks=True)
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
        with Workspace.open(work, state_dir=state) as ws:
            with ws.step("rm -rf * && echo 'oops' > README.md"):
                for name in sorted(os.listdir(work)):
                    ws.fs.remove_tree(name)
                ws.fs.write_file("README.md", b"oops\n")
            print(f"after `rm -rf * && echo 'oops' > README.md`: {sorted(os.listdir(work))}\n")
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


def cmd_serve_9p(args) -> int:
    """Serve a folder over 9P2000.L until SIGTERM/SIGINT; intercepted unless --read-only."""
    import asyncio
    import logging
    import signal

    from .mounts import Provider
    from .ninep.server import NinePServer, ServerConfig

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    config = ServerConfig(msize_max=args.msize_max)
    ws = None
    if args.read_only:
        provider = Provider.read_only_dir(args.root)
        what = "read-only"
    else:
        args.workdir = args.root
        ws = _open(args, must_exist=False)
        provider = Provider.intercepted(ws)
        what = f"intercepted; undo store {_state_dir(args)}"

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
                  f"msize up to {config.msize_max}. SIGTERM or Ctrl-C stops.", file=sys.stderr, flush=True)
            await stop.wait()
        finally:
            await server.close()

    try:
        asyncio.run(serve())
    finally:
        provider.close()
        if ws is not None:
            ws.close()  # closes the open ambient step: it is in `sandbox history` from now on
    print("sandbox: server stopped", file=sys.stderr)
    return EXIT_OK


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
               "  sandbox serve-9p --root DIR --socket PATH [--read-only]\n"
               "  sandbox demo\n\n"
               "exit codes:\n"
               "  0  success\n"
               "  1  failed, nothing to undo, or no undo history for the folder\n"
               "  2  bad usage or input (e.g. the folder does not exist)\n"
               "  3  refused: an undo barrier or an external change is in the way (undo --force overrides)\n"
               "  4  undo unavailable: format version mismatch (sandbox discard), unprotected or corrupt step\n"
               "  5  the undo store is in use by another process")
    p.add_argument("--version", action="version", version=f"sandbox {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, help, description, exit_codes):
        epilog = "exit codes:\n" + "\n".join(f"  {code}  {what}" for code, what in exit_codes)
        return sub.add_parser(name, help=help, description=description, epilog=epilog, formatter_class=raw)

    def with_workdir(sp):
        sp.add_argument("--workdir", required=True, metavar="DIR", help="the working folder")
        sp.add_argument("--state-dir", metavar="DIR", help="where its undo store lives (default: under "
                        "$XDG_STATE_HOME/sandbox/undo/, keyed by the folder's real path)")
        return sp

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
         (4, "undo unavailable: format version mismatch (run `sandbox discard`), unprotected or corrupt step"),
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
    s9 = command(
        "serve-9p", "serve a folder to 9P2000.L clients; every write lands in an undoable step",
        "Serve the folder --root DIR over 9P2000.L on a unix socket (what QEMU's guestfwd connects\n"
        "to) and/or TCP on loopback, until SIGTERM or Ctrl-C. Every mutation a client makes is\n"
        "intercepted: it lands in ambient steps (closed after 5 s without writes) that\n"
        "`sandbox history --workdir DIR` lists and `sandbox undo --workdir DIR -n N` undoes once the\n"
        "server has stopped (the undo store is locked while it runs). --read-only serves without\n"
        "interception and refuses every mutation (EROFS).\n\n"
        "Linux client: mount -t 9p -o trans=unix,version=9p2000.L,msize=1048576 PATH /mnt\n"
        "(or trans=tcp,port=PORT 127.0.0.1 /mnt with --tcp).",
        [(0, "stopped cleanly"), (1, "failed to start (e.g. the socket path is taken)"),
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
    s9.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    s9.set_defaults(fn=cmd_serve_9p)
    demo = command(
        "demo", "run a session on a copy of the sample project: `rm -rf *`, history, undo, verify",
        "Copy the sample project to a temporary folder, run a destructive step on it\n"
        "(`rm -rf * && echo oops > README.md`), show the history, undo the step and check that\n"
        "the tree is identical to the original (bytes, modes, mtimes). Needs no --workdir.",
        [(0, "the tree is identical after undo"), (1, "it is not (a bug)"), (2, "the sample project was not found")])
    demo.add_argument("--sample", metavar="DIR", help="project to copy (default: fixtures/sample-project)")
    demo.add_argument("--keep", action="store_true", help="keep the temporary copy")
    demo.set_defaults(fn=cmd_demo)
    return p


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
    except UndoUnavailable as e:
        print(f"sandbox: {e.message}", file=sys.stderr)
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
