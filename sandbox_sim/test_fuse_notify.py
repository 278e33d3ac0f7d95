"""The FUSE notifier (:mod:`sandbox.fuse.notify`) against a pipe standing in for /dev/fuse.

What it writes is decoded back (the notify header and body of fuse.h); the event loop that
computes the notifications runs in a thread, as in the server.
"""

from __future__ import annotations

import asyncio
import os
import struct
import threading

import pytest

from sandbox.fuse import abi
from sandbox.fuse import messages as m
from sandbox.fuse.notify import EVERYTHING, Notifier

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20


class Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


def _decode(data: bytes) -> list[tuple]:
    out = []
    while data:
        length, code, unique = struct.unpack_from("<IiQ", data)
        assert unique == 0
        body, data = data[16:length], data[length:]
        if code == abi.NotifyCode.INVAL_INODE:
            out.append(("inode",) + struct.unpack("<Qqq", body))
        else:
            assert code == abi.NotifyCode.INVAL_ENTRY
            parent, namelen, _flags = struct.unpack_from("<QII", body)
            out.append(("entry", parent, body[16:16 + namelen]))
    return out


@pytest.fixture
def rig():
    r, w = os.pipe()
    os.set_blocking(r, False)
    lp = Loop()
    calls = []

    def compute(paths):
        calls.append(paths)
        if paths is None:
            return [m.NotifyInvalInode(1, 0, 0)]
        return [m.NotifyInvalEntry(1, p.encode()) for p in paths]

    n = Notifier(w, compute, paths_max=3)
    yield n, r, lp, calls
    n.stop()
    assert n.join(WAIT_S)
    lp.close()
    os.close(r)
    os.close(w)


def test_changes_before_start_and_while_held_are_written_once_quiet(rig):
    n, r, lp, calls = rig
    n.changed(["a"])  # before start: kept
    n.set_quiet(False)  # a request is held: nothing may be written
    n.start(lp.loop)
    n.changed(["b", "a"])
    mark = n.mark()
    assert mark == 0 and calls == []
    n.set_quiet(True)
    assert n.wait_flushed("b", WAIT_S, since=mark)
    assert calls == [["a", "b"]]
    assert _decode(os.read(r, 65536)) == [("entry", 1, b"a"), ("entry", 1, b"b")]
    assert n.written == 2 and n.batches == 1


def test_more_paths_than_the_bound_become_everything(rig):
    n, r, lp, calls = rig
    n.set_quiet(False)
    n.start(lp.loop)
    n.changed(["a", "b"])
    n.changed(["c", "d"])  # 4 > paths_max 3
    n.set_quiet(True)
    assert n.wait_flushed(EVERYTHING, WAIT_S)
    assert calls == [None]
    assert _decode(os.read(r, 65536)) == [("inode", 1, 0, 0)]


def test_a_stopped_notifier_writes_nothing_more_and_ends(rig):
    n, r, lp, calls = rig
    n.set_quiet(False)
    n.start(lp.loop)
    n.changed(["a"])
    n.stop()
    assert n.join(WAIT_S)
    n.changed(["b"])
    n.everything()
    assert calls == [] and n.written == 0
    with pytest.raises(BlockingIOError):
        os.read(r, 1)
