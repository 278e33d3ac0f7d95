"""Exhaustion by one client: every resource of the 9P server has a limit and an overflow rule.

One abusive connection — replies never read, fids or xattr walks or directory listings
piled up, files held open, half-sent frames, connections opened by the dozen — must not
starve the host agent: its memory and descriptors stay bounded (measured from
``/proc/<pid>/status`` and ``/proc/<pid>/fd``, before and after), each limit answers its
documented errno or refusal (``sandbox/limits.py``), and another client is still served
a Tversion/Tattach/Twalk/Tlopen/Tread round trip meanwhile. The limits are the defaults
of :class:`~sandbox.limits.ServerLimits` wherever the count stays small, and a small
configured value otherwise. No sleeps: a closed connection is waited for by reading it
(pytest-timeout is the guard), a server's state is read on its own loop.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
from contextlib import ExitStack, contextmanager

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.limits import (DESCRIPTORS_RESERVED, DIR_ENTRY_OVERHEAD_BYTES, PROCESS_DESCRIPTORS, DescriptorBudget,
                            MiB, ServerLimits, listing_cost, raise_nofile_soft_limit)
from sandbox.mounts import Provider, memory_tree
from sandbox.mounts.memory import memory_hostfs
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client, NinePError
from sandbox.ninep.codec import encode
from sandbox.ninep.server import NinePServer, ServerConfig
from sandbox_sim import oracle
from sandbox.ninep.wirefs import serve

pytestmark = pytest.mark.timeout(180)
LIMITS = ServerLimits()
NINEP_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "9p.md")


# --------------------------------------------------------------------------- measuring


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss(pid: int) -> int:
    return _status(pid, "VmRSS")


def peak_since_reset(pid: int) -> int:
    return _status(pid, "VmHWM")


def reset_peak(pid: int) -> int:
    """Make VmHWM the current RSS (Linux ≥ 4.0), so a later VmHWM is this test's peak; the RSS."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    return rss(pid)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def errno_of(fn, *args) -> int:
    with pytest.raises(OSError) as info:
        fn(*args)
    return info.value.errno


def errnos(c: Client, tags: list[int]) -> list[int]:
    """Wait for every tag; 0 for a success, the errno of an Rlerror."""
    out = []
    for t in tags:
        try:
            c.wait(t)
            out.append(0)
        except NinePError as e:
            out.append(e.errno)
    return out


def served(path: str, name: str, expect: bytes) -> None:
    """Another client gets a full Tversion/Tattach/Twalk/Tlopen/Tread round trip."""
    with Client.connect_unix(path) as c:
        root, _ = c.attach()
        fid, _ = c.walk(root, [name])
        c.lopen(fid, m.DOTL_RDONLY)
        assert c.read(fid, 0, len(expect)) == expect


def closed_by_server(sock: socket.socket) -> bool:
    """Read until EOF (the server closed us); pytest-timeout guards a server that never does."""
    sock.settimeout(None)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


# --------------------------------------------------------------------------- a real server process


class ServerProcess:
    """``sandbox serve-9p`` in its own process (its RSS and descriptors are its own)."""

    def __init__(self, tmp_path, root, *args: str, nofile: tuple[int, int] | None = None):
        self.sock = str(tmp_path / "9p.sock")
        self.env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg")}
        self.root = str(root)

        def limit():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

        self.p = subprocess.Popen([sys.executable, "-m", "sandbox", "serve-9p", "--root", self.root, "--socket",
                                   self.sock, "--log-level", "info", *args],
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=self.env,
                                  preexec_fn=limit)
        self.lines: list[str] = []
        for line in self.p.stderr:  # blocks until the server announces itself (or dies)
            self.lines.append(line)
            if "serving" in line:
                break
        else:
            raise AssertionError("serve-9p did not start:\n" + "".join(self.lines))
        self._drain = threading.Thread(target=lambda: self.lines.extend(self.p.stderr), daemon=True)
        self._drain.start()
        self.pid = self.p.pid

    def stop(self) -> str:
        self.p.send_signal(signal.SIGTERM)
        self.p.wait(60)
        self._drain.join(30)
        assert self.p.returncode == 0, "".join(self.lines)
        return "".join(self.lines)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(30)


