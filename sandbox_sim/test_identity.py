"""The guest's root is not the host's root (SPEC §5 "Identity", docs/identity.md).

Over the 9P wire against a real temporary folder (as root in CI): set-uid/set-gid bits
from the guest are kept by the server and reported back, never applied to host files;
``security.*`` (file capabilities, SELinux labels), ``trusted.*`` and POSIX ACL xattrs
land in ``user.sandbox.x.*``, which the host kernel does not honour; the server's
reserved ``user.sandbox.*`` names are invisible to the guest; undo restores the tree —
real modes and mappings alike — exactly. Then the pure mapping rules of
:mod:`sandbox.mounts.identity`, for every mode and many names.
"""

from __future__ import annotations

import errno
import os
import stat
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sandbox.core.workspace import Workspace
from sandbox.hostfs import LNK
from sandbox.hostfs.memory import MemoryHostFS
from sandbox.mounts import Provider, identity, memory_tree
from sandbox.ninep import messages as m
from sandbox.ninep.client import Client
from sandbox.barriers.journal import RecordingHostFS
from sandbox_sim import oracle
from sandbox_sim.test_watch import Reports, detect
from sandbox.ninep.wirefs import WireFS, serve

pytestmark = pytest.mark.timeout(60)

#: cap_setuid+ep as ``setcap`` writes it: VFS_CAP_REVISION_2 | effective, permitted = 1 << CAP_SETUID
CAP_SETUID_EP = struct.pack("<IIIII", 0x0200_0001, 1 << 7, 0, 0, 0)
#: a POSIX ACL granting uid 1000 rwx: user::rwx, user:1000:rwx, group::r-x, mask::rwx, other::r-x
ACL_USER_1000 = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", tag, perm, ident) for tag, perm, ident in (
    (0x01, 7, 0xFFFFFFFF), (0x02, 7, 1000), (0x04, 5, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF), (0x20, 5, 0xFFFFFFFF)))
PRIVILEGED = {
    "security.capability": CAP_SETUID_EP,
    "trusted.x": b"trusted value",
    "security.selinux": b"system_u:object_r:shell_exec_t:s0\0",
    "system.posix_acl_access": ACL_USER_1000,
}


@pytest.fixture
def work(tmp_path):
    w = tmp_path / "work"
    w.mkdir()
    (w / "tool").write_bytes(b"#!/bin/sh\nid\n")
    os.chmod(w / "tool", 0o755)
    (w / "dir").mkdir()
    os.symlink("tool", w / "link")
    return w


@pytest.fixture
def fs(ws):
    with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
        yield WireFS(c)


def errno_of(fn, *args, **kwargs) -> int:
    with pytest.raises(OSError) as info:
        fn(*args, **kwargs)
    return info.value.errno


def host_mode(p) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def host_has_no_privileged_xattrs(p) -> None:
    names = os.listxattr(p, follow_symlinks=False)
    assert not [n for n in names if not n.startswith("user.")], names
    with pytest.raises(OSError) as info:
        os.getxattr(p, "security.capability", follow_symlinks=False)
    assert info.value.errno == errno.ENODATA  # no real file capability


def undo_all(ws) -> None:
    ws.close_active()
    ws.rollback(len(ws.history()))


# --------------------------------------------------------------------------- modes over the wire


@pytest.mark.parametrize("mode", [0o4755, 0o2755, 0o6755], ids=oct)
def test_guest_chmod_setid_is_reported_but_never_applied(fs, ws, work, mode):
    before = oracle.snapshot(ws.fs.host)
    assert os.lstat(work / "tool").st_uid == os.getuid()  # root-owned when CI runs as root
    fs.chmod("tool", mode)
    assert host_mode(work / "tool") == 0o755  # no S_ISUID / S_ISGID on the host
    assert fs.lstat("tool").mode == mode  # the guest's Tgetattr reports what it set
    fs.chmod("tool", 0o750)  # a chmod without set-id bits drops the kept mode
    assert host_mode(work / "tool") == 0o750 and fs.lstat("tool").mode == 0o750
    assert not [n for n in os.listxattr(work / "tool") if n.startswith(identity.RESERVED_PREFIX)]
    fs.chmod("dir", 0o2775)
    assert host_mode(work / "dir") == 0o775 and fs.lstat("dir").mode == 0o2775
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of guest set-id chmods")


