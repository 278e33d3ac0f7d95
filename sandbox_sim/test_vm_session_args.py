"""Session and `sandbox run` argument handling (no VM is booted here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sandbox.session.runtime import Folder, Session, _allow_items, guest_owner_map
from sandbox.vm.guestroot import user_ids as guest_user_ids


def test_folder_spec():
    assert Folder.parse("/a/b") == Folder("/a/b")
    assert Folder.parse("/a/b:ro") == Folder("/a/b", True)
    assert Folder.parse("/a/b:rw") == Folder("/a/b", False)
    assert Folder.parse("/a:b") == Folder("/a:b")  # a colon that is not a mode stays in the path


def test_allow_items_are_normalised_and_checked():
    assert _allow_items(["10.0.2.2", "192.168.0.0/16", " 1.2.3.4/24 ", "Example.org"]) == \
        ["10.0.2.2/32", "192.168.0.0/16", "1.2.3.0/24", "example.org"]
    for bad in (["nope"], ["::1"], ["300.1.1.1"], ["a b.org"]):
        with pytest.raises(ValueError):
            _allow_items(bad)


def test_session_validates_before_booting(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Session([Folder(str(tmp_path / "missing"))])
    with pytest.raises(ValueError, match="at least one IP"):
        Session([Folder(str(tmp_path))], network="allowlist", allow=[])
    with pytest.raises(ValueError, match="network must be"):
        Session([Folder(str(tmp_path))], network="wifi")
    with pytest.raises(ValueError, match="at most 8"):
        Session([Folder(str(tmp_path))] * 9)
    with pytest.raises(ValueError, match="vm_mode"):
        Session([Folder(str(tmp_path))], vm_mode="forever")


@pytest.mark.parametrize("args, words", [
    (["--network", "bogus"], "--network wants"),
    (["--network", "allowlist"], "--network wants"),
    (["--network", "allowlist:not-an-ip"], "not an IP address"),
    ([], "give the command after --"),
])
def test_run_bad_usage_exits_2(tmp_path, args, words):
    cmd = [sys.executable, "-m", "sandbox", "run", "--workdir", str(tmp_path), *args]
    if words != "give the command after --":
        cmd += ["--", "true"]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_run_missing_workdir_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "sandbox", "run", "--workdir", str(tmp_path / "nope"), "--", "true"],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr


# -- the guest user (issue 13)


def test_the_guest_user_is_the_folder_owner_or_1000_for_root(tmp_path):
    if os.geteuid() != 0:
        assert guest_user_ids(str(tmp_path)) == (os.geteuid(), os.getegid())
        pytest.skip("chown to another owner needs root")
    os.chown(tmp_path, 0, 0)
    assert guest_user_ids(str(tmp_path)) == (1000, 1000)
    os.chown(tmp_path, 4321, 4322)
    assert guest_user_ids(str(tmp_path)) == (4321, 4322)
    owners = guest_owner_map(str(tmp_path), as_root=False)
    assert (owners.uid(4321), owners.gid(4322), owners.uid(os.geteuid()), owners.uid(77)) == (4321, 4322, 4321, 77)
    assert guest_owner_map(str(tmp_path), as_root=True) is None


def test_as_root_is_checked_and_reported(tmp_path):
    with pytest.raises(ValueError, match="as_root"):
        Session([Folder(str(tmp_path))], as_root="yes")
    assert Session([Folder(str(tmp_path))]).status()["as_root"] is False
    assert Session([Folder(str(tmp_path))], as_root=True).status()["as_root"] is True


def test_as_root_is_a_flag_of_every_session_command():
    for cmd in ("run", "shell", "serve", "demo"):
        r = subprocess.run([sys.executable, "-m", "sandbox", cmd, "--help"], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=60)
        assert r.returncode == 0 and "--as-root" in r.stdout, (cmd, r.stderr)
