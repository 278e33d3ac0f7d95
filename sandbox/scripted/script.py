"""The scripted guest's language: parsing and running a script against mounted 9P shares.

Used by :class:`sandbox.scripted.guest.ScriptedGuest`, which owns the mounts, the worker
threads and the log; a :class:`_Script` reads them through the guest object it is given
(``_mounts`` deepest first, each with ``parts``, ``spec.read_only`` and ``fs``; ``_log``).

Script language
===============

A script is a sequence of commands separated by newlines or ``;``. Each command is one
line of words, split as a POSIX shell splits them (``shlex``): ``'single'`` and
``"double"`` quotes group words, a backslash escapes the next character, a
backslash-newline continues the line. ``#`` at the start of a word begins a comment that
runs to the end of the line (``a#b`` is a word). ``;`` and ``#`` inside quotes are literal.

Not shell: there are no pipes, redirections, ``&&``/``||``, subshells, backticks or
globbing. An *unquoted* ``| & < > ( ) ` * ? [`` is a syntax error (quote it to mean the
character), so a script written for ``sh`` never silently does something else. Every
command behaves as under ``set -e``: the first one that fails stops the script.

Variables: ``$NAME`` and ``${NAME}`` expand to the value of ``NAME`` in the ``env`` given to
``exec`` (nothing else is in the environment; an unset name expands to nothing).
Expansion happens *before* the words are split, as in ``sh``, and is quote-aware: it
happens unquoted and inside double quotes, not inside single quotes; ``\\$NAME`` is
literal. Unlike ``sh`` an expanded value is never split into several words or globbed
(``echo $PYTHONPATH`` prints it whole, spaces included). A ``$`` not followed by a name or
``{`` is a literal ``$`` (so ``$1``, ``$?`` are not special); ``$(`` is a syntax error.

Paths: an absolute path names a share by the longest mount target that is a prefix of it
*in whole components* (``/mnt/working/10`` is not inside ``/mnt/working/1``; with shares at
``/mnt/working/0`` and ``/mnt/working/0/sub``, ``/mnt/working/0/sub/x`` is ``x`` in the
second). A relative path is relative to the current directory (``exec``'s ``cwd``, changed
by ``cd``). ``.`` and ``..`` are resolved lexically (``..`` of ``/`` is ``/``). A path in no
share fails with ``not in a shared folder`` (even under ``rm -f``). Symlinks are never
followed — the server refuses them (``ELOOP``) in the middle of a path and to ``cat``/``cp``;
``ls``/``stat``/``rm``/``mv`` act on the link itself.

A share mounted read-only (``GuestMount.read_only``) refuses every write with ``EROFS`` in
the guest, as a kernel ``mount -o ro`` does, before any message is sent; a writable mount
of a read-only export gets ``EROFS`` from the server.

Commands (``[x]`` optional, ``...`` repeatable)::

    echo [-n] TEXT...            TEXT joined by spaces, then a newline (none with -n);
                                 no escapes are interpreted
    write PATH [TEXT...]         create or truncate PATH and write TEXT (words joined by
                                 spaces, no newline added) as UTF-8
    append PATH [TEXT...]        append TEXT to PATH (created if missing)
    cat PATH...                  file contents to stdout (decoded as UTF-8, bad bytes → U+FFFD)
    ls [-a] [PATH...]            names in a directory, sorted by code point, one per line;
                                 dot-names only with -a; a non-directory prints its operand;
                                 several operands get "PATH:" headers
    stat PATH...                 one line per operand: KIND MODE SIZE, e.g. "reg 0644 5"
                                 (KIND: reg, dir, lnk, other; MODE in octal; never follows)
    mkdir [-p] PATH...           mode 0755; -p makes parents and accepts existing directories
    touch PATH...                create (mode 0644) if missing, else set mtime and atime to now
    rm [-r|-R] [-f] PATH...      unlink; -r removes a tree (children first, one unlink/rmdir
                                 each, as rm -rf sends them); -f ignores missing operands
    rmdir PATH...                remove empty directories
    mv SRC DST                   rename within a share; DST an existing directory → DST/name.
                                 Across shares (as mv across devices): a regular file or a
                                 symlink is copied (mode and mtime kept) and the source
                                 removed; a directory fails with EXDEV
    cp SRC DST                   copy a regular file (a new file gets the source's mode minus
                                 the umask 022); DST an existing directory → DST/name
    chmod MODE PATH...           MODE octal (644) or symbolic ([ugoa]*[+-=][rwx]*, comma-separated)
    ln -s [-f] TARGET PATH       symlink PATH → TARGET (TARGET stored verbatim); -f replaces PATH;
                                 PATH an existing directory → PATH/basename(TARGET)
    ln [-f] TARGET PATH          hard link (same share only, else EXDEV)
    truncate -s SIZE PATH...     set the size (SIZE in bytes, K/M/G suffixes are powers of 1024);
                                 creates a missing file
    setfattr -n NAME [-v VALUE] PATH...
                                 set an xattr; VALUE is text (UTF-8), 0x<hex> or 0s<base64>
    setfattr -x NAME PATH...     remove an xattr
    gen DIR COUNT [SIZE]         mkdir -p DIR, then create COUNT files DIR/f00000, DIR/f00001 …
                                 of SIZE bytes (default 16). Stops early if cancelled
    cd DIR / pwd                 change / print the current directory (must be in a share)
    wait | sleep-until-cancelled block until the script is cancelled
    halt                         the guest dies (as a VM's ``poweroff -f``): alive() turns False
                                 and the command never completes
    true / false                 exit status 0 / 1 (false stops the script with 1)
    exit [N]                     stop the script with status N (0-255, default 0)

Escapes in ``write``/``append`` TEXT: ``\\n`` newline, ``\\t`` tab, ``\\r``, ``\\0`` NUL and
``\\\\`` a backslash; any other backslash is kept. The shell removes an unquoted backslash
first, so write them quoted: ``write notes "line 1\\nline 2\\n"``.

Exit status and output: 0 if every command succeeded. A failing command prints
``<command>: <operand>: <strerror>`` on stderr (e.g. ``cat: missing: No such file or
directory``; a refused safeguard hold is ``Input/output error``) and the script stops with 1;
commands with several operands try each and report each failure first. Bad usage (an
unknown option, a missing operand) prints ``<command>: usage: …`` and stops with 2; a
syntax error prints ``sh: line N: …`` and exits 2 before anything runs; an unknown command
prints ``sh: NAME: not found`` and stops with 127. Output is streamed: ``on_output(stream,
text)`` is called (on the script's worker thread) as each command produces it.

Cancellation: ``cancel`` makes the script stop before its next command (``wait`` wakes at
once, ``gen`` stops between files) and complete with exit code 143, signal 15 — what a
SIGTERM'd shell reports. A 9P request the server holds (a safeguard hold) blocks the
worker thread until the hold is decided, as a syscall blocks in the guest; a cancel then
takes effect once it returns (a real kernel would send ``Tflush`` — the scripted guest
does not). ``stop`` closes the sockets, which ends even a held request.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import logging
import os
import posixpath
import re
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..hostfs import DIR, LNK, REG
from ..ninep.messages import ProtocolError

__all__ = ["ScriptSyntaxError", "parse_script", "unescape"]

log = logging.getLogger("sandbox.scripted_guest")

EXIT_CANCELLED = 128 + 15  # SIGTERM
SIGTERM = 15
EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
UMASK = 0o022
GEN_SIZE_DEFAULT = 16
SHOWN_MAX = 300  # characters of a command kept in the log


# ---------------------------------------------------------------------------- parsing


class ScriptSyntaxError(ValueError):
    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line = line


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_UNSUPPORTED = {
    "|": "pipes are not supported",
    "&": "'&', '&&' are not supported (commands already stop at the first failure: use ';')",
    "<": "redirections are not supported",
    ">": "redirections are not supported (use write/append)",
    "(": "subshells are not supported",
    ")": "subshells are not supported",
    "`": "command substitution is not supported",
    "*": "globbing is not supported (quote '*' for the character)",
    "?": "globbing is not supported (quote '?' for the character)",
    "[": "globbing and '[' tests are not supported (quote '[' for the character)",
}


def parse_script(script: str, env: dict[str, str]) -> list[tuple[int, list[str]]]:
    """The commands of ``script`` as (line number, argv), variables expanded (module docstring).

    A quote-aware scanner splits commands at unquoted ``;``/newlines, drops comments and
    substitutes ``$NAME`` (re-quoted, so a value is never re-parsed); ``shlex`` then splits
    each command into words. Raises :class:`ScriptSyntaxError`."""
    commands: list[tuple[int, list[str]]] = []
    buf: list[str] = []
    line = cmd_line = 1
    quote: str | None = None
    quote_line = 0
    word_start = True
    i, n = 0, len(script)

    def flush() -> None:
        text = "".join(buf)
        buf.clear()
        try:
            argv = shlex.split(text, comments=False, posix=True)
        except ValueError as e:  # pragma: no cover - the scanner balanced the quotes
            raise ScriptSyntaxError(cmd_line, str(e)) from None
        if argv:
            commands.append((cmd_line, argv))

    def expand(i: int, in_double: bool) -> int:
        """``script[i]`` is ``$``: append the expansion, return the index after it."""
        if script.startswith("{", i + 1):
            j = script.find("}", i + 2)
            name = script[i + 2:j] if j >= 0 else ""
            if j < 0 or not _NAME.fullmatch(name):
                raise ScriptSyntaxError(line, "bad substitution (write ${NAME})")
            end = j + 1
        else:
            match = _NAME.match(script, i + 1)
            if match is None:
                if script.startswith("(", i + 1):
                    raise ScriptSyntaxError(line, "command substitution $(...) is not supported")
                buf.append("$")
                return i + 1
            name, end = match.group(), match.end()
        value = env.get(name, "")
        if in_double:
            buf.append(value.replace("\\", "\\\\").replace('"', '\\"'))
        elif value:
            buf.append(shlex.quote(value))
        return end

    while i < n:
        c = script[i]
        if quote == "'":
            buf.append(c)
            if c == "'":
                quote = None
            elif c == "\n":
                line += 1
            i += 1
            continue
        if quote == '"':
            if c == "\\" and i + 1 < n:
                nxt = script[i + 1]
                if nxt == "$":
                    buf.append("$")  # literal: shlex gives "$" no meaning
                elif nxt == "\n":
                    line += 1  # a continuation inside double quotes too
                else:
                    buf.append(c + nxt)
                i += 2
                continue
            if c == '"':
                quote = None
                buf.append(c)
                i += 1
            elif c == "$":
                i = expand(i, True)
            else:
                if c == "\n":
                    line += 1
                buf.append(c)
                i += 1
            continue
        # unquoted
        if c == "\\":
            if i + 1 < n and script[i + 1] == "\n":
                line += 1
                i += 2
                continue
            buf.append(script[i:i + 2] if i + 1 < n else "\\\\")
            word_start = False
            i += 2
            continue
        if c in "'\"":
            quote, quote_line = c, line
            buf.append(c)
            word_start = False
            i += 1
        elif c in ";\n":
            flush()
            if c == "\n":
                line += 1
            cmd_line = line
            word_start = True
            i += 1
        elif c in " \t\r":
            buf.append(c)
            word_start = True
            i += 1
        elif c == "#" and word_start:
            j = script.find("\n", i)
            i = n if j < 0 else j
        elif c in _UNSUPPORTED:
            raise ScriptSyntaxError(line, _UNSUPPORTED[c])
        elif c == "$":
            i = expand(i, False)
            word_start = False
        else:
            buf.append(c)
            word_start = False
            i += 1
    if quote is not None:
        raise ScriptSyntaxError(quote_line, f"unterminated quote {quote}")
    flush()
    return commands


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\"}


def unescape(text: str) -> str:
    """``write``/``append``'s escapes: ``\\n \\t \\r \\0 \\\\``; any other backslash stays."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text, flags=re.DOTALL)


