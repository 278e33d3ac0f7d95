"""The SDK against a real VM: ``sandbox.Sandbox(guest="vm")`` end to end.

One boot per test (about 10 s under TCG): volumes (one read-write, one read-only), an
in-memory mount on PYTHONPATH, real programs as steps, their output, events, exact undo
(the tree oracle, byte-exact) and a live mount the running guest sees. Skipped with the
reason where QEMU or the guest image cannot be had.
"""

from __future__ import annotations

import asyncio

import pytest

import sandbox
from sandbox.guest import control as proto
from sandbox_sim import oracle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module", autouse=True)
def guest_available(vm_guest):
    """Every test here boots a session VM (conftest.vm_guest skips with the reason otherwise)."""


@pytest.fixture
def folders(tmp_path):
    proj, data = tmp_path / "proj", tmp_path / "data"
    (proj / "build").mkdir(parents=True)
    (proj / "build" / "out.o").write_bytes(b"\x7fELF" + bytes(range(256)))
    (proj / "notes.txt").write_text("keep me\n")
    data.mkdir()
    (data / "input.csv").write_text("a,b\n1,2\n")
    return proj, data


def test_sdk_session_in_a_vm(folders, tmp_path):
    proj, data = folders
    before = oracle.snapshot_dir(str(proj))

    async def main():
        chunks = []
        async with sandbox.Sandbox(volumes=[sandbox.Volume(str(proj), "/workspace", state_dir=str(tmp_path / "s")),
                                            (str(data), "/data", "ro")],
                                   mounts={"/mnt/tools": {"tool.py": b"def hi():\n    return 'hi from tool'\n"}},
                                   python_path=["/mnt/tools"], network="disabled", guest="vm",
                                   external_modification_policy=None) as sb:
            r = await sb.run("rm -rf build && python3 -c 'import tool; print(tool.hi())' && cat /data/input.csv "
                             "&& echo made > made.txt", on_output=chunks.append)
            assert r.exit_code == 0, r.stderr
            assert r.stdout == "hi from tool\na,b\n1,2\n" and "".join(chunks) == r.stdout
            assert not (proj / "build").exists() and (proj / "made.txt").read_text() == "made\n"
            r = await sb.run("echo x > /data/input.csv")
            assert r.exit_code != 0 and (data / "input.csv").read_text() == "a,b\n1,2\n"
            events = [e async for e in sb.events(wait=False)]
            assert any(e["type"] == "step_completed" for e in events)
            steps = [h["id"] for h in await sb.history()]
            await sb.undo(len(steps))
            oracle.assert_same(before, oracle.snapshot_dir(str(proj)))
            r = await sb.run("ls build")  # the guest sees the restored tree at once
            assert r.stdout == "out.o\n"

            for _round in range(2):  # over virtio-fs (the default here) a hot-plugged device, unplugged again
                await sb.mount("/mnt/up", {"upload.txt": b"uploaded\n"})
                r = await sb.run("cat /mnt/up/upload.txt; ls /mnt; grep ' /mnt/up ' /proc/mounts")
                assert r.stdout.startswith("uploaded\n") and "up" in r.stdout.split()
                fstype = r.stdout.splitlines()[-1].split()[2]
                assert fstype == ("virtiofs" if sb._session.share == "virtiofs" else "9p"), r.stdout
                if fstype == "virtiofs":  # the shim sets a live mount's readahead as init.sh does at boot
                    r = await sb.run("cat /sys/class/bdi/$(mountpoint -d /mnt/up)/read_ahead_kb")
                    assert r.stdout.split() == [str(proto.VIRTIOFS_READ_AHEAD_KB)], (r.stdout, r.stderr)
                await sb.unmount("/mnt/up")
                assert (await sb.run("cat /mnt/up/upload.txt")).exit_code != 0

    asyncio.run(main())
