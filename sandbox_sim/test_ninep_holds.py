"""Reply holding: a mutation that crosses a safeguard threshold is not answered until decided.

The guest blocks mid-syscall; later mutations on the export queue behind it (cap →
``ENOSPC``); reads and other exports go on; allow releases the queue in order, deny rolls
the step back and fails the held and queued requests with ``EIO``, a timeout denies, and
``Tflush`` cancels a held request so that it never runs. No sleeps: a request's reply on
the same connection proves every earlier request was processed (the server handles a
connection's frames in order), and the gate's state is read on the server's own loop.
"""

from __future__ import annotations

import errno

import pytest

from sandbox.core.safeguard import SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.limits import ServerLimits
from sandbox.mounts import Provider, memory_tree
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client, NinePError
from sandbox.ninep.server import ServerConfig
from sandbox.ninep.wirefs import serve

pytestmark = pytest.mark.timeout(60)
FILES = 6


def guarded(tmp_path, threshold: int, timeout_s: float = 30.0) -> Workspace:
    work = tmp_path / "work"
    work.mkdir()
    for i in range(FILES):
        (work / f"f{i}").write_bytes(b"x" * (i + 1))
    return Workspace.open(str(work), state_dir=str(tmp_path / "state"),
                          safeguard=SafeguardConfig(delete_threshold=threshold, timeout_s=timeout_s))


def sync(c: Client, fid: int) -> None:
    """Round trip on the same connection: every earlier request has been processed."""
    c.getattr(fid)


def gate_state(st):
    gate = st.server.exports[""].gate
    return st.call(lambda: (gate.pending.id if gate.pending else None, gate.pending.kind if gate.pending else None,
                            gate.queued))


def present(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "work").iterdir())


