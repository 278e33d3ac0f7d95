"""The session's mount table: which tree serves which guest path, and what a worker may reach.

Seed 004's mount model (Docker-style bind mounts, sub-workers that can only narrow their
access) as pure logic over guest paths. Nothing here touches the host, except through the
``exists`` callback a caller hands to :func:`check_mount_points`.

Invariants:

* every guest path this module accepts or returns went through :func:`guest_path`: a
  ``str``, absolute, no NUL, no empty/``.``/``..`` component, no trailing ``/`` (except
  ``/`` itself), each component at most 255 bytes of UTF-8 and the whole at most 4096.
  ``..`` is resolved lexically; one that would climb above ``/`` is an error, never
  clamped (``/../etc/passwd`` is refused, not read as ``/etc/passwd``);
* a :class:`Mount`'s target is such a path and is never ``/`` (the guest's root is not
  ours); in a :class:`MountTable` targets, names and non-empty labels are unique, and there
  are at most :data:`MAX_MOUNTS` mounts;
* prefixes are matched on whole components only: ``/mnt/working/10`` is not inside
  ``/mnt/working/1``. A mount nested in another one overlays it: the longest matching target
  wins, and :attr:`MountTable.mounts` lists shallower targets first (the order the guest
  must mount them in);
* :meth:`MountTable.resolve` returns ``(mount, rel)`` with ``mount.target + "/" + rel`` (or
  ``mount.target`` when ``rel == ""``) equal to the normalised path, and only for a path
  inside the table's view; writing needs both the mount and the table to be writable;
* :meth:`MountTable.restrict` only narrows: the new view lies within the old one and inside
  some mount, read-only can be added and never removed, each mount keeps its own
  read-only flag. Anything wider is :class:`WidenDenied`;
* tables and mounts are immutable values: every "change" returns a new one.

Errors are :class:`~sandbox.core.errors.SandboxError` subclasses with stable codes:
configuration problems are :class:`MountError` (``session.invalid_mounts``), a path the
caller may not reach is :class:`PathDenied` (``fs.access_denied``) or its subclass
:class:`PathOutside` (``fs.outside_mounts``: no mount contains it).
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.errors import SandboxError
from ..hostfs import NAME_LEN_MAX, PATH_LEN_MAX, is_within

__all__ = [
    "MAX_MOUNTS",
    "FOLDER",
    "MEMORY",
    "MountError",
    "UnknownDirectory",
    "PathDenied",
    "PathOutside",
    "WidenDenied",
    "guest_path",
    "Mount",
    "MountTable",
    "from_docker_style",
    "check_mount_points",
]

#: the most mounts one session may have
MAX_MOUNTS = 16

FOLDER = "folder"
MEMORY = "memory"
_KINDS = (FOLDER, MEMORY)


# --------------------------------------------------------------------------- errors


class MountError(SandboxError):
    """The mount configuration is invalid (bad target, duplicate, too many, …)."""

    code = "session.invalid_mounts"


class UnknownDirectory(MountError):
    """An operation's ``directory`` names no working folder of the session."""

    code = "session.unknown_directory"


class PathDenied(SandboxError):
    """A path the caller may not reach: outside the view, or a write in a read-only place."""

    code = "fs.access_denied"


class PathOutside(PathDenied):
    """No mount contains the path (or it climbs above ``/``)."""

    code = "fs.outside_mounts"


class WidenDenied(PathDenied):
    """A restriction that would widen access (a wider view, or dropping read-only)."""

    code = "session.widen_denied"


# --------------------------------------------------------------------------- paths


