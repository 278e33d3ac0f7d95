"""The embedding SDK (``sandbox.Sandbox``, ``SyncSandbox``) with the scripted guest.

Everything below the SDK is real: the session, the 9P server on a unix socket, the undo
core on a temporary folder, the scripted guest's 9P clients. What a test asserts is what an
embedder sees: files on the host, exit codes, output, events, history.
"""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

import sandbox
from sandbox.core.safeguard import SafeguardConfig
from sandbox.mounts.table import MountError
from sandbox.mounts.vfs import FileStat
from sandbox.scripted.guest import ScriptedGuest
from sandbox.session import guest as guest_protocol
from sandbox.session.runtime import LIVE_MOUNTS_MAX
from sandbox.vm.guest import VmGuest

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20.0


Guest = ScriptedGuest


@pytest.fixture
def proj(tmp_path):
    p = tmp_path / "proj"
    (p / "src").mkdir(parents=True)
    (p / "src" / "a.txt").write_text("alpha\n")
    return p


def make(proj, tmp_path, **kw):
    kw.setdefault("volumes", [(str(proj), "/workspace")])
    kw.setdefault("guest", lambda run_dir: Guest())
    kw.setdefault("external_modification_policy", None)
    vols = [sandbox.Volume.parse(v) for v in kw.pop("volumes")]
    kw["volumes"] = [sandbox.Volume(v.host, v.guest, v.read_only, state_dir=str(tmp_path / f"state{i}"))
                     for i, v in enumerate(vols)]
    return sandbox.Sandbox(**kw)


async def drain(sb) -> list[dict]:
    return [e async for e in sb.events(wait=False)]


# ---------------------------------------------------------------------------- run, undo, history, events


async def test_run_undo_history_events(proj, tmp_path):
    async with make(proj, tmp_path) as sb:
        r = await sb.run("write /workspace/src/a.txt changed; mkdir /workspace/new; write /workspace/new/b x")
        assert (r.exit_code, r.signal, r.cancelled) == (0, None, False)
        assert r.step_id is not None
        assert (proj / "src" / "a.txt").read_text() == "changed"
        assert (proj / "new" / "b").read_text() == "x"
        hist = await sb.history()
        assert hist[0]["id"] == r.step_id and hist[0]["type"] == "command"  # newest first
        events = await drain(sb)
        assert any(e["type"] == "step_completed" and e["step_id"] == r.step_id for e in events), events
        undone = await sb.undo(1)
        assert undone["step_ids"] == [r.step_id]
        assert (proj / "src" / "a.txt").read_text() == "alpha\n"
        assert not (proj / "new").exists()
        r2 = await sb.run("cat /workspace/src/a.txt")  # the guest sees the undo at once
        assert r2.stdout == "alpha\n"
    assert not sb.running


async def test_on_output_gets_chunks_with_their_stream_in_order(proj, tmp_path):
    seen = []

    async def slow(chunk):  # coroutine callbacks are awaited before run returns
        await asyncio.sleep(0)
        seen.append(("async", str(chunk)))

    async with make(proj, tmp_path) as sb:
        r = await sb.run("echo one; cat /workspace/missing; echo two",
                         on_output=lambda c: seen.append((c.stream, str(c))))
        assert r.exit_code == 1
        assert seen == [("stdout", "one\n"), ("stderr", "cat: /workspace/missing: No such file or directory\n")]
        assert r.stdout == "one\n" and "No such file" in r.stderr and not r.output_truncated
        seen.clear()
        await sb.run("echo three", on_output=slow)
        assert seen == [("async", "three\n")]


async def test_read_only_volume_and_second_volume(proj, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "d.txt").write_text("keep")
    async with make(proj, tmp_path, volumes=[(str(proj), "/workspace"), (str(data), "/data", "ro")]) as sb:
        r = await sb.run("cat /data/d.txt; write /data/d.txt gone")
        assert r.exit_code == 1 and r.stdout == "keep" and "Read-only file system" in r.stderr
        assert (data / "d.txt").read_text() == "keep"
        st = await sb.status()
        assert [f["read_only"] for f in st["folders"]] == [False, True]
        assert await sb.history(volume=1) == []