@dataclass
class _Target:
    mount: Any  # the guest's _Mount: parts, spec (GuestMount), fs (a WireFS)
    rel: str  # relative to the share's root ("" = the mount point)
    shown: str  # the operand as written, for messages

    @property
    def fs(self) -> Any:
        return self.mount.fs


def _components(path: str, cwd: str = "/") -> tuple[str, ...]:
    """``path`` (relative to ``cwd``) as absolute components, ``.``/``..`` resolved lexically."""
    full = path if path.startswith("/") else cwd.rstrip("/") + "/" + path
    parts: list[str] = []
    for c in full.split("/"):
        if c in ("", "."):
            continue
        if c == "..":
            if parts:
                parts.pop()
            continue
        parts.append(c)
    return tuple(parts)


def _strerror(e: BaseException) -> str:
    if isinstance(e, ProtocolError):
        return f"protocol error: {e}"
    if isinstance(e, OSError) and isinstance(e.errno, int) and e.errno > 0:
        try:
            return os.strerror(e.errno)
        except ValueError:
            pass
    if isinstance(e, OSError) and e.strerror:
        return str(e.strerror)
    return str(e) or type(e).__name__


# ---------------------------------------------------------------------------- running


class _Fail(Exception):
    """A command failed; ``message`` (if any) goes to stderr; the script stops with ``code``."""

    def __init__(self, message: str | None, code: int = 1):
        super().__init__(message)
        self.message = message
        self.code = code


