"""The session's hold broker: one owner of pending holds, their answers and the one deadline.

Unit tests on the broker alone (a fake undo core: ``resolve`` records what it is told;
a fake clock for deadlines), then the broker behind a real 9P server: a hold answered
from two places, by a subscriber, and denied when the session stops.
"""

from __future__ import annotations

import asyncio
import errno
import threading

import pytest

from sandbox.core.safeguard import Hold, SafeguardConfig
from sandbox.core.workspace import Workspace
from sandbox.mounts import Provider
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client, NinePError
from sandbox.ninep.wirefs import serve
from sandbox.serving import HoldBroker

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Core:
    """What the broker tells the undo core; ``gone``: ids the core no longer has (expired there)."""

    def __init__(self):
        self.told: list[tuple[str, str]] = []
        self.gone: set[str] = set()

    def resolve(self, hold_id: str, action: str) -> None:
        if hold_id in self.gone:
            raise KeyError(hold_id)
        self.told.append((hold_id, action))


def hold(hold_id="sg_001", timeout_s=30.0, step_id=1) -> Hold:
    return Hold(hold_id, step_id, "delete", 3, "f2", ["f0", "f1", "f2"], 5.0, 5.0 + timeout_s)


def recorder(broker: HoldBroker):
    seen = []
    unsubscribe = broker.subscribe(lambda kind, payload: seen.append((kind, payload["safeguard_id"],
                                                                      payload.get("action"), payload.get("reason"))))
    return seen, unsubscribe


def test_a_hold_is_pending_with_its_payload_until_answered_once():
    broker, core = HoldBroker(), Core()
    seen, _ = recorder(broker)
    payload = broker.register(hold(), core.resolve, context={"directory": 0})
    assert payload["safeguard_id"] == "sg_001" and payload["timeout_seconds"] == 30.0 and payload["directory"] == 0
    assert broker.register(hold(), core.resolve) == payload  # idempotent: no second notification
    assert broker.pending() == [payload]
    assert broker.answer("sg_001", "allow") is True
    assert broker.answer("sg_001", "deny") is False  # a second place answering the same hold
    assert core.told == [("sg_001", "allow")]
    assert broker.pending() == []
    assert seen == [("triggered", "sg_001", None, None), ("resolved", "sg_001", "allow", "answered")]


def test_answers_from_two_threads_decide_once():
    broker, core = HoldBroker(), Core()
    broker.register(hold(), core.resolve)
    start = threading.Barrier(2)
    results = []

    def answer(action):
        start.wait()
        results.append(broker.answer("sg_001", action))

    threads = [threading.Thread(target=answer, args=(a,)) for a in ("allow", "deny")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, True]
    assert len(core.told) == 1


def test_a_bad_action_is_refused_and_unknown_ids_are_false():
    broker = HoldBroker()
    with pytest.raises(ValueError):
        broker.answer("sg_001", "maybe")
    assert broker.answer("sg_404", "allow") is False


def test_the_deadline_denies_once_whoever_notices_it():
    clock, core = Clock(), Core()
    broker = HoldBroker(clock_s=clock)
    seen, _ = recorder(broker)
    broker.register(hold(timeout_s=30.0), core.resolve)
    clock.now += 29.9
    assert broker.poll() == 0 and broker.pending()
    clock.now += 0.1
    assert broker.poll() == 1
    assert core.told == [("sg_001", "deny")]
    assert broker.answer("sg_001", "allow") is False  # too late
    assert seen[-1] == ("resolved", "sg_001", "deny", "timeout")


def test_a_payload_registered_first_takes_the_holds_own_timeout_when_the_hold_arrives():
    clock, core = Clock(), Core()
    broker = HoldBroker(clock_s=clock)
    broker.register({"safeguard_id": "sg_001", "step_id": 1, "kind": "delete"}, core.resolve, timeout_s=99.0)
    assert broker.register(hold(timeout_s=10.0), core.resolve)["timeout_seconds"] == 10.0
    clock.now += 10.0
    assert broker.poll() == 1


