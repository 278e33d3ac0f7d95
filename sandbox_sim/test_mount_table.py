"""The mount table of seed 004: guest path normalisation, longest-prefix resolution on whole
components, views and read-only narrowing for sub-workers, folder lookup, Docker-style config.

Pure logic: no host, no sleeps. The Hypothesis properties compare against independent
oracles (``posixpath.normpath`` plus a running depth count for normalisation, a brute-force
"longest component-prefix" search for resolution).
"""

from __future__ import annotations

import json
import posixpath

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sandbox.core.errors import SandboxError
from sandbox.mounts.table import (
    MAX_MOUNTS,
    Mount,
    MountError,
    MountTable,
    PathDenied,
    PathOutside,
    UnknownDirectory,
    WidenDenied,
    check_mount_points,
    from_docker_style,
    guest_path,
)
from sandbox_sim.budget import scale

SETTINGS = settings(max_examples=scale(300, 5000), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def folder(target, name, *, ro=False, label="", source=None):
    return Mount(target=target, name=name, read_only=ro, label=label, source=source or f"/host{target}", kind="folder")


def memory(target, name, *, ro=False, label=""):
    return Mount(target=target, name=name, read_only=ro, label=label, source=None, kind="memory")


def table_from_dirs(dirs, **kw):
    """Working-directory dicts (from_docker_style's output) as a table, name = index."""
    return MountTable([Mount(target=d["target"], name=str(i), read_only=d["access"] == "read_only", label=d["label"],
                             source=d["path"], kind="folder") for i, d in enumerate(dirs)], **kw)


def host_path(mount, rel):
    return mount.source + ("/" + rel if rel else "")


# --------------------------------------------------------------------------- guest_path

COMPONENTS = ["a", "b", "ab", "a.b", "é", "..", ".", "", "..."]
raw_paths = st.lists(st.sampled_from(COMPONENTS), max_size=10).map(lambda parts: "/" + "/".join(parts))


def escapes(path: str) -> bool:
    """Oracle: does some ``..`` climb above ``/``? (running depth, no normalisation code)."""
    depth = 0
    for part in path.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


@SETTINGS
@given(raw_paths)
def test_guest_path_matches_normpath_and_never_escapes(p):
    if escapes(p):
        with pytest.raises(PathOutside, match="escapes /"):
            guest_path(p)
        return
    g = guest_path(p)
    # posixpath.normpath clamps '..' at the root and keeps a leading '//': neither matters here
    assert g == posixpath.normpath("/" + p.lstrip("/"))
    assert g.startswith("/")
    assert g == "/" or not g.endswith("/")
    assert "//" not in g
    assert not {".", ".."} & set(g.split("/"))


@SETTINGS
@given(raw_paths)
def test_guest_path_is_idempotent(p):
    assume(not escapes(p))
    g = guest_path(p)
    assert guest_path(g) == g
    assert guest_path(g + "/") == g
    assert guest_path(g + "/.") == g


@SETTINGS
@given(raw_paths)
def test_one_dotdot_too_many_is_refused(p):
    assume(not escapes(p))
    g = guest_path(p)
    depth = 0 if g == "/" else g.count("/")
    assert guest_path(g + "/.." * depth) == "/"
    with pytest.raises(PathOutside, match="escapes /"):
        guest_path(g + "/.." * (depth + 1))


@pytest.mark.parametrize("p, want", [
    ("/", "/"), ("//", "/"), ("/.", "/"), ("/a//b/./c/", "/a/b/c"), ("/a/b/../c", "/a/c"), ("/a/..", "/"),
    ("/a/./../b/", "/b"), ("/...", "/..."), ("/a/..b", "/a/..b"),
])
def test_guest_path_examples(p, want):
    assert guest_path(p) == want


@pytest.mark.parametrize("p", ["/..", "/../etc/passwd", "/a/../..", "/a/b/../../../c", "/./.."])
def test_guest_path_refuses_climbing_above_root(p):
    with pytest.raises(PathOutside, match="escapes /") as e:
        guest_path(p)
    assert e.value.code == "fs.outside_mounts"
    assert isinstance(e.value, PathDenied)


@pytest.mark.parametrize("p, match", [
    ("a/b", "absolute"), ("", "absolute"), ("./a", "absolute"), ("/a\0b", "NUL"), (b"/a", "str"), (None, "str"),
    ("/" + "x" * 256, "component longer than 255"), ("/" + "é" * 128, "component longer than 255"),
    ("/" + "/".join(["x" * 200] * 21), "longer than 4096"),
])
def test_guest_path_refuses_malformed(p, match):
    with pytest.raises(PathDenied, match=match) as e:
        guest_path(p)
    assert type(e.value) is PathDenied and e.value.code == "fs.access_denied"


def test_guest_path_length_limits_are_inclusive():
    assert guest_path("/" + "x" * 255) == "/" + "x" * 255
    assert guest_path("/" + "é" * 127 + "x") == "/" + "é" * 127 + "x"  # 255 bytes
    p = "/" + "/".join(["x" * 255] * 16)  # 16 * 256 = 4096 bytes
    assert len(p) == 4096 and guest_path(p) == p


# --------------------------------------------------------------------------- Mount, table validation


def test_errors_are_sandbox_errors_with_codes():
    assert issubclass(MountError, SandboxError) and MountError.code == "session.invalid_mounts"
    assert issubclass(UnknownDirectory, MountError) and UnknownDirectory.code == "session.unknown_directory"
    assert issubclass(PathDenied, SandboxError) and PathDenied.code == "fs.access_denied"
    assert issubclass(PathOutside, PathDenied) and PathOutside.code == "fs.outside_mounts"
    assert issubclass(WidenDenied, PathDenied) and WidenDenied.code == "session.widen_denied"


def test_mount_normalises_its_target_and_refuses_root():
    assert folder("/mnt//working/0/", "0").target == "/mnt/working/0"
    for bad in ("/", "//", "/a/.."):
        with pytest.raises(MountError, match="root"):
            folder(bad, "0")
    with pytest.raises(MountError, match="escapes"):
        folder("/..", "0")
    with pytest.raises(MountError, match="absolute"):
        folder("mnt", "0")


@pytest.mark.parametrize("kw, match", [
    (dict(kind="folder", source=None), "source"),
    (dict(kind="memory", source="/x"), "no host source"),
    (dict(kind="tmpfs", source=None), "kind"),
    (dict(name=""), "name"),
    (dict(read_only="no"), "read_only"),
    (dict(label=None), "label"),
])
def test_mount_validates_fields(kw, match):
    args = dict(target="/m", name="0", read_only=False, label="", source="/h", kind="folder") | kw
    with pytest.raises(MountError, match=match):
        Mount(**args)


@pytest.mark.parametrize("mounts, match", [
    ([folder("/a", "0"), folder("/a/", "1")], "target '/a'"),
    ([folder("/a", "0"), folder("/b", "0")], "name '0'"),
    ([folder("/a", "0", label="x"), folder("/b", "1", label="x")], "label 'x'"),
    ([folder(f"/m/{i}", str(i)) for i in range(MAX_MOUNTS + 1)], "at most 16"),
    (["/a"], "Mount"),
])
def test_table_refuses_invalid_mount_sets(mounts, match):
    with pytest.raises(MountError, match=match):
        MountTable(mounts)


def test_table_accepts_empty_labels_twice_and_sixteen_mounts():
    t = MountTable([folder(f"/m/{i}", str(i)) for i in range(MAX_MOUNTS)])
    assert len(t.mounts) == MAX_MOUNTS
    MountTable([folder("/a", "0"), memory("/b", "1")])


def test_table_view_is_normalised_and_must_reach_a_mount():
    t = MountTable([folder("/mnt/working/0", "0")], view="/mnt//working/")
    assert t.view == "/mnt/working"
    with pytest.raises(MountError, match="reaches no mount"):
        MountTable([folder("/mnt/working/0", "0")], view="/etc")
    with pytest.raises(MountError, match="escapes"):
        MountTable([folder("/mnt/working/0", "0")], view="/..")
    with pytest.raises(MountError):
        MountTable([folder("/a", "0")], read_only="yes")


def test_mounts_are_listed_shallowest_first_folders_in_given_order():
    given_ = [folder("/w/0/cache/npm", "2"), memory("/mem", "m"), folder("/w/1", "1"), folder("/w/0/cache", "3"),
              folder("/w/0", "0")]
    t = MountTable(given_)
    assert [m.target for m in t.mounts] == ["/mem", "/w/0", "/w/1", "/w/0/cache", "/w/0/cache/npm"]
    assert [m.target for m in t.folders] == ["/w/0/cache/npm", "/w/1", "/w/0/cache", "/w/0"]
    assert [t.index_of(m) for m in t.folders] == [0, 1, 2, 3]
    with pytest.raises(UnknownDirectory):
        t.index_of(given_[1])  # a memory mount has no folder index


# --------------------------------------------------------------------------- resolve


def test_longest_prefix_wins():
    root, cache = folder("/mnt/working/0", "0"), folder("/mnt/working/0/cache", "1", ro=True)
    t = MountTable([cache, root])
    assert t.resolve("/mnt/working/0/cache/npm/pkg") == (cache, "npm/pkg")
    assert t.resolve("/mnt/working/0/cache") == (cache, "")
    assert t.resolve("/mnt/working/0/cache/") == (cache, "")
    assert t.resolve("/mnt/working/0/src/app.ts") == (root, "src/app.ts")
    assert t.resolve("/mnt/working/0") == (root, "")
    assert t.resolve("/mnt/working/0/cache/../src") == (root, "src")


def test_prefixes_match_whole_components_only():
    one, ten = folder("/mnt/working/1", "1"), folder("/mnt/working/10", "10")
    t = MountTable([one])
    with pytest.raises(PathOutside):
        t.resolve("/mnt/working/10")
    with pytest.raises(PathOutside):
        t.resolve("/mnt/working/10/x")
    assert t.resolve("/mnt/working/1/0") == (one, "0")
    t2 = MountTable([ten, one])
    assert t2.resolve("/mnt/working/10/x") == (ten, "x")
    assert t2.resolve("/mnt/working/1/x") == (one, "x")
    root, cache = folder("/w", "r"), folder("/w/cache", "c")
    assert MountTable([root, cache]).resolve("/w/cachex/y") == (root, "cachex/y")


def test_resolve_outside_every_mount_and_malformed():
    t = MountTable([folder("/mnt/working/0", "0")])
    for p in ("/", "/mnt", "/mnt/working", "/etc/passwd", "/mnt/working/0/../../etc"):
        with pytest.raises(PathOutside):
            t.resolve(p)
    with pytest.raises(PathOutside, match="escapes"):
        t.resolve("/../mnt/working/0")
    with pytest.raises(PathDenied, match="absolute"):
        t.resolve("mnt/working/0")


def test_write_needs_a_writable_mount_and_table():
    rw, ro = folder("/w/0", "0"), folder("/w/1", "1", ro=True, label="cache")
    t = MountTable([rw, ro])
    assert t.resolve("/w/0/f", write=True) == (rw, "f")
    assert t.resolve("/w/1/f") == (ro, "f")
    with pytest.raises(PathDenied, match=r"/w/1/f.*'cache' \(/w/1\) is read-only") as e:
        t.resolve("/w/1/f", write=True)
    assert type(e.value) is PathDenied and e.value.data["reason"] == "read_only_mount"
    t_ro = t.restrict(read_only=True)
    with pytest.raises(PathDenied, match=r"/w/0/f.*read-only") as e:
        t_ro.resolve("/w/0/f", write=True)
    assert e.value.data["reason"] == "read_only_view"
    assert t_ro.resolve("/w/0/f") == (rw, "f")
    assert (t.writable(rw), t.writable(ro), t_ro.writable(rw), t_ro.writable(ro)) == (True, False, False, False)


# --------------------------------------------------------------------------- seed 004


SEED_004 = dict(root="/home/user/project", mounts=[{"source": "/home/user/.cache", "target": "/cache", "readonly": True}])


def test_seed_004_config_translates_to_working_folders():
    dirs = from_docker_style(**SEED_004)
    assert dirs == [
        {"path": "/home/user/project", "target": "/mnt/working/0", "access": "read_write", "label": "root"},
        {"path": "/home/user/.cache", "target": "/mnt/working/0/cache", "access": "read_only", "label": "/cache"},
    ]
    assert from_docker_style("/p", readonly=True, root_target="/r/")[0] == \
        {"path": "/p", "target": "/r", "access": "read_only", "label": "root"}


@pytest.mark.parametrize("virtual, real, label", [
    ("/src/app.ts", "/home/user/project/src/app.ts", "root"),
    ("/README.md", "/home/user/project/README.md", "root"),
    ("/cache/npm/pkg", "/home/user/.cache/npm/pkg", "/cache"),
    ("/cache", "/home/user/.cache", "/cache"),
    ("/cachex", "/home/user/project/cachex", "root"),
])
def test_seed_004_resolution_table(virtual, real, label):
    t = table_from_dirs(from_docker_style(**SEED_004))
    mount, rel = t.resolve("/mnt/working/0" + virtual)
    assert (host_path(mount, rel), mount.label) == (real, label)


def test_seed_004_traversal_is_an_error():
    t = table_from_dirs(from_docker_style(**SEED_004))
    with pytest.raises(PathOutside, match="escapes /"):
        t.resolve("/../etc/passwd")  # the seed's virtual path, as is
    with pytest.raises(PathOutside):
        t.resolve("/mnt/working/0/../etc/passwd")  # …and under the root target: /mnt/working/etc/passwd
    with pytest.raises(PathOutside):
        t.resolve("/mnt/working/0/cache/../../etc/passwd")


def test_seed_004_read_only_cache_refuses_writes_root_accepts_them():
    t = table_from_dirs(from_docker_style(**SEED_004))
    assert t.resolve("/mnt/working/0/src/x", write=True)[0].label == "root"
    with pytest.raises(PathDenied, match="read-only"):
        t.resolve("/mnt/working/0/cache/x", write=True)


@pytest.mark.parametrize("parent_ro, requested, result", [
    (False, None, False),   # read-write, (default)      -> read-write (inherited)
    (False, True, True),    # read-write, readonly: true -> read-only (downgrade allowed)
    (False, False, False),  # read-write, readonly: false -> read-write
    (True, None, True),     # read-only, (default)       -> read-only (inherited)
    (True, True, True),     # read-only, readonly: true  -> read-only
    (True, False, WidenDenied),  # read-only, readonly: false -> ERROR (cannot upgrade)
])
def test_seed_004_permission_inheritance(parent_ro, requested, result):
    parent = table_from_dirs(from_docker_style(**SEED_004), read_only=parent_ro)
    if result is WidenDenied:
        with pytest.raises(WidenDenied, match="read-only") as e:
            parent.restrict(read_only=requested)
        assert e.value.code == "session.widen_denied"
        return
    child = parent.restrict(read_only=requested)
    assert child.read_only is result
    assert child.view == parent.view and child.mounts == parent.mounts


def test_seed_004_per_mount_inheritance():
    parent = table_from_dirs(from_docker_style(**SEED_004))
    root, cache = parent.resolve("/mnt/working/0")[0], parent.resolve("/mnt/working/0/cache")[0]
    assert (parent.writable(root), parent.writable(cache)) == (True, False)
    inherited = parent.restrict()
    assert (inherited.writable(root), inherited.writable(cache)) == (True, False)
    child = parent.restrict(read_only=True)
    assert (child.writable(root), child.writable(cache)) == (False, False)
    assert [m.read_only for m in child.mounts] == [False, True]  # each mount keeps its own flag


# --------------------------------------------------------------------------- restrict


def test_restrict_to_subtree_then_widening_is_denied():
    t = table_from_dirs(from_docker_style(**SEED_004))
    sub = t.restrict("/mnt/working/0/src/", read_only=True)
    assert sub.view == "/mnt/working/0/src" and sub.read_only
    assert sub.resolve("/mnt/working/0/src/app.ts")[1] == "src/app.ts"
    for p in ("/mnt/working/0/secrets/api-key.txt", "/mnt/working/0", "/mnt/working/0/srcx", "/mnt/working/0/cache/x"):
        with pytest.raises(PathDenied) as e:
            sub.resolve(p)
        assert type(e.value) is PathDenied, p
    for wider in ("/mnt/working/0", "/mnt/working/0/cache", "/mnt/working/0/srcx", "/"):
        with pytest.raises(WidenDenied, match="outside the current view"):
            sub.restrict(wider)
    with pytest.raises(WidenDenied):
        sub.restrict(read_only=False)
    assert sub.restrict("/mnt/working/0/src").view == "/mnt/working/0/src"  # the same view is not wider
    assert sub.restrict("/mnt/working/0/src/lib").view == "/mnt/working/0/src/lib"
    assert sub.restrict("/mnt/working/0/src/lib/..").view == "/mnt/working/0/src"


def test_restrict_outside_every_mount_is_path_outside():
    t = MountTable([folder("/mnt/working/0", "0"), folder("/mnt/working/1", "1")])
    for p in ("/etc", "/mnt/working", "/mnt", "/mnt/working/2"):
        with pytest.raises(PathOutside):
            t.restrict(p)
    with pytest.raises(PathOutside, match="escapes"):
        t.restrict("/..")
    sub = t.restrict("/mnt/working/1")
    assert sub.view == "/mnt/working/1" and sub.resolve("/mnt/working/1/x")[0].name == "1"
    with pytest.raises(PathDenied):
        sub.resolve("/mnt/working/0/x")


def test_restrict_keeps_folder_order_and_returns_a_new_table():
    t = MountTable([folder("/w/1", "1", label="b"), folder("/w/0", "0", label="a")])
    sub = t.restrict("/w/0", read_only=True)
    assert sub is not t and t.view == "/" and not t.read_only
    assert [m.label for m in sub.folders] == ["b", "a"]
    assert sub.by_directory(None).label == "b"


mount_sets = st.lists(st.lists(st.sampled_from(["a", "b", "ab", "c"]), min_size=1, max_size=3).map(
    lambda parts: "/" + "/".join(parts)), min_size=1, max_size=6, unique=True).flatmap(
    lambda targets: st.tuples(st.just(targets), st.lists(st.booleans(), min_size=len(targets), max_size=len(targets))))
probe_paths = st.lists(st.sampled_from(["a", "b", "ab", "c", "x", "..", "."]), max_size=6).map(
    lambda parts: "/" + "/".join(parts))


@SETTINGS
@given(mount_sets, probe_paths)
def test_resolve_is_the_longest_component_prefix(ms, path):
    targets, ro = ms
    t = MountTable([folder(tg, str(i), ro=r) for i, (tg, r) in enumerate(zip(targets, ro))])
    assume(not escapes(path))
    norm = guest_path(path)
    candidates = [m for m in t.mounts if norm == m.target or norm.startswith(m.target + "/")]
    if not candidates:
        with pytest.raises(PathOutside):
            t.resolve(path)
        return
    best = max(candidates, key=lambda m: len(m.target.split("/")))
    mount, rel = t.resolve(path)
    assert mount == best
    assert (mount.target + "/" + rel if rel else mount.target) == norm
    assert rel == "" or not rel.startswith("/")
    if best.read_only:
        with pytest.raises(PathDenied):
            t.resolve(path, write=True)
    else:
        assert t.resolve(path, write=True) == (mount, rel)


@SETTINGS
@given(mount_sets, probe_paths, probe_paths, st.sampled_from([None, True, False]))
def test_restrict_never_widens(ms, sub, path, ro):
    targets, ros = ms
    t = MountTable([folder(tg, str(i), ro=r) for i, (tg, r) in enumerate(zip(targets, ros))])
    assume(not escapes(sub) and not escapes(path))
    try:
        child = t.restrict(sub, ro)
    except PathOutside:
        assert not any(posixpath.commonpath([guest_path(sub), m.target]) == m.target for m in t.mounts)
        return
    try:
        got = child.resolve(path, write=True)
    except PathDenied:
        pass
    else:
        assert t.resolve(path, write=True) == got
    try:
        got = child.resolve(path)
    except PathDenied:
        pass
    else:
        assert t.resolve(path) == got
        assert guest_path(path) == child.view or guest_path(path).startswith(child.view + "/")
    grandchild_wider = [p for p in ("/", posixpath.dirname(child.view)) if p != child.view]
    for p in grandchild_wider:
        with pytest.raises(PathDenied):
            child.restrict(p)


# --------------------------------------------------------------------------- by_directory


@pytest.fixture
def dirs_table():
    return MountTable([
        memory("/mnt/scratch", "m0", label="scratch"),
        folder("/mnt/working/1", "1", label="docs", source="/home/u/docs"),
        folder("/mnt/working/0", "0", source="/home/u/project"),
        folder("/mnt/working/0/cache", "2", label="cache", source="/home/u/.cache", ro=True),
    ])


def test_by_directory_default_and_index_follow_the_given_order(dirs_table):
    t = dirs_table
    assert t.by_directory(None).target == "/mnt/working/1"  # first *folder* given, not the shallowest
    assert [t.by_directory(i).target for i in range(3)] == ["/mnt/working/1", "/mnt/working/0",
                                                            "/mnt/working/0/cache"]


def test_by_directory_by_label_target_and_source(dirs_table):
    t = dirs_table
    assert t.by_directory("docs").target == "/mnt/working/1"
    assert t.by_directory("cache").target == "/mnt/working/0/cache"
    assert t.by_directory("/mnt/working/0").name == "0"
    assert t.by_directory("/mnt//working/0/").name == "0"
    assert t.by_directory("/mnt/working/0/cache/../../1").name == "1"
    assert t.by_directory("/home/u/project").name == "0"
    assert t.by_directory("/home/u/project/").name == "0"


@pytest.mark.parametrize("key", [3, -1, "nope", "scratch", "/mnt/scratch", "/mnt/working", "", "/..", 1.0, [0]])
def test_by_directory_unknown(dirs_table, key):
    with pytest.raises(UnknownDirectory) as e:
        dirs_table.by_directory(key)
    assert e.value.code == "session.unknown_directory" and isinstance(e.value, MountError)
    assert e.value.data["known"] == ["docs", 1, "cache"]
    json.dumps(e.value.data)


@pytest.mark.parametrize("key", [True, False])
def test_by_directory_refuses_bools(dirs_table, key):
    with pytest.raises(UnknownDirectory, match="not " + str(key)) as e:
        dirs_table.by_directory(key)
    assert e.value.data["directory"] is key


def test_by_directory_without_folders():
    with pytest.raises(UnknownDirectory, match="no working folder"):
        MountTable([memory("/m", "m")]).by_directory(None)


def test_label_beats_target_beats_source():
    a = folder("/b", "0", label="/a", source="/c")
    b = folder("/a", "1", label="x", source="/b")
    t = MountTable([a, b])
    assert t.by_directory("/a") == a  # label
    assert t.by_directory("/b") == a  # target of a, though b's source is /b
    assert t.by_directory("/c") == a  # source


# --------------------------------------------------------------------------- as_dict


def test_as_dict_is_json_and_round_trips(dirs_table):
    t = dirs_table.restrict("/mnt/working/0", read_only=True)
    d = json.loads(json.dumps(t.as_dict()))
    assert d["view"] == "/mnt/working/0" and d["read_only"] is True
    assert d["mounts"][0] == {"target": "/mnt/scratch", "name": "m0", "read_only": False, "label": "scratch",
                              "source": None, "kind": "memory"}
    assert [m["name"] for m in d["mounts"]] == ["m0", "1", "0", "2"]
    back = MountTable.from_dict(d)
    assert back == t and back.folders == t.folders and back.mounts == t.mounts
    with pytest.raises(MountError):
        MountTable.from_dict({"mounts": [{"target": "/a"}]})


# --------------------------------------------------------------------------- from_docker_style validation


@pytest.mark.parametrize("kw, match", [
    (dict(root=None), "root"),
    (dict(root=""), "root"),
    (dict(readonly="yes"), "readonly"),
    (dict(mounts="/x"), "mounts"),
    (dict(mounts=["/x"]), r"mounts\[0\]"),
    (dict(mounts=[{"source": "/s", "target": "cache"}]), r"mounts\[0\]\.target"),
    (dict(mounts=[{"source": "/s", "target": "/"}]), r"mounts\[0\]\.target.*root"),
    (dict(mounts=[{"source": "/s", "target": "/a/.."}]), r"mounts\[0\]\.target.*root"),
    (dict(mounts=[{"source": "/s", "target": "/.."}]), r"mounts\[0\]\.target.*escapes"),
    (dict(mounts=[{"source": "/s", "target": "/../etc"}]), r"mounts\[0\]\.target.*escapes"),
    (dict(mounts=[{"source": 3, "target": "/c"}]), r"mounts\[0\]\.source"),
    (dict(mounts=[{"target": "/c"}]), r"mounts\[0\]\.source"),
    (dict(mounts=[{"source": "/s", "target": 7}]), r"mounts\[0\]\.target"),
    (dict(mounts=[{"source": "/s", "target": "/c", "readonly": "true"}]), r"mounts\[0\]\.readonly"),
    (dict(mounts=[{"source": "/s", "target": "/c", "ro": True}]), "unknown keys"),
    (dict(mounts=[{"source": "/s", "target": "/c"}, {"source": "/t", "target": "/c/"}]),
     r"mounts\[1\]\.target.*mounts\[0\]"),
    (dict(root_target="/"), "root_target"),
    (dict(root_target="mnt"), "root_target"),
])
def test_from_docker_style_refuses(kw, match):
    args = dict(root="/p") | kw
    with pytest.raises(MountError, match=match) as e:
        from_docker_style(**args)
    assert e.value.code == "session.invalid_mounts"


def test_from_docker_style_normalises_targets_and_keeps_order():
    dirs = from_docker_style("/p", mounts=[{"source": "/o", "target": "/out//put/"},
                                           {"source": "/n", "target": "/a/../npm", "readonly": False}])
    assert [(d["target"], d["label"], d["access"]) for d in dirs] == [
        ("/mnt/working/0", "root", "read_write"), ("/mnt/working/0/out/put", "/out/put", "read_write"),
        ("/mnt/working/0/npm", "/npm", "read_write")]


# --------------------------------------------------------------------------- check_mount_points


def test_check_mount_points_asks_the_nearest_parent():
    root = folder("/w/0", "0", source="/home/u/p")
    cache = folder("/w/0/cache", "1", source="/home/u/.cache")
    npm = folder("/w/0/cache/npm/v1", "2", source="/home/u/.npm")
    other = folder("/w/1", "3")
    t = MountTable([npm, other, cache, root])
    asked = []
    check_mount_points(t, lambda m, rel: asked.append((m.target, rel)) or True)
    assert sorted(asked) == [("/w/0", "cache"), ("/w/0/cache", "npm/v1")]


def test_check_mount_points_missing_directory():
    t = table_from_dirs(from_docker_style(**SEED_004))
    with pytest.raises(MountError) as e:
        check_mount_points(t, lambda m, rel: False)
    assert e.value.message == ("mount target /mnt/working/0/cache is inside /mnt/working/0: create the directory "
                               "cache in /home/user/project first (mount points are not created in your folders)")
    check_mount_points(t, lambda m, rel: (m.label, rel) == ("root", "cache"))


def test_check_mount_points_memory_parent():
    t = MountTable([memory("/m", "m"), folder("/m/sub", "0")])
    with pytest.raises(MountError, match="in the in-memory tree at /m first"):
        check_mount_points(t, lambda m, rel: False)
