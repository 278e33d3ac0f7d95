"""The node table of a ``/dev/fuse`` mount never fills with names the kernel merely caches.

The kernel keeps the inodes it looked up until its memory runs short, so a program that
walks more files than ``fids_per_connection_max`` (``git status`` in a very large tree)
used to meet ``ENFILE`` once the table was full. Now, from :data:`NODE_RELIEF_AT` of the
table, the dispatcher asks the transport to make the kernel forget the names of its oldest
nodes (``NOTIFY_INVAL_ENTRY``), :data:`NODE_RELIEF_SHARE` of the table at a time; the
kernel FORGETs what nothing uses. First the dispatcher's choice (no kernel), then a real
mount walked past its table (skipped, saying why, without ``/dev/fuse`` or root).
"""

from __future__ import annotations

import os

import pytest

from sandbox.core.workspace import Workspace
from sandbox.fuse import abi
from sandbox.fuse import dispatcher as dispatcher_module
from sandbox.fuse import messages as m
from sandbox.fuse.dispatcher import NODE_RELIEF_AT, NODE_RELIEF_SHARE
from sandbox.limits import ServerLimits
from sandbox.mounts import Provider
from sandbox_sim.fuse_mount import ServedMount, fuse_unavailable
from sandbox_sim.test_fuse_dispatcher import H, ROOT, Mount

pytestmark = pytest.mark.timeout(120)
LIMIT = 64


def test_the_dispatcher_names_its_oldest_nodes_not_open_once_the_table_fills(tmp_path):
    mo = Mount(tmp_path, limits=ServerLimits(fids_per_connection_max=LIMIT))
    asked: list[list[str]] = []
    mo.d.on_node_pressure = asked.append
    try:
        for i in range(LIMIT):
            open(mo.host(f"f{i:03d}"), "w").close()
        kept = mo.lookup("f000").nodeid
        fh = mo.call(m.Open(H(abi.Opcode.OPEN, kept), os.O_RDONLY, 0)).fh  # open: never named
        mark, batch = int(LIMIT * NODE_RELIEF_AT), int(LIMIT * NODE_RELIEF_SHARE)
        # the root and f000 are two nodes: f001..f(mark-3) leave the table one short of the mark
        ids = {i: mo.lookup(f"f{i:03d}").nodeid for i in range(1, mark - 2)}
        assert asked == []
        ids[mark - 2] = mo.lookup(f"f{mark - 2:03d}").nodeid
        assert asked == [[f"f{i:03d}" for i in range(1, 1 + batch)]]  # the oldest, f000 skipped
        for i in range(mark - 1, mark + batch - 2):
            ids[i] = mo.lookup(f"f{i:03d}").nodeid
        assert len(asked) == 1  # again only once as many more came ...
        ids[mark + batch - 2] = mo.lookup(f"f{mark + batch - 2:03d}").nodeid
        assert asked[1] == [f"f{i:03d}" for i in range(1 + batch, 1 + 2 * batch)]  # ... the next oldest
        for nodeid in ids.values():  # the kernel forgot them all: the table is small again
            mo.forget(nodeid, 1)
        assert set(mo.d.nodes) == {ROOT, kept}
        for i in range(1, mark - 1):  # filled to the mark again: asked again, after the last it named
            mo.lookup(f"f{i:03d}")
        assert len(asked) == 3 and len(asked[2]) == batch and "f000" not in asked[2]
        mo.call(m.Release(H(abi.Opcode.RELEASE, kept), fh, 0, 0, 0))
    finally:
        mo.close()


@pytest.mark.skipif(fuse_unavailable() is not None, reason=str(fuse_unavailable()))
@pytest.mark.parametrize("coherent", [False, True], ids=["open-handles", "no-open"])
def test_a_walk_of_more_files_than_the_node_table_holds_never_meets_enfile(tmp_path, coherent, monkeypatch):
    """The kernel's FORGETs come asynchronously (the notifier's thread writes the
    invalidations): a served mount's table leaves 65,536 × (1 − NODE_RELIEF_AT) = 16,384
    lookups of room for them; this small one 2,048 (relief from half of it)."""
    monkeypatch.setattr(dispatcher_module, "NODE_RELIEF_AT", 0.5)
    work = tmp_path / "work"
    limit, dirs, files = 4096, 3, 3000
    for d in range(dirs):
        (work / f"d{d}").mkdir(parents=True)
        for i in range(files):
            (work / f"d{d}" / f"f{i:04d}").write_bytes(b"x")
    point = tmp_path / "mnt"
    point.mkdir()
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"))
    try:
        with ServedMount(Provider.intercepted(ws), str(point), limits=ServerLimits(fids_per_connection_max=limit),
                         coherent=coherent) as sm:
            for _round in range(2):  # the second walk finds some names forgotten, some not
                for d in range(dirs):
                    for i in range(files):
                        assert os.stat(point / f"d{d}" / f"f{i:04d}").st_size == 1
            assert sorted(os.listdir(point / "d2"))[-1] == f"f{files - 1:04d}"
            assert len(sm.dispatcher.nodes) <= limit
    finally:
        ws.close()