def test_guest_create_and_mkdir_with_setid_modes(fs, ws, work):
    before = oracle.snapshot(ws.fs.host)
    c = fs.c
    dfid = c.walk_path("dir")
    c.lcreate(dfid, "suid", m.DOTL_WRONLY | m.DOTL_CREATE | m.DOTL_EXCL, 0o4755)
    assert stat.S_IMODE(c.getattr(dfid).mode) == 0o4755  # Tgetattr on the open fid of the new file
    c.clunk(dfid)
    fs.mkdir("dir/shared", 0o2775)
    assert host_mode(work / "dir" / "suid") == 0o755
    assert host_mode(work / "dir" / "shared") == 0o775
    assert fs.lstat("dir/suid").mode == 0o4755 and fs.lstat("dir/shared").mode == 0o2775
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of set-id creations")


def test_a_setid_bit_the_host_gave_stays_while_the_guest_keeps_it(fs, work):
    os.chmod(work / "tool", 0o4755)  # the host user's own set-uid file
    fs.chmod("tool", 0o4750)
    assert host_mode(work / "tool") == 0o4750 and fs.lstat("tool").mode == 0o4750
    fs.chmod("tool", 0o6750)  # S_ISGID is new: kept, not applied
    assert host_mode(work / "tool") == 0o4750 and fs.lstat("tool").mode == 0o6750
    fs.chmod("tool", 0o755)  # dropping one is always applied
    assert host_mode(work / "tool") == 0o755 and fs.lstat("tool").mode == 0o755


@pytest.mark.parametrize("mode", [0o4755, 0o2755, 0o6711], ids=oct)
def test_a_guest_write_disarms_a_host_setid_file(fs, ws, work, mode):
    """The host kernel clears set-id bits on a write only for a writer without CAP_FSETID —
    and the server, as root, has it. The guest's root is not the host's root: a file the
    guest can write has no set-id bit on the host (the guest still sees it, as root would)."""
    os.chmod(work / "tool", mode)  # the host user's own set-uid/set-gid program
    before = oracle.snapshot(ws.fs.host)
    assert fs.read_file("tool") == b"#!/bin/sh\nid\n"  # reading changes nothing
    assert host_mode(work / "tool") == mode
    fid = fs._walk("tool")
    fs.c.lopen(fid, m.DOTL_RDWR)
    assert host_mode(work / "tool") == mode & ~0o6000  # before the guest could write a byte
    fs.c.write_all(fid, 0, b"#!/bin/sh\nexec /bin/sh\n")
    assert stat.S_IMODE(fs.c.getattr(fid).mode) == mode  # the guest's view is a root's view
    fs.c.clunk(fid)
    assert host_mode(work / "tool") == mode & ~0o6000 and fs.lstat("tool").mode == mode
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of a write into a set-id file")


def test_setgid_without_group_exec_grants_nothing_and_stays(fs, work):
    os.chmod(work / "tool", 0o2644)
    fs.write("tool", 0, b"x")
    assert host_mode(work / "tool") == 0o2644 and fs.lstat("tool").mode == 0o2644


def test_opening_an_existing_setid_file_through_create_disarms_it(fs, work):
    os.chmod(work / "tool", 0o4755)
    fs.write_file("tool", b"replaced")  # walk finds it: lopen(O_TRUNC)
    assert host_mode(work / "tool") == 0o755 and fs.lstat("tool").mode == 0o4755
    os.chmod(work / "tool", 0o4755)
    dfid = fs._walk("")
    fs.c.lcreate(dfid, "tool", m.DOTL_WRONLY | m.DOTL_CREATE, 0o644)  # open(O_CREAT) of an existing file
    assert host_mode(work / "tool") == 0o755
    fs.c.clunk(dfid)