def _utf8_len(text: str, path: str) -> int:
    try:
        return len(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        raise PathDenied(f"guest path is not valid UTF-8: {path!r}", path=path) from None


def guest_path(path: str) -> str:
    """The canonical form of the absolute guest path ``path``, or :class:`PathDenied`.

    ``"/a//b/./c/../d/"`` → ``"/a/b/d"``. ``..`` is resolved lexically; one that would go
    above ``/`` raises :class:`PathOutside` (``fs.outside_mounts``). Idempotent: the result
    of a successful call is accepted again and returned unchanged.
    """
    if not isinstance(path, str):
        raise PathDenied(f"guest path must be str, not {type(path).__name__}", type=type(path).__name__)
    if "\0" in path:
        raise PathDenied(f"guest path contains a NUL byte: {path!r}", path=path)
    if not path.startswith("/"):
        raise PathDenied(f"guest path must be absolute (start with '/'): {path!r}", path=path)
    if _utf8_len(path, path) > PATH_LEN_MAX:
        raise PathDenied(f"guest path longer than {PATH_LEN_MAX} bytes: {path[:64]!r}…", path=path)
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise PathOutside(f"guest path escapes / via '..': {path!r}", path=path)
            parts.pop()
            continue
        if _utf8_len(part, path) > NAME_LEN_MAX:
            raise PathDenied(f"guest path component longer than {NAME_LEN_MAX} bytes: {part[:64]!r}…", path=path)
        parts.append(part)
    return "/" + "/".join(parts)


def _depth(target: str) -> int:
    return 0 if target == "/" else target.count("/")


def _within(path: str, prefix: str) -> bool:
    """``path`` is ``prefix`` or below it, on whole components (both normalised, absolute)."""
    return prefix == "/" or is_within(path, prefix)


def _rel(path: str, prefix: str) -> str:
    """``path`` relative to ``prefix`` (``_within(path, prefix)`` holds; ``prefix != "/"``)."""
    return "" if path == prefix else path[len(prefix) + 1 :]


def _config_path(value: Any, what: str) -> str:
    """:func:`guest_path` for configuration: every failure is a :class:`MountError` naming ``what``."""
    try:
        return guest_path(value)
    except PathDenied as e:
        raise MountError(f"{what}: {e.message}", field=what) from None


# --------------------------------------------------------------------------- mounts


@dataclass(frozen=True)
class Mount:
    """One tree the guest mounts at ``target``.

    ``name`` is the export's 9P attach name; ``source`` the host directory of a
    ``"folder"`` (``None`` for a ``"memory"`` tree); ``label`` how operations and messages
    refer to it (may be empty). ``target`` is normalised on construction and must not be ``/``.
    """

    target: str
    name: str
    read_only: bool
    label: str
    source: str | None
    kind: str

    def __post_init__(self) -> None:
        target = _config_path(self.target, "mount target")
        if target == "/":
            raise MountError(f"mount target {self.target!r} is the guest's root: mount below it", target=self.target)
        object.__setattr__(self, "target", target)
        if not isinstance(self.name, str) or not self.name or "\0" in self.name:
            raise MountError(f"mount name must be a non-empty str without NUL, not {self.name!r}", target=target)
        if not isinstance(self.read_only, bool):
            raise MountError(f"mount read_only must be a bool, not {type(self.read_only).__name__}", target=target)
        if not isinstance(self.label, str):
            raise MountError(f"mount label must be a str, not {type(self.label).__name__}", target=target)
        if self.kind not in _KINDS:
            raise MountError(f"mount kind must be one of {', '.join(_KINDS)}, not {self.kind!r}", target=target)
        if self.kind == FOLDER:
            if not isinstance(self.source, str) or not self.source or "\0" in self.source:
                raise MountError(f"folder mount at {target} needs a host path as source, not {self.source!r}",
                                 target=target)
        elif self.source is not None:
            raise MountError(f"memory mount at {target} has no host source, got {self.source!r}", target=target)

    def as_dict(self) -> dict:
        return {"target": self.target, "name": self.name, "read_only": self.read_only, "label": self.label,
                "source": self.source, "kind": self.kind}

    def describe(self) -> str:
        """How messages name this mount: its label, else its target."""
        return f"{self.label!r} ({self.target})" if self.label else self.target


# --------------------------------------------------------------------------- table


class MountTable:
    """The mounts of one session (or sub-worker), its view and its read-only flag.

    See the module docstring for the invariants. ``mounts`` is given in the caller's order,
    which fixes folder indexes (:attr:`folders`, :meth:`by_directory`); :attr:`mounts`
    returns them shallowest target first. The ``view`` must overlap some mount (lie
    within one, or above one) unless there are no mounts.
    """

    __slots__ = ("_by_depth", "_folders", "_given", "_read_only", "_sorted", "_view")

    def __init__(self, mounts: Iterable[Mount], *, view: str = "/", read_only: bool = False):
        if isinstance(mounts, (str, bytes, dict)) or not isinstance(mounts, Iterable):
            raise MountError(f"mounts must be a list of Mount, not {type(mounts).__name__}")
        given = tuple(mounts)
        for m in given:
            if not isinstance(m, Mount):
                raise MountError(f"mounts must be Mount values, not {type(m).__name__}")
        if len(given) > MAX_MOUNTS:
            raise MountError(f"{len(given)} mounts: at most {MAX_MOUNTS} are allowed", count=len(given))
        if not isinstance(read_only, bool):
            raise MountError(f"read_only must be a bool, not {type(read_only).__name__}")
        seen: dict[tuple[str, str], Mount] = {}
        for m in given:
            # Mount normalised its target already; a Mount is frozen, but be explicit.
            if m.target != guest_path(m.target) or m.target == "/":
                raise MountError(f"mount target {m.target!r} is not a normalised path below /", target=m.target)
            keys = [("target", m.target), ("name", m.name)] + ([("label", m.label)] if m.label else [])
            for field, value in keys:
                other = seen.get((field, value))
                if other is not None:
                    raise MountError(f"two mounts share the {field} {value!r}: {other.describe()} and {m.describe()}",
                                     field=field, value=value)
                seen[(field, value)] = m
        view_ = _config_path(view, "view")
        if given and not any(_within(view_, m.target) or _within(m.target, view_) for m in given):
            raise MountError(f"view {view_} reaches no mount", view=view_)
        self._given = given
        self._sorted = tuple(sorted(given, key=lambda m: (_depth(m.target), m.target)))
        self._by_depth = tuple(reversed(self._sorted))  # deepest first: the first match is the longest
        self._folders = tuple(m for m in given if m.kind == FOLDER)
        self._view = view_
        self._read_only = read_only

    # -- properties

    @property
    def mounts(self) -> tuple[Mount, ...]:
        """Every mount, shallowest target first (then by target): the guest's mount order."""
        return self._sorted

    @property
    def folders(self) -> tuple[Mount, ...]:
        """The ``"folder"`` mounts in the order the caller gave them (folder index order)."""
        return self._folders

    @property
    def view(self) -> str:
        return self._view

    @property
    def read_only(self) -> bool:
        return self._read_only

    # -- lookups

    def _containing(self, path: str) -> Mount | None:
        for m in self._by_depth:
            if _within(path, m.target):
                return m
        return None

    def resolve(self, path: str, *, write: bool = False) -> tuple[Mount, str]:
        """``(mount, rel)`` for the absolute guest ``path`` (``rel == ""`` at the mount root).

        :class:`PathDenied` if ``path`` is malformed, outside the view, or ``write`` and the
        mount or the table is read-only; :class:`PathOutside` if no mount contains it.
        """
        p = guest_path(path)
        if not _within(p, self._view):
            raise PathDenied(f"{p} is outside this worker's view {self._view}", path=p, view=self._view)
        m = self._containing(p)
        if m is None:
            raise PathOutside(f"{p} is not inside any mount", path=p, targets=[x.target for x in self._sorted])
        if write:
            if m.read_only:
                raise PathDenied(f"cannot write {p}: the mount {m.describe()} is read-only", path=p, target=m.target,
                                 reason="read_only_mount")
            if self._read_only:
                raise PathDenied(f"cannot write {p}: this worker's access is read-only", path=p, target=m.target,
                                 reason="read_only_view")
        return m, _rel(p, m.target)

    def writable(self, mount: Mount) -> bool:
        """The mount is writable here: neither it nor the table is read-only."""
        return not mount.read_only and not self._read_only

    def _known(self) -> list:
        return [m.label if m.label else i for i, m in enumerate(self._folders)]

    def _unknown(self, key: Any, why: str) -> UnknownDirectory:
        shown = key if isinstance(key, (str, int)) or key is None else repr(key)
        return UnknownDirectory(f"{why}; known folders: {self._known()}", directory=shown, known=self._known())

    def by_directory(self, key: int | str | None) -> Mount:
        """The folder an operation's ``directory`` parameter names.

        ``None``: the first folder; an ``int``: that folder index (``bool`` is refused); a
        ``str``: the folder with that label, else the one mounted at that guest path, else the
        one whose host source is that path. Anything else is :class:`UnknownDirectory`.
        The view is not checked here: resolve a path under the folder for that.
        """
        if isinstance(key, bool):
            raise self._unknown(key, f"directory must be a folder index, label or path, not {key!r}")
        if key is None:
            if not self._folders:
                raise self._unknown(key, "this session has no working folder")
            return self._folders[0]
        if isinstance(key, int):
            if 0 <= key < len(self._folders):
                return self._folders[key]
            raise self._unknown(key, f"no working folder with index {key} (there are {len(self._folders)})")
        if isinstance(key, str):
            if key:
                for m in self._folders:
                    if m.label == key:
                        return m
            if key.startswith("/"):
                try:
                    target = guest_path(key)
                except PathDenied:
                    target = None
                for m in self._folders:
                    if m.target == target:
                        return m
            if key and "\0" not in key:
                norm = posixpath.normpath(key)
                for m in self._folders:
                    if m.source == key or posixpath.normpath(m.source) == norm:
                        return m
            raise self._unknown(key, f"no working folder has the label, guest path or host path {key!r}")
        raise self._unknown(key, f"directory must be a folder index, label or path, not {type(key).__name__}")

    def index_of(self, mount: Mount) -> int:
        """The folder index of ``mount`` (:class:`UnknownDirectory` if it is not one of our folders)."""
        for i, m in enumerate(self._folders):
            if m == mount:
                return i
        target = mount.target if isinstance(mount, Mount) else repr(mount)
        raise self._unknown(target, f"{target} is not a working folder of this session")

    def view_within(self, mount: Mount) -> str | None:
        """The view as a path relative to ``mount``'s root: ``""`` if the whole mount is in
        the view, the subtree if the view lies inside it, None if they do not overlap (what
        :meth:`~sandbox.mounts.provider.Provider.narrowed` takes)."""
        if _within(mount.target, self._view):
            return ""
        if _within(self._view, mount.target):
            return _rel(self._view, mount.target)
        return None

    # -- narrowing

    def restrict(self, subtree: str | None = None, read_only: bool | None = None) -> MountTable:
        """A new table for a sub-worker: the same mounts, a view within ours, read-only or not.

        ``None`` keeps the current value. A ``subtree`` outside the current view, or
        ``read_only=False`` on a read-only table, is :class:`WidenDenied`; a ``subtree`` that
        no mount contains is :class:`PathOutside`.
        """
        if read_only is None:
            ro = self._read_only
        elif not isinstance(read_only, bool):
            raise MountError(f"read_only must be a bool or None, not {type(read_only).__name__}")
        elif self._read_only and not read_only:
            raise WidenDenied("cannot lift read-only: this worker's access is read-only", read_only=True)
        else:
            ro = read_only
        if subtree is None:
            view = self._view
        else:
            view = guest_path(subtree)
            if not _within(view, self._view):
                raise WidenDenied(f"cannot widen the view to {view}: it is outside the current view {self._view}",
                                  view=self._view, requested=view)
            if self._containing(view) is None:
                raise PathOutside(f"cannot restrict to {view}: it is not inside any mount", path=view)
        return MountTable(self._given, view=view, read_only=ro)

    # -- live mounts (seed 000)

    def with_mount(self, mount: Mount) -> MountTable:
        """A new table with ``mount`` added after the others (same view and read-only flag).

        The usual checks apply (unique target, name and label, at most :data:`MAX_MOUNTS`):
        a violation is :class:`MountError`; this table is unchanged either way."""
        if not isinstance(mount, Mount):
            raise MountError(f"with_mount needs a Mount, not {type(mount).__name__}")
        return MountTable(self._given + (mount,), view=self._view, read_only=self._read_only)

    def without(self, target: str) -> MountTable:
        """A new table without the mount at ``target``; :class:`MountError` if none is there.
        Folder indexes of the remaining folders keep their order."""
        t = _config_path(target, "mount target")
        kept = tuple(m for m in self._given if m.target != t)
        if len(kept) == len(self._given):
            raise MountError(f"no mount at {t}", target=t)
        return MountTable(kept, view=self._view, read_only=self._read_only)

    # -- serialisation

    def as_dict(self) -> dict:
        """JSON-able form; ``mounts`` in the caller's order (so folder indexes survive :meth:`from_dict`)."""
        return {"view": self._view, "read_only": self._read_only, "mounts": [m.as_dict() for m in self._given]}

    @classmethod
    def from_dict(cls, data: dict) -> MountTable:
        """The inverse of :meth:`as_dict`; malformed input is :class:`MountError`."""
        if not isinstance(data, dict) or not isinstance(data.get("mounts"), list):
            raise MountError("a mount table is a dict with a 'mounts' list")
        fields = ("target", "name", "read_only", "label", "source", "kind")
        mounts = []
        for i, m in enumerate(data["mounts"]):
            if not isinstance(m, dict) or set(m) != set(fields):
                raise MountError(f"mounts[{i}] must be a dict with exactly the keys {', '.join(fields)}", index=i)
            mounts.append(Mount(**m))
        return cls(mounts, view=data.get("view", "/"), read_only=data.get("read_only", False))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MountTable):
            return NotImplemented
        return (self._given, self._view, self._read_only) == (other._given, other._view, other._read_only)

    def __hash__(self) -> int:
        return hash((self._given, self._view, self._read_only))

    def __repr__(self) -> str:
        ro = ", read_only=True" if self._read_only else ""
        return f"MountTable([{', '.join(m.target for m in self._given)}], view={self._view!r}{ro})"


