"""Caching and coherence of the FUSE mount against the real kernel, served in this process.

The server runs as ``sandbox mount`` wires it (a watched workspace, the dispatcher, the
``/dev/fuse`` loop, the watcher's invalidations — :func:`sandbox.fuse.notify.watch`) on an
event loop in a thread, so a test can wait on the notifier's condition ("the notifications
for this path are written") instead of sleeping, then look through the mount at once. The
mount caches for :data:`~sandbox.fuse.dispatcher.COHERENT_ATTR_VALID_S` seconds and keeps
pages across opens: what the host changed is seen only because the kernel was told.

Skipped, saying why, without /dev/fuse or root (mount(2)), or when mounting fails.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.fuse.dispatcher import Dispatcher
from sandbox.fuse.notify import watch
from sandbox.fuse.transport import FuseServer, mount, unmount
from sandbox.limits import ServerLimits
from sandbox.mounts import Provider
from sandbox.serving import Export, HoldBroker
from sandbox.serving.workspaces import open_workspace

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

#: seconds to wait for a notification to be written, and for the server to stop
WAIT_S = 20


class LiveMount:
    """``work`` served at ``point`` in this process (module docstring)."""

    def __init__(self, tmp_path, safeguard: SafeguardConfig | None = None, read_only: bool = False):
        self.work, self.point = str(tmp_path / "work"), str(tmp_path / "mnt")
        for d in (self.work, self.point):
            os.makedirs(d, exist_ok=True)
        kw = {"safeguard": safeguard} if safeguard else {}
        self.state = str(tmp_path / "state")
        if read_only:  # as `sandbox mount --read-only`: no workspace, every change is someone else's
            self.ws, own_writes = None, None
            self.provider = Provider.read_only_dir(self.work)
        else:
            self.ws, own_writes = open_workspace(self.work, watched=True, state_dir=self.state, **kw)
            self.provider = Provider.intercepted(self.ws)
        self.holds = HoldBroker()
        limits = ServerLimits()
        self.dispatcher = Dispatcher(Export(self.provider, self.holds, limits), limits)
        try:
            self.fd, self.via_fusermount = mount(self.point)
        except OSError as e:
            self.provider.close()
            if self.ws is not None:
                self.ws.close()
            pytest.skip(f"mounting a FUSE filesystem failed here: {e}")
        self.server = FuseServer(self.dispatcher, self.fd, limits)
        self._stop_watching = watch(self.server, self.work, own_writes)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True)
        self.thread.start()
        self._mark = 0

    def host(self, *parts: str) -> str:
        return os.path.join(self.work, *parts)

    def mnt(self, *parts: str) -> str:
        return os.path.join(self.point, *parts)

    def mark(self) -> None:
        """From now on: :meth:`written` waits for notifications written after this."""
        self._mark = self.server.notifier.mark()

    def written(self, path: str) -> None:
        """Wait until the invalidations for ``path`` (relative) have been written to the kernel
        in a batch after the last :meth:`mark`."""
        assert self.server.notifier.wait_flushed(path, WAIT_S, self._mark), f"no invalidation of {path!r} was written"

    def stop(self) -> None:
        """Unmount and stop serving (the workspace stays open for the test to inspect)."""
        if self.thread is None:
            return
        unmount(self.point, self.via_fusermount)
        self.thread.join(WAIT_S)
        if self.thread.is_alive():  # a file left open on the mount: stop anyway
            self.loop.call_soon_threadsafe(self.server.stop)
            self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the server did not stop"
        self.thread = None
        self.loop.close()
        self._stop_watching()
        os.close(self.fd)
        self.provider.close()

    def close(self) -> None:
        self.stop()
        if self.ws is not None:
            self.ws.close()
            self.ws = None


@pytest.fixture
def live(tmp_path):
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    if os.geteuid() != 0:
        pytest.skip("not root: this test mounts with mount(2)")
    lm = LiveMount(tmp_path)
    yield lm
    lm.close()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_host_edits_are_seen_through_the_mount_at_once(live):
    """Contents (same size, so only an invalidation can reveal it), a new name, a removed
    name, a rename and a mode change made on the host are visible through the mount as
    soon as their notifications are written — well inside the cache timeouts."""
    assert live.dispatcher.coherent
    live.mark()
    with open(live.host("a"), "wb") as f:
        f.write(b"one\n")
    os.mkdir(live.host("d"))
    with open(live.host("d", "old"), "wb") as f:
        f.write(b"x")
    for p in ("a", "d/old"):  # their creation was seen: no later wait can be satisfied by it
        live.written(p)
    assert _read(live.mnt("a")) == b"one\n"  # now cached: pages, attributes, names
    assert os.stat(live.mnt("a")).st_mode & 0o777 == 0o644
    assert sorted(os.listdir(live.mnt("d"))) == ["old"] and os.path.exists(live.mnt("d", "old"))

    live.mark()
    with open(live.host("a"), "r+b") as f:  # the same size: the kernel cannot guess
        f.write(b"two\n")
    live.written("a")
    assert _read(live.mnt("a")) == b"two\n"

    live.mark()
    os.chmod(live.host("a"), 0o600)
    live.written("a")
    assert os.stat(live.mnt("a")).st_mode & 0o777 == 0o600

    live.mark()
    os.rename(live.host("d", "old"), live.host("d", "new"))
    live.written("d/old")
    assert not os.path.exists(live.mnt("d", "old"))
    assert _read(live.mnt("d", "new")) == b"x"

    live.mark()
    os.unlink(live.host("d", "new"))
    live.written("d/new")
    assert not os.path.exists(live.mnt("d", "new"))
    assert os.listdir(live.mnt("d")) == []


#: in another process: a page fault on the mount holds this process's GIL, which the server needs
MMAP_WRITER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
mm[100:105] = b"HELLO"
mm[5000:5003] = b"abc"
mm.flush()  # msync(MS_SYNC)
mm.close()  # munmap
os.close(fd)
"""