def test_opening_an_existing_setid_file_read_only_through_create_leaves_it(fs, work):
    """Only a handle that can write disarms: open(O_CREAT|O_RDONLY) of an existing set-uid
    program (no write can follow) leaves the host's bit alone."""
    os.chmod(work / "tool", 0o4755)
    dfid = fs._walk("")
    fs.c.lcreate(dfid, "tool", m.DOTL_RDONLY | m.DOTL_CREATE, 0o644)
    assert host_mode(work / "tool") == 0o4755
    fs.c.clunk(dfid)


def test_a_host_chmod_since_wins_over_the_kept_mode(fs, work):
    fs.chmod("tool", 0o4755)
    os.chmod(work / "tool", 0o700)  # the host user changes it
    assert fs.lstat("tool").mode == 0o700


def test_guest_cannot_forge_the_kept_mode(fs, work):
    fs.setxattr("tool", identity.MODE_XATTR, b"4755")  # stored as the guest's own xattr
    assert fs.lstat("tool").mode == 0o755
    assert identity.MODE_XATTR not in os.listxattr(work / "tool")
    assert fs.xattrs("tool") == {identity.MODE_XATTR: b"4755"}  # it reads back what it set
    fs.chmod("tool", 0o4755)
    assert fs.xattrs("tool") == {identity.MODE_XATTR: b"4755"}  # the real one stays invisible
    fs.removexattr("tool", identity.MODE_XATTR)  # removes the guest's, not the server's
    assert fs.lstat("tool").mode == 0o4755 and fs.xattrs("tool") == {}
    os.setxattr(work / "tool", identity.MODE_XATTR, b"garbage!")  # damaged on the host: ignored
    assert fs.lstat("tool").mode == 0o755


# --------------------------------------------------------------------------- xattrs over the wire


def test_privileged_xattrs_are_kept_in_user_namespace(fs, ws, work):
    before = oracle.snapshot(ws.fs.host)
    for name, value in PRIVILEGED.items():
        fs.setxattr("tool", name, value)
    fs.setxattr("dir", "system.posix_acl_default", ACL_USER_1000)
    fs.setxattr("tool", "user.plain", b"as is")
    host_has_no_privileged_xattrs(work / "tool")
    host_has_no_privileged_xattrs(work / "dir")
    assert os.getxattr(work / "tool", "user.plain") == b"as is"
    assert os.getxattr(work / "tool", "user.sandbox.x.security.capability") == CAP_SETUID_EP
    assert fs.xattrs("tool") == {**PRIVILEGED, "user.plain": b"as is"}
    assert fs.xattrs("dir") == {"system.posix_acl_default": ACL_USER_1000}
    fs.removexattr("tool", "security.capability")
    assert "security.capability" not in fs.xattrs("tool")
    assert "user.sandbox.x.security.capability" not in os.listxattr(work / "tool")
    undo_all(ws)
    oracle.assert_same(before, oracle.snapshot(ws.fs.host), "undo of privileged xattrs")


def test_removing_an_absent_posix_acl_succeeds_as_the_kernel_does(fs, work):
    """``cp -a`` (libacl) removes ``system.posix_acl_*`` from a file that has none; the
    kernel answers 0 there (a removal is setting no ACL), so the mapped name must too —
    other absent names stay ENODATA."""
    def remove(path, name):  # as Linux v9fs sends it: a size-0 xattr write with XATTR_REPLACE, no listing first
        with fs._fid(path) as fid:
            fs.c.setxattr(fid, name, b"", m.XATTR_REPLACE)

    for name in ("system.posix_acl_access", "system.posix_acl_default"):
        remove("dir", name)
    remove("tool", "system.posix_acl_access")
    assert errno_of(remove, "tool", "security.capability") == errno.ENODATA
    assert errno_of(remove, "tool", "user.absent") == errno.ENODATA
    host_has_no_privileged_xattrs(work / "tool")


def test_xattr_create_and_replace_flags_apply_to_the_guest_name(fs):
    fid = fs._walk("tool")
    fs.c.setxattr(fid, "trusted.once", b"1", m.XATTR_CREATE)
    assert errno_of(fs.c.setxattr, fid, "trusted.once", b"2", m.XATTR_CREATE) == errno.EEXIST
    assert errno_of(fs.c.setxattr, fid, "trusted.never", b"2", m.XATTR_REPLACE) == errno.ENODATA
    fs.c.setxattr(fid, "trusted.once", b"3", m.XATTR_REPLACE)
    assert fs.c.getxattr(fid, "trusted.once") == b"3"