# --------------------------------------------------------------------------- seed 004 config


_DOCKER_MOUNT_KEYS = ("source", "target", "readonly")


def from_docker_style(root: str, *, readonly: bool = False, mounts: Iterable[dict] = (),
                      root_target: str = "/mnt/working/0") -> list[dict]:
    """Seed 004's ``{root, readonly, mounts: [{source, target, readonly}]}`` as working folders.

    Returns ``[{"path", "target", "access", "label"}, …]``: the root at ``root_target``
    (label ``"root"``), then each mount, in the given order, at ``root_target + target``
    (seed 004's targets are relative to the root's virtual ``/``; label = the normalised
    target). ``readonly`` applies to the root only, as in Docker. Every problem is a
    :class:`MountError` naming the field.
    """
    if not isinstance(root, str) or not root or "\0" in root:
        raise MountError(f"root must be a host path (non-empty str), not {root!r}", field="root")
    if not isinstance(readonly, bool):
        raise MountError(f"readonly must be a bool, not {type(readonly).__name__}", field="readonly")
    base = _config_path(root_target, "root_target")
    if base == "/":
        raise MountError("root_target must be below /: the guest's root is not ours", field="root_target")
    if isinstance(mounts, (str, bytes, dict)) or not isinstance(mounts, Iterable):
        raise MountError(f"mounts must be a list of mounts, not {type(mounts).__name__}", field="mounts")
    out = [{"path": root, "target": base, "access": "read_only" if readonly else "read_write", "label": "root"}]
    seen: dict[str, int] = {}
    for i, m in enumerate(mounts):
        where = f"mounts[{i}]"
        if not isinstance(m, dict):
            raise MountError(f"{where} must be a dict with source and target, not {type(m).__name__}", field=where)
        extra = sorted(map(str, set(m) - set(_DOCKER_MOUNT_KEYS)))
        if extra:
            raise MountError(f"{where} has unknown keys {extra} (allowed: {', '.join(_DOCKER_MOUNT_KEYS)})",
                             field=where)
        source, target, ro = m.get("source"), m.get("target"), m.get("readonly", False)
        if not isinstance(source, str) or not source or "\0" in source:
            raise MountError(f"{where}.source must be a host path (non-empty str), not {source!r}",
                             field=f"{where}.source")
        if not isinstance(target, str) or not target.startswith("/"):
            raise MountError(f"{where}.target must be an absolute path (start with '/'), not {target!r}",
                             field=f"{where}.target")
        if not isinstance(ro, bool):
            raise MountError(f"{where}.readonly must be a bool, not {type(ro).__name__}", field=f"{where}.readonly")
        rel = _config_path(target, f"{where}.target")
        if rel == "/":
            raise MountError(f"{where}.target {target!r} is the root itself: the root is mounted there already",
                             field=f"{where}.target")
        if rel in seen:
            raise MountError(f"{where}.target {target!r} is the same as mounts[{seen[rel]}].target",
                             field=f"{where}.target")
        seen[rel] = i
        full = _config_path(base + rel, f"{where}.target")
        out.append({"path": source, "target": full, "access": "read_only" if ro else "read_write", "label": rel})
    return out


# --------------------------------------------------------------------------- host check


def check_mount_points(table: MountTable, exists: Callable[[Mount, str], bool]) -> None:
    """Every nested mount's mount point must already exist in the mount it sits in.

    For each mount whose target lies inside another mount's target, ``exists(parent, rel)``
    is asked about the directory ``rel`` of the nearest enclosing mount ``parent``; a
    ``False`` is a :class:`MountError`. Nothing is ever created in a user's folder.
    """
    for m in table.mounts:
        parent = None
        for p in table.mounts:  # shallowest first: the last enclosing one is the nearest
            if p.target != m.target and _within(m.target, p.target):
                parent = p
        if parent is None:
            continue
        rel = _rel(m.target, parent.target)
        if not exists(parent, rel):
            where = parent.source if parent.source is not None else f"the in-memory tree at {parent.target}"
            raise MountError(f"mount target {m.target} is inside {parent.target}: create the directory {rel} in "
                             f"{where} first (mount points are not created in your folders)",
                             target=m.target, parent=parent.target, directory=rel)