def test_shared_writable_mmap_reaches_the_host_and_is_undone(live):
    """mmap(MAP_SHARED) of a file opened O_RDWR on the mount: bytes written through the map,
    msync, munmap — on the host, in the undo step, and undone exactly."""
    original = bytes(range(256)) * 32  # 8 KiB: two pages
    with open(live.host("m.bin"), "wb") as f:
        f.write(original)
    r = subprocess.run([sys.executable, "-c", MMAP_WRITER, live.mnt("m.bin")], capture_output=True, text=True,
                       timeout=WAIT_S)
    assert r.returncode == 0, r.stderr
    expected = bytearray(original)
    expected[100:105], expected[5000:5003] = b"HELLO", b"abc"
    assert _read(live.host("m.bin")) == bytes(expected)
    assert _read(live.mnt("m.bin")) == bytes(expected)
    live.close()  # the ambient step closes with the workspace, as when `sandbox mount` stops
    ws = Workspace.open(live.work, state_dir=live.state)
    try:
        steps = ws.history()
        assert len(steps) == 1
        changed = [(p["path"], p["change"]) for p in ws.step_diff(steps[0]["id"])["paths"]]
        assert changed == [("m.bin", "modified")], changed
        ws.rollback(1)
    finally:
        ws.close()
    assert _read(live.host("m.bin")) == original