@pytest.mark.skipif(os.geteuid() != 0, reason="setting trusted.* on the host needs CAP_SYS_ADMIN")
def test_host_privileged_xattrs_are_neither_shown_nor_changed(fs, work):
    os.setxattr(work / "tool", "trusted.host", b"host only")
    assert "trusted.host" not in fs.xattrs("tool")
    assert errno_of(fs.c.getxattr, fs._walk("tool"), "trusted.host") == errno.ENODATA
    fs.setxattr("tool", "trusted.host", b"guest")  # the guest's own, beside the host's
    assert os.getxattr(work / "tool", "trusted.host") == b"host only"
    assert fs.xattrs("tool") == {"trusted.host": b"guest"}


def test_privileged_xattrs_on_a_symlink_are_refused(fs, work):
    assert errno_of(fs.setxattr, "link", "security.selinux", b"x\0") == errno.EPERM
    assert os.listxattr(work / "link", follow_symlinks=False) == []


@pytest.mark.parametrize("kind", ["symlink", "fifo", "socket", "chardev"])
def test_user_xattr_writes_on_anything_but_files_and_dirs_are_eperm(fs, work, kind):
    """The kernel's ``xattr_permission``: ``user.*`` on anything but a regular file or a
    directory — set, or remove, present or not — is ``EPERM`` (a read: ``ENODATA``); an
    emulated device (a regular placeholder on the host) answers as the device would."""
    make = {"symlink": lambda: fs.symlink("tool", "n"), "fifo": lambda: fs.mknod("n", 0o644, stat.S_IFIFO),
            "socket": lambda: fs.mknod("n", 0o644, stat.S_IFSOCK),
            "chardev": lambda: fs.mknod("n", 0o644, stat.S_IFCHR, os.makedev(1, 3))}
    make[kind]()
    before = os.listxattr(work / "n", follow_symlinks=False)
    fid = fs._walk("n")
    for flags in (0, m.XATTR_REPLACE):  # size 0 with XATTR_REPLACE: how v9fs removes one
        assert errno_of(fs.c.setxattr, fid, "user.a", b"", flags) == errno.EPERM
    assert errno_of(fs.c.setxattr, fid, "user.a", b"v") == errno.EPERM
    assert errno_of(fs.c.getxattr, fid, "user.a") == errno.ENODATA
    assert fs.c.listxattr(fid) == []
    assert os.listxattr(work / "n", follow_symlinks=False) == before


def test_an_empty_value_is_set_and_a_removal_is_size_0_with_xattr_replace(fs, work):
    """Linux v9fs sends ``setxattr(name, "")`` as a size-0 Txattrcreate with the caller's flags
    (0 or XATTR_CREATE) and ``removexattr`` as size 0 with XATTR_REPLACE (the VFS's
    ``__vfs_removexattr``): the first sets an empty value, the second removes."""
    fid = fs._walk("tool")
    fs.c.setxattr(fid, "user.e", b"")
    assert os.getxattr(work / "tool", "user.e") == b""
    assert errno_of(fs.c.setxattr, fid, "user.e", b"", m.XATTR_CREATE) == errno.EEXIST
    fs.c.setxattr(fid, "user.f", b"", m.XATTR_CREATE)
    assert fs.xattrs("tool") == {"user.e": b"", "user.f": b""}
    fs.c.setxattr(fid, "user.e", b"", m.XATTR_REPLACE)  # = removexattr
    assert "user.e" not in os.listxattr(work / "tool")
    assert errno_of(fs.c.setxattr, fid, "user.e", b"", m.XATTR_REPLACE) == errno.ENODATA


def test_a_name_too_long_to_map_is_erange(fs):
    assert errno_of(fs.setxattr, "tool", "trusted." + "n" * 240, b"v") == errno.ERANGE


