"""The image guest root (sandbox.vm.imageroot): the package list, the cache key, the apt
sources it is built from, the mmdebstrap command, the atomic cache (with a stand-in
mmdebstrap on PATH: the real one downloads; e2e/test_guest_image.py runs it), the
skeleton made from an image's /etc, and the options through Session and the CLI."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from sandbox.session.runtime import Folder, Session
from sandbox.vm import guestroot, imageroot

HOST_SOURCES = """Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def test_the_package_list_is_sorted_unique_and_always_has_python3():
    assert imageroot.validate_packages(["git", "make", "git"]) == ("git", "make", "python3")
    assert "python3" in imageroot.validate_packages(None)
    assert imageroot.validate_packages(None) == tuple(sorted(imageroot.DEFAULT_PACKAGES))
    assert imageroot.validate_packages(["g++", "libstdc++6", "python3.11-venv"])[0] == "g++"


@pytest.mark.parametrize("bad", [["Git"], ["a"], ["git;rm -rf /"], ["../x"], ["git:amd64"], ["-git"], [""], [3],
                                 "git,make", ["x" * 129], [f"p{i:03d}" for i in range(257)]])
def test_the_package_list_refuses_what_is_not_a_bounded_list_of_debian_names(bad):
    with pytest.raises(ValueError):
        imageroot.validate_packages(bad)


def test_parse_packages():
    assert imageroot.parse_packages("git, python3,,build-essential ") == ["git", "python3", "build-essential"]
    assert imageroot.parse_packages("") == []


def test_the_cache_key_ignores_order_and_repeats_and_changes_with_packages_suite_arch():
    k = imageroot.cache_key(["git", "python3"], "bookworm", "amd64")
    assert k == imageroot.cache_key(["python3", "git", "git"], "bookworm", "amd64")
    assert k == imageroot.cache_key(["git"], "bookworm", "amd64")  # python3 is implied
    assert len({k, imageroot.cache_key(["git", "make"], "bookworm", "amd64"),
                imageroot.cache_key(["git"], "trixie", "amd64"),
                imageroot.cache_key(["git"], "bookworm", "arm64")}) == 4
    assert all(c in "0123456789abcdef" for c in k) and len(k) == 32


def test_the_sources_are_regenerated_from_the_hosts_deb_stanzas(tmp_path):
    entries = imageroot.parse_sources(HOST_SOURCES)
    assert [e["suites"] for e in entries] == [["bookworm", "bookworm-updates"], ["bookworm-security"]]
    text = imageroot.sources_text(entries)
    assert "#" not in text and "deb-src" not in text
    assert imageroot.parse_sources(text) == entries
    f = tmp_path / "creds.sources"
    f.write_text("Types: deb\nURIs: https://user:token@apt.example.org/debian\nSuites: bookworm\nComponents: main\n")
    with pytest.raises(imageroot.ImageRootError, match="credentials"):
        imageroot.host_sources(str(f))
    (tmp_path / "none.sources").write_text("Types: deb-src\nURIs: http://x/\nSuites: bookworm\n")
    with pytest.raises(imageroot.ImageRootError, match="no enabled"):
        imageroot.host_sources(str(tmp_path / "none.sources"))


def test_the_mmdebstrap_command_line():
    cmd = imageroot.mmdebstrap_command("/c/.build-x/root", ("git", "python3"), "bookworm", "amd64", "/c/s.sources")
    assert cmd[0] == "mmdebstrap" and cmd[-3:] == ["bookworm", "/c/.build-x/root", "/c/s.sources"]
    assert "--variant=apt" in cmd and "--architectures=amd64" in cmd and "--include=git,python3" in cmd
    hook = next(a for a in cmd if a.startswith("--customize-hook="))
    assert '"$1/etc/resolv.conf"' in hook and '"$1/etc/hostname"' in hook  # host files mmdebstrap copies in


FAKE_MMDEBSTRAP = """#!{python}
import os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(" ".join(args) + "\\n")
target = args[-2]
print("I: downloading packages with apt...", flush=True)
if os.environ.get("FAKE_FAIL"):
    os.makedirs(target + "/usr")
    print("E: apt-get download failed: 404  Not Found", flush=True)
    sys.exit(1)
for d in ("usr/bin", "etc/apt/sources.list.d"):
    os.makedirs(os.path.join(target, d))
os.symlink("usr/bin", target + "/bin")
os.symlink("usr/lib", target + "/lib")
os.symlink("usr/sbin", target + "/sbin")
open(target + "/usr/bin/bash", "w").close()
for name, data in (("hostname", "thehost"), ("resolv.conf", "nameserver 192.0.2.1"), ("os-release", "ID=debian")):
    with open(os.path.join(target, "etc", name), "w") as f:
        f.write(data)
with open(target + "/etc/apt/sources.list.d/0000debian.sources", "w") as f:
    f.write(open(args[-1]).read())
print("I: success in 1 seconds", flush=True)
"""


@pytest.fixture
def fake_mmdebstrap(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "mmdebstrap"
    exe.write_text(FAKE_MMDEBSTRAP.format(python=sys.executable))
    exe.chmod(0o755)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(log))
    src = tmp_path / "host.sources"
    src.write_text(HOST_SOURCES)
    return {"log": log, "sources": str(src), "cache": str(tmp_path / "roots")}


