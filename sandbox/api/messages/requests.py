"""The payload of every STDIO request (closed: an unknown field is refused), by type: :data:`REQUESTS`."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import ConfigDict, Field

from .bounds import (ALLOWLIST_MAX, CONTENT_CHARS_MAX, ENV_ENTRIES_MAX, GUEST_PACKAGES_MAX, INT64_MAX, MEMORY_FILES_MAX,
                     PACKAGE_CHARS_MAX, PATH_CHARS_MAX, PROTOCOL_VERSION_MAX, PYTHON_PATH_MAX,
                     SAFEGUARD_TIMEOUT_S_MAX, SESSION_MOUNTS_MAX, TEXT_CHARS_MAX, UNDO_STEP_COUNT_MAX,
                     WORKING_DIRECTORIES_MAX)
from .fields import (I64, U64, AbsPath, Closed, Encoding, Int, Name, NonEmptyName, Path, SafeguardAction, Str,
                     UPos64)

Env = Annotated[dict[NonEmptyName, Str(TEXT_CHARS_MAX)], Field(max_length=ENV_ENTRIES_MAX)]
StepCount = Int(1, UNDO_STEP_COUNT_MAX)
Directory = Annotated[Union[U64, Path], Field(
    description="A working directory: its index, its label, its guest path or its host path; default the first.")]
Handle = Annotated[U64, Field(description="A handle from fs.open or fs.create_temp (this client's).")]
#: a request id: a short string or a 64-bit integer (echoed back in the response)
RequestId = Union[Name, I64]
FileContents = Annotated[dict[Path, Str(CONTENT_CHARS_MAX)], Field(
    max_length=MEMORY_FILES_MAX, description="relative path -> base64 contents")]
FILE_MODES = ("r", "r+", "w", "w+", "a", "a+", "x", "x+")


class OnDirectory(Closed):
    """A request that acts on one working directory."""

    directory: Directory = None


class SafeguardConfig(Closed):
    schema_name = "safeguard_config"
    delete_threshold: Int(1, INT64_MAX) | None = Field(
        None, description="Deletions in one step that need confirmation (null: off).")
    overwrite_threshold: Int(1, INT64_MAX) | None = Field(
        None, description="Overwrites/truncations of files over overwrite_size_bytes in one step (null: off).")
    overwrite_size_bytes: U64 = None
    rename_over_threshold: Int(1, INT64_MAX) | None = Field(
        None, description="Renames onto an existing destination in one step (null: off).")
    timeout_seconds: float = Field(None, gt=0, le=SAFEGUARD_TIMEOUT_S_MAX,
                                   description="Unanswered holds are denied after this.")


class UndoLimits(Closed):
    schema_name = "undo_limits"
    max_log_size_bytes: UPos64 = None
    max_step_count: StepCount = None
    max_single_step_size_bytes: UPos64 = None


class WorkingDirectory(Closed):
    schema_name = "working_directory"
    path: Path
    label: Name = None
    access: Literal["read_write", "read_only"] = None
    target: AbsPath = None
    state_dir: AbsPath = None  # the folder's undo store (default: beside the user's state, see docs/cli.md)


class MemoryMount(Closed):
    """An in-memory tree mounted into the guest, never undo-tracked (seed 000)."""

    schema_name = "memory_mount"
    path: AbsPath
    files: FileContents
    writable: bool = None
    label: Name = None


class BindMount(Closed):
    schema_name = "bind_mount"
    source: Path
    target: AbsPath
    readonly: bool = None


class Restrict(Closed):
    schema_name = "restrict"
    path: AbsPath = None
    readonly: bool = None


class AgentConfig(Closed):
    schema_name = "agent_config"
    command: Str(TEXT_CHARS_MAX, 1)
    cwd: AbsPath = None
    env: Env = None


class Hello(Closed):
    schema_name = "request.hello"
    protocol_version: Int(1, PROTOCOL_VERSION_MAX)
    client: Name = None


class SessionStart(Closed):
    schema_name = "request.session.start"
    working_directories: list[WorkingDirectory] = Field(None, min_length=1, max_length=WORKING_DIRECTORIES_MAX)
    root: Path = Field(None, description="Seed 004 style: the project folder (with root_target and bind mounts).")
    readonly: bool = None
    root_target: AbsPath = None
    mounts: list[Union[MemoryMount, BindMount]] = Field(None, max_length=SESSION_MOUNTS_MAX)
    python_path: list[AbsPath] = Field(None, max_length=PYTHON_PATH_MAX)
    network_policy: Literal["disabled", "open", "allowlist"] = None
    network_allowlist: list[NonEmptyName] = Field(None, max_length=ALLOWLIST_MAX)
    vm_mode: Literal["ephemeral", "persistent"] = None
    as_root: bool = Field(None, description=(
        "Commands run as root in the guest. Default false: as the unprivileged user `agent` (uid/gid of the first "
        "working directory's owner; 1000 if root owns it), no sudo; the control port and the shim are unreachable "
        "from it."))
    guest_root: Literal["host-usr", "image"] = Field(None, description=(
        "The guest's userland. host-usr (default): the host's /usr read-only and an /etc synthesized from an "
        "allowlist of non-secret files; image: a Debian root built once by mmdebstrap from the host's apt sources "
        "(cached under ~/.cache/sandbox/guest/roots/; the first start downloads its packages)."))
    guest_packages: list[Str(PACKAGE_CHARS_MAX, 2, pattern="^[a-z0-9][a-z0-9+.-]+$")] = Field(
        None, max_length=GUEST_PACKAGES_MAX, json_schema_extra={"uniqueItems": True}, description=(
            "The image root's Debian packages (only with guest_root image; default python3, python3-venv, "
            "python3-pip, git, ca-certificates, build-essential, nftables; python3 is always added)."))
    external_modification_policy: Literal["barrier", "warn", "lock"] = None
    guest: Literal["vm", "scripted", "local"] = Field(None, description=(
        "Where commands run (default: the agent's `sandbox serve --guest`). vm: a QEMU guest; scripted: the test "
        "double (file-operation scripts, no VM); local: no VM — commands run on the host against FUSE mounts of the "
        "working directories at their own paths in a private mount namespace: undo, not isolation."))
    share: Literal["9p", "virtiofs"] = Field(None, description=(
        "How a VM guest reaches the working directories and in-memory mounts. virtiofs (the default on Linux when "
        "QEMU has vhost-user-fs-pci and memfd): a vhost-user-fs device per share, served from its export; 9p: the "
        "9P server through QEMU's guestfwd (the fallback, logged, where virtio-fs is unavailable). Both intercept "
        "every write alike; not with guest local or scripted (they use their own transport)."))
    virtiofs_direct_io: Literal["write-only", "all"] = Field(None, description=(
        "With share virtiofs, which opens skip the guest's page cache. write-only (default): write-only opens of a "
        "file open nowhere else, and every open beside them; shared mmap works. all: every open, as C virtiofsd "
        "cache=none: large reads skip the guest's copy, but a Linux 6.1 guest refuses a shared mmap of any file on "
        "the shares (ENODEV) and each small read is a request."))
    safeguard: SafeguardConfig = None
    undo_limits: UndoLimits = None
    agent: AgentConfig = None
    restrict: Restrict = None
    memory_mb: Int(128, 65536) = None
    cpus: Int(1, 64) = None


class SessionStop(Closed):
    schema_name = "request.session.stop"


class SessionReset(Closed):
    schema_name = "request.session.reset"


class SessionStatus(Closed):
    schema_name = "request.session.status"


class SessionRestrict(Restrict):
    schema_name = "request.session.restrict"


class UndoRollback(OnDirectory):
    schema_name = "request.undo.rollback"
    count: StepCount = None
    force: bool = None


class UndoHistory(OnDirectory):
    schema_name = "request.undo.history"
    limit: StepCount = None


class UndoConfigure(UndoLimits, OnDirectory):
    schema_name = "request.undo.configure"


class UndoDiscard(OnDirectory):
    schema_name = "request.undo.discard"


class UndoDiff(OnDirectory):
    schema_name = "request.undo.diff"
    step_id: I64 | None = Field(None, description="A step of undo.history (default: the newest).")


class AgentExecute(AgentConfig):
    schema_name = "request.agent.execute"


class AgentPrompt(Closed):
    schema_name = "request.agent.prompt"
    text: Str(TEXT_CHARS_MAX)


class AgentCancel(Closed):
    schema_name = "request.agent.cancel"
    request_id: RequestId = None


class FsList(OnDirectory):
    schema_name = "request.fs.list"
    path: Str(PATH_CHARS_MAX) = None


class FsRead(OnDirectory):
    schema_name = "request.fs.read"
    model_config = ConfigDict(json_schema_extra={
        "description": "By path (a range of the file: offset, length) or by handle (length bytes at its position).",
        "oneOf": [{"required": ["path"]}, {"required": ["handle"], "not": {"required": ["offset"]}}]})
    path: Path = None
    handle: Handle = None
    offset: U64 = None
    length: U64 = None
    encoding: Encoding = None


class FsStatus(OnDirectory):
    schema_name = "request.fs.status"


class FsOpen(OnDirectory):
    schema_name = "request.fs.open"
    path: Path
    mode: Literal[FILE_MODES] = None


class FsWrite(OnDirectory):
    schema_name = "request.fs.write"
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["path"]}, {"required": ["handle"]}]})
    path: Path = None
    handle: Handle = None
    data: Str(CONTENT_CHARS_MAX)
    encoding: Encoding = None


class FsSeek(Closed):
    schema_name = "request.fs.seek"
    handle: Handle
    offset: I64
    whence: Literal["set", "cur", "end"] = None


class FsStat(OnDirectory):
    schema_name = "request.fs.stat"
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["path"]}, {"required": ["handle"]}]})
    path: Path = None
    handle: Handle = None


class FsClose(Closed):
    schema_name = "request.fs.close"
    handle: Handle


class FsCreateTemp(Closed):
    schema_name = "request.fs.create_temp"


class FsMkdir(OnDirectory):
    schema_name = "request.fs.mkdir"
    path: Path
    parents: bool = None


class FsRemove(OnDirectory):
    schema_name = "request.fs.remove"
    path: Path
    recursive: bool = None


class FsRename(OnDirectory):
    schema_name = "request.fs.rename"
    src: Path
    dst: Path


class SafeguardConfigure(SafeguardConfig, OnDirectory):
    schema_name = "request.safeguard.configure"


class MountAdd(MemoryMount):
    schema_name = "request.mount.add"


class MountRemove(Closed):
    schema_name = "request.mount.remove"
    path: AbsPath


class SafeguardConfirm(Closed):
    schema_name = "request.safeguard.confirm"
    safeguard_id: NonEmptyName
    action: SafeguardAction


#: request type -> its payload model (the protocol's operations, in this order)
REQUESTS: dict[str, type[Closed]] = {
    m.schema_name.removeprefix("request."): m for m in (
        Hello, SessionStart, SessionStop, SessionReset, SessionStatus, SessionRestrict, UndoRollback, UndoHistory,
        UndoConfigure, UndoDiscard, UndoDiff, AgentExecute, AgentPrompt, AgentCancel, FsList, FsRead, FsStatus,
        FsOpen, FsWrite, FsSeek, FsStat, FsClose, FsCreateTemp, FsMkdir, FsRemove, FsRename, SafeguardConfigure,
        MountAdd, MountRemove, SafeguardConfirm)}
#: the undo limit fields (undo.configure passes exactly these on)
UNDO_LIMIT_FIELDS = tuple(UndoLimits.model_fields)