def test_a_denied_step_is_not_served_stale(tmp_path):
    """A safeguard's deny rolls the step back on the host behind the kernel's back: the
    kernel is told to forget everything, so the restored contents show at once."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root (mount(2))")
    lm = LiveMount(tmp_path, SafeguardConfig(delete_threshold=2, timeout_s=60))
    try:
        for name in ("x", "y"):
            with open(lm.host(name), "wb") as f:
                f.write(b"orig")
        assert _read(lm.mnt("x")) == b"orig"
        with open(lm.mnt("x"), "r+b") as f:  # the step: an overwrite (same size) ...
            f.write(b"CHG!")
        assert _read(lm.mnt("x")) == b"CHG!"  # cached through the mount
        changed = os.stat(lm.mnt("x"))  # its attributes, cached now (the step's mtime)
        assert changed.st_mtime_ns == os.stat(lm.host("x")).st_mtime_ns
        os.unlink(lm.mnt("y"))  # ... and a delete; the second delete is held
        assert not os.path.exists(lm.mnt("y"))  # a negative entry now, cached 60 s: the rollback must drop it
        done = threading.Event()
        errors = []

        def second() -> None:
            try:
                open(lm.mnt("z"), "w").close()
                os.unlink(lm.mnt("z"))
            except OSError as e:
                errors.append(e.errno)
            done.set()

        t = threading.Thread(target=second, daemon=True)
        t.start()
        while not lm.holds.pending():
            assert not done.wait(0.01), "the second delete was not held"
        lm.mark()
        assert lm.holds.answer(lm.holds.pending()[0]["safeguard_id"], "deny")
        assert done.wait(WAIT_S) and errors == [5]  # EIO
        lm.written("*")
        assert os.stat(lm.host("x")).st_mtime_ns != changed.st_mtime_ns  # the rollback restored the mtime
        for name in ("x", "y"):  # attributes first: a cached node would still show the step's
            m, h = os.stat(lm.mnt(name)), os.stat(lm.host(name))
            assert (m.st_ino, m.st_size, m.st_mtime_ns) == (h.st_ino, h.st_size, h.st_mtime_ns), name
        assert _read(lm.mnt("x")) == b"orig"
        assert _read(lm.mnt("y")) == b"orig"
    finally:
        lm.close()


def test_a_write_deferred_behind_a_hold_keeps_its_bytes(tmp_path):
    """A WRITE's data is a view of the transport's read buffer: one deferred behind a
    safeguard hold (the gate is busy) must keep its own bytes while later requests are read
    — the file gets exactly what was written once the hold is allowed."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root (mount(2))")
    lm = LiveMount(tmp_path, SafeguardConfig(delete_threshold=1, timeout_s=60))
    try:
        os.mkdir(lm.host("sub"))  # the held unlink locks this directory, not the root
        with open(lm.host("sub", "victim"), "wb") as f:
            f.write(b"v")
        with open(lm.host("other"), "wb") as f:
            f.write(b"o" * 4096)
        w = os.open(lm.mnt("w.bin"), os.O_WRONLY | os.O_CREAT, 0o644)  # opened before the hold
        data = os.urandom(256 * 1024)
        done = {n: threading.Event() for n in ("unlink", "write")}

        def unlink() -> None:
            os.unlink(lm.mnt("sub", "victim"))
            done["unlink"].set()

        def write() -> None:
            assert os.write(w, data) == len(data)
            done["write"].set()

        threading.Thread(target=unlink, daemon=True).start()
        while not lm.holds.pending():
            assert not done["unlink"].wait(0.01), "the delete was not held"
        threading.Thread(target=write, daemon=True).start()
        while not lm.dispatcher.pipeline.tasks or len(lm.dispatcher.pipeline.tasks) < 2:
            assert not done["write"].wait(0.01), "the write was not deferred behind the hold"
        for i in range(20):  # later requests, read while the write waits (into the read buffer)
            assert not os.path.exists(lm.mnt(f"{i:03d}" + "n" * 240))  # a LOOKUP longer than a WRITE's header
            os.stat(lm.mnt("other"))
            with open(lm.mnt("other"), "rb") as f:
                assert f.read() == b"o" * 4096
            os.listdir(lm.mnt(""))
        assert lm.holds.answer(lm.holds.pending()[0]["safeguard_id"], "allow")
        assert done["unlink"].wait(WAIT_S) and done["write"].wait(WAIT_S)
        os.close(w)
        assert _read(lm.host("w.bin")) == data
    finally:
        lm.close()


def _ops(live, *names: str) -> dict:
    return {n: live.server.op_counts[n] for n in names}


def test_own_writes_stay_cached_and_closes_send_no_flush(live):
    """What the mount's own writes put in the page cache is served from it after a reopen
    (no READ: the watcher, not the mtime, decides what is dropped), and opens and closes send
    nothing (no-open: the first OPEN, and the one FLUSH of that file's close, are answered
    ENOSYS; none after). A host edit of the same file is still seen."""
    data = os.urandom(3 * 4096)
    with open(live.mnt("w.bin"), "wb") as f:
        f.write(data)
    before = _ops(live, "READ", "FLUSH", "OPEN", "RELEASE")
    for _ in range(3):
        assert _read(live.mnt("w.bin")) == data
    after = _ops(live, "READ", "FLUSH", "OPEN", "RELEASE")
    assert after["READ"] == before["READ"], (before, after)
    # at most the CREATE'd file's own RELEASE (sent in the background, handle 0), never one per open
    assert after["RELEASE"] <= before["RELEASE"] + 1, (before, after)
    assert after["OPEN"] <= before["OPEN"] + 1 and after["FLUSH"] <= before["FLUSH"] + 1, (before, after)
    assert live.dispatcher.no_open
    live.mark()
    with open(live.host("w.bin"), "r+b") as f:  # same size
        f.write(b"HOST")
    live.written("w.bin")
    assert _read(live.mnt("w.bin")) == b"HOST" + data[4:]