def test_a_root_is_built_once_into_the_cache_without_the_hosts_files(fake_mmdebstrap):
    said = []
    root = imageroot.ensure_root(["git"], progress=said.append, sources_path=fake_mmdebstrap["sources"],
                                 cache=fake_mmdebstrap["cache"], arch="amd64")
    assert os.path.basename(root) == imageroot.cache_key(["git"], "bookworm", "amd64")
    assert os.listdir(fake_mmdebstrap["cache"]) == [os.path.basename(root)]  # no build directory left
    assert not os.path.lexists(os.path.join(root, "etc/hostname"))
    assert not os.path.lexists(os.path.join(root, "etc/resolv.conf"))
    sources = open(os.path.join(root, "etc/apt/sources.list.d/0000debian.sources")).read()
    assert "snapshot.debian.org" not in sources and "bookworm-security" in sources  # generated, not copied
    assert any("downloading packages" in m for m in said) and any("built in" in m for m in said)
    assert imageroot.ensure_root(["python3", "git"], progress=said.append, sources_path=fake_mmdebstrap["sources"],
                                 cache=fake_mmdebstrap["cache"], arch="amd64") == root
    assert len(fake_mmdebstrap["log"].read_text().splitlines()) == 1  # the second call used the cache


def test_a_failed_build_leaves_no_cache_entry_and_says_why(fake_mmdebstrap, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    with pytest.raises(imageroot.ImageRootError, match="404  Not Found"):
        imageroot.ensure_root(["git"], progress=lambda m: None, sources_path=fake_mmdebstrap["sources"],
                              cache=fake_mmdebstrap["cache"], arch="amd64")
    assert os.listdir(fake_mmdebstrap["cache"]) == []


def test_the_skeleton_of_an_image_root_has_its_etc_and_generated_users(fake_mmdebstrap, tmp_path):
    root = imageroot.ensure_root(None, progress=lambda m: None, sources_path=fake_mmdebstrap["sources"],
                                 cache=fake_mmdebstrap["cache"], arch="amd64")
    etc = os.path.join(root, "etc")
    for name, data, mode in (("shadow", "root:*:19000::::::\n", 0o640), ("passwd", "debian-user:x:5:5::/:/bin/sh\n", 0o644),
                             ("ssh/ssh_host_rsa_key", "PRIVATE", 0o600), ("ld.so.cache", "CACHE", 0o644)):
        os.makedirs(os.path.dirname(os.path.join(etc, name)), exist_ok=True)
        with open(os.path.join(etc, name), "w") as f:
            f.write(data)
        os.chmod(os.path.join(etc, name), mode)
    entries = imageroot.etc_entries(root)
    assert "shadow" not in entries and "ssh" not in entries and "passwd" not in entries
    dest = tmp_path / "skel"
    guestroot.build_skeleton(str(dest), uid=1234, gid=1234, host_root=root, etc_entries=entries)
    assert (dest / "etc" / "ld.so.cache").read_text() == "CACHE"
    assert (dest / "etc" / "os-release").read_text() == "ID=debian"
    assert (dest / "etc" / "apt" / "sources.list.d" / "0000debian.sources").exists()
    assert not (dest / "etc" / "shadow").exists() and not (dest / "etc" / "ssh").exists()
    assert "debian-user" not in (dest / "etc" / "passwd").read_text()
    assert "agent:x:1234:1234:" in (dest / "etc" / "passwd").read_text()
    assert (dest / "etc" / "hostname").read_text() == "sandbox\n"
    assert os.readlink(dest / "bin") == "usr/bin"
    assert stat.S_IMODE(os.stat(dest / "root").st_mode) == 0o700


def test_session_takes_the_image_options_and_refuses_bad_ones(tmp_path):
    s = Session([Folder(str(tmp_path))], guest_root="image", guest_packages=["git", "make"], guest="scripted")
    assert s.guest_packages == ["git", "make", "python3"]
    assert Session([Folder(str(tmp_path))], guest_root="image", guest="scripted").guest_packages == \
        sorted(imageroot.DEFAULT_PACKAGES)
    assert Session([Folder(str(tmp_path))], guest="scripted").guest_packages is None
    with pytest.raises(ValueError, match="guest_root='image'"):
        Session([Folder(str(tmp_path))], guest_packages=["git"], guest="scripted")
    with pytest.raises(ValueError, match="not a Debian package name"):
        Session([Folder(str(tmp_path))], guest_root="image", guest_packages=["Git!"], guest="scripted")


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "sandbox", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_the_command_line_options(tmp_path):
    r = _cli("run", "--workdir", str(tmp_path), "--guest-packages", "git", "--", "true")
    assert r.returncode == 2 and "--guest-packages needs --guest-root image" in r.stderr
    r = _cli("run", "--workdir", str(tmp_path), "--guest-root", "image", "--guest-packages", "Git;x", "--", "true")
    assert r.returncode == 2 and "not a Debian package name" in r.stderr
    r = _cli("run", "--workdir", str(tmp_path), "--guest-root", "debian", "--", "true")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = _cli("guest", "build", "--guest-root", "image", "--guest-packages", "a")
    assert r.returncode == 2 and "not a Debian package name" in r.stderr
    for cmd in ("run", "shell", "demo", "guest"):
        h = _cli(cmd, "--help").stdout
        assert "--guest-root" in h and "--guest-packages" in h, cmd
