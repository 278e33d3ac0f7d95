"""Integrity of the undo store: nothing it holds is trusted before it is checked.

A store with three steps holding every kind of preimage — inline zstd in a journal line,
zstd blobs, raw (reflinked) blobs on the ``sim-reflink`` disk — has one of its files
damaged at a time: a bit flipped, truncated, emptied. Whatever the damage:

* opening the store and ``history`` still work, and list every step by its id;
* an undo that needs the damaged step is refused with :class:`CorruptStep` naming the
  step, *before* anything is touched (the tree oracle compares byte for byte) — or, if the
  damage changed nothing that matters (a zstd window-size bit), it restores exactly;
* the newer steps still undo, exactly;
* the CLI says so in one line and exits 4; the STDIO API answers ``undo.corrupt_step``.

The damage that only a checksum can see (valid zstd of other bytes, a record with a
wrong type but a valid seal, one journal record missing) is made by rewriting the files
with valid seals, so each check is pinned on its own.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sandbox import BarrierInTheWay, CorruptStep, UndoUnavailable, Workspace
from sandbox.core import store as store_mod
from sandbox.core.store import CorruptStep as StoreCorruptStep, parse_journal, seal, unseal
from sandbox.hostfs import join
from sandbox_sim import oracle
from sandbox_sim.faults import FaultInjector
from sandbox_sim.world import World

KINDS = ["sim", "sim-reflink", "real"]


def _bytes(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


@dataclass
class Built:
    world: World
    snaps: list  # snaps[k]: the tree before step k (0-based); snaps[-1]: after the last step
    ids: list[int]  # step ids, oldest first
    dirs: list[str]  # their store directories


def build(world: World, barrier: bool = False) -> Built:
    """Three steps; between them every kind of record and preimage."""
    ws = world.open()
    with world.paused():
        w = world.work
        for path, data, mode in (("small.txt", b"small original\n", 0o644), ("mid.bin", _bytes(1, 20_000), 0o600),
                                 ("big.bin", _bytes(2, 100_000), 0o644), ("big2.bin", _bytes(3, 70_000), 0o640)):
            w.create(path, mode)
            w.write_all(path, 0, data)
        w.setxattr("small.txt", "user.k", b"v")
        w.mkdir("d", 0o750)
        w.create("d/x", 0o644)
        w.write_all("d/x", 0, b"x")
        w.symlink("small.txt", "link")
        w.link("small.txt", "d/small.hard")  # its preimage carries ino, nlink and links
    snaps = [world.snapshot()]
    with ws.step("one"):
        ws.fs.write_file("small.txt", b"one\n")  # inline zstd
        ws.fs.write_file("big.bin", b"one")  # raw blob on a reflink disk, else a zstd blob
        ws.fs.chmod("mid.bin", 0o640)  # meta
        ws.fs.write_file("new1", b"n1")  # created
    snaps.append(world.snapshot())
    with ws.step("two"):
        ws.fs.write_file("mid.bin", b"two")  # zstd blob (incompressible, under the reflink size)
        ws.fs.rename("d/x", "d/y")  # renamed + directory preimage
        ws.fs.unlink("link")  # symlink preimage
        ws.fs.symlink("mid.bin", "link")
    snaps.append(world.snapshot())
    if barrier:
        ws.record_external_modification(["outside-edit"], "a test's external edit")
    with ws.step("three"):
        ws.fs.write_file("small.txt", b"three\n")
        ws.fs.write_file("big2.bin", b"three")
        ws.fs.setxattr("d", "user.t", b"3")
    snaps.append(world.snapshot())
    hist = ws.history()
    ws.close()
    ids = [h["id"] for h in reversed(hist)]
    dirs = [f"steps/{h['seq']:010d}" for h in reversed(hist)]
    return Built(world, snaps, ids, dirs)


def store_files(world: World) -> list[str]:
    """Every file of a store at rest that the sandbox reads (``lock`` and ``WORKDIR`` hold
    only a pid and a path for humans)."""
    out = []

    def walk(d: str) -> None:
        for name in sorted(world.store.listdir(d)):
            p = join(d, name)
            if world.store.lstat(p).kind == "dir":
                walk(p)
            elif p not in ("lock", "WORKDIR"):
                out.append(p)

    walk("")
    return out


def damage(world: World, path: str, how: str, pos: int) -> None:
    fs = world.store
    with world.paused():
        data = fs.read_all(path)
        if how == "empty":
            fs.truncate(path, 0)
        elif how == "truncate":
            fs.truncate(path, pos % len(data))
        else:
            bit = pos % (len(data) * 8)
            fs.write_all(path, bit // 8, bytes([data[bit // 8] ^ (1 << (bit % 8))]))


def new_world(kind: str, tmp_path, n: int = 0) -> World:
    if kind == "real":
        d = tmp_path / f"w{n}"
        d.mkdir()
        return World("real", str(d))
    return World(kind)


def check_after_damage(b: Built, target: str) -> None:
    """The properties of the module docstring, for one damaged file."""
    world = b.world
    events: list[dict] = []
    ws = world.open(on_event=events.append)  # opening never fails on a damaged store
    try:
        if target == "VERSION":
            before = world.snapshot()
            if not ws.undo_available:  # refused as a version mismatch: nothing is read, nothing touched
                with pytest.raises(UndoUnavailable):
                    ws.rollback(1)
                oracle.assert_same(before, world.snapshot())
                return
            # a flip that still reads as our version ("2\n" -> "2\v")
            k = -1
        elif target == "counters.json":
            assert not any("Traceback" in str(e) for e in events)
            k = -1
        elif target.startswith("barriers/"):
            # an unreadable barrier stands after every step: undo needs force, then works
            assert any(e["type"] == "event.warning" and target.split("/")[1] in e["message"] for e in events), events
            before = world.snapshot()
            with pytest.raises(BarrierInTheWay):
                ws.rollback(1)
            oracle.assert_same(before, world.snapshot())
            ws.rollback(len(b.ids), force=True)
            oracle.assert_same(b.snaps[0], world.snapshot())
            return
        else:
            k = b.dirs.index(target.rsplit("/", 1)[0])
        hist = ws.history()
        assert [h["id"] for h in hist] == b.ids[::-1]
        if k < 0:  # nothing of a step was damaged: every step undoes, one at a time, exactly
            for j in range(len(b.ids) - 1, -1, -1):
                ws.rollback(1)
                oracle.assert_same(b.snaps[j], world.snapshot())
            with ws.step("after"):  # ids are never reused
                ws.fs.write_file("after", b"a")
            assert ws.history()[0]["id"] > max(b.ids)
            return
        before = world.snapshot()
        oracle.assert_same(b.snaps[-1], before)
        try:
            ws.rollback(len(b.ids) - k)  # across the damaged step
        except CorruptStep as e:
            assert f"step {b.ids[k]} " in e.message and "\n" not in e.message, e.message
            assert e.data["step_id"] == b.ids[k]
            oracle.assert_same(before, world.snapshot(), "tree after a refused undo")
        else:  # the damage changed nothing that matters: the undo is exact
            oracle.assert_same(b.snaps[k], world.snapshot())
            return
        for j in range(len(b.ids) - 1, k, -1):  # the newer steps still undo, exactly
            ws.rollback(1)
            oracle.assert_same(b.snaps[j], world.snapshot())
        with pytest.raises(CorruptStep, match=f"step {b.ids[k]} "):
            ws.rollback(1)
        oracle.assert_same(b.snaps[k + 1], world.snapshot())
        assert [h["id"] for h in ws.history()] == b.ids[: k + 1][::-1]
        assert world.store.exists(target) or target.endswith((".json", ".jsonl"))  # nothing deleted silently
    finally:
        ws.close()


# ---------------------------------------------------------------------------- every file, every damage


def test_the_store_holds_every_kind_of_preimage():
    """The fixture is what the suite claims: inline, zstd blob and raw blob preimages."""
    encs = set()
    for kind in ("sim", "sim-reflink"):
        b = build(World(kind))
        for d in b.dirs:
            for line in b.world.store.read_all(f"{d}/journal.jsonl").splitlines()[1:]:
                r = unseal(line)
                if r.get("op") == "pre" and r.get("kind") == "reg":
                    encs.add((r["enc"], "data" in r))
    assert encs == {("zstd", True), ("zstd", False), ("raw", False)}


DAMAGES = [("empty", 0), ("truncate", 7), ("flip", 0), ("flip", 8 * 57 + 3), ("flip", -1)]


@pytest.mark.parametrize("kind", KINDS)
def test_every_store_file_damaged_is_refused_by_name_and_nothing_is_touched(kind, tmp_path):
    n = 0
    targets = store_files(build(new_world(kind, tmp_path, n)).world)
    assert {t.rsplit("/", 1)[-1][:1] for t in targets} >= {"V", "c", "m", "j", "b"}
    for target in targets:
        for how, pos in DAMAGES:
            n += 1
            b = build(new_world(kind, tmp_path, n))
            size = len(b.world.store.read_all(target))
            if how == "truncate":
                pos = min(pos, size - 1)
            damage(b.world, target, how, pos if pos >= 0 else size * 8 - 1)
            try:
                check_after_damage(b, target)
            except BaseException as e:
                raise AssertionError(f"{kind}: {how} {pos} of {target}: {e}") from e


@pytest.mark.parametrize("kind", ["sim", "sim-reflink"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_bit_flip_anywhere_in_the_store_is_caught_or_harmless(kind, data):
    b = build(World(kind))
    targets = store_files(b.world)
    target = data.draw(st.sampled_from(targets), label="file")
    size = len(b.world.store.read_all(target))
    how = data.draw(st.sampled_from(["flip", "flip", "truncate", "empty"]), label="damage")
    pos = data.draw(st.integers(0, size * 8 - 1 if how == "flip" else max(size - 1, 0)), label="position")
    damage(b.world, target, how, pos)
    check_after_damage(b, target)


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
def test_a_damaged_barrier_stands_after_every_step(how):
    b = build(World("sim"), barrier=True)
    (target,) = [t for t in store_files(b.world) if t.startswith("barriers/")]
    damage(b.world, target, how, 77)
    check_after_damage(b, target)


# ---------------------------------------------------------------------------- each check on its own


def rewrite_step(world: World, d: str, edit_records=None, edit_manifest=None, drop_last: bool = False) -> None:
    """Rewrite a step's journal and manifest *with valid seals and counts*, so only the
    check under test can see the change."""
    with world.paused():
        lines = world.store.read_all(f"{d}/journal.jsonl").splitlines()
        objs = [unseal(line) for line in lines]
        if edit_records:
            edit_records(objs[1:])
        if drop_last:
            objs.pop()
        journal = b"".join(seal(o) for o in objs)
        man = unseal(world.store.read_all(f"{d}/manifest.json"))
        if not drop_last:
            man.update(journal_bytes=len(journal), journal_lines=len(objs), journal_hash=store_mod.journal_hash(journal))
        if edit_manifest:
            edit_manifest(man)
        for name, data in (("journal.jsonl", journal), ("manifest.json", seal(man))):
            world.store.truncate(f"{d}/{name}", 0)
            world.store.write_all(f"{d}/{name}", 0, data)


def _refused(b: Built, k: int, match: str) -> None:
    world = b.world
    ws = world.open()
    try:
        before = world.snapshot()
        assert [h["id"] for h in ws.history()] == b.ids[::-1]
        with pytest.raises(CorruptStep, match=match) as e:
            ws.rollback(len(b.ids) - k)
        assert f"step {b.ids[k]} " in e.value.message and "\n" not in e.value.message
        oracle.assert_same(before, world.snapshot())
        for j in range(len(b.ids) - 1, k, -1):
            ws.rollback(1)
            oracle.assert_same(b.snaps[j], world.snapshot())
    finally:
        ws.close()


def _rec(records, path):
    return next(r for r in records if r.get("op") == "pre" and r.get("path") == path)


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_an_inline_preimage_that_decodes_to_other_bytes_fails_its_checksum(kind, tmp_path):
    b = build(new_world(kind, tmp_path))
    other = zstandard.ZstdCompressor(level=3).compress(b"small ORIGINAL\n")  # same size, valid zstd

    def edit(records):
        _rec(records, "small.txt")["data"] = base64.b64encode(other).decode()

    rewrite_step(b.world, b.dirs[0], edit)
    _refused(b, 0, r"small\.txt.*checksum")


@pytest.mark.parametrize("kind", ["sim", "sim-reflink"])
def test_a_blob_with_other_bytes_of_the_same_size_fails_its_checksum(kind):
    b = build(World(kind))
    recs = [unseal(line) for line in b.world.store.read_all(f"{b.dirs[0]}/journal.jsonl").splitlines()[1:]]
    rec = _rec(recs, "big.bin")
    assert rec["enc"] == ("raw" if kind == "sim-reflink" else "zstd")
    blob = f"{b.dirs[0]}/{rec['blob']}"
    with b.world.paused():
        if rec["enc"] == "raw":  # a raw blob has no frame checksum: only ours sees this
            b.world.store.write_all(blob, 5000, b"\0")
        else:
            data = bytearray(_bytes(2, 100_000))
            data[5000] ^= 1
            b.world.store.truncate(blob, 0)
            b.world.store.write_all(blob, 0, zstandard.ZstdCompressor(level=3).compress(bytes(data)))
    _refused(b, 0, r"big\.bin.*checksum")


def test_a_journal_one_record_short_is_corrupt():
    b = build(World("sim"))
    rewrite_step(b.world, b.dirs[1], drop_last=True)  # the manifest still counts the lost record
    _refused(b, 1, "journal")


@pytest.mark.parametrize("field,value", [("paths", 5), ("id", "2"), ("fingerprints", []), ("size_bytes", -1),
                                         ("outcome", 3), ("unprotected", "no"), ("exit_code", 1.5),
                                         ("journal_bytes", None), ("extra", 1)])
def test_a_manifest_with_wrong_types_is_corrupt_and_history_still_works(field, value):
    b = build(World("sim"))
    rewrite_step(b.world, b.dirs[1], edit_manifest=lambda m: m.__setitem__(field, value))
    ws = b.world.open()
    hist = ws.history()
    assert [h["id"] for h in hist] == b.ids[::-1]  # the id comes from the journal's header
    assert field in hist[1]["corrupt"] and hist[1]["command"] == "two"
    ws.close()
    _refused(b, 1, field)


@pytest.mark.parametrize("field,value", [("mode", "755"), ("path", 5), ("path", "../../etc/passwd"), ("kind", "fifo"),
                                         ("mtime_ns", None), ("xattrs", {"user.k": "not base64!"}), ("blob", "../b1"),
                                         ("size", -3), ("hash", "00"), ("op", "boom"), ("enc", "lz4"), ("ino", True),
                                         ("nlink", 0), ("links", "d/small.hard"), ("links", ["../x"]), ("links", [None]),
                                         ("links", ["d/small.hard"] * 65)])
def test_a_journal_record_with_wrong_types_is_corrupt_before_anything_is_touched(field, value):
    b = build(World("sim"))

    def edit(records):
        rec = _rec(records, "mid.bin") if field in ("blob", "enc") else _rec(records, "small.txt")
        rec[field] = value

    rewrite_step(b.world, b.dirs[0] if field not in ("blob", "enc") else b.dirs[1], edit)
    _refused(b, 0 if field not in ("blob", "enc") else 1, "journal line")


def test_parse_journal_pins_each_check():
    header = {"seq": 1, "id": 1, "type": "command", "command": "c", "started_ns": 5}
    ok = {"op": "created", "path": "a"}
    h, recs = parse_journal(seal(header) + seal(ok), "w")
    assert h == header and recs == [ok]
    for bad, why in [(seal(header) + seal(ok)[:-1] + b"x\n", "checksum"),
                     (seal(header) + json.dumps(ok).encode() + b"\n", "checksum"),
                     (seal(header) + seal({"op": "created", "path": "/etc"}), "path"),
                     (seal(header) + seal({"op": "void", "lines": [7]}), "void"),
                     (seal({**header, "id": "1"}) + seal(ok), "id")]:
        with pytest.raises(StoreCorruptStep, match=why):
            parse_journal(bad, "w")
    # lenient (recovery): a bad line becomes a marker where it stood; a torn last line is dropped
    h, recs = parse_journal(seal(header) + b'{"op":"crea\n' + seal(ok) + b'{"op"', "w", strict=False)
    assert h == header and [r["op"] for r in recs] == ["corrupt", "created"]
    # a void names journal lines, so a damaged line never shifts what it cancels
    h, recs = parse_journal(seal(header) + seal(ok) + b"garbage\n" + seal({"op": "void", "lines": [1]}), "w", strict=False)
    assert [r["op"] for r in recs] == ["corrupt"]


def test_seal_round_trip_and_every_single_bit_flip_is_detected():
    obj = {"op": "pre", "path": "a/b", "mode": 420, "s": "\u00e9\n"}
    line = seal(obj)
    assert line.endswith(b"\n") and unseal(line) == obj
    for bit in range((len(line) - 1) * 8):
        bad = bytearray(line)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ValueError):
            unseal(bytes(bad[:-1]))


# ---------------------------------------------------------------------------- progress of a rollback


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
def test_a_damaged_rollback_progress_count_still_finishes_exactly(how):
    """``wal/rollback/progress`` only counts records undone (its size): a flip changes
    nothing; a shorter count redoes records whose undo is idempotent."""
    import errno

    for j in range(1, 12):
        b = build(World("sim"))
        ws = b.world.open()
        b.world.injector = FaultInjector(error_at=(j, errno.EIO))
        try:
            ws.rollback(1)
        except OSError:
            pass
        b.world.injector = FaultInjector()
        if b.world.store.exists("wal/rollback/progress") and b.world.store.lstat("wal/rollback/progress").size >= 2:
            break
        ws.close()
    else:
        pytest.fail("no injected EIO left a rollback half-way with a progress count of at least 2")
    b.world.crash(ws)
    damage(b.world, "wal/rollback/progress", how, 1)
    ws = b.world.open()
    oracle.assert_same(b.snaps[2], b.world.snapshot())
    assert [h["id"] for h in ws.history()] == b.ids[:2][::-1]
    ws.rollback(2)
    oracle.assert_same(b.snaps[0], b.world.snapshot())
    ws.close()


# ---------------------------------------------------------------------------- recovery of an in-progress WAL


def crashed_mid_step(world: World):
    """A step that captured a (inline), b (zstd blob), c (inline) in that order, then died."""
    ws = world.open()
    with world.paused():
        for path, data in (("a", b"a original"), ("b", _bytes(4, 30_000)), ("c", b"c original")):
            world.work.create(path, 0o644)
            world.work.write_all(path, 0, data)
    before = world.snapshot()
    ws.begin_step("dies")
    for path in ("a", "b", "c"):
        ws.fs.write_file(path, b"agent's " + path.encode())
    after = world.snapshot()
    world.crash(ws)
    return before, after


def _wal_lines(world):
    return world.store.read_all("wal/in_progress/journal.jsonl").split(b"\n")


@pytest.mark.parametrize("kind", ["sim", "real"])
def test_recovery_skips_a_preimage_that_fails_its_checksum_and_reports_it(kind, tmp_path):
    world = new_world(kind, tmp_path)
    before, after = crashed_mid_step(world)
    (blob,) = [n for n in world.store.listdir("wal/in_progress") if n.startswith("b")]
    damage(world, f"wal/in_progress/{blob}", "flip", 8 * 100)
    events = []
    ws = world.open(on_event=events.append)  # no exception: recovery never loops
    r = ws.recovery
    assert r["kind"] == "in_progress_rolled_back" and r["paths_not_restored"] == ["b"], r
    assert "b" in r["message"] and "checksum" in r["message"]
    now = world.snapshot()
    assert now["a"] == before["a"] and now["c"] == before["c"]  # verified preimages are restored
    assert now["b"] == after["b"]  # the unverifiable one keeps the step's version, never wrong bytes
    assert any(e["type"] == "event.recovery" and e.get("paths_not_restored") == ["b"] for e in events)
    ws.close()
    ws = world.open()
    assert ws.recovery is None and not world.store.exists("wal/in_progress")  # reported once, not a loop
    ws.close()


def test_cli_reports_paths_a_recovery_could_not_restore(tmp_path):
    world = World("real", str(tmp_path))
    before, after = crashed_mid_step(world)
    (blob,) = [n for n in world.store.listdir("wal/in_progress") if n.startswith("b")]
    damage(world, f"wal/in_progress/{blob}", "flip", 8 * 100)
    r = _cli("history", "--workdir", str(tmp_path / "work"), "--state-dir", str(tmp_path / "store"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "recovered" in r.stderr and "warning" in r.stderr and "'b'" in r.stderr and "checksum" in r.stderr, r.stderr
    now = oracle.snapshot_dir(str(tmp_path / "work"))
    assert now["a"] == before["a"] and now["b"] == after["b"]


def test_recovery_stops_at_a_damaged_journal_line_and_leaves_older_records_as_the_step_left_them():
    world = World("sim")
    before, after = crashed_mid_step(world)
    lines = _wal_lines(world)
    i = next(k for k, line in enumerate(lines) if b'"path":"b"' in line and b'"op":"pre"' in line)
    with world.paused():
        off = sum(len(line) + 1 for line in lines[:i]) + 10
        world.store.write_all("wal/in_progress/journal.jsonl", off, b"#")
    ws = world.open()
    r = ws.recovery
    # what the damaged line named is unknown; the older records' paths are named
    assert r["paths_not_restored"] == ["a"] and "journal line 3" in r["message"], r
    now = world.snapshot()
    assert now["c"] == before["c"] and now["a"] == after["a"] and now["b"] == after["b"]
    ws.close()
    assert world.open().recovery is None


def test_recovery_of_a_wal_whose_header_is_damaged_still_undoes_its_records():
    world = World("sim")
    before, _ = crashed_mid_step(world)
    with world.paused():
        world.store.write_all("wal/in_progress/journal.jsonl", 3, b"#")
    ws = world.open()
    assert ws.recovery["kind"] == "in_progress_rolled_back" and ws.recovery["step_id"] is None
    oracle.assert_same(before, world.snapshot())


# ---------------------------------------------------------------------------- the CLI and the STDIO API


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ))


@pytest.mark.parametrize("what", ["journal_emptied", "journal_one_short", "blob_flip", "inline_flip", "manifest_types",
                                  "manifest_truncated"])
def test_cli_undo_of_a_corrupt_step_exits_4_with_one_line_naming_it(tmp_path, what):
    work, state = tmp_path / "work", tmp_path / "state"
    work.mkdir()
    with Workspace.open(str(work), state_dir=str(state)) as ws:
        with ws.step("one"):
            ws.fs.write_file("keep", b"k")
        with ws.step("two"):
            ws.fs.write_file("keep", _bytes(9, 50_000))
            ws.fs.write_file("small", b"s")
        with ws.step("two-b"):
            ws.fs.write_file("small", b"t")
            ws.fs.write_file("keep", b"k3")
        with ws.step("three"):
            ws.fs.write_file("last", b"l")
        ids = [h["id"] for h in ws.history()][::-1]
        seqs = [h["seq"] for h in ws.history()][::-1]
    d = f"steps/{seqs[2]:010d}"  # "two-b": an inline preimage of small, a zstd blob of keep
    world = World.__new__(World)  # reuse the rewrite helpers on the real store
    from sandbox.hostfs.real import RealHostFS

    world.store = RealHostFS(str(state), name="store")
    world.injector_paused = True
    world.injector = FaultInjector()
    jpath = str(state / d / "journal.jsonl")
    if what == "journal_emptied":
        open(jpath, "wb").close()
    elif what == "journal_one_short":
        rewrite_step(world, d, drop_last=True)
    elif what == "blob_flip":
        blob = next(p for p in os.listdir(state / d) if p.startswith("b"))
        with open(state / d / blob, "r+b") as f:
            f.seek(200)
            c = f.read(1)
            f.seek(200)
            f.write(bytes([c[0] ^ 0x10]))
    elif what == "inline_flip":
        data = open(jpath, "rb").read()
        i = data.index(b'"data":"') + 12
        with open(jpath, "r+b") as f:
            f.seek(i)
            f.write(bytes([data[i] ^ 0x01]))
    elif what == "manifest_types":
        rewrite_step(world, d, edit_manifest=lambda m: m.update(paths={"not": "a list"}, fingerprints=7))
    else:
        mp = state / d / "manifest.json"
        mp.write_bytes(mp.read_bytes()[:40])
    world.store.close()
    before = oracle.snapshot_dir(str(work))
    common = ["--workdir", str(work), "--state-dir", str(state)]

    r = _cli("history", *common)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert [row.split()[0] for row in r.stdout.splitlines()[1:] if row.split() and row.split()[0].isdigit()] == \
        [str(i) for i in reversed(ids)]

    r = _cli("undo", "-n", "2", *common)
    assert r.returncode == 4, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("undoing")]
    assert len(lines) == 1 and f"step {ids[2]} " in lines[0] and "corrupt" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert oracle.snapshot_dir(str(work)) == before

    r = _cli("undo", *common)  # the newer step is fine
    assert r.returncode == 0, r.stderr
    assert not (work / "last").exists()
    r = _cli("undo", *common)
    assert r.returncode == 4 and f"step {ids[2]} " in r.stderr
    r = _cli("history", *common)
    assert r.returncode == 0 and "Traceback" not in r.stderr


def test_stdio_undo_of_a_corrupt_step_is_undo_corrupt_step(tmp_path):
    from sandbox_sim.api_client import ApiClient, Commands

    project = tmp_path / "project"
    project.mkdir()
    (project / "f").write_text("original\n")
    state_home = tmp_path / "state"
    state_home.mkdir()
    cmds = Commands("scripted")
    c = ApiClient(guest="scripted", env={"XDG_STATE_HOME": str(state_home)})
    try:
        c.ok("session.start", {"working_directories": [{"path": str(project)}]}, timeout_s=400)
        c.ok("agent.execute", {"command": cmds.write("f", "one")})
        c.ok("agent.execute", {"command": cmds.write("g", "two")})
        c.ok("session.stop")
        journals = sorted(os.path.join(d, "journal.jsonl") for d, _, fs in os.walk(state_home)
                          if "journal.jsonl" in fs and "steps" in d)
        assert len(journals) == 2
        open(journals[0], "wb").close()  # the older step's journal emptied
        c.ok("session.start", {"working_directories": [{"path": str(project)}]}, timeout_s=400)
        hist = c.ok("undo.history")["steps"]
        assert len(hist) == 2 and "corrupt" in hist[1]
        e = c.error("undo.rollback", {"count": 2})
        assert e["code"] == "undo.corrupt_step" and e["data"]["step_id"] == hist[1]["id"], e
        assert (project / "f").read_text() == "one" and (project / "g").exists()
        c.ok("undo.rollback", {"count": 1})
        assert not (project / "g").exists()
        assert c.error("undo.rollback", {"count": 1})["code"] == "undo.corrupt_step"
        assert (project / "f").read_text() == "one"
        # manifest and journal both unreadable: history still lists it, schema-valid (the
        # client validates every message), of type "unknown"
        c.ok("session.stop")
        open(os.path.join(os.path.dirname(journals[0]), "manifest.json"), "wb").close()
        c.ok("session.start", {"working_directories": [{"path": str(project)}]}, timeout_s=400)
        hist = c.ok("undo.history")["steps"]
        assert [h["type"] for h in hist] == ["unknown"] and "corrupt" in hist[0], hist
    finally:
        if c.proc.poll() is None:
            c.close()
        c.check()


def test_a_step_kept_unprotected_by_recovery_reads_back_intact():
    """Recovery promotes an unprotected WAL itself (its manifest's journal counts come from
    the file, a torn last line cut off): reopened, the step is intact, not corrupt."""
    from sandbox import Limits, StepUnprotected

    world = World("sim")
    ws = world.open(limits=Limits(max_single_step_size_bytes=5000))
    with world.paused():
        world.work.create("big", 0o644)
        world.work.write_all("big", 0, _bytes(5, 20_000))
    ws.begin_step("huge")
    ws.fs.write_file("big", b"small now")
    ws.fs.write_file("other", b"o")
    world.crash(ws)
    with world.paused():  # a torn last line, as a crash mid-append leaves it
        size = world.store.lstat("wal/in_progress/journal.jsonl").size
        world.store.write_all("wal/in_progress/journal.jsonl", size, b'{"op":"crea')
    ws = world.open()
    assert ws.recovery["kind"] == "unprotected_step_kept"
    ws.close()
    ws = world.open()
    (h,) = ws.history()
    assert h["unprotected"] and h["outcome"] == "recovered" and "corrupt" not in h, h
    with pytest.raises(StepUnprotected):
        ws.rollback(1)
    ws.close()


def test_a_denied_step_keeps_its_outcome_after_reopening():
    from sandbox import SafeguardConfig, SafeguardDenied

    world = World("sim")
    ws = world.open(safeguard=SafeguardConfig(delete_threshold=2), decide=lambda hold: "deny")
    with world.paused():
        for n in "abc":
            world.work.create(n, 0o644)
    with ws.step("rm"):
        with pytest.raises(SafeguardDenied):
            for n in "abc":
                ws.fs.unlink(n)
    assert ws.history()[0]["outcome"] == "denied"
    ws.close()
    ws = world.open()
    assert ws.history()[0]["outcome"] == "denied"
    ws.close()


@pytest.mark.parametrize("kind", ["sim", "sim-reflink"])
@pytest.mark.parametrize("in_memory", [True, False])
def test_restore_checks_each_preimage_before_it_touches_the_path(kind, in_memory, monkeypatch):
    """Defence in depth: the undo itself (here without the up-front check a Workspace
    makes) refuses a damaged preimage before the file is truncated or written — both for
    a preimage checked in memory and for a large one checked by a first pass."""
    from sandbox.core import preimage

    if not in_memory:
        monkeypatch.setattr(store_mod, "VERIFY_IN_MEMORY_BYTES_MAX", 1000)
        monkeypatch.setattr(preimage, "CHUNK_BYTES", 4096)  # many chunks per preimage
    b = build(World(kind))
    ws = b.world.open()
    ws.rollback(3)  # intact: exact, also through the two-pass path
    oracle.assert_same(b.snaps[0], b.world.snapshot())
    ws.close()
    b = build(World(kind))
    ws = b.world.open()
    rec = _rec(ws.records(), "big2.bin")
    assert rec["enc"] == ("raw" if kind == "sim-reflink" else "zstd")
    blob = f"{b.dirs[2]}/{rec['blob']}"
    damage(b.world, blob, "flip", 8 * (len(b.world.store.read_all(blob)) - 40))  # near the end
    before = b.world.snapshot()
    with pytest.raises(CorruptStep, match=r"big2\.bin"):
        ws._log.rollback_top(ws.work)
    assert b.world.snapshot()["big2.bin"] == before["big2.bin"]  # neither truncated nor half-written
    ws.close()


class _JournalWriteFailsPartWay(FaultInjector):
    """The next journal write stores all but its last byte, then fails with ENOSPC (the
    process lives on): what a disk that fills up part-way through a write leaves."""

    def __call__(self, fs, op, path, nbytes):
        super().__call__(fs, op, path, nbytes)
        if fs.name == "store" and op == "write" and path.endswith("journal.jsonl") and not self.injected:
            self.injected.append(f"short write of {path}")
            return nbytes - 1
        return None

    def after_torn_write(self, fs, path, written):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@pytest.mark.interpreted_only
def test_bytes_a_failed_append_left_past_the_journal_do_not_make_the_step_corrupt():
    world = World("sim")
    ws = world.open()
    with ws.step("s"):
        ws.fs.write_file("a", b"1" * 500)
        world.injector = _JournalWriteFailsPartWay()
        with pytest.raises(OSError) as e:
            ws.fs.write_file("b" * 40, b"2")  # its intent's line is cut short: the create never runs
        assert e.value.errno == errno.ENOSPC and world.injector.injected
        world.injector = FaultInjector()
        assert world.store.lstat("wal/in_progress/journal.jsonl").size > ws._log.open_step.journal_offset
        ws.fs.write_file("c", b"3")  # a shorter line over part of what it left; the rest stays past it
        assert world.store.lstat("wal/in_progress/journal.jsonl").size > ws._log.open_step.journal_offset
    ws.close()
    ws = world.open()
    assert "corrupt" not in ws.history()[0]
    ws.rollback(1)
    assert world.work.listdir("") == []
    ws.close()


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@given(st.dictionaries(st.text(max_size=10).filter(lambda k: k != "h"), _json_values, min_size=1, max_size=6))
@settings(max_examples=300, deadline=None)
def test_a_sealed_line_is_json_dumps_of_the_object_then_its_checksum(obj):
    """seal() calls the C JSON encoder directly: the body must be exactly what
    json.dumps(obj, separators=(",", ":"), ensure_ascii=True) gives, and unseal its inverse."""
    line = seal(obj)
    body = json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    assert line.startswith(body[:-1] + b',"h":"') and line.endswith(b'"}\n')
    assert unseal(line) == json.loads(body)


def test_seal_refuses_what_json_dumps_refuses():
    cyclic: dict = {"a": []}
    cyclic["a"].append(cyclic)
    with pytest.raises(ValueError, match="Circular"):
        seal(cyclic)
    with pytest.raises(TypeError):
        seal({"a": object()})
    deep: list = []
    for _ in range(100_000):  # not circular, only too deep: json.dumps's RecursionError
        deep = [deep]
    with pytest.raises(RecursionError):
        json.dumps({"a": deep})
    with pytest.raises(RecursionError):
        seal({"a": deep})
    assert seal({"a": [1, 2]}).startswith(b'{"a":[1,2],"h":"')  # no markers left behind by the failures


def test_preimage_readers_each_own_their_decompressor(monkeypatch):
    """Decompression contexts are reused (``DECOMPRESSORS_KEPT_MAX``): two preimages read
    interleaved chunk by chunk both come out exact, and a context that failed on a damaged
    preimage decodes the next one exactly."""
    from sandbox.core import preimage

    world = World("sim")
    ws = world.open()
    old = {"a": _bytes(7, 30_000) + b"a" * 5000, "b": b"b" * 9000 + _bytes(8, 20_000)}
    with world.paused():
        for path, data in old.items():
            world.work.create(path, 0o644)
            world.work.write_all(path, 0, data)
    with ws.step("overwrite"):
        for path in old:
            ws.fs.write_file(path, b"new")
    log = ws._log
    info = log.steps()[-1]
    pres = {r["path"]: r for r in log.records_of(info) if r["op"] == "pre" and r.get("enc") == "zstd"}
    assert set(pres) == {"a", "b"}
    monkeypatch.setattr(preimage, "CHUNK_BYTES", 4096)
    ga, gb = log._preimage_chunks(info.dirname, pres["a"]), log._preimage_chunks(info.dirname, pres["b"])
    got = {"a": b"", "b": b""}
    live = {"a": ga, "b": gb}
    while live:  # one chunk of each in turn: both readers are mid-frame at once
        for path, gen in list(live.items()):
            chunk = next(gen, None)
            if chunk is None:
                del live[path]
            else:
                got[path] += chunk
    assert got == old
    damaged = dict(pres["a"], data=base64.b64encode(b"\x28\xb5\x2f\xfd" + b"\x00" * 40).decode()) if "data" in pres["a"] else None
    if damaged is None:  # stored as a blob: damage the blob instead
        blob = join(info.dirname, pres["a"]["blob"])
        with world.paused():
            world.store.write_all(blob, 8, b"\xff" * 32)
        damaged = pres["a"]
    for _ in range(store_mod.DECOMPRESSORS_KEPT_MAX + 1):
        with pytest.raises(StoreCorruptStep):
            b"".join(log._preimage_chunks(info.dirname, damaged))
        assert b"".join(log._preimage_chunks(info.dirname, pres["b"])) == old["b"]
    assert 0 < len(log._dctxs) <= store_mod.DECOMPRESSORS_KEPT_MAX


# ---------------------------------------------------------------------------- journals this process wrote


@pytest.mark.interpreted_only
def test_a_journal_this_process_wrote_parses_exactly_as_its_bytes_do(monkeypatch):
    """A finished step's journal is checked from the objects its lines sealed (not unsealed
    again) only when the bytes read back are exactly the ones written; across campaigns with
    every fault (crashes, torn writes, ENOSPC/EIO, power loss, denied steps) each such
    parse equals ``parse_journal`` of those bytes, and each one is used."""
    from sandbox_sim.campaign import execute, plan

    original = store_mod.UndoLog._parse_checked
    seen = {"written": 0}

    def checked(self, info, data, where):
        written = data in self._written
        got = original(self, info, data, where)
        if written:
            seen["written"] += 1
            assert got == parse_journal(data, where), where
        return got

    monkeypatch.setattr(store_mod.UndoLog, "_parse_checked", checked)
    for seed in (1, 2, 3):
        d, fail_at, err = execute(*plan(seed, 120, {"crash", "enospc", "eio", "torn", "power"}))
        assert err is None, (seed, fail_at, err)
    assert seen["written"] > 20, seen


def _edit_mode_in_journal(world: World, d: str, path: str, mode: int) -> None:
    """Rewrite step ``d``'s ``pre`` record of ``path`` with another mode: valid seals, the
    journal the same length, its manifest's hash updated."""
    def edit(records):
        rec = _rec(records, path)
        assert len(str(rec["mode"])) == len(str(mode))
        rec["mode"] = mode

    rewrite_step(world, d, edit)