async def test_mounts_and_python_path(proj, tmp_path):
    async with make(proj, tmp_path, mounts={"/mnt/tools": {"hello.sh": b"#!/bin/sh\necho hi\n"}},
                    python_path=["/mnt/tools"]) as sb:
        r = await sb.run("cat /mnt/tools/hello.sh; echo $PYTHONPATH")
        assert r.stdout == "#!/bin/sh\necho hi\n/mnt/tools\n"
        r = await sb.run("write /mnt/tools/x y")
        assert r.exit_code == 1  # in-memory mounts are read-only unless writable


async def test_a_vfs_mounted_at_start(proj, tmp_path):
    async with make(proj, tmp_path, mounts={"/mnt/cat": Catalog()}) as sb:
        assert (await sb.run("cat /mnt/cat/readme.txt")).stdout == "from the embedder\n"
        assert {"guest_path": "/mnt/cat", "read_only": True, "label": "", "live": False} in (await sb.status())["mounts"]


async def test_cancelling_run_cancels_the_command(proj, tmp_path):
    async with make(proj, tmp_path) as sb:
        started = asyncio.Event()
        task = asyncio.ensure_future(sb.run("echo go; wait", on_output=lambda c: started.set()))
        await asyncio.wait_for(started.wait(), WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        r = await sb.run("echo after")  # the session goes on
        assert (r.exit_code, r.stdout) == (0, "after\n")


async def test_create_context_manager_and_start_stop(proj, tmp_path):
    async with sandbox.Sandbox.create(volumes=[sandbox.Volume(str(proj), "/w", state_dir=str(tmp_path / "s"))],
                                      guest="scripted", external_modification_policy=None) as sb:
        assert (await sb.run("cat /w/src/a.txt")).stdout == "alpha\n"
    sb2 = make(proj, tmp_path)
    await sb2.start()
    try:
        assert sb2.running
    finally:
        await sb2.stop()
        await sb2.stop()  # idempotent
    assert not sb2.running

    async def everything():
        return [e async for e in sb2.events()]  # wait=True: ends because the sandbox stopped

    assert all(e["type"] != "step_completed" for e in await asyncio.wait_for(everything(), WAIT_S))


# ---------------------------------------------------------------------------- configuration errors


@pytest.mark.parametrize("kw, exc, text", [
    ({"share": "virtiofs"}, ValueError, "goes with guest='vm'"),
    ({"share": "local"}, ValueError, "goes with guest='local'"),
    ({"guest": "local"}, ValueError, "at its own path"),
    ({"guest": "local", "volumes": ["."], "network": "allowlist", "allow": ["example.org"]}, ValueError,
     "cannot enforce a network allowlist"),
    ({"share": "nfs"}, ValueError, "share must be one of"),
    ({"virtiofs_direct_io": "all"}, ValueError, "needs share='virtiofs'"),
    ({"share": "9p", "virtiofs_direct_io": "reads"}, ValueError, "virtiofs_direct_io must be one of"),
    ({"network": "wide"}, ValueError, "network must be one of"),
    ({"guest": "qemu"}, ValueError, "guest must be"),
    ({"volumes": []}, ValueError, "at least one volume"),
    ({"volumes": [("a", "/b", "rx")]}, ValueError, "'ro' or 'rw'"),
    ({"external_modification_policy": "ignore"}, ValueError, "external_modification_policy"),
    ({"mounts": {"/": {"a": b""}}}, MountError, "root"),
    ({"python_path": ["rel"]}, ValueError, "python_path"),
])
def test_bad_configuration_is_refused_before_anything_starts(proj, tmp_path, kw, exc, text):
    with pytest.raises(exc, match=text):
        base = {"volumes": [(str(proj), "/workspace")], "guest": "scripted"}
        sandbox.Sandbox(**{**base, **kw})


# ---------------------------------------------------------------------------- safeguards


async def test_safeguard_callback_denies_and_the_step_is_rolled_back(proj, tmp_path):
    (proj / "many").mkdir()
    for i in range(5):
        (proj / "many" / f"f{i}").write_text(str(i))
    asked = []

    def decide(hold):
        asked.append(hold)
        return "deny"

    async with make(proj, tmp_path, safeguard=SafeguardConfig(delete_threshold=2), on_safeguard=decide) as sb:
        r = await sb.run("rm -r /workspace/many")
        assert r.exit_code == 1 and "Input/output error" in r.stderr
        assert sorted(os.listdir(proj / "many")) == [f"f{i}" for i in range(5)]
        assert len(asked) == 1 and asked[0]["safeguard_id"]
        kinds = [e["type"] for e in await drain(sb)]
        assert "safeguard_triggered" in kinds and "safeguard_resolved" in kinds
        assert sb.safeguards.pending() == []


async def test_safeguard_answered_through_events_and_confirm(proj, tmp_path):
    (proj / "many").mkdir()
    for i in range(5):
        (proj / "many" / f"f{i}").write_text(str(i))
    async with make(proj, tmp_path, safeguard=SafeguardConfig(delete_threshold=2)) as sb:
        task = asyncio.ensure_future(sb.run("rm -r /workspace/many"))
        async for e in sb.events():
            if e["type"] == "safeguard_triggered":
                break
        assert [p["safeguard_id"] for p in sb.safeguards.pending()] == [e["safeguard_id"]]
        assert sb.safeguards.confirm("no-such-hold", "allow") is False
        assert sb.safeguards.confirm(e["safeguard_id"], "allow") is True
        r = await asyncio.wait_for(task, WAIT_S)
        assert r.exit_code == 0 and not (proj / "many").exists()
        await sb.undo(1)
        assert sorted(os.listdir(proj / "many")) == [f"f{i}" for i in range(5)]


# ---------------------------------------------------------------------------- live mounts (seed 000)


class Catalog:
    """A VirtualFileSystem an embedder writes: two files, one computed on every read."""

    def __init__(self):
        self.reads = 0
        self.written: dict[str, bytes] = {}

    def list(self, path):
        return ["readme.txt", "count.txt"] + list(self.written) if path == "" else []

    def stat(self, path):
        if path == "":
            return FileStat("dir")
        if path in ("readme.txt", "count.txt") or path in self.written:
            return {"type": "file", "size": len(self.read(path))}
        raise FileNotFoundError(path)

    def read(self, path):
        if path == "readme.txt":
            return b"from the embedder\n"
        if path == "count.txt":
            self.reads += 1
            return f"{self.reads}\n".encode()
        return self.written[path]

    def write(self, path, data):
        self.written[path] = data


async def test_live_mount_visible_at_once_and_gone_after_unmount(proj, tmp_path):
    async with make(proj, tmp_path) as sb:
        m = await sb.mount("/mnt/up", {"a.txt": b"uploaded", "lib/m.py": b"X = 1\n"})
        assert m == {"guest_path": "/mnt/up", "read_only": True, "label": ""}
        r = await sb.run("cat /mnt/up/a.txt; ls /mnt/up; cat /mnt/up/lib/m.py")
        assert r.stdout == "uploadeda.txt\nlib\nX = 1\n"  # ls sorts by code point
        r = await sb.run("write /mnt/up/a.txt no")
        assert r.exit_code == 1 and "Read-only" in r.stderr
        st = await sb.status()
        assert {"guest_path": "/mnt/up", "read_only": True, "label": "", "files": 2, "live": True} in st["mounts"]
        assert "/mnt/up" in [mt.target for mt in sb.session.table.mounts]  # listings see it
        await sb.unmount("/mnt/up")
        r = await sb.run("cat /mnt/up/a.txt")
        assert r.exit_code == 1 and "not in a shared folder" in r.stderr
        assert not any(x["guest_path"] == "/mnt/up" for x in (await sb.status())["mounts"])
        with pytest.raises(MountError, match="not a live mount"):
            await sb.unmount("/mnt/up")
        await sb.mount("/mnt/up", {"b": b"again"})  # the target is free again
        assert (await sb.run("cat /mnt/up/b")).stdout == "again"


async def test_live_mount_of_a_vfs_is_live_and_writable_without_undo(proj, tmp_path):
    cat = Catalog()
    async with make(proj, tmp_path) as sb:
        await sb.mount("/mnt/cat", cat, writable=True)
        r = await sb.run("cat /mnt/cat/readme.txt; cat /mnt/cat/count.txt; cat /mnt/cat/count.txt")
        assert r.stdout.startswith("from the embedder\n") and r.exit_code == 0
        first, second = map(int, r.stdout.splitlines()[1:])
        assert second > first  # asked again: a VFS is live, not a snapshot
        r = await sb.run("write /mnt/cat/new.txt hello")
        assert r.exit_code == 0, r.stderr
        assert cat.written == {"new.txt": b"hello"}
        hist = await sb.history()
        assert hist[0]["command"].startswith("write /mnt/cat") and hist[0]["paths"] == []  # never undo-tracked
        r = await sb.run("rm /mnt/cat/readme.txt")
        assert r.exit_code == 1


async def test_live_mount_errors(proj, tmp_path):
    class Broken:
        def list(self, path):
            raise RuntimeError("bug in the embedder")

        def stat(self, path):
            if path == "":
                return FileStat("dir")
            return FileStat("file", 3)

        def read(self, path):
            return 42  # not bytes

    async with make(proj, tmp_path) as sb:
        await sb.mount("/mnt/broken", Broken())
        r = await sb.run("ls /mnt/broken")
        assert r.exit_code == 1 and "Input/output error" in r.stderr  # EIO, the session goes on
        r = await sb.run("cat /mnt/broken/x")
        assert r.exit_code == 1 and "Input/output error" in r.stderr
        with pytest.raises(MountError, match="share the target"):
            await sb.mount("/mnt/broken", {"a": b""})
        with pytest.raises(MountError, match="create the directory"):
            await sb.mount("/workspace/nope/deeper", {"a": b""})  # no mount point in the folder
        with pytest.raises(MountError):
            await sb.mount("/", {"a": b""})
        with pytest.raises(ValueError):
            await sb.mount("/mnt/bad", {"../x": b""})
        for k in range(LIVE_MOUNTS_MAX - 1):
            await sb.mount(f"/mnt/n{k}", {"f": b"%d" % k})
        with pytest.raises(MountError, match=f"at most {LIVE_MOUNTS_MAX} live mounts"):
            await sb.mount("/mnt/one-too-many", {"f": b""})
        assert (await sb.run(f"cat /mnt/n{LIVE_MOUNTS_MAX - 2}/f")).stdout == str(LIVE_MOUNTS_MAX - 2)
        r = await sb.run("echo still fine")
        assert r.exit_code == 0


async def test_live_mount_inside_a_volume_needs_its_mount_point(proj, tmp_path):
    async with make(proj, tmp_path) as sb:
        await sb.mount("/workspace/src", {"over.txt": b"overlay"})
        r = await sb.run("ls /workspace/src")
        assert r.stdout == "over.txt\n"  # the live mount overlays the folder's directory
        await sb.unmount("/workspace/src")
        assert (await sb.run("ls /workspace/src")).stdout == "a.txt\n"


async def test_live_mounts_end_with_the_session(proj, tmp_path):
    sb = make(proj, tmp_path)
    async with sb:
        await sb.mount("/mnt/up", {"a": b"1"})
    assert [m.target for m in sb.session.table.mounts] == ["/workspace"]
    with pytest.raises(sandbox.SessionError, match="not running"):
        await sb.mount("/mnt/up", {"a": b"1"})


# ---------------------------------------------------------------------------- STDIO mount.add / mount.remove


def test_stdio_mount_add_and_remove(proj, tmp_path):
    import base64

    from sandbox_sim.api_client import ApiClient

    state = tmp_path / "xdg"
    state.mkdir()
    c = ApiClient(guest="scripted", env={"XDG_STATE_HOME": str(state)})
    try:
        b64 = base64.b64encode(b"uploaded").decode()
        assert c.error("mount.add", {"path": "/mnt/up", "files": {"a": b64}})["code"] == "session.not_started"
        c.ok("session.start", {"working_directories": [{"path": str(proj)}]}, timeout_s=60)
        assert c.error("mount.add", {"path": "/mnt/up", "files": {"a": "%%%"}})["code"] == "protocol.invalid_request"
        assert c.error("mount.add", {"path": "/mnt/up", "files": {"../a": b64}})["code"] in (
            "session.invalid_mounts", "protocol.invalid_request")
        assert c.error("mount.add", {"path": "/", "files": {"a": b64}})["code"] == "session.invalid_mounts"
        assert c.error("mount.remove", {"path": "/mnt/none"})["code"] == "session.invalid_mounts"
        r = c.ok("mount.add", {"path": "/mnt/up", "files": {"a": b64}})
        assert r["mount"] == {"guest_path": "/mnt/up", "read_only": True, "label": "", "files": 1, "live": True}
        assert c.ok("fs.read", {"path": "/mnt/up/a"})["data"] == "uploaded"
        assert [e["name"] for e in c.ok("fs.list", {"path": "/mnt/up"})["entries"]] == ["a"]
        assert c.ok("agent.execute", {"command": "cat /mnt/up/a"}, timeout_s=30)["exit_code"] == 0
        assert all(not m["live"] for m in c.ok("mount.remove", {"path": "/mnt/up"})["mounts"])
        assert c.error("fs.read", {"path": "/mnt/up/a"})["code"] == "fs.outside_mounts"
    finally:
        c.close()
        c.check()


# ---------------------------------------------------------------------------- sync facade


def test_sync_sandbox(proj, tmp_path):
    out = []
    sb = sandbox.SyncSandbox(volumes=[sandbox.Volume(str(proj), "/workspace", state_dir=str(tmp_path / "s"))],
                             guest=lambda run_dir: Guest(), external_modification_policy=None)
    with sb:
        r = sb.run("write /workspace/src/a.txt sync; echo done", on_output=out.append)
        assert (r.exit_code, r.stdout, out) == (0, "done\n", ["done\n"])
        assert (proj / "src" / "a.txt").read_text() == "sync"
        assert any(e["type"] == "step_completed" for e in sb.events())
        assert sb.history()[0]["id"] == r.step_id
        sb.mount("/mnt/x", {"f": b"live"})
        assert sb.run("cat /mnt/x/f").stdout == "live"
        sb.unmount("/mnt/x")
        newer = [h["id"] for h in sb.history()]
        sb.undo(newer.index(r.step_id) + 1)  # the steps after it too (they changed nothing)
        assert (proj / "src" / "a.txt").read_text() == "alpha\n"
    assert not sb.sandbox.running
    sb.stop()  # idempotent


def test_sync_facade_of_an_async_sandbox(proj, tmp_path):
    with make(proj, tmp_path).sync() as sb:
        assert sb.run("cat /workspace/src/a.txt").stdout == "alpha\n"


# ---------------------------------------------------------------------------- the Guest protocol


@pytest.mark.parametrize("cls", [ScriptedGuest, VmGuest])
def test_guests_implement_the_guest_protocol(cls):
    assert guest_protocol.missing_members(cls) == []


def test_guest_protocol_names_every_member():
    class Nothing:
        pass

    assert set(guest_protocol.missing_members(Nothing)) >= {
        "boot", "exec", "cancel", "rollback_notify", "pause", "resume", "vm_status", "alive", "tail", "stop",
        "mount", "unmount"}




# ---------------------------------------------------------------------------- units: VFS adapter, table changes


def test_vfs_hostfs_reads_and_refuses_as_documented():
    from sandbox.mounts.vfs import VFS_FILE_BYTES_MAX, VfsHostFS

    cat = Catalog()
    ro = VfsHostFS(cat)
    assert ro.listdir("") == ["count.txt", "readme.txt"]
    assert ro.getattr("readme.txt").mode == 0o444 and ro.getattr("").kind == "dir"
    with ro.open("readme.txt", os.O_RDONLY) as h:
        assert h.pread(4, 5) == b"the " and h.pread(10, 1000) == b""
    for call, code in [(lambda: ro.open("readme.txt", os.O_WRONLY), errno.EROFS),
                       (lambda: ro.create("x", 0o644), errno.EROFS),
                       (lambda: ro.unlink("readme.txt"), errno.EROFS),
                       (lambda: ro.lstat("missing"), errno.ENOENT),
                       (lambda: ro.open("", os.O_RDONLY), errno.EISDIR),
                       (lambda: ro.open("readme.txt", os.O_RDONLY | os.O_CREAT), errno.EINVAL),
                       (lambda: ro.listdir("readme.txt"), errno.ENOTDIR)]:
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno == code
    rw = VfsHostFS(cat, writable=True)
    with rw.create_handle("n", 0o644, os.O_RDWR) as h:
        h.pwrite(b"abc", 0)
        h.pwrite(b"Z", 5)
    assert cat.written["n"] == b"abc\0\0Z"
    rw.truncate("n", 2)
    assert cat.written["n"] == b"ab"
    with pytest.raises(OSError) as e:
        rw.mkdir("d", 0o755)
    assert e.value.errno == errno.EPERM

    class Huge(Catalog):
        def read(self, path):
            return b"x" * (VFS_FILE_BYTES_MAX + 1)

    with pytest.raises(OSError) as e:
        VfsHostFS(Huge()).open("readme.txt", os.O_RDONLY)
    assert e.value.errno == errno.EFBIG

    class BadNames(Catalog):
        def list(self, path):
            return ["ok", "a/b"]

    with pytest.raises(OSError) as e:
        VfsHostFS(BadNames()).listdir("")
    assert e.value.errno == errno.EIO


def test_mount_table_with_mount_and_without_return_new_tables():
    from sandbox.mounts.table import Mount, MountTable

    t = MountTable([Mount("/w", "0", False, "", "/host", "folder")])
    t2 = t.with_mount(Mount("/mnt/x/", "l0", True, "", None, "memory"))
    assert [m.target for m in t.mounts] == ["/w"] and [m.target for m in t2.mounts] == ["/w", "/mnt/x"]
    assert t2.resolve("/mnt/x/f")[1] == "f"
    with pytest.raises(MountError, match="share the target"):
        t2.with_mount(Mount("/mnt/x", "l1", True, "", None, "memory"))
    assert t2.without("/mnt/x/") == t
    with pytest.raises(MountError, match="no mount at"):
        t.without("/mnt/x")


# ---------------------------------------------------------------------------- files (seed 002)


async def test_files_handle_is_one_api_step_and_undoes(proj, tmp_path):
    async with make(proj, tmp_path) as sb:
        async with await sb.files.open("/workspace/notes.txt", "w") as f:
            assert await f.write(b"one\n") == 4
            assert await f.write(b"two\n") == 4
            assert (await f.stat())["size"] == 8
        assert (proj / "notes.txt").read_bytes() == b"one\ntwo\n"
        assert (await sb.run("cat /workspace/notes.txt")).stdout == "one\ntwo\n"  # the guest sees it
        api = [h for h in await sb.history() if h["type"] == "api"]
        assert len(api) == 1, await sb.history()
        newest = [h["id"] for h in await sb.history()]
        await sb.undo(newest.index(api[0]["id"]) + 1)
        assert not (proj / "notes.txt").exists()


async def test_files_one_shots_list_read_and_in_memory_mounts(proj, tmp_path):
    async with make(proj, tmp_path, mounts={"/mnt/tools": {"hello.sh": b"echo hi\n"}}) as sb:
        await sb.files.write_file("/workspace/src/b.txt", b"beta")
        assert await sb.files.read_file("/workspace/src/b.txt") == b"beta"
        assert await sb.files.read_file("src/a.txt", 2, 3) == b"pha"  # relative: the first volume
        names = [e["name"] for e in (await sb.files.list("/workspace/src"))["entries"]]
        assert names == ["a.txt", "b.txt"]
        assert [e["name"] for e in (await sb.files.list("/mnt"))["entries"]] == ["tools"]
        assert await sb.files.read_file("/mnt/tools/hello.sh") == b"echo hi\n"
        await sb.mount("/mnt/live", {"x": b"live"})
        assert await sb.files.read_file("/mnt/live/x") == b"live"  # a live mount is reachable at once
        await sb.files.rename("/workspace/src/b.txt", "/workspace/src/c.txt")
        assert await sb.files.remove("/workspace/src/c.txt") == 1
        async with await sb.files.create_temp() as t:
            await t.write(b"scratch")
            await t.seek(0)
            assert await t.read() == b"scratch"
        assert sorted(p.name for p in (proj / "src").iterdir()) == ["a.txt"]  # the temp file went nowhere
        c = sb.files.counters()
        assert c["opens"] >= 1 and c["bytes_in"] >= len(b"beta")


async def test_files_bad_input_is_a_stable_error(proj, tmp_path):
    from sandbox.api.errors import ApiError

    async with make(proj, tmp_path, volumes=[(str(proj), "/workspace"), (str(tmp_path), "/ro", "ro")]) as sb:
        f = await sb.files.open("/workspace/src/a.txt")
        await f.close()
        cases = [(f.read(1), "fs.invalid_handle"),
                 (sb.files.open("/etc/passwd"), "fs.outside_mounts"),
                 (sb.files.open("/workspace/src/a.txt", "q"), "fs.invalid_argument"),
                 (sb.files.write_file("/ro/x", b"x"), "fs.access_denied"),
                 (sb.files.read_file("/workspace/missing"), "fs.not_found")]
        for coro, code in cases:
            with pytest.raises(ApiError) as e:
                await coro
            assert e.value.code == code, (code, e.value.code, e.value.message)
    with pytest.raises(sandbox.SessionError):
        sb.files  # noqa: B018 — after stop there is no file service


def test_sync_facade_files(proj, tmp_path):
    with make(proj, tmp_path).sync() as sb:
        with sb.files.open("/workspace/src/a.txt", "a") as f:
            f.write(b"more\n")
        assert sb.files.read_file("/workspace/src/a.txt") == b"alpha\nmore\n"
        assert sb.run("cat /workspace/src/a.txt").stdout == "alpha\nmore\n"

async def test_restrict_narrows_the_guest_and_files(proj, tmp_path):
    from sandbox.api.errors import ApiError
    from sandbox.mounts.table import PathOutside, WidenDenied

    (proj / "other.txt").write_text("other\n")
    async with make(proj, tmp_path, restrict="/workspace/src") as sb:
        assert (await sb.run("cat /workspace/src/a.txt")).stdout == "alpha\n"
        r = await sb.run("cat /workspace/other.txt")
        assert r.exit_code != 0 and "Permission denied" in r.stderr  # outside the view: EACCES
        with pytest.raises(ApiError) as e:
            await sb.files.read_file("/workspace/other.txt")
        assert e.value.code == "fs.access_denied"
        assert await sb.restrict(read_only=True) == {"view": "/workspace/src", "read_only": True}
        r = await sb.run("write /workspace/src/a.txt changed")
        assert r.exit_code != 0 and (proj / "src" / "a.txt").read_text() == "alpha\n"  # EROFS
        with pytest.raises(ApiError):
            await sb.files.write_file("/workspace/src/a.txt", b"changed")
        with pytest.raises(WidenDenied):
            await sb.restrict("/workspace")  # it only narrows
    with pytest.raises(PathOutside):
        make(proj, tmp_path, restrict="/elsewhere")  # refused before anything starts



# ---------------------------------------------------------------------------- async tests without a plugin


def _in_a_loop(fn):
    import functools

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run


# last in the file: every async test above runs in its own loop
for _name, _fn in list(globals().items()):
    if _name.startswith("test_") and asyncio.iscoroutinefunction(_fn):
        globals()[_name] = _in_a_loop(_fn)