@contextmanager
def server_process(tmp_path, root, *args: str, nofile=None):
    sp = ServerProcess(tmp_path, root, *args, nofile=nofile)
    try:
        yield sp
    finally:
        sp.kill()


def sandbox_cmd(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL)


# --------------------------------------------------------------------------- write buffer: backpressure


def test_unread_pipelined_reads_stop_being_read_so_memory_stays_bounded(tmp_path):
    """The review's probe: 128 pipelined 1 MiB Treads in one 3 KiB write, replies never read,
    buffered +128 MiB. Now the server stops reading the connection once its unsent replies
    pass ``write_buffer_bytes_max`` and goes on when they drain: every reply still arrives."""
    work = tmp_path / "work"
    work.mkdir()
    data = os.urandom(MiB)
    (work / "big").write_bytes(data)
    with server_process(tmp_path, work, "--read-only") as sp:
        with Client.connect_unix(sp.sock, msize=MiB) as abuser:
            root, _ = abuser.attach()
            fid, _ = abuser.walk(root, ["big"])
            abuser.lopen(fid, m.DOTL_RDONLY)
            base = reset_peak(sp.pid)
            tags = abuser.send_many([m.Tread(fid, 0, abuser.iounit)] * 128)
            served(sp.sock, "big", data[:4096])  # while the abuser's replies sit unread
            served(sp.sock, "big", data[:4096])
            peak = peak_since_reset(sp.pid) - base
            for t in tags:
                assert abuser.wait(t).data == data[:abuser.iounit]
            peak = max(peak, peak_since_reset(sp.pid) - base)
        sp.stop()
    # the bound twice (asyncio's buffer is a bytearray: growing it while it drains copies it)
    # and a few msize of one reply in the making; unbounded, this was 128 MiB and more
    assert peak < 2 * LIMITS.write_buffer_bytes_max + 4 * MiB, f"server grew {peak / MiB:.1f} MiB"


# --------------------------------------------------------------------------- fids


def test_fids_per_connection_stop_at_65536_with_enfile(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "f").write_bytes(b"x")
    assert LIMITS.fids_per_connection_max == 65_536
    with server_process(tmp_path, work, "--read-only") as sp:
        with Client.connect_unix(sp.sock) as c:
            root, _ = c.attach()  # fid 1 of 65,536
            base = reset_peak(sp.pid)
            fids = iter(range(2, LIMITS.fids_per_connection_max + 2))
            for _batch in range(16):
                got = errnos(c, c.send_many([m.Twalk(root, next(fids), ["f"]) for _ in range(4096)]))
                assert got == [0] * 4096 or _batch == 15
            assert got == [0] * 4095 + [errno.ENFILE]  # 1 + 16 × 4096 − 1 fids, then one too many
            served(sp.sock, "f", b"x")
            grown = peak_since_reset(sp.pid) - base
            c.clunk(2)
            c.walk(root, ["f"], newfid=LIMITS.fids_per_connection_max + 1)  # a freed fid slot is reusable
        sp.stop()
    assert grown < 64 * MiB, f"65,536 fids cost {grown / MiB:.1f} MiB"


# --------------------------------------------------------------------------- xattr values


XATTR = os.urandom(64 * 1024)


def xattr_tree() -> Provider:
    host = memory_hostfs({"f": b"x", "g": b"y"})
    host.setxattr("f", "user.big", XATTR)
    return Provider(host, None, read_only=False, label="memory")