def test_the_mappings_are_own_writes_for_the_external_change_watcher(work, tmp_path):
    wrapped: list[RecordingHostFS] = []
    ws = Workspace.open(str(work), state_dir=str(tmp_path / "state"),
                        wrap_work=lambda fs: wrapped.append(RecordingHostFS(fs)) or wrapped[-1])
    stack: list = [ws.close]
    try:
        r = Reports()
        detect(str(work), wrapped[0].journal, r, stack)
        with serve(Provider.intercepted(ws)) as (_st, path), Client.connect_unix(path) as c:
            fs = WireFS(c)
            fs.chmod("tool", 0o4755)
            fs.setxattr("tool", "security.capability", CAP_SETUID_EP)
            fs.create("new", 0o4755)
            fs.mkdir("newdir", 0o2775)
            fs.chmod("tool", 0o755)
        undo_all(ws)
        sentinel = r.sentinel(str(work))
        assert r.paths() == {sentinel}
        assert r.warnings == []
    finally:
        for stop in reversed(stack):
            stop()


# --------------------------------------------------------------------------- other providers


def test_in_memory_provider_maps_too():
    prov = memory_tree({"bin/tool": b"x"}, writable=True)
    with serve(prov) as (_st, path), Client.connect_unix(path) as c:
        fs = WireFS(c)
        fs.chmod("bin/tool", 0o4755)
        fs.setxattr("bin/tool", "security.capability", CAP_SETUID_EP)
        assert fs.lstat("bin/tool").mode == 0o4755
        assert fs.xattrs("bin/tool") == {"security.capability": CAP_SETUID_EP}
    assert prov.host.lstat("bin/tool").mode == 0o755
    assert sorted(prov.host.listxattr("bin/tool")) == sorted([identity.MAPPED_PREFIX + "security.capability",
                                                               identity.MODE_XATTR])


def test_read_only_provider_reports_the_kept_mode(work):
    os.setxattr(work / "tool", identity.MODE_XATTR, b"4755")
    with serve(Provider.read_only_dir(str(work))) as (_st, path), Client.connect_unix(path) as c:
        fs = WireFS(c)
        assert fs.lstat("tool").mode == 0o4755
        assert fs.xattrs("tool") == {}
        assert errno_of(fs.chmod, "tool", 0o755) == errno.EROFS


def _no_user_xattrs(fs, op, path, nbytes):
    if op == "setxattr":
        raise OSError(errno.EOPNOTSUPP, "no user xattrs on this filesystem", path)


def test_where_the_host_cannot_keep_setid_bits_chmod_is_refused_and_create_drops_them():
    host = MemoryHostFS("nouser", fault_hook=_no_user_xattrs)
    host.create("f", 0o644)
    prov = Provider(host, None, read_only=False)
    assert errno_of(prov.setattr, "f", mode=0o4755) == errno.EPERM
    assert host.lstat("f").mode == 0o644  # nothing applied
    prov.setattr("f", mode=0o755)
    assert host.lstat("f").mode == 0o755
    prov.create("g", 0o4755, os.O_WRONLY | os.O_EXCL)[0].close()
    prov.mkdir("d", 0o2775)
    assert host.lstat("g").mode == 0o755 and prov.getattr("g").mode == 0o755
    assert host.lstat("d").mode == 0o775 and prov.getattr("d").mode == 0o775
    host.chmod("f", 0o4755)  # the host's own set-uid file: a guest write still clears it
    prov.open("f", os.O_WRONLY).close()
    assert host.lstat("f").mode == 0o755


def test_chmod_of_a_symlink_stays_eopnotsupp(fs):
    assert errno_of(fs.chmod, "link", 0o4755) == errno.EOPNOTSUPP
    assert fs.lstat("link").kind == LNK


# --------------------------------------------------------------------------- the mapping rules


modes = st.integers(0, 0o7777)


@given(modes, modes)
def test_host_mode_never_grants_a_new_setid_bit_and_the_guest_reads_its_mode_back(mode, current):
    h = identity.host_mode(mode, current)
    assert h & identity.SETID_BITS & ~current == 0
    assert h & ~identity.SETID_BITS == mode & ~identity.SETID_BITS
    assert identity.guest_mode(h, identity.mode_mapping(mode, current)) == mode


