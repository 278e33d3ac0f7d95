"""sandbox.files.FileService: the handle API as a Hypothesis stateful model, on the simulated
disk (MemoryHostFS) and on a real directory (a real Session with the scripted guest).

The model: random open/read/write/seek/stat/close/create_temp (and one-shot write_file)
against an in-memory model of the files and handles — every result and every error code
must match it; then every API step is undone and the tree must be exactly as it began.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    rule,
)

from sandbox.api.errors import ApiError
from sandbox.core.workspace import Workspace
from sandbox import files as files_module
from sandbox.files import HANDLES_MAX, READ_CALL_BYTES_MAX, FileService
from sandbox.hostfs import NAME_LEN_MAX
from sandbox.hostfs.memory import MemoryHostFS
from sandbox.limits import DIR_ENTRY_OVERHEAD_BYTES
from sandbox.mounts import Provider
from sandbox.mounts.table import Mount, MountTable
from sandbox_sim import oracle
from sandbox_sim.budget import scale

pytestmark = pytest.mark.timeout(scale(300, 3000))

NAMES = ("a", "b", "c")
INITIAL = {"a": b"alpha\n", "b": b"bravo bravo\n"}
TARGET = "/mnt/working/0"


class DiskSession:
    """What a FileService needs of a session, over one workspace on the simulated disk: the
    mount table, the workspaces, the providers, the command lock and the step hooks."""

    def __init__(self):
        self.work = MemoryHostFS("work")
        for name, data in INITIAL.items():
            self.work.create(name, 0o644)
            self.work.write_all(name, 0, data)
        self.ws = Workspace.open_on(self.work, MemoryHostFS("store"))
        self.table = MountTable([Mount(TARGET, "0", False, "", "/sim", "folder")])
        self.workspaces = [self.ws]
        self._provider = Provider.intercepted(self.ws)
        self.command_lock = threading.Lock()
        self.before_step: list = []

    def provider(self, name: str) -> Provider:
        assert name == "0"
        return self._provider

    def tree(self):
        return oracle.snapshot(self.work)

    def undo(self, n: int) -> None:
        self.ws.rollback(n)

    def api_steps(self) -> int:
        return sum(1 for s in self.ws.history() if s["type"] == "api")


class HandleModel(RuleBasedStateMachine):
    """Subclasses set ``make_session()``."""

    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.s = self.make_session()
        self.initial = self.s.tree()
        self.files = FileService(self.s, handles_max=8)
        self.model = {k: bytearray(v) for k, v in INITIAL.items()}  # name -> content
        self.open: dict[int, dict] = {}  # handle -> {"name"|None, "pos", "r", "w", "append", "data"(temp)}
        self.closed: set[int] = set()

    def make_session(self):
        raise NotImplementedError

    def _content(self, hd: dict) -> bytearray:
        return hd["data"] if hd["name"] is None else self.model[hd["name"]]

    def _expect_error(self, code: str, fn, *args):
        with pytest.raises(ApiError) as e:
            fn(*args)
        assert e.value.code == code, (e.value.code, e.value.message)
        assert e.value.data.get("errno"), e.value.data

    @rule(target=handles, name=st.sampled_from(NAMES), mode=st.sampled_from(["r", "r+", "w", "w+", "a", "a+", "x", "x+"]))
    def open_file(self, name, mode):
        exists = name in self.model
        full = len(self.open) >= self.files.handles_max
        path = f"{TARGET}/{name}"
        if full:
            self._expect_error("fs.too_many_handles", self.files.open, path, mode)
            return -1
        if mode[0] == "r" and not exists:
            self._expect_error("fs.not_found", self.files.open, path, mode)
            return -1
        if mode[0] == "x" and exists:
            self._expect_error("fs.exists", self.files.open, path, mode)
            return -1
        h = self.files.open(path, mode)
        if mode[0] == "w":
            self.model[name] = bytearray()
        self.model.setdefault(name, bytearray())
        self.open[h] = {"name": name, "pos": 0, "r": mode in ("r", "r+", "w+", "a+", "x+"), "w": mode != "r",
                        "append": mode[0] == "a"}
        return h

    @rule(target=handles)
    def create_temp(self):
        if len(self.open) >= self.files.handles_max:
            self._expect_error("fs.too_many_handles", self.files.create_temp)
            return -1
        h = self.files.create_temp()
        self.open[h] = {"name": None, "pos": 0, "r": True, "w": True, "append": False, "data": bytearray()}
        return h

    @rule(h=handles, n=st.integers(-1, 40))
    def read(self, h, n):
        hd = self.open.get(h)
        if hd is None:
            self._expect_error("fs.invalid_handle", self.files.read, h, n)
            return
        if not hd["r"]:
            self._expect_error("fs.invalid_argument", self.files.read, h, n)
            return
        content = self._content(hd)
        want = READ_CALL_BYTES_MAX if n == -1 else n
        expect = bytes(content[hd["pos"]:hd["pos"] + want])
        assert self.files.read(h, n) == expect
        hd["pos"] += len(expect)

    @rule(h=handles, data=st.binary(max_size=30))
    def write(self, h, data):
        hd = self.open.get(h)
        if hd is None:
            self._expect_error("fs.invalid_handle", self.files.write, h, data)
            return
        if not hd["w"]:
            self._expect_error("fs.invalid_argument", self.files.write, h, data)
            return
        assert self.files.write(h, data) == len(data)
        content = self._content(hd)
        pos = len(content) if hd["append"] else hd["pos"]
        if data:
            if pos > len(content):
                content.extend(bytes(pos - len(content)))
            content[pos:pos + len(data)] = data
        hd["pos"] = pos + len(data)

    @rule(h=handles, offset=st.integers(-60, 60) | st.sampled_from([-(2 ** 63), 2 ** 63]), whence=st.sampled_from([0, 1, 2]))
    def seek(self, h, offset, whence):
        hd = self.open.get(h)
        if hd is None:
            self._expect_error("fs.invalid_handle", self.files.seek, h, offset, whence)
            return
        base = (0, hd["pos"], len(self._content(hd)))[whence]
        if not 0 <= base + offset <= 2 ** 63 - 1:
            self._expect_error("fs.invalid_argument", self.files.seek, h, offset, whence)
            return
        assert self.files.seek(h, offset, whence) == base + offset
        hd["pos"] = base + offset

    @rule(h=handles)
    def stat(self, h):
        hd = self.open.get(h)
        if hd is None:
            self._expect_error("fs.invalid_handle", self.files.stat, h)
            return
        assert self.files.stat(h)["size"] == len(self._content(hd))

    @rule(h=handles)
    def close(self, h):
        if h not in self.open:
            self._expect_error("fs.invalid_handle", self.files.close, h)
            return
        self.files.close(h)
        del self.open[h]
        self.closed.add(h)

    @rule(name=st.sampled_from(NAMES), data=st.binary(max_size=30))
    def write_file(self, name, data):
        self.files.write_file(f"{TARGET}/{name}", data)
        self.model.setdefault(name, bytearray())[:] = data

    @invariant()
    def files_match_the_model(self):
        for name in NAMES:
            if name in self.model:
                assert self.files.read_file(f"{TARGET}/{name}") == bytes(self.model[name]), name
            else:
                with pytest.raises(ApiError) as e:
                    self.files.read_file(f"{TARGET}/{name}")
                assert e.value.code == "fs.not_found"

    def teardown(self):
        try:
            self.files.close_all()
            c = self.files.counters()
            assert c["handles_open"] == 0 and c["opens"] >= c["closes"]
            n = self.s.api_steps()
            if n:
                self.s.undo(n)
            assert self.s.tree() == self.initial  # every API step undone: exactly as it began
        finally:
            self.close_session()

    def close_session(self):
        self.s.ws.close()


class DiskModel(HandleModel):
    def make_session(self):
        return DiskSession()


TestHandlesOnTheSimulatedDisk = DiskModel.TestCase
TestHandlesOnTheSimulatedDisk.settings = settings(max_examples=scale(60, 600), stateful_step_count=30, deadline=None,
                                                 suppress_health_check=list(HealthCheck))


class RealSession:
    """A real Session (scripted guest, real 9P server, real directory): reused across examples,
    each example's undo leaves the directory as it began."""

    instance = None

    def __init__(self, root, state):
        from sandbox.session.runtime import Folder, Session

        for name, data in INITIAL.items():
            (root / name).write_bytes(data)
        self.root = root
        self.session = Session([Folder(str(root), state_dir=str(state))], guest="scripted").start()
        self.ws = self.session.workspaces[0]
        self.table = self.session.table

    def __getattr__(self, name):
        return getattr(self.session, name)

    def tree(self):
        return oracle.snapshot_dir(str(self.root))

    def undo(self, n: int) -> None:
        self.session.undo(n)

    def api_steps(self) -> int:
        return sum(1 for s in self.ws.history() if s["type"] == "api")


