"""The host-usr guest root's skeleton (sandbox.vm.guestroot): what of the host's /etc reaches
the guest, built from a fake host root and from this machine's real one."""

from __future__ import annotations

import os

import pytest

from sandbox.vm import guestroot


def _write(path, data=b"x", mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


@pytest.fixture
def host(tmp_path):
    """A fake merged-usr host root with secrets beside the allowlisted files."""
    root = tmp_path / "host"
    etc = root / "etc"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "bash").write_bytes(b"")
    for name in ("bin", "sbin", "lib", "lib64"):
        os.symlink(f"usr/{name}", root / name)
    _write(str(etc / "shadow"), b"root:$6$secret:::\n", 0o640)
    _write(str(etc / "gshadow"), b"root:*::\n", 0o640)
    _write(str(etc / "passwd"), b"root:x:0:0::/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/bash\n")
    _write(str(etc / "ssh" / "ssh_host_ed25519_key"), b"PRIVATE", 0o600)
    _write(str(etc / "ssh" / "ssh_host_ed25519_key.pub"), b"PUBLIC")
    _write(str(etc / "ssl" / "private" / "server.key"), b"PRIVATE", 0o600)
    _write(str(etc / "ssl" / "certs" / "ca-certificates.crt"), b"CERTS")
    os.symlink("/usr/share/ca-certificates/a.crt", etc / "ssl" / "certs" / "a.pem")
    _write(str(etc / "ld.so.cache"), b"CACHE")
    _write(str(etc / "ld.so.conf.d" / "libc.conf"), b"/usr/local/lib\n")
    _write(str(etc / "ld.so.conf.d" / "private.conf"), b"/secret\n", 0o600)  # not world-readable
    os.makedirs(etc / "alternatives")
    os.symlink("/usr/bin/vim.basic", etc / "alternatives" / "editor")
    _write(str(etc / "pip.conf"), b"[global]\nindex-url = https://user:token@example.org/simple\n")
    _write(str(etc / "gitconfig"), b"[credential]\nhelper = store\n")
    _write(str(etc / "python3.11" / "sitecustomize.py"), b"")
    _write(str(etc / "nsswitch.conf"), b"passwd: files\n")
    os.symlink("../usr/lib/os-release", etc / "os-release")
    return root


def _files(d):
    out = {}
    for dirpath, dirs, files in os.walk(d):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, d)] = p
    return out


def test_the_skeleton_holds_the_allowlist_and_no_secret(host, tmp_path):
    dest = tmp_path / "skel"
    guestroot.build_skeleton(str(dest), uid=1234, gid=2345, host_root=str(host))
    got = _files(dest / "etc")
    for secret in ("shadow", "gshadow", "ssh", "ssl/private", "pip.conf", "gitconfig", "ld.so.conf.d/private.conf"):
        assert secret not in got, secret
    assert (dest / "etc" / "ld.so.cache").read_bytes() == b"CACHE"
    assert (dest / "etc" / "ssl" / "certs" / "ca-certificates.crt").read_bytes() == b"CERTS"
    assert os.readlink(dest / "etc" / "ssl" / "certs" / "a.pem") == "/usr/share/ca-certificates/a.crt"
    assert os.readlink(dest / "etc" / "alternatives" / "editor") == "/usr/bin/vim.basic"
    assert os.readlink(dest / "etc" / "os-release") == "../usr/lib/os-release"
    assert "python3.11/sitecustomize.py" in got and "ld.so.conf.d/libc.conf" in got
    # the host's users never reach the guest: a generated passwd with root, agent and nobody
    passwd = (dest / "etc" / "passwd").read_text()
    assert "alice" not in passwd
    assert "agent:x:1234:2345:sandbox agent:/home/agent:/bin/bash" in passwd.splitlines()
    assert passwd.startswith("root:x:0:0:")
    assert "agent:x:2345:" in (dest / "etc" / "group").read_text().splitlines()


def test_the_skeleton_mirrors_merged_usr_and_has_empty_dirs(host, tmp_path):
    dest = tmp_path / "skel"
    guestroot.build_skeleton(str(dest), uid=1000, gid=1000, host_root=str(host))
    assert {n: os.readlink(dest / n) for n in ("bin", "sbin", "lib", "lib64")} == {
        "bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
    for d in ("home", "root", "tmp", "var/tmp", "usr", "proc"):
        assert (dest / d).is_dir() and not os.listdir(dest / d), d
    assert os.stat(dest / "tmp").st_mode & 0o7777 == 0o1777
    assert os.stat(dest / "root").st_mode & 0o7777 == 0o700


def test_a_host_without_merged_usr_is_refused(host, tmp_path):
    os.unlink(host / "sbin")
    (host / "sbin").mkdir()
    with pytest.raises(guestroot.GuestRootError, match="merged-usr"):
        guestroot.build_skeleton(str(tmp_path / "skel"), uid=1000, gid=1000, host_root=str(host))


def test_an_etc_over_its_bound_is_an_error(host, tmp_path, monkeypatch):
    monkeypatch.setattr(guestroot, "ETC_BYTES_MAX", 4)
    with pytest.raises(guestroot.GuestRootError, match="larger than 4 bytes"):
        guestroot.build_skeleton(str(tmp_path / "skel"), uid=1000, gid=1000, host_root=str(host))


def test_user_ids_are_the_folder_owner_or_1000_for_root(tmp_path, monkeypatch):
    st = os.stat(tmp_path)
    expected = (1000, 1000) if st.st_uid == 0 else (st.st_uid, st.st_gid)
    assert guestroot.user_ids(str(tmp_path)) == expected


def test_this_hosts_skeleton_has_no_secret(tmp_path):
    """On this machine's real /etc: nothing never-shipped, nothing unreadable to others."""
    if not os.path.islink("/bin"):
        pytest.skip("this host is not merged-usr")
    dest = tmp_path / "skel"
    guestroot.build_skeleton(str(dest), uid=1000, gid=1000)
    got = _files(dest / "etc")
    assert "ld.so.cache" in got and "nsswitch.conf" in got
    for rel, path in got.items():
        assert not any(part in ("shadow", "gshadow", "ssh", "private", "sudoers") for part in rel.split("/")), rel
        if os.path.isfile(path) and not os.path.islink(path) and rel not in guestroot.generated_etc(1000, 1000):
            assert os.stat(os.path.join("/etc", rel)).st_mode & 0o004, rel


@pytest.mark.parametrize("kind", ["debian", "host", ""])
def test_a_session_refuses_a_guest_root_kind_it_cannot_make(tmp_path, kind):
    from sandbox.session.runtime import Folder, Session

    with pytest.raises(ValueError, match="guest_root must be one of host-usr"):
        Session([Folder(str(tmp_path))], guest_root=kind)


def test_the_sdk_passes_the_guest_root_kind(tmp_path):
    from sandbox import Sandbox

    assert Sandbox(volumes=[(str(tmp_path), "/w")], guest_root="host-usr")._session.guest_root == "host-usr"
    sb = Sandbox(volumes=[(str(tmp_path), "/w")], guest_root="image", guest_packages=["git"])
    assert (sb._session.guest_root, sb._session.guest_packages) == ("image", ["git", "python3"])
    with pytest.raises(ValueError, match="guest_root must be one of"):
        Sandbox(volumes=[(str(tmp_path), "/w")], guest_root="debian")