def test_a_journal_edited_on_disk_is_what_a_rollback_reads_after_a_crash():
    world = World("sim")
    with world.paused():
        world.work.create("a", 0o644)  # 420
        world.work.write_all("a", 0, b"before")
    ws = world.open()
    with ws.step("s"):
        ws.fs.write_file("a", b"after")
    seq = ws.history()[0]["seq"]
    world.crash(ws)
    _edit_mode_in_journal(world, f"steps/{seq:010d}", "a", 0o600)  # 384: same length
    ws = world.open()
    ws.rollback(1)
    assert world.work.lstat("a").mode == 0o600 and world.work.read_all("a") == b"before"
    ws.close()


def _one_finished_step(before: bytes = b""):
    """A simulated world whose file ``a`` (holding ``before``) was rewritten in one finished step."""
    world = World("sim")
    with world.paused():
        world.work.create("a", 0o644)
        if before:
            world.work.write_all("a", 0, before)
    ws = world.open()
    with ws.step("s"):
        ws.fs.write_file("a", b"after")
    return world, ws


def test_a_journal_edited_on_disk_after_its_step_finished_is_parsed_from_the_disk():
    """In the same process: the objects kept for a journal this process wrote are used only
    for exactly its bytes, never for other bytes of the same step."""
    world, ws = _one_finished_step(b"before")
    log = ws._log
    info = log.steps()[-1]
    assert log._written, "the step's journal objects were not kept"
    _edit_mode_in_journal(world, info.dirname, "a", 0o600)
    log._steps[-1] = log._read_step(info.seq)  # as if this process had read the edited manifest
    ws.rollback(1)
    assert world.work.lstat("a").mode == 0o600 and world.work.read_all("a") == b"before"
    ws.close()