@pytest.fixture(scope="module")
def real_session(tmp_path_factory):
    root = tmp_path_factory.mktemp("real") / "project"
    root.mkdir()
    s = RealSession(root, tmp_path_factory.mktemp("state"))
    yield s
    s.session.stop()


def test_handles_on_a_real_directory(real_session):
    class RealModel(HandleModel):
        def make_session(self):
            return real_session

        def close_session(self):
            pass

    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(RealModel, settings=settings(max_examples=scale(25, 250), stateful_step_count=25,
                                                           deadline=None, suppress_health_check=list(HealthCheck)))


def test_an_empty_write_past_the_end_never_extends_a_file():
    """Found by the model on a real directory: a temporary file grew by an empty write."""
    s = DiskSession()
    try:
        files = FileService(s)
        for h in (files.create_temp(), files.open(f"{TARGET}/empty", "w+")):
            files.seek(h, 5)
            assert files.write(h, b"") == 0
            assert files.seek(h, 0, 2) == 0 and files.stat(h)["size"] == 0
    finally:
        s.ws.close()


def test_handles_are_per_client_bounded_and_closed_at_close_all():
    s = DiskSession()
    try:
        a, b = FileService(s), FileService(s, handles_max=2)
        ha = a.open(f"{TARGET}/a")
        with pytest.raises(ApiError) as e:
            b.read(ha)  # another client's handle number is unknown here
        assert e.value.code == "fs.invalid_handle"
        b.open(f"{TARGET}/a")
        b.create_temp()
        with pytest.raises(ApiError) as e:
            b.open(f"{TARGET}/b")
        assert e.value.code == "fs.too_many_handles" and e.value.data["limit"] == 2
        assert b.counters()["rejects"] == 2 and b.counters()["opens"] == 2
        b.close_all()
        assert b.counters()["handles_open"] == 0 and a.counters()["handles_open"] == 1
        assert HANDLES_MAX >= 8
    finally:
        s.ws.close()