def test_writes_need_no_capability_lookup_and_drop_the_capability(live):
    """HANDLE_KILLPRIV_V2: once the kernel has seen that a file has nothing to drop, its later
    write(2)s send no GETXATTR of ``security.capability`` (before: one per write); the server
    drops a file's kept (mapped) capability on write itself — as Linux does for every writer —
    also one set on the host after the kernel stopped looking; undo brings it back."""
    import struct

    from sandbox.mounts.identity import host_xattr_name

    cap = struct.pack("<IIIII", 0x02000000, 1 << 10, 0, 0, 0)  # VFS_CAP_REVISION_2: cap_net_bind_service
    with open(live.host("c.bin"), "wb") as f:
        f.write(b"0123456789")
    os.setxattr(live.host("c.bin"), host_xattr_name("security.capability"), cap)  # before the step
    fd = os.open(live.mnt("c.bin"), os.O_WRONLY)
    try:
        os.pwrite(fd, b"a", 0)
        assert host_xattr_name("security.capability") not in os.listxattr(live.host("c.bin"))
        before = live.server.op_counts["GETXATTR"]
        for i in range(1, 4):
            os.pwrite(fd, b"x", i)
        assert live.server.op_counts["GETXATTR"] == before  # no lookup per write
        live.mark()
        os.setxattr(live.host("c.bin"), host_xattr_name("security.capability"), cap)  # beside the mount
        live.written("c.bin")
        assert os.getxattr(live.mnt("c.bin"), "security.capability") == cap
        os.pwrite(fd, b"y", 4)
    finally:
        os.close(fd)
    assert host_xattr_name("security.capability") not in os.listxattr(live.host("c.bin"))
    assert _read(live.mnt("c.bin")) == b"axxxy56789"
    live.close()
    ws = Workspace.open(live.work, state_dir=live.state)
    try:
        ws.rollback(1)
    finally:
        ws.close()
    assert os.getxattr(live.host("c.bin"), host_xattr_name("security.capability")) == cap
    assert _read(live.host("c.bin")) == b"0123456789"


def test_missing_names_are_cached_until_the_host_makes_them(live):
    """A missing name is a cached negative entry (a second look sends no LOOKUP); the host
    making it is seen as soon as its notifications are written."""
    assert not os.path.exists(live.mnt("later"))
    before = live.server.op_counts["LOOKUP"]
    assert not os.path.exists(live.mnt("later"))
    assert live.server.op_counts["LOOKUP"] == before
    live.mark()
    with open(live.host("later"), "wb") as f:
        f.write(b"now")
    live.written("later")
    assert _read(live.mnt("later")) == b"now"


def test_a_read_only_mount_sees_host_edits_at_once(tmp_path):
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs /dev/fuse and root (mount(2))")
    lm = LiveMount(tmp_path, read_only=True)
    try:
        lm.mark()
        with open(lm.host("r"), "wb") as f:
            f.write(b"aaaa")
        lm.written("r")
        assert _read(lm.mnt("r")) == b"aaaa"
        assert os.stat(lm.mnt("r")).st_size == 4  # cached now
        lm.mark()
        with open(lm.host("r"), "wb") as f:
            f.write(b"bbbbbb")
        lm.written("r")
        assert os.stat(lm.mnt("r")).st_size == 6
        assert _read(lm.mnt("r")) == b"bbbbbb"
    finally:
        lm.close()


def test_a_mount_that_lost_its_watcher_still_sees_same_size_host_edits(live):
    """The watcher is gone (its watch limit, a failure): the mount keeps no-open — the kernel
    keeps a file's pages across opens, without AUTO_INVAL_DATA — but goes back to the 1 s
    timeouts, and the server compares each reported mtime, ctime and size with what it last
    told the kernel: a same-size host edit of a cached file shows within those timeouts (a
    condition wait: reopened and read until it does, with a deadline)."""
    import time

    data = b"A" * 10000
    with open(live.mnt("f"), "wb") as f:
        f.write(data)
    assert _read(live.mnt("f")) == data  # pages cached
    assert live.dispatcher.no_open
    live.mark()
    live._stop_watching()  # as the watcher's failure: coherent no more, everything invalidated once
    live._stop_watching = lambda: None
    live.written("f")  # the "everything" batch
    assert _read(live.mnt("f")) == data  # cached again
    before = live.server.op_counts["READ"]
    assert _read(live.mnt("f")) == data
    assert live.server.op_counts["READ"] == before  # served from the kept pages
    for new in (b"B" * 10000, b"C" * 4000 + b"B" * 6000):  # the same size: the whole file, then a part
        with open(live.host("f"), "r+b") as f:
            f.write(new[:4000] if new.startswith(b"C") else new)
        deadline = time.monotonic() + WAIT_S
        while _read(live.mnt("f")) != new:
            assert time.monotonic() < deadline, "the host's same-size edit never showed through the mount"
            time.sleep(0.01)