def test_xattr_values_held_per_connection_stop_with_enomem(tmp_path):
    """The review's probe: 3,000 Txattrwalks of a 64 KiB value held 188 MiB. Now the values
    held for one connection's fids stop at ``xattr_bytes_per_connection_max`` (ENOMEM);
    clunking frees them; another connection has its own budget."""
    per_conn = LIMITS.xattr_bytes_per_connection_max // len(XATTR)
    pid = os.getpid()
    with serve(xattr_tree()) as (_st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        f, _ = c.walk(root, ["f"])
        base = reset_peak(pid)
        fids = list(range(100, 3100))
        got = errnos(c, c.send_many([m.Txattrwalk(f, x, "user.big") for x in fids]))
        grown = peak_since_reset(pid) - base
        assert got == [0] * per_conn + [errno.ENOMEM] * (3000 - per_conn)
        assert grown < 32 * MiB, f"held xattr values cost {grown / MiB:.1f} MiB"
        assert c.read(fids[0], 0, 10) == XATTR[:10]  # the values held are served
        with Client.connect_unix(path) as other:
            other.attach()
            assert other.getxattr(other.walk_path("f"), "user.big") == XATTR  # its own budget
        for x in fids[:per_conn]:
            c.clunk(x)
        assert c.getxattr(f, "user.big") == XATTR  # freed on clunk
        # Txattrcreate reserves its declared size the same way
        held = [c.xattrwalk(f, "user.big")[0] for _ in range(per_conn)]
        g, _ = c.walk(root, ["g"])
        assert errno_of(c.xattrcreate, g, "user.new", 100) == errno.ENOMEM
        c.clunk(held.pop())
        c.setxattr(g, "user.new", XATTR[:100])
        assert c.getxattr(g, "user.new") == XATTR[:100]


# --------------------------------------------------------------------------- readdir listings


def names_in(tmp_path, n: int, width: int = 40) -> tuple[str, list[str]]:
    d = tmp_path / "work" / "many"
    d.mkdir(parents=True)
    names = [f"{i:07d}".ljust(width, "x") for i in range(n)]
    for name in names:
        os.close(os.open(d / name, os.O_CREAT | os.O_WRONLY, 0o644))
    return str(d), names


def test_readdir_listings_per_connection_are_bounded(tmp_path):
    """The review's probe: every readdir fid kept its own sorted copy of a 100,000-entry
    listing (~10 MiB each). Now one connection keeps at most
    ``dir_listing_bytes_per_connection_max`` of listings; every fid still reads all entries."""
    _d, names = names_in(tmp_path, 50_000)
    with server_process(tmp_path, tmp_path / "work", "--read-only") as sp:
        with Client.connect_unix(sp.sock) as c:
            root, _ = c.attach()
            base = reset_peak(sp.pid)
            opened = []
            for _ in range(24):
                fid, _ = c.walk(root, ["many"])
                c.lopen(fid, m.DOTL_RDONLY)
                got, offset = read_some(c, fid, 0, 4096)
                assert got[:3] == [".", "..", names[0]]
                opened.append((fid, got, offset))
            grown = peak_since_reset(sp.pid) - base
            fid, got, offset = opened[0]  # its listing was dropped long ago: re-read, resumed
            while True:
                more, offset = read_some(c, fid, offset, 65536)
                if not more:
                    break
                got += more
            assert got == [".", ".."] + names
        sp.stop()
    listing = 50_000 * (40 + 64)
    assert grown < LIMITS.dir_listing_bytes_per_connection_max + 3 * listing, f"listings cost {grown / MiB:.1f} MiB"


def test_a_directory_over_the_listing_budget_is_read_only_up_to_it_and_refused():
    """A listing is never larger than ``dir_listing_bytes_per_connection_max`` (kept listings
    of other fids are dropped to make room, as before): the host reads a directory only up to
    that bound — the in-memory host counts one name past it, never the rest — and a
    directory over it is ``ENOMEM`` at Treaddir, as an OPENDIR over the FUSE server's budget.
    Directories within it are still listed whole, however many fids keep theirs."""
    big = [f"f{i:04d}" for i in range(2000)]
    small = [f"f{i:02d}" for i in range(20)]
    tree = memory_tree({f"big/{n}": b"" for n in big} | {f"small/{n}": b"" for n in small})
    budget = 4096
    with serve(tree, ServerConfig(limits=ServerLimits(dir_listing_bytes_per_connection_max=budget))) as (_st, path), \
            Client.connect_unix(path) as c:
        root, _ = c.attach()
        fid, _ = c.walk(root, ["big"])
        c.lopen(fid, m.DOTL_RDONLY)
        before = tree.host.entries_read
        with pytest.raises(NinePError) as e:
            c.readdir(fid, 0, 8192)
        assert e.value.errno == errno.ENOMEM
        room = budget - listing_cost([".", ".."])
        assert tree.host.entries_read - before == room // (5 + DIR_ENTRY_OVERHEAD_BYTES) + 1 < len(big)
        fids = []
        for _ in range(4):  # each listing fits alone; together they do not: the oldest are dropped
            f, _ = c.walk(root, ["small"])
            c.lopen(f, m.DOTL_RDONLY)
            got, _offset = read_some(c, f, 0, 8192)
            assert got == [".", ".."] + small
            fids.append(f)
        assert 4 * listing_cost([".", ".."] + small) > budget


def read_some(c: Client, fid: int, offset: int, count: int = 2048) -> tuple[list[str], int]:
    ents = c.readdir(fid, offset, count)
    return [e.name for e in ents], (ents[-1].offset if ents else offset)


def test_evicted_listings_resume_exactly_even_if_the_directory_changed(tmp_path):
    """Listings are dropped least-recently-used first; a fid whose listing was dropped
    re-reads the directory and resumes after the last name it returned, so no entry that
    stayed is skipped or repeated — even after entries before it were removed or added."""
    d, names = names_in(tmp_path, 3000)
    cost = 3002 * (40 + 64)  # one listing, as the server counts it
    limits = ServerLimits(dir_listing_bytes_per_connection_max=cost + cost // 2)  # one fits, not two
    ws = Workspace.open(str(tmp_path / "work"), state_dir=str(tmp_path / "state"))
    with serve(Provider.intercepted(ws), ServerConfig(limits=limits)) as (_st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        fids = []
        for _ in range(3):
            fid, _ = c.walk(root, ["many"])
            c.lopen(fid, m.DOTL_RDONLY)
            fids.append(fid)
        seen = {fid: [] for fid in fids}
        offsets = dict.fromkeys(fids, 0)
        # round robin: every switch evicts the listing of the fid read before
        for _round in range(10):
            for fid in fids:
                got, offsets[fid] = read_some(c, fid, offsets[fid])
                seen[fid] += got
        # the directory changes under fids[0] (mid-scan, its listing dropped meanwhile)
        before_pos = seen[fids[0]][-1]
        removed = [n for n in names if n < before_pos][-5:]
        for n in removed:
            os.unlink(os.path.join(d, n))
        os.close(os.open(os.path.join(d, "0000000-new-before"), os.O_CREAT | os.O_WRONLY, 0o644))
        got, offsets[fids[1]] = read_some(c, fids[1], offsets[fids[1]])  # evict fids[0]'s listing
        seen[fids[1]] += got
        for fid in fids:
            while True:
                got, offsets[fid] = read_some(c, fid, offsets[fid])
                if not got:
                    break
                seen[fid] += got
    ws.close()
    for fid in fids:
        assert seen[fid][:2] == [".", ".."]
        rest = seen[fid][2:]
        assert len(rest) == len(set(rest)), "an entry came twice"
        assert set(names) - set(removed) <= set(rest) <= set(names) | {"0000000-new-before"}


# --------------------------------------------------------------------------- connections and frames


def test_connection_cap_refuses_cleanly_and_the_others_are_served(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "f").write_bytes(b"hello")
    with server_process(tmp_path, work, "--read-only") as sp, ExitStack() as stack:
        clients = [stack.enter_context(Client.connect_unix(sp.sock)) for _ in range(LIMITS.connections_max)]
        base = fds(sp.pid)
        for _ in range(50):
            s = socket.socket(socket.AF_UNIX)
            s.connect(sp.sock)  # accepted by the kernel, then closed by the server
            try:
                s.sendall(encode(m.NOTAG, m.Tversion(8192, m.VERSION)))
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed before we could even ask
            assert closed_by_server(s)
            s.close()
        assert fds(sp.pid) == base  # nothing left of the refused connections
        for c in clients:
            root, _ = c.attach()
            fid, _ = c.walk(root, ["f"])
            c.lopen(fid, m.DOTL_RDONLY)
            assert c.read(fid, 0, 5) == b"hello"
        clients.pop().close()
        for _ in range(1000):  # until the server has seen that close (no timing: bounded tries)
            try:
                served(sp.sock, "f", b"hello")
                break
            except (ConnectionError, OSError):
                continue
        else:
            raise AssertionError("a freed connection slot was never reused")
        stack.close()
        log = sp.stop()
    assert re.search(r"refused.*connections_max", log), log


@pytest.mark.timeout(60)
def test_a_half_sent_frame_times_out_and_closes_only_that_connection(tmp_path):
    limits = ServerLimits(frame_incomplete_timeout_s=0.2)
    tree = Provider(memory_hostfs({"f": b"hello"}), None, read_only=True)
    with serve(tree, ServerConfig(limits=limits)) as (_st, path), Client.connect_unix(path) as other:
        # before Tversion: a few bytes of a frame
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(struct.pack("<IBH", 100, m.Tversion.TYPE, 0xFFFF) + b"\0" * 10)
        assert closed_by_server(s)
        s.close()
        # after Tversion: half a Twrite
        with Client.connect_unix(path) as c:
            c.attach()
            frame = encode(1, m.Twrite(1, 0, b"z" * 4000))
            c.sock.sendall(frame[:2000])
            assert closed_by_server(c.sock)
        root, _ = other.attach()  # the other connection is untouched
        fid, _ = other.walk(root, ["f"])
        other.lopen(fid, m.DOTL_RDONLY)
        assert other.read(fid, 0, 5) == b"hello"


class RecordingTransport(asyncio.Transport):
    """asyncio's transport interface, recording what the connection asks of it."""

    def __init__(self):
        super().__init__()
        self.aborted, self.reading, self.buffered, self.written = False, True, 0, []

    def get_extra_info(self, name, default=None):
        return default

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def get_write_buffer_size(self):
        return self.buffered

    def write(self, data):
        self.written.append(bytes(data))

    def is_closing(self):
        return self.aborted

    def pause_reading(self):
        self.reading = False

    def resume_reading(self):
        self.reading = True

    def abort(self):
        self.aborted = True


def test_the_incomplete_frame_clock_starts_at_each_frame_s_first_byte_and_stops_while_not_reading():
    """Unit test of the deadline on a manual clock: bytes trickling into one frame do not
    reset it; a completed frame does (a stream of large frames, each read ending mid-frame,
    is never cut); time spent not reading (backpressure) does not count."""
    loop = asyncio.new_event_loop()
    now = [1000.0]
    loop.time = lambda: now[0]
    tree = Provider(memory_hostfs({"f": b"x"}), None, read_only=True)
    server = NinePServer(tree, ServerConfig(ServerLimits(frame_incomplete_timeout_s=10)))

    def at(t, fn=None):
        now[0] = 1000.0 + t
        if fn is not None:
            loop.call_soon(fn)
        loop.call_soon(loop.stop)
        loop.run_forever()  # one turn: callbacks, and every timer due by now

    def connection():
        conn, tr = server._protocol(), RecordingTransport()
        at(0, lambda: conn.connection_made(tr))
        at(0, lambda: conn.data_received(encode(m.NOTAG, m.Tversion(65536, m.VERSION))))
        assert len(tr.written) == 1  # Rversion
        return conn, tr

    frame = encode(1, m.Twrite(1, 0, b"z" * 4000))
    try:
        conn, tr = connection()  # trickling into one frame
        at(0, lambda: conn.data_received(frame[:10]))
        at(5, lambda: conn.data_received(frame[10:20]))
        at(9.9, lambda: conn.data_received(frame[20:30]))
        assert not tr.aborted
        at(10)
        assert tr.aborted

        conn, tr = connection()  # a stream of frames, every read ending inside one
        at(0, lambda: conn.data_received(frame[:-5]))
        at(9, lambda: conn.data_received(frame[-5:] + frame[:10]))
        at(18.9)
        assert not tr.aborted and len(tr.written) == 2  # the first frame was answered (EBADF)
        at(19)
        assert tr.aborted

        conn, tr = connection()  # not reading: the clock stops; reading again: it starts anew
        tr.buffered = ServerLimits().write_buffer_bytes_max + 1
        at(0, lambda: conn.data_received(frame + frame[:10]))
        assert not tr.reading
        at(100)
        assert not tr.aborted
        tr.buffered = 0
        at(100, conn.resume_writing)
        assert tr.reading and len(tr.written) == 2
        at(109.9)
        assert not tr.aborted
        at(110)
        assert tr.aborted
    finally:
        loop.close()


@pytest.mark.timeout(60)
def test_frames_are_bounded_before_and_after_version(tmp_path):
    """A connection's receive buffer holds at most one frame: ≤ 8 KiB before Tversion,
    ≤ the negotiated msize after; a size field beyond closes the connection at once."""
    tree = Provider(memory_hostfs({"f": b"hello"}), None, read_only=True)
    with serve(tree) as (_st, path):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(struct.pack("<IBH", LIMITS.frame_bytes_before_version_max + 1, m.Tversion.TYPE, 0xFFFF))
        assert closed_by_server(s)
        s.close()
        with Client.connect_unix(path, msize=64 * 1024) as c:
            c.sock.sendall(struct.pack("<IBH", 64 * 1024 + 1, m.Twrite.TYPE, 1))
            assert closed_by_server(c.sock)
        served(path, "f", b"hello")


# --------------------------------------------------------------------------- held requests


def test_requests_held_behind_a_safeguard_stop_being_read_past_their_bound(tmp_path):
    """Mutations queued behind a hold keep their data; past
    ``held_request_bytes_per_connection_max`` the connection is not read until the hold
    is answered — then every request runs, in order."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "victim").write_bytes(b"v")
    (work / "out").write_bytes(b"")
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"),
                        safeguard=SafeguardConfig(delete_threshold=1, timeout_s=120))
    limits = ServerLimits(held_request_bytes_per_connection_max=64 * 1024)
    chunk = 8 * 1024
    with serve(Provider.intercepted(ws), ServerConfig(limits=limits)) as (st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        out, _ = c.walk(root, ["out"])
        c.lopen(out, m.DOTL_WRONLY)
        held = c.send(m.Tunlinkat(root, "victim", 0))
        c.getattr(root)  # the unlink is held now
        gate = st.server.exports[""].gate
        hold_id = st.call(lambda: gate.pending.id)
        writes = [m.Twrite(out, i * chunk, bytes([65 + i % 26]) * chunk) for i in range(40)]
        frames = [encode(0, w) for w in writes]
        tags = []
        sender = threading.Thread(target=lambda: tags.extend(c.send_many(writes)))
        sender.start()
        bound = limits.held_request_bytes_per_connection_max // len(frames[0]) + 1  # the write that crosses it
        conn = st.call(lambda: next(iter(st.server._connections)))
        while True:  # until the server stops reading, or reads past the bound (no timing)
            queued, reading = st.call(lambda: (gate.queued, conn.transport.is_reading()))
            if not reading or queued > bound:
                break
        assert (queued, reading) == (bound, False)
        served(path, "victim", b"v")  # another client still reads
        assert st.call(lambda: st.server.resolve(hold_id, "allow"))
        sender.join(60)
        assert isinstance(c.wait(held), m.Runlinkat)
        assert errnos(c, tags) == [0] * 40
    ws.close()
    assert (work / "out").read_bytes() == b"".join(w.data for w in writes)


# --------------------------------------------------------------------------- descriptors


def test_open_files_per_connection_stop_with_emfile_and_another_client_reads(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "f").write_bytes(b"x")
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
        # 1,024 unless this process's descriptor limit is so low that a quarter of it is less
        n = min(LIMITS.open_files_per_connection_max,
                int(PROCESS_DESCRIPTORS.capacity * LIMITS.open_files_per_connection_share_max))
        root, _ = c.attach()
        base = fds(os.getpid())
        fids = list(range(10, 10 + n + 1))
        assert errnos(c, c.send_many([m.Twalk(root, x, ["f"]) for x in fids])) == [0] * (n + 1)
        got = errnos(c, c.send_many([m.Tlopen(x, m.DOTL_RDONLY) for x in fids]))
        assert got == [0] * n + [errno.EMFILE]
        assert fds(os.getpid()) - base <= n + 2  # the handles, and the other client's socket
        served(path, "f", b"x")
        c.clunk(fids[0])
        c.lopen(fids[-1], m.DOTL_RDONLY)  # a freed handle is reusable
        assert c.read(fids[-1], 0, 1) == b"x"
    ws.close()


def test_the_process_budget_leaves_descriptors_for_the_undo_core(tmp_path):
    """``serve-9p`` under a low descriptor limit: it raises the soft limit to the hard one;
    one connection's open files stop at a quarter of the process budget (EMFILE), all
    clients' at the budget (ENFILE), while the undo core still journals every mutation —
    and the whole session undoes exactly."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "f").write_bytes(b"0123456789")
    (work / "doomed").write_bytes(b"doomed\n")
    before = oracle.snapshot_dir(str(work))
    budget = 290
    hard = DESCRIPTORS_RESERVED + LIMITS.connections_max + budget
    per_conn = int(budget * LIMITS.open_files_per_connection_share_max)  # 72
    full, rest = divmod(budget, per_conn)  # 4 connections at their cap, 2 files for a fifth
    with server_process(tmp_path, work, nofile=(64, hard)) as sp:
        with open(f"/proc/{sp.pid}/limits") as f:
            row = next(line for line in f if line.startswith("Max open files")).split()
        assert (int(row[3]), int(row[4])) == (hard, hard)  # soft raised to hard
        with ExitStack() as stack:
            abusers = [stack.enter_context(Client.connect_unix(sp.sock)) for _ in range(full + 1)]
            c = stack.enter_context(Client.connect_unix(sp.sock))
            got = []
            for cl in abusers:
                root, _ = cl.attach()
                fids = list(range(10, 10 + per_conn + 1))
                assert errnos(cl, cl.send_many([m.Twalk(root, x, ["f"]) for x in fids])) == [0] * len(fids)
                got.append(errnos(cl, cl.send_many([m.Tlopen(x, m.DOTL_RDWR) for x in fids])))
            assert got[:full] == [[0] * per_conn + [errno.EMFILE]] * full
            assert got[full] == [0] * rest + [errno.ENFILE] * (per_conn + 1 - rest)
            assert fds(sp.pid) < hard - DESCRIPTORS_RESERVED // 2
            b = abusers[0]
            root, _ = c.attach()
            fid, _ = c.walk(root, ["f"])
            assert errno_of(c.lopen, fid, m.DOTL_RDONLY) == errno.ENFILE  # a clean errno, not a crash
            # the undo core still works: mutations are journalled and done
            assert b.write(10, 0, b"ABC") == 3
            c.mkdir(root, "made")
            c.unlinkat(root, "doomed")
            assert (work / "f").read_bytes() == b"ABC3456789" and not (work / "doomed").exists()
            stack.close()
        sp.stop()
    hist = sandbox_cmd(sp.env, "history", "--workdir", str(work), "--json")
    assert hist.returncode == 0, hist.stderr
    undo = sandbox_cmd(sp.env, "undo", "--workdir", str(work), "-n", str(len(json.loads(hist.stdout)["steps"])))
    assert undo.returncode == 0, undo.stderr
    oracle.assert_same(before, oracle.snapshot_dir(str(work)), "undo after the descriptor budget was exhausted")


def test_raise_nofile_soft_limit_raises_to_hard_and_is_idempotent():
    code = ("import resource; from sandbox.limits import raise_nofile_soft_limit as r;"
            "print(r(), r(), resource.getrlimit(resource.RLIMIT_NOFILE))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 777))).stdout
    assert out.split("\n")[0] == "777 777 (777, 777)"
    assert raise_nofile_soft_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def test_descriptor_budget_arithmetic():
    b = DescriptorBudget(reserved=100, nofile=lambda: 120)
    assert b.capacity == 20
    b.reserve_sockets(16)
    assert b.capacity == 4
    for _ in range(4):
        b.acquire()
    assert errno_of(b.acquire) == errno.ENFILE
    b.release()
    b.acquire()
    b.release_sockets(16)
    assert b.capacity == 20 and b.held == 4
    assert DescriptorBudget(reserved=100, nofile=lambda: 50).capacity == 0
    reads = []
    b = DescriptorBudget(reserved=0, nofile=lambda: reads.append(1) or 2)
    cap = b.capacity
    b.acquire(cap)  # a capacity read just before: no second getrlimit
    b.acquire(cap)
    assert len(reads) == 1 and b.held == 2
    assert errno_of(b.acquire, cap) == errno.ENFILE and b.held == 2


# --------------------------------------------------------------------------- one place, documented


def test_limits_live_in_one_place_and_the_9p_doc_says_the_code_s_numbers():
    import inspect

    from sandbox.mounts.provider import XATTR_SIZE_MAX
    from sandbox.serving.holds import HoldGate
    from sandbox.serving.locks import LOCKS_MAX

    queue_max = inspect.signature(HoldGate).parameters["queue_max"].default
    assert (queue_max, LOCKS_MAX, XATTR_SIZE_MAX) == (
        LIMITS.held_requests_per_export_max, LIMITS.locks_per_export_max, LIMITS.xattr_value_bytes_max)
    assert ServerConfig().limits == LIMITS
    with open(NINEP_DOC) as f:
        text = " ".join(f.read().split())
    para = text[text.index("Limits (`ServerLimits`"):]
    para = para.split("## ", 1)[0]  # to the next heading, or the end of the page
    for number, what in [(LIMITS.fids_per_connection_max, "fids"),
                         (LIMITS.open_files_per_connection_max, "open files"),
                         (LIMITS.connections_max, "connections"),
                         (LIMITS.held_requests_per_export_max, "held requests"),
                         (LIMITS.locks_per_export_max, "locks")]:
        assert f"{number:,} {what}" in para, (number, what, para)
    for size in ("1 MiB", "8 MiB", "16 MiB", "64 KiB", "8 KiB"):
        assert size in para, size
    assert f"{LIMITS.frame_incomplete_timeout_s:g} s" in para


def test_serve_9p_help_names_the_main_limits(tmp_path):
    out = sandbox_cmd(os.environ, "serve-9p", "--help").stdout
    flat = " ".join(out.split())
    for phrase in ("65,536 fids", "1,024 open files", "16 connections", "8 MiB", "60 s"):
        assert phrase in flat, phrase
