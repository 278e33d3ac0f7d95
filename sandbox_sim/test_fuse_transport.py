"""The ``/dev/fuse`` transport's request counter (``FuseServer.op_counts``, what ``sandbox mount
--op-counts`` and ``bench/fuse_local.py --counts`` print) counts every request the kernel sends,
the ones we answer ``ENOSYS`` without decoding included: Python's ``open()`` asks ``isatty``,
and the kernel forwards that ``ioctl(TCGETS)`` to the server as an IOCTL on every open
(docs/fuse.md "The round-trip floor"). Skipped, saying why, without ``/dev/fuse`` or root."""

from __future__ import annotations

import pytest

from sandbox.mounts import Provider
from sandbox_sim.fuse_mount import ServedMount, fuse_unavailable

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(fuse_unavailable() is not None, reason=str(fuse_unavailable()))]


def test_every_request_read_is_counted_by_its_opcode_the_ones_not_decoded_too(tmp_path):
    work, point = tmp_path / "work", tmp_path / "mnt"
    work.mkdir()
    point.mkdir()
    (work / "f").write_bytes(b"data")
    with ServedMount(Provider.read_only_dir(str(work)), str(point)) as sm:
        for _ in range(3):
            with open(point / "f", "rb") as f:  # buffered: open() asks isatty
                assert f.read() == b"data"
        counts, requests = dict(sm.server.op_counts), sm.server.requests
    assert counts.get("IOCTL", 0) >= 3, counts  # ENOSYS, never decoded, each open asks again
    assert sum(counts.values()) == requests, (counts, requests)