def test_views_are_per_client_and_narrowing_makes_a_new_provider():
    s = DiskSession()
    try:
        s.work.mkdir("src", 0o755)
        s.work.create("src/x", 0o644)
        whole = FileService(s)
        narrow = FileService(s, s.table.restrict(f"{TARGET}/src", read_only=True))
        assert [e["name"] for e in narrow.list(TARGET)["entries"]] == ["src"]  # the way down only
        assert {e["name"] for e in whole.list(TARGET)["entries"]} == {"a", "b", "src"}
        with pytest.raises(ApiError) as e:
            narrow.read_file(f"{TARGET}/a")
        assert e.value.code == "fs.access_denied"
        with pytest.raises(ApiError) as e:
            narrow.write_file(f"{TARGET}/src/x", b"no")
        assert e.value.code == "fs.access_denied"
        whole.write_file(f"{TARGET}/src/x", b"yes")  # the other client's view is untouched
        assert narrow.read_file(f"{TARGET}/src/x") == b"yes"
        base = s.provider("0")
        assert base.view == "" and not base.read_only  # narrowing never mutated the base provider
        n = base.narrowed("src", read_only=True)
        assert n is not base and n.view == "src" and n.read_only
        assert base.narrowed("src").narrowed("").view == "src"  # never widens
    finally:
        s.ws.close()


def test_list_status_and_remove_read_a_directory_only_up_to_their_entry_limits(monkeypatch):
    """``list`` answers the first ``LIST_ENTRIES_MAX`` names in code-point order and
    ``truncated``, ``status`` scans at most ``STATUS_ENTRIES_MAX`` entries, a recursive
    ``remove`` takes at most ``REMOVE_ENTRIES_MAX``: each now has the host read a directory
    only up to what its limit needs (``len(name) + DIR_ENTRY_OVERHEAD_BYTES`` a name, at most
    ``NAME_LEN_MAX`` bytes long — a bounded ``listdir``), never the whole of a huge one (the
    in-memory host counts the names it read). Within the bound, the answers are as before."""
    limit = 50
    for name in ("LIST_ENTRIES_MAX", "STATUS_ENTRIES_MAX", "REMOVE_ENTRIES_MAX"):
        monkeypatch.setattr(files_module, name, limit)
    read_max = (limit + 1) * (NAME_LEN_MAX + DIR_ENTRY_OVERHEAD_BYTES) // (5 + DIR_ENTRY_OVERHEAD_BYTES) + 1
    s = DiskSession()
    try:
        s.work.mkdir("big", 0o755)
        big = [f"f{i:04d}" for i in range(3000)]
        for n in big:
            s.work.create(f"big/{n}", 0o644)
        assert read_max < len(big)
        for n_entries, truncated in ((limit, False), (limit + 1, True)):  # small: read whole, as before
            s.work.mkdir(f"d{n_entries}", 0o755)
            names = [f"g{i:03d}" for i in range(n_entries)]
            for n in reversed(names):
                s.work.create(f"d{n_entries}/{n}", 0o644)
            out = FileService(s).list(f"{TARGET}/d{n_entries}")
            assert [e["name"] for e in out["entries"]] == names[:limit] and out["truncated"] is truncated
        files = FileService(s)
        before = s.work.entries_read
        out = files.list(f"{TARGET}/big")
        assert s.work.entries_read - before <= read_max
        got = [e["name"] for e in out["entries"]]
        assert out["truncated"] and len(got) == limit and got == sorted(got) and set(got) <= set(big)
        before = s.work.entries_read
        assert files.status()["truncated"]
        assert s.work.entries_read - before <= 5 + read_max  # the root's names, then big's
        before = s.work.entries_read
        with pytest.raises(ApiError) as e:
            files.remove(f"{TARGET}/big", recursive=True)
        assert e.value.code == "fs.too_large"
        assert s.work.entries_read - before <= read_max
    finally:
        s.ws.close()