def test_a_journal_changed_on_disk_after_its_step_finished_is_corrupt_in_the_same_process():
    world, ws = _one_finished_step()
    info = ws._log.steps()[-1]
    _edit_mode_in_journal(world, info.dirname, "a", 0o600)  # the manifest in memory still has the old hash
    with pytest.raises(CorruptStep, match="checksum"):
        ws.rollback(1)
    ws.close()


def test_records_of_hands_out_records_no_later_call_shares():
    world, ws = _one_finished_step()
    log, info = ws._log, ws._log.steps()[-1]
    first = log.records_of(info)  # from the objects this process wrote
    expected = [dict(r) for r in first]
    for r in first:
        r["path"] = "changed"
    second = log.records_of(info)  # from the same kept objects, copied and checked again
    assert second == expected
    second[0]["path"] = "changed again"
    assert log.records_of(info) == expected
    ws.rollback(1)
    assert world.work.read_all("a") == b""
    ws.close()


@pytest.mark.interpreted_only
def test_inline_preimages_verified_before_a_rollback_restore_each_their_own_bytes(monkeypatch):
    """The rollback's check keeps the inline preimages it verified for the restore that
    follows: every step's own bytes come back — the same path, the same size, other bytes
    in each step — and none is decoded twice."""
    world = World("sim")
    with world.paused():
        world.work.create("a", 0o644)
        world.work.write_all("a", 0, b"zero\n")
    ws = world.open()
    trees = [world.snapshot()]
    for word in (b"one\n", b"two\n", b"six\n"):
        with ws.step(word.decode().strip()):
            ws.fs.write_file("a", word)
            ws.fs.write_file("b", word * 3)
        trees.append(world.snapshot())
    decoded = []
    chunks = store_mod.UndoLog._preimage_chunks

    def counted(self, where, rec):
        decoded.append(rec["hash"])
        return chunks(self, where, rec)

    monkeypatch.setattr(store_mod.UndoLog, "_preimage_chunks", counted)
    ws.rollback(1)
    oracle.assert_same(trees[2], world.snapshot())
    ws.rollback(2)
    oracle.assert_same(trees[0], world.snapshot())
    assert decoded and len(decoded) == len(set(decoded)), decoded  # each checked once, then restored from that
    ws.close()


