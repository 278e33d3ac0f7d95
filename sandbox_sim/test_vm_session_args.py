"""Session and `sandbox run` argument handling (no VM is booted here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sandbox.session.runtime import Folder, Session, _allow_items


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