def test_the_core_having_expired_the_hold_already_makes_an_answer_false_and_a_deny():
    broker, core = HoldBroker(), Core()
    seen, _ = recorder(broker)
    broker.register(hold(), core.resolve)
    core.gone.add("sg_001")
    assert broker.answer("sg_001", "allow") is False
    assert seen[-1] == ("resolved", "sg_001", "deny", "timeout")


def test_unsubscribe_stops_notifications_and_is_idempotent():
    broker, core = HoldBroker(), Core()
    seen, unsubscribe = recorder(broker)
    unsubscribe()
    unsubscribe()
    broker.register(hold(), core.resolve)
    broker.answer("sg_001", "deny")
    assert seen == []


def test_a_failing_subscriber_does_not_stop_the_others():
    broker, core = HoldBroker(), Core()
    broker.subscribe(lambda kind, payload: 1 / 0)
    seen, _ = recorder(broker)
    broker.register(hold(), core.resolve)
    assert seen == [("triggered", "sg_001", None, None)]


def test_caps():
    broker, core = HoldBroker(pending_max=1, subscribers_max=1), Core()
    broker.subscribe(lambda kind, payload: None)
    with pytest.raises(RuntimeError):
        broker.subscribe(lambda kind, payload: None)
    assert broker.register(hold("sg_001"), core.resolve) is not None
    assert broker.register(hold("sg_002"), core.resolve) is None  # over the cap
    assert asyncio.run(broker.wait(hold("sg_002"), core.resolve)) == "deny"  # denied at once through the core
    assert core.told == [("sg_002", "deny")]
    with pytest.raises(ValueError):
        HoldBroker(pending_max=0)


def test_deny_all_wakes_every_waiter_with_deny():
    broker, core = HoldBroker(), Core()

    async def main():
        waits = [asyncio.ensure_future(broker.wait(hold(f"sg_00{i}"), core.resolve)) for i in (1, 2)]
        while len(broker.pending()) < 2:
            await asyncio.sleep(0)
        assert broker.deny_all() == 2
        return await asyncio.gather(*waits)

    assert asyncio.run(main()) == ["deny", "deny"]
    assert sorted(core.told) == [("sg_001", "deny"), ("sg_002", "deny")]
    assert broker.pending() == []


def test_a_cancelled_waiter_leaves_the_hold_pending_for_the_next_one():
    broker, core = HoldBroker(), Core()
    seen, _ = recorder(broker)

    async def main():
        first = asyncio.ensure_future(broker.wait(hold(), core.resolve))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert [p["safeguard_id"] for p in broker.pending()] == ["sg_001"]
        second = asyncio.ensure_future(broker.wait(hold(), core.resolve))
        await asyncio.sleep(0)
        assert broker.answer("sg_001", "allow")
        return await second

    assert asyncio.run(main()) == "allow"
    assert [k for k, *_ in seen] == ["triggered", "resolved"]


def test_a_hold_met_again_after_its_answer_is_not_raised_again():
    broker, core = HoldBroker(), Core()
    seen, _ = recorder(broker)
    broker.register(hold(), core.resolve)
    broker.answer("sg_001", "allow")
    assert asyncio.run(broker.wait(hold(), core.resolve)) == "allow"
    assert [k for k, *_ in seen] == ["triggered", "resolved"]


def test_a_zero_timeout_denies_a_waiter_at_once():
    broker, core = HoldBroker(), Core()
    assert asyncio.run(broker.wait(hold(timeout_s=0.0), core.resolve)) == "deny"
    assert core.told == [("sg_001", "deny")]


def test_wait_blocking_is_woken_by_an_answer_from_another_thread():
    broker, core = HoldBroker(), Core()
    asked = threading.Event()
    broker.subscribe(lambda kind, payload: kind == "triggered" and asked.set())
    t = threading.Thread(target=lambda: (asked.wait(10), broker.answer("sg_001", "allow")))
    t.start()
    assert broker.wait_blocking(hold(), core.resolve) == "allow"
    t.join()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_ask_puts_each_hold_to_a_decide_callback(asynchronous):
    broker, core = HoldBroker(), Core()
    asked = []

    def decide(h):
        asked.append((h.id, h.kind, h.count))
        return "allow"

    async def decide_async(h):
        return decide(h)

    unask = broker.ask(decide_async if asynchronous else decide)
    assert asyncio.run(broker.wait(hold(), core.resolve)) == "allow"
    assert asked == [("sg_001", "delete", 3)] and core.told == [("sg_001", "allow")]
    unask()