class _Exit(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _Cancelled(Exception):
    pass


def _opts(cmd: str, args: list[str], flags: str, valued: str = "") -> tuple[set[str], dict[str, str], list[str]]:
    """POSIX-style short options: ``-rf``, ``-s 10``/``-s10``, ``--``; options end at the
    first operand. Returns (flags seen, option values, operands)."""
    seen: set[str] = set()
    values: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        j = 1
        while j < len(a):
            o = a[j]
            if o in valued:
                rest = a[j + 1:]
                if not rest:
                    i += 1
                    if i >= len(args):
                        raise _Fail(f"{cmd}: usage: option -{o} needs a value", EXIT_USAGE)
                    rest = args[i]
                values[o] = rest
                break
            if o not in flags:
                raise _Fail(f"{cmd}: usage: invalid option -- '{o}'", EXIT_USAGE)
            seen.add(o)
            j += 1
        i += 1
    return seen, values, args[i:]


def _size(cmd: str, text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text)
    if m is None:
        raise _Fail(f"{cmd}: usage: invalid size {text!r}", EXIT_USAGE)
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


_WHO_BITS = {"u": 0o700, "g": 0o070, "o": 0o007}
_PERM_BITS = {"r": 0o444, "w": 0o222, "x": 0o111}


def _chmod_mode(spec: str, current: int | None) -> int:
    """Octal or symbolic (``u+x``, ``go-w``, ``a=r``, ``+x``) mode; ``current`` for symbolic."""
    if re.fullmatch(r"[0-7]{1,4}", spec):
        return int(spec, 8)
    mode = current if current is not None else 0
    for clause in spec.split(","):
        m = re.fullmatch(r"([ugoa]*)([-+=])([rwx]*)", clause)
        if m is None:
            raise ValueError(spec)
        who, op, perms = m.groups()
        if not who or "a" in who:
            scope = 0o777
        else:
            scope = 0
            for w in who:
                scope |= _WHO_BITS[w]
        bits = 0
        for p in perms:
            bits |= _PERM_BITS[p]
        bits &= scope
        if not who:
            bits &= ~UMASK  # "+w" honours the umask, as chmod does
        if op == "+":
            mode |= bits
        elif op == "-":
            mode &= ~bits
        else:
            mode = (mode & ~scope) | bits
    return mode


def _gen_content(name: str, size: int) -> bytes:
    unit = (name + "\n").encode()
    return (unit * (size // len(unit) + 1))[:size]


class _Script:
    """One running script, on its worker thread."""

    def __init__(self, guest: Any, ex: Any, env: dict[str, str],
                 on_output: Callable[[str, str], None] | None):
        self.guest = guest
        self.ex = ex
        self.env = env
        self.on_output = on_output
        self.cwd = "/" + "/".join(_components(ex.cwd or "/"))
        self.cmd = ""

    # -- output --

    def _emit(self, stream: str, text: str) -> None:
        if not text or self.on_output is None:
            return
        try:
            self.on_output(stream, text)
        except Exception:
            log.exception("scripted guest: the output callback failed")

    def out(self, text: str) -> None:
        self._emit("stdout", text)

    def err(self, text: str) -> None:
        self._emit("stderr", text)

    # -- main --

    def run(self) -> int:
        """The exit code (EXIT_CANCELLED if cancelled)."""
        cancel = self.ex._cancel
        try:
            commands = parse_script(self.ex.command, self.env)
        except ScriptSyntaxError as e:
            self.err(f"sh: line {e.line}: syntax error: {e}\n")
            self.guest._log(f"[{self.ex.id}] syntax error on line {e.line}: {e}")
            return EXIT_USAGE
        for _line, argv in commands:
            if cancel.is_set():
                return EXIT_CANCELLED
            self.cmd = argv[0]
            shown = shlex.join(argv)
            self.guest._log(f"[{self.ex.id}] $ {shown[:SHOWN_MAX]}{'…' if len(shown) > SHOWN_MAX else ''}")
            handler = None
            if re.fullmatch(r"[a-z]+(-[a-z]+)*", argv[0]):
                handler = getattr(self, "cmd_" + argv[0].replace("-", "_"), None)
            try:
                if handler is None:
                    raise _Fail(f"sh: {argv[0]}: not found", EXIT_NOT_FOUND)
                handler(argv[1:])
            except _Exit as e:
                return e.code
            except _Cancelled:
                return EXIT_CANCELLED
            except _Fail as f:
                if cancel.is_set():  # the failure is the cancel's doing (stop closed the socket)
                    self.guest._log(f"[{self.ex.id}] {f.message or 'failed'} (cancelled)")
                    return EXIT_CANCELLED
                if f.message:
                    self.err(f.message + "\n")
                    self.guest._log(f"[{self.ex.id}] {f.message}")
                return f.code
            except (OSError, ProtocolError) as e:
                if cancel.is_set():
                    return EXIT_CANCELLED
                msg = f"{argv[0]}: {_strerror(e)}"
                self.err(msg + "\n")
                self.guest._log(f"[{self.ex.id}] {msg}")
                return 1
        return 0

    # -- paths --

    def resolve(self, path: str) -> _Target:
        if path == "":
            raise _Fail(f"{self.cmd}: '': No such file or directory")
        parts = _components(path, self.cwd)
        for mount in self.guest._mounts:  # deepest target first
            if mount.fs is None:
                continue  # a live mount still attaching
            k = len(mount.parts)
            if parts[:k] == mount.parts:
                return _Target(mount, "/".join(parts[k:]), path)
        raise _Fail(f"{self.cmd}: {path}: not in a shared folder")

    @contextlib.contextmanager
    def about(self, shown: str) -> Iterator[None]:
        """OSError (incl. NinePError) and ProtocolError inside → ``cmd: shown: strerror``."""
        try:
            yield
        except (OSError, ProtocolError) as e:
            raise _Fail(f"{self.cmd}: {shown}: {_strerror(e)}") from e

    @staticmethod
    def writable(t: _Target) -> None:
        if t.mount.spec.read_only:
            raise OSError(errno.EROFS, "read-only mount", t.shown)

    def each(self, operands: list[str], fn: Callable[[str], None]) -> None:
        """``fn`` on every operand; each failure reported; the command fails if any did."""
        failed = False
        for p in operands:
            try:
                fn(p)
            except _Fail as f:
                if f.code != 1:
                    raise
                if f.message:
                    self.err(f.message + "\n")
                    self.guest._log(f"[{self.ex.id}] {f.message}")
                failed = True
        if failed:
            raise _Fail(None)

    def need(self, operands: list[str], count: int, usage: str, exact: bool = False) -> None:
        if len(operands) < count or (exact and len(operands) != count):
            raise _Fail(f"{self.cmd}: usage: {usage}", EXIT_USAGE)

    def _into_dir(self, d: _Target, name: str) -> _Target:
        """DST an existing directory → DST/name (mv, cp, ln)."""
        try:
            st = d.fs.lstat(d.rel)
        except (FileNotFoundError, NotADirectoryError):
            return d
        if st.kind != DIR:
            return d
        return _Target(d.mount, posixpath.join(d.rel, name), posixpath.join(d.shown, name))

    # -- commands --

    def cmd_echo(self, args: list[str]) -> None:
        newline = "\n"
        if args and args[0] == "-n":
            args, newline = args[1:], ""
        self.out(" ".join(args) + newline)

    def cmd_true(self, args: list[str]) -> None:
        pass

    def cmd_false(self, args: list[str]) -> None:
        raise _Fail(None)

    def cmd_exit(self, args: list[str]) -> None:
        if not args:
            raise _Exit(0)
        try:
            code = int(args[0])
        except ValueError:
            raise _Fail(f"exit: usage: illegal number: {args[0]}", EXIT_USAGE) from None
        raise _Exit(code & 0xFF)

    def cmd_wait(self, args: list[str]) -> None:
        self.ex._cancel.wait()
        raise _Cancelled()

    cmd_sleep_until_cancelled = cmd_wait

    def cmd_halt(self, args: list[str]) -> None:
        """The guest dies (a VM's ``poweroff -f``): not alive any more, the command never completes."""
        self.guest._halted = True
        self.guest._log("halted")
        self.ex._cancel.wait()
        raise _Cancelled()

    def cmd_pwd(self, args: list[str]) -> None:
        self.out(self.cwd + "\n")

    def cmd_cd(self, args: list[str]) -> None:
        self.need(args, 1, "cd DIR", exact=True)
        t = self.resolve(args[0])
        with self.about(args[0]):
            if t.fs.lstat(t.rel).kind != DIR:
                raise OSError(errno.ENOTDIR, "not a directory")
        self.cwd = "/" + "/".join(_components(args[0], self.cwd))

    def cmd_write(self, args: list[str]) -> None:
        self.need(args, 1, "write PATH [TEXT...]")
        t = self.resolve(args[0])
        data = unescape(" ".join(args[1:])).encode()
        with self.about(t.shown):
            self.writable(t)
            t.fs.write_file(t.rel, data)

    def cmd_append(self, args: list[str]) -> None:
        self.need(args, 1, "append PATH [TEXT...]")
        t = self.resolve(args[0])
        data = unescape(" ".join(args[1:])).encode()
        with self.about(t.shown):
            self.writable(t)
            try:
                st = t.fs.lstat(t.rel)
            except FileNotFoundError:
                t.fs.write_file(t.rel, data)
                return
            if st.kind == DIR:
                raise OSError(errno.EISDIR, "is a directory")
            if data:
                t.fs.write(t.rel, st.size, data)

    def cmd_cat(self, args: list[str]) -> None:
        self.need(args, 1, "cat PATH...")

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                if t.fs.lstat(t.rel).kind == DIR:
                    raise OSError(errno.EISDIR, "is a directory")
                data = t.fs.read_file(t.rel)
            self.out(data.decode("utf-8", "replace"))

        self.each(args, one)

    def cmd_ls(self, args: list[str]) -> None:
        flags, _v, operands = _opts("ls", args, "aA")
        operands = operands or ["."]
        headers = len(operands) > 1

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                st = t.fs.lstat(t.rel)
                if st.kind != DIR:
                    self.out(p + "\n")
                    return
                names = sorted(n for n in t.fs.listdir(t.rel) if flags or not n.startswith("."))
            self.out((f"{p}:\n" if headers else "") + "".join(n + "\n" for n in names))

        self.each(operands, one)

    def cmd_stat(self, args: list[str]) -> None:
        self.need(args, 1, "stat PATH...")

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                st = t.fs.lstat(t.rel)
            self.out(f"{st.kind} {st.mode:04o} {st.size}\n")

        self.each(args, one)

    def cmd_mkdir(self, args: list[str]) -> None:
        flags, _v, operands = _opts("mkdir", args, "p")
        self.need(operands, 1, "mkdir [-p] PATH...")

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                self.writable(t)
                if "p" in flags:
                    t.fs.makedirs(t.rel, 0o755)
                elif t.rel == "":
                    raise FileExistsError(errno.EEXIST, "the mount point exists")
                else:
                    t.fs.mkdir(t.rel, 0o755)

        self.each(operands, one)

    def cmd_touch(self, args: list[str]) -> None:
        self.need(args, 1, "touch PATH...")

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                self.writable(t)
                if t.fs.exists(t.rel):
                    now = time.time_ns()
                    t.fs.utime(t.rel, now, now)
                else:
                    t.fs.create(t.rel, 0o644)

        self.each(args, one)

    def cmd_rm(self, args: list[str]) -> None:
        flags, _v, operands = _opts("rm", args, "rRf")
        force, recursive = "f" in flags, bool(flags & {"r", "R"})
        if not operands and not force:
            raise _Fail("rm: usage: rm [-r] [-f] PATH...", EXIT_USAGE)

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                try:
                    st = t.fs.lstat(t.rel)
                except FileNotFoundError:
                    if force:
                        return
                    raise
                self.writable(t)
                if recursive:
                    t.fs.remove_tree(t.rel)
                elif st.kind == DIR:
                    raise OSError(errno.EISDIR, "is a directory")
                else:
                    t.fs.unlink(t.rel)

        self.each(operands, one)

    def cmd_rmdir(self, args: list[str]) -> None:
        self.need(args, 1, "rmdir PATH...")

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                self.writable(t)
                t.fs.rmdir(t.rel)

        self.each(args, one)

    def cmd_mv(self, args: list[str]) -> None:
        self.need(args, 2, "mv SRC DST", exact=True)
        s, d = self.resolve(args[0]), self.resolve(args[1])
        with self.about(s.shown):
            if s.rel == "":
                raise OSError(errno.EBUSY, "a mount point")
            self.writable(s)
            st = s.fs.lstat(s.rel)
        with self.about(d.shown):
            d = self._into_dir(d, posixpath.basename(s.rel))
            self.writable(d)
        if d.mount is s.mount:
            with self.about(s.shown):
                s.fs.rename(s.rel, d.rel)
            return
        # across shares: what mv does across devices, for a file or a symlink
        with self.about(s.shown):
            if st.kind not in (REG, LNK):
                raise OSError(errno.EXDEV, "a directory across shares")
            data = s.fs.read_file(s.rel) if st.kind == REG else s.fs.readlink(s.rel)
        with self.about(d.shown):
            if st.kind == LNK:
                if d.fs.exists(d.rel):
                    d.fs.unlink(d.rel)
                d.fs.symlink(data, d.rel)
            else:
                d.fs.write_file(d.rel, data, st.mode)
                d.fs.chmod(d.rel, st.mode)
                d.fs.utime(d.rel, st.mtime_ns)
        with self.about(s.shown):
            s.fs.unlink(s.rel)

    def cmd_cp(self, args: list[str]) -> None:
        self.need(args, 2, "cp SRC DST", exact=True)
        s, d = self.resolve(args[0]), self.resolve(args[1])
        with self.about(s.shown):
            st = s.fs.lstat(s.rel)
            if st.kind == DIR:
                raise OSError(errno.EISDIR, "is a directory")
            data = s.fs.read_file(s.rel)
        with self.about(d.shown):
            d = self._into_dir(d, posixpath.basename(s.rel))
            self.writable(d)
            d.fs.write_file(d.rel, data, st.mode & 0o777 & ~UMASK)

    def cmd_chmod(self, args: list[str]) -> None:
        self.need(args, 2, "chmod MODE PATH...")
        spec, operands = args[0], args[1:]
        try:
            _chmod_mode(spec, 0)
        except ValueError:
            raise _Fail(f"chmod: invalid mode: {spec!r}") from None

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                self.writable(t)
                current = None if re.fullmatch(r"[0-7]{1,4}", spec) else t.fs.lstat(t.rel).mode
                t.fs.chmod(t.rel, _chmod_mode(spec, current))

        self.each(operands, one)

    def cmd_ln(self, args: list[str]) -> None:
        flags, _v, operands = _opts("ln", args, "sf")
        self.need(operands, 2, "ln [-s] [-f] TARGET PATH", exact=True)
        target, path = operands
        d = self.resolve(path)
        with self.about(path):
            d = self._into_dir(d, posixpath.basename(target.rstrip("/")) or target)
            self.writable(d)
        if "s" in flags:
            with self.about(d.shown):
                if "f" in flags and d.fs.exists(d.rel):
                    d.fs.unlink(d.rel)
                d.fs.symlink(target, d.rel)
            return
        s = self.resolve(target)
        with self.about(target):
            if s.mount is not d.mount:
                raise OSError(errno.EXDEV, "a hard link across shares")
            if s.fs.lstat(s.rel).kind == DIR:
                raise OSError(errno.EPERM, "a hard link to a directory")
        with self.about(d.shown):
            if "f" in flags and d.fs.exists(d.rel):
                d.fs.unlink(d.rel)
            d.fs.link(s.rel, d.rel)

    def cmd_truncate(self, args: list[str]) -> None:
        _f, values, operands = _opts("truncate", args, "", "s")
        if "s" not in values:
            raise _Fail("truncate: usage: truncate -s SIZE PATH...", EXIT_USAGE)
        self.need(operands, 1, "truncate -s SIZE PATH...")
        size = _size("truncate", values["s"])

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                self.writable(t)
                if not t.fs.exists(t.rel):
                    t.fs.create(t.rel, 0o644)
                t.fs.truncate(t.rel, size)

        self.each(operands, one)

    def cmd_setfattr(self, args: list[str]) -> None:
        _f, values, operands = _opts("setfattr", args, "", "nvx")
        usage = "setfattr -n NAME [-v VALUE] PATH... | setfattr -x NAME PATH..."
        if ("n" in values) == ("x" in values) or not operands:
            raise _Fail(f"setfattr: usage: {usage}", EXIT_USAGE)
        raw = values.get("v", "")
        try:
            if raw[:2].lower() == "0x":
                value = binascii.unhexlify(raw[2:])
            elif raw[:2].lower() == "0s":
                value = base64.b64decode(raw[2:], validate=True)
            else:
                value = raw.encode()
        except (ValueError, binascii.Error):
            raise _Fail(f"setfattr: usage: bad value {raw!r}", EXIT_USAGE) from None

        def one(p: str) -> None:
            t = self.resolve(p)
            with self.about(p):
                self.writable(t)
                if "x" in values:
                    t.fs.removexattr(t.rel, values["x"])
                else:
                    t.fs.setxattr(t.rel, values["n"], value)

        self.each(operands, one)

    def cmd_gen(self, args: list[str]) -> None:
        if len(args) not in (2, 3) or not all(a.isdigit() for a in args[1:]):
            raise _Fail("gen: usage: gen DIR COUNT [SIZE]", EXIT_USAGE)
        count = int(args[1])
        size = int(args[2]) if len(args) == 3 else GEN_SIZE_DEFAULT
        t = self.resolve(args[0])
        with self.about(t.shown):
            self.writable(t)
            t.fs.makedirs(t.rel, 0o755)
        for k in range(count):
            if self.ex._cancel.is_set():
                raise _Cancelled()
            name = f"f{k:05d}"
            with self.about(posixpath.join(t.shown, name)):
                t.fs.write_file(posixpath.join(t.rel, name), _gen_content(name, size))