def test_allow_releases_the_held_and_queued_requests_in_order(tmp_path):
    ws = guarded(tmp_path, threshold=3)
    with serve(Provider.intercepted(ws)) as (st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        tags = [c.send(m.Tunlinkat(root, f"f{i}", 0)) for i in range(5)]
        sync(c, root)  # answered while f2 is held: reads keep working
        assert [type(c.wait(t)) for t in tags[:2]] == [m.Runlinkat, m.Runlinkat]
        hold_id, kind, queued = gate_state(st)
        assert kind == "delete" and queued == 2
        assert present(tmp_path) == ["f2", "f3", "f4", "f5"]  # the held delete has not run
        assert st.call(lambda: ws.requests_in_flight) == 3  # the step's quiescence waits for them
        assert any(e["type"] == "event.safeguard_triggered" and e["safeguard_id"] == hold_id for e in ws.events)
        assert st.call(lambda: st.server.resolve(hold_id, "allow"))
        order = [c.recv() for _ in range(3)]
        assert [t for t, _r in order] == tags[2:] and all(isinstance(r, m.Runlinkat) for _t, r in order)
        assert present(tmp_path) == ["f5"]
        assert st.call(lambda: ws.requests_in_flight) == 0
    ws.close()


def test_deny_rolls_the_step_back_and_fails_queued_requests_with_eio(tmp_path):
    ws = guarded(tmp_path, threshold=3)
    with serve(Provider.intercepted(ws)) as (st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        tags = [c.send(m.Tunlinkat(root, f"f{i}", 0)) for i in range(5)]
        sync(c, root)
        c.wait(tags[0]), c.wait(tags[1])
        hold_id, _kind, _queued = gate_state(st)
        assert st.call(lambda: st.server.resolve(hold_id, "deny"))
        for t in tags[2:]:
            with pytest.raises(NinePError) as e:
                c.wait(t)
            assert e.value.errno == errno.EIO
        assert present(tmp_path) == [f"f{i}" for i in range(FILES)]  # f0 and f1 are back
        with pytest.raises(NinePError) as e:  # the denied step refuses further writes
            c.unlinkat(root, "f5", 0)
        assert e.value.errno == errno.EIO
    ws.close_active()
    assert ws.history()[0]["outcome"] == "denied"
    ws.close()


def test_an_unanswered_hold_times_out_as_deny(tmp_path):
    ws = guarded(tmp_path, threshold=1, timeout_s=0.3)
    with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        with pytest.raises(NinePError) as e:
            c.unlinkat(root, "f0", 0)  # blocks until the timeout denies it
        assert e.value.errno == errno.EIO
        assert present(tmp_path) == [f"f{i}" for i in range(FILES)]
    ws.close()


def test_queue_cap_answers_enospc(tmp_path):
    ws = guarded(tmp_path, threshold=1)
    with serve(Provider.intercepted(ws), ServerConfig(ServerLimits(held_requests_per_export_max=2))) as (st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        tags = [c.send(m.Tunlinkat(root, f"f{i}", 0)) for i in range(5)]
        sync(c, root)
        for t in tags[3:]:
            with pytest.raises(NinePError) as e:
                c.wait(t)
            assert e.value.errno == errno.ENOSPC
        hold_id, _kind, queued = gate_state(st)
        assert queued == 2
        st.call(lambda: st.server.resolve(hold_id, "allow"))
        for t in tags[:3]:
            assert isinstance(c.wait(t), m.Runlinkat)
        assert present(tmp_path) == ["f3", "f4", "f5"]
    ws.close()


def test_flush_cancels_a_held_request_which_never_runs(tmp_path):
    ws = guarded(tmp_path, threshold=1)
    with serve(Provider.intercepted(ws)) as (st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        held = c.send(m.Tunlinkat(root, "f0", 0))
        queued = c.send(m.Tunlinkat(root, "f1", 0))
        sync(c, root)
        c.flush(held)  # Rflush comes only once the held request is cancelled
        hold_id, _kind, _q = gate_state(st)  # the queued one now waits on the same hold
        assert hold_id is not None
        st.call(lambda: st.server.resolve(hold_id, "allow"))
        assert isinstance(c.wait(queued), m.Runlinkat)
        assert present(tmp_path) == ["f0"] + [f"f{i}" for i in range(2, FILES)]  # f0 never deleted
    ws.close()


def test_reads_and_other_exports_go_on_while_held(tmp_path):
    ws = guarded(tmp_path, threshold=1)
    scratch = memory_tree({"note": b"n"}, writable=True)
    with serve({"work": Provider.intercepted(ws), "scratch": scratch}) as (st, path), \
            Client.connect_unix(path) as c, Client.connect_unix(path) as other:
        root, _ = c.attach(aname="work")
        held = c.send(m.Tunlinkat(root, "f0", 0))
        sync(c, root)
        f1, _ = other.walk(other.attach(aname="work")[0], ["f1"])
        other.lopen(f1, m.DOTL_RDONLY)
        assert other.read(f1, 0, 10) == b"xx"  # reads on the held export
        sroot, _ = other.attach(aname="scratch")
        other.lcreate(sroot, "new", m.DOTL_WRONLY | m.DOTL_CREATE, 0o644)
        other.write(sroot, 0, b"written during the hold")
        assert scratch.host.read_all("new") == b"written during the hold"
        gate = st.server.exports["work"].gate
        st.call(lambda: st.server.resolve(gate.pending.id, "allow"))
        assert isinstance(c.wait(held), m.Runlinkat)
    ws.close()


@pytest.mark.parametrize("answer", ["allow", "deny"])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_decision_callback(tmp_path, answer, asynchronous):
    ws = guarded(tmp_path, threshold=2)
    asked = []

    def decide(hold):
        asked.append((hold.kind, hold.count))
        return answer

    async def decide_async(hold):
        return decide(hold)

    with serve(Provider.intercepted(ws), decide=decide_async if asynchronous else decide) as (_st, path), \
            Client.connect_unix(path) as c:
        root, _ = c.attach()
        c.unlinkat(root, "f0", 0)
        if answer == "allow":
            for i in range(1, FILES):
                c.unlinkat(root, f"f{i}", 0)
            assert present(tmp_path) == []
        else:
            with pytest.raises(NinePError) as e:
                c.unlinkat(root, "f1", 0)
            assert e.value.errno == errno.EIO
            assert present(tmp_path) == [f"f{i}" for i in range(FILES)]
    assert asked == [("delete", 2)]
    ws.close()
