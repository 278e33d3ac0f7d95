"""The guest's readahead on virtio-fs mounts (issue 17): Linux reads a virtio-fs file ahead
by its backing device's ``read_ahead_kb`` (128 KiB by default; INIT's ``max_readahead`` can
only lower it), so a sequential read came as 128 KiB READs. The guest sets it to one full
request on every virtio-fs mount — ``sandbox/guest/init.sh`` for the boot shares, the shim
for live mounts — finding the device by the mount's ``st_dev``. Here: the value, and that the
shell's and Python's device names agree with the kernel's ``major:minor`` (the e2e tests read
the real value in a guest)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import sandbox
from sandbox.fuse import abi
from sandbox.guest import control as proto

INIT_SH = Path(sandbox.__file__).parent / "guest" / "init.sh"
DEVICES = [(0, 27), (0, 255), (0, 256), (0, 4095), (0, (1 << 20) - 1), (8, 1), (259, 70_000), (4095, 300)]


def test_the_read_ahead_is_one_full_request():
    assert proto.VIRTIOFS_READ_AHEAD_KB * 1024 == abi.MAX_WRITE_BYTES


@pytest.mark.parametrize("major, minor", DEVICES)
def test_the_shim_names_the_mount_s_backing_device(major, minor):
    assert proto.bdi_read_ahead_path(os.makedev(major, minor)) == f"/sys/class/bdi/{major}:{minor}/read_ahead_kb"


def test_init_sh_names_the_same_device_and_reads_its_value_from_the_command_line():
    text = INIT_SH.read_text()
    fn = re.search(r"^bdi_name\(\) \{.*\}$", text, re.M)
    assert fn, "init.sh defines bdi_name() on one line"
    assert re.search(r"sandbox\.vfs_ra_kb=\*\) VFS_RA_KB=", text)
    sh = shutil.which("busybox")
    argv = [sh, "sh"] if sh else ["sh"]
    script = fn.group(0) + "\n" + "\n".join(f"bdi_name {os.makedev(a, b)}" for a, b in DEVICES)
    out = subprocess.run([*argv, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"{a}:{b}" for a, b in DEVICES]