@given(modes)
def test_a_write_leaves_no_setid_bit_that_grants_anything(mode):
    left = mode & ~identity.privileges_on_write(mode)
    assert not left & stat.S_ISUID and not (left & stat.S_ISGID and left & stat.S_IXGRP)
    assert left | identity.SETID_BITS == mode | identity.SETID_BITS


@given(modes, modes, modes)
def test_a_stale_kept_mode_yields_to_the_host(mode, current, later):
    value = identity.mode_mapping(mode, current)
    h = identity.host_mode(mode, current)
    if later != h:  # the host user chmod-ed since
        assert identity.guest_mode(later, value) in (later, mode)
        if later & ~identity.SETID_BITS != mode & ~identity.SETID_BITS:
            assert identity.guest_mode(later, value) == later


@pytest.mark.parametrize("value", [None, b"", b"9", b"47555555555", b"17777", b"-1", b"0o4755", b"47\x0055"])
def test_a_damaged_kept_mode_is_ignored(value):
    assert identity.decode_mode(value) is None
    assert identity.guest_mode(0o755, value) == 0o755


names = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), min_size=1, max_size=60)


@given(st.one_of(names, *(names.map(lambda n, p=p: p + n) for p in
                          ("user.", "user.sandbox.", "user.sandbox.x.", "security.", "trusted.", "system."))))
def test_xattr_names_map_into_user_and_back(name):
    host = identity.host_xattr_name(name)
    assert host.startswith("user.")
    assert identity.guest_xattr_name(host) == name
    assert (host == name) == identity.is_passthrough(name)


@pytest.mark.parametrize("host_name", ["security.selinux", "trusted.a", "system.posix_acl_access", identity.MODE_XATTR,
                                       "user.sandbox.other", identity.MAPPED_PREFIX, identity.MAPPED_PREFIX + "user.a"])
def test_host_names_the_guest_never_sees(host_name):
    assert identity.guest_xattr_name(host_name) is None


# --------------------------------------------------------------------------- owners (issue 13)


def _owner_of(c: Client, path: str) -> tuple[int, int]:
    if c.root_fid is None:
        WireFS(c)  # version + attach
    fid = c.walk_path(path)
    try:
        r = c.getattr(fid)
        return r.uid, r.gid
    finally:
        c.clunk(fid)


def test_the_guest_user_sees_the_folder_owners_and_the_servers_files_as_its_own(work):
    """A VM session's commands run as the guest user (uid/gid 4242 here): the server reports the
    working folder owner's files and the files it creates itself as that user's, so the guest
    kernel's permission checks let the user work in its share; every other owner is reported
    as it is on the host."""
    st = os.stat(work)
    if os.geteuid() == 0:
        os.chown(work / "tool", 31337, 31338)  # someone else's file: shown as it is
    owners = identity.OwnerMap(host_uids=frozenset({st.st_uid, os.geteuid()}),
                               host_gids=frozenset({st.st_gid, os.getegid()}), guest_uid=4242, guest_gid=4243)
    from sandbox.ninep.server import ServerConfig

    with serve(Provider.read_only_dir(str(work)), ServerConfig(owners=owners)) as (_st, path), \
            Client.connect_unix(path) as c:
        assert _owner_of(c, "") == (4242, 4243)
        assert _owner_of(c, "dir") == (4242, 4243)
        if os.geteuid() == 0:
            assert _owner_of(c, "tool") == (31337, 31338)
    with serve(Provider.read_only_dir(str(work))) as (_st, path), Client.connect_unix(path) as c:
        assert _owner_of(c, "dir") == (st.st_uid, st.st_gid)  # without a map: the host's owners


def test_owner_map_is_total_on_ids():
    owners = identity.OwnerMap(host_uids=frozenset({0, 1000}), host_gids=frozenset({0}), guest_uid=1000,
                               guest_gid=1000)
    assert [owners.uid(u) for u in (0, 1000, 7)] == [1000, 1000, 7]
    assert [owners.gid(g) for g in (0, 1000, 7)] == [1000, 1000, 7]
    with pytest.raises(ValueError):
        identity.OwnerMap(host_uids=frozenset({1}), host_gids=frozenset(), guest_uid=0, guest_gid=1)