# ---------------------------------------------------------------------------- behind a 9P server


def guarded(tmp_path, threshold: int) -> Workspace:
    work = tmp_path / "work"
    work.mkdir()
    for i in range(4):
        (work / f"f{i}").write_bytes(b"x")
    return Workspace.open(str(work), state_dir=str(tmp_path / "state"),
                          safeguard=SafeguardConfig(delete_threshold=threshold, timeout_s=60))


def test_a_session_broker_shared_by_the_server_answers_from_a_subscriber(tmp_path):
    """The broker the server was given is the one a subscriber (the SDK, STDIO) answers through."""
    ws = guarded(tmp_path, threshold=2)
    broker = HoldBroker()
    triggered = []

    def on(kind, payload):
        if kind == "triggered":
            triggered.append(payload)
            threading.Thread(target=broker.answer, args=(payload["safeguard_id"], "deny")).start()

    broker.subscribe(on)
    with serve({"work": Provider.intercepted(ws)}, holds=broker) as (st, path), Client.connect_unix(path) as c:
        root, _ = c.attach(aname="work")
        c.unlinkat(root, "f0", 0)
        with pytest.raises(NinePError) as e:
            c.unlinkat(root, "f1", 0)  # held, then denied by the subscriber: the step is rolled back
        assert e.value.errno == errno.EIO
        assert st.server.holds is broker
    assert [p["export"] for p in triggered] == ["work"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["f0", "f1", "f2", "f3"]
    assert broker.pending() == []
    ws.close()


def test_deny_all_releases_a_request_held_on_the_wire(tmp_path):
    ws = guarded(tmp_path, threshold=1)
    with serve(Provider.intercepted(ws)) as (st, path), Client.connect_unix(path) as c:
        root, _ = c.attach()
        tag = c.send(m.Tunlinkat(root, "f0", 0))
        c.getattr(root)  # the held request was processed
        assert [p["safeguard_id"] for p in st.server.holds.pending()] == ["sg_001"]
        assert st.server.holds.deny_all() == 1
        with pytest.raises(NinePError) as e:
            c.wait(tag)
        assert e.value.errno == errno.EIO
    ws.close()


# ---------------------------------------------------------------------------- a whole session (scripted guest)


def session_with_victims(tmp_path, files: int = 6, share_servers: str = "thread"):
    from sandbox.session.runtime import Folder, Session

    work = tmp_path / "proj"
    (work / "many").mkdir(parents=True)
    for i in range(files):
        (work / "many" / f"f{i}").write_bytes(b"%d" % i)
    return work, Session([Folder(str(work), state_dir=str(tmp_path / "state"))], guest="scripted",
                         safeguard=SafeguardConfig(delete_threshold=3, timeout_s=60), share_servers=share_servers)


@pytest.mark.parametrize("action", ["allow", "deny"])
@pytest.mark.parametrize("share_servers", ["thread", "process"])
def test_session_holds_are_announced_listed_and_answered_through_session_holds(tmp_path, share_servers, action):
    """In process mode the hold is raised in the share server's core and asked over its
    control channel: the session's broker is the one place it is listed and answered."""
    import queue

    work, s = session_with_victims(tmp_path, share_servers=share_servers)
    heard = queue.Queue()
    s.holds.subscribe(lambda kind, payload: heard.put((kind, payload)))
    with s:
        results = []
        t = threading.Thread(target=lambda: results.append(s.run("rm -r many")))
        t.start()
        kind, p = heard.get(timeout=30)
        assert kind == "triggered" and p["directory"] == 0 and p["timeout_seconds"] == 60 and p["count"] == 3
        assert [h["safeguard_id"] for h in s.holds.pending()] == [p["safeguard_id"]]
        assert (work / "many").exists()  # the held request has not run
        assert s.holds.answer(p["safeguard_id"], action)
        assert not s.holds.answer(p["safeguard_id"], "deny")  # a second answerer is told no
        t.join(30)
        assert (results[0].exit_code == 0) == (action == "allow")
        assert heard.get(timeout=30)[0] == "resolved"
    if action == "deny":  # rolled back
        assert sorted(x.name for x in (work / "many").iterdir()) == [f"f{i}" for i in range(6)]
    else:  # the held request went on
        assert not (work / "many").exists()


@pytest.mark.parametrize("share_servers", ["thread", "process"])
def test_stopping_a_session_denies_its_pending_holds(tmp_path, share_servers):
    import queue

    work, s = session_with_victims(tmp_path, share_servers=share_servers)
    heard = queue.Queue()
    s.holds.subscribe(lambda kind, payload: heard.put((kind, payload)))
    s.start()
    try:
        t = threading.Thread(target=lambda: _quietly(s.run, "rm -r many"), daemon=True)
        t.start()
        kind, p = heard.get(timeout=30)
        assert kind == "triggered"
    finally:
        s.stop()
    kind, r = heard.get(timeout=30)
    assert (kind, r["action"], r["reason"]) == ("resolved", "deny", "stopped")
    assert sorted(x.name for x in (work / "many").iterdir()) == [f"f{i}" for i in range(6)]  # rolled back
    assert s.holds.pending() == []
    t.join(30)


def _quietly(fn, *args):
    try:
        fn(*args)
    except Exception:
        pass  # the session stopped under it


def test_the_vm_is_paused_while_a_hold_is_pending_and_resumed_after(tmp_path):
    """The session's pause hook subscribes to its broker (a guest whose pause works: like QMP's)."""
    import queue

    from sandbox.scripted.guest import ScriptedGuest
    from sandbox.session.runtime import Folder, Session

    calls = queue.Queue()

    class PausableGuest(ScriptedGuest):
        async def pause(self) -> bool:
            calls.put("pause")
            return True

        async def resume(self) -> None:
            calls.put("resume")

    work, _ = session_with_victims(tmp_path)
    s = Session([Folder(str(work), state_dir=str(tmp_path / "state"))], guest=lambda run_dir: PausableGuest(),
                safeguard=SafeguardConfig(delete_threshold=3, timeout_s=60))
    heard = queue.Queue()
    s.holds.subscribe(lambda kind, payload: heard.put(payload["safeguard_id"]) if kind == "triggered" else None)
    with s:
        results = []
        t = threading.Thread(target=lambda: results.append(s.run("rm -r many")))
        t.start()
        hold_id = heard.get(timeout=30)
        assert calls.get(timeout=30) == "pause"
        s.holds.answer(hold_id, "deny")
        assert calls.get(timeout=30) == "resume"
        t.join(30)
        assert results[0].exit_code != 0
    assert calls.empty()  # no second pause/resume
    assert sorted(x.name for x in (work / "many").iterdir()) == [f"f{i}" for i in range(6)]


def test_two_cores_with_the_same_hold_id_get_distinct_public_ids():
    """Two working folders number their holds independently: an answer names exactly one."""
    broker, a, b = HoldBroker(), Core(), Core()
    pa = broker.register(hold("sg_001"), a.resolve, context={"directory": 0})
    pb = broker.register(hold("sg_001"), b.resolve, context={"directory": 1})
    assert (pa["safeguard_id"], pb["safeguard_id"]) == ("sg_001", "sg_001.2")
    assert broker.answer("sg_001.2", "deny")
    assert (a.told, b.told) == ([], [("sg_001", "deny")])  # the core hears its own id
    assert asyncio.run(broker.wait(hold("sg_001"), b.resolve)) == "deny"  # b's retry: ended
    assert [p["safeguard_id"] for p in broker.pending()] == ["sg_001"]  # a's is still pending
    assert broker.answer("sg_001", "allow") and a.told == [("sg_001", "allow")]


def test_a_hold_answered_before_its_request_waits_is_not_raised_again(tmp_path):
    """deny_all between the gate registering a hold and its task running: the task learns the deny."""
    broker, core = HoldBroker(), Core()
    seen, _ = recorder(broker)
    broker.register(hold(), core.resolve)
    assert broker.deny_all() == 1
    assert asyncio.run(broker.wait(hold(), core.resolve)) == "deny"
    assert [k for k, *_ in seen] == ["triggered", "resolved"] and broker.pending() == []