def _descriptors_on(path: str) -> int:
    """How many of this process's descriptors are open on ``path`` (by name)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == path
        except OSError:
            pass
    return n


def test_a_real_disks_journal_is_appended_through_one_kept_descriptor_reopened_when_replaced(tmp_path):
    """On the real disk the open step's journal is written through one descriptor opened
    when the step begins (not one path resolution per line); a deny rewrites the journal
    as a new file, after which lines must still land in the file at the path (a descriptor
    kept on the old file would lose them); none is left open once the step is promoted.
    The simulated disks write by path as before (``HostFS.append_handle`` is None there)."""
    from sandbox import Workspace as W

    work = tmp_path / "work"
    work.mkdir()
    (work / "a").write_bytes(b"A")
    ws = W.open(str(work), state_dir=str(tmp_path / "state"))
    log = ws._log
    journal = os.path.join(os.path.realpath(tmp_path / "state"), "wal", "in_progress", "journal.jsonl")
    try:
        with ws.step("one"):
            ws.fs.write_file("a", b"B")
            assert _descriptors_on(journal) == 1 and log.open_step.journal_out is not None
            with ws._interceptor.lock:
                log.deny_open(ws.work)  # the journal is rewritten: a new file at its path
            assert _descriptors_on(journal) == 1
            ws.fs.write_file("c", b"new")  # its intent: a line after the rewrite
            lines = [unseal(x) for x in open(journal, "rb").read().splitlines()]
            assert [r.get("path") for r in lines[1:]] == ["", "c"]  # the parent, then the new file
            assert lines[0]["command"] == "one"
        assert _descriptors_on(journal) == 0
        step = log.steps()[-1]
        assert step.outcome == "denied" and step.journal_lines == 3
        with ws.step("two"):
            ws.fs.write_file("a", b"C")
        ws.rollback(1)
        assert (work / "a").read_bytes() == b"A"
    finally:
        ws.close()
    assert _descriptors_on(journal) == 0
    from sandbox.hostfs.memory import MemoryHostFS
    assert MemoryHostFS().append_handle("wal/in_progress/journal.jsonl") is None


def test_a_retired_step_is_deleted_whole_entries_unlinked_without_a_look_each(world):
    """``UndoLog._remove_dir``: each entry of a retired step directory is unlinked without a
    look; one that refuses (a directory: ``EISDIR``) is looked at and emptied. A stray
    directory in a step (nested, with a file) goes too, and ``trash/`` ends empty."""
    ws = world.open()
    with ws.step("s"):
        ws.fs.write_file("a", b"1" * 9000)
    step_dir = ws._log.steps()[-1].dirname
    with world.paused():
        world.store.mkdir(join(step_dir, "stray"), 0o700)
        world.store.mkdir(join(step_dir, "stray/deeper"), 0o700)
        world.store.create(join(step_dir, "stray/deeper/f"), 0o600)
        world.store.write_all(join(step_dir, "stray/deeper/f"), 0, b"x")
    world.injector = FaultInjector()
    world.injector.trace = trace = []
    ws.rollback(1)
    assert world.store.listdir("trash") == [] and world.work.listdir("") == []
    looks = [path for fs, op, path in trace if fs == "store" and op == "lstat" and path.startswith("trash/")]
    assert sorted(looks) == sorted(["trash/rb-1/stray", "trash/rb-1/stray/deeper"]), looks
    ws.close()


def test_a_small_file_read_whole_is_one_sized_frame_and_every_frame_form_restores():
    """A preimage read whole by its first read and at most ``ONE_SHOT_COMPRESS_BYTES_MAX``
    long is compressed as one frame that states its size; a longer one is streamed (no size
    in the frame) as before, and so is an empty file — and every one of them, inline or a blob,
    restores exactly: the store reads frames of both kinds."""
    cap = store_mod.ONE_SHOT_COMPRESS_BYTES_MAX
    sizes = {"empty": 0, "one": 1, "kib": 1024, "cap": cap, "over": cap + 1, "blob": 20_000}
    world = World("sim")
    with world.paused():
        for i, (name, n) in enumerate(sizes.items()):
            world.work.create(name, 0o644)
            world.work.write_all(name, 0, _bytes(10 + i, n))
    before = world.snapshot()
    ws = world.open()
    with ws.step("s"):
        for name in sizes:
            ws.fs.unlink(name)
    info = ws._log.steps()[-1]
    recs = {r["path"]: r for r in (unseal(line) for line in world.store.read_all(f"{info.dirname}/journal.jsonl").splitlines()[1:])
            if r.get("op") == "pre" and r.get("path") in sizes}
    assert set(recs) == set(sizes)
    for name, n in sizes.items():
        rec = recs[name]
        assert rec["enc"] == "zstd" and rec["size"] == n
        frame = base64.b64decode(rec["data"]) if "data" in rec else world.store.read_all(join(info.dirname, rec["blob"]))
        stated = zstandard.frame_content_size(frame)
        if 0 < n <= cap:
            assert "data" in rec and stated == n, (name, stated)
        elif n > cap:
            assert stated == -1, (name, stated)  # frame_content_size: not stated
        assert ("data" in rec) == (name != "blob")
    ws.rollback(1)
    oracle.assert_same(before, world.snapshot())
    ws.close()
