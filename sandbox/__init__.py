"""sandbox — let an AI coding agent loose on a real project without fear.

The embedding API (everything else is internal and may move):

* :class:`Sandbox` — a whole session (a guest, host volumes, undo, live mounts), async;
  :class:`SyncSandbox` the same for scripts; :class:`Volume`, :class:`StepResult`,
  :class:`VirtualFileSystem`/:class:`FileStat` (trees an embedder mounts), :class:`Guest`;
* :class:`Workspace` — the undo core for one working folder.
* :class:`Limits`, :class:`SafeguardConfig` — its configuration.
* the errors below, each with a stable ``code``.
"""

from .core.errors import (
    BarrierInTheWay,
    CorruptStep,
    ExternalChange,
    HoldRequired,
    NothingToUndo,
    RollbackIncomplete,
    SafeguardDenied,
    SandboxError,
    StepError,
    StepUnprotected,
    UndoError,
    UndoUnavailable,
)
from .core.safeguard import Hold, SafeguardConfig
from .core.store import Limits
from .core.workspace import Workspace
from .hostfs import PathError, StoreBusy

__version__ = "0.1.0"

# the session layer is imported on first use: the undo core alone stays light
_LAZY = {
    "Sandbox": "sandbox.sdk", "SyncSandbox": "sandbox.sdk", "Volume": "sandbox.sdk",
    "StepResult": "sandbox.sdk", "Output": "sandbox.sdk",
    "VirtualFileSystem": "sandbox.mounts.vfs", "FileStat": "sandbox.mounts.vfs",
    "Guest": "sandbox.session.guest", "MountError": "sandbox.mounts.table", "SessionError": "sandbox.session.runtime",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sandbox' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Sandbox", "SyncSandbox", "Volume", "StepResult", "Output", "VirtualFileSystem", "FileStat", "Guest",
    "MountError", "SessionError",
    "Workspace", "Limits", "SafeguardConfig", "Hold",
    "SandboxError", "UndoError", "NothingToUndo", "UndoUnavailable", "BarrierInTheWay", "ExternalChange",
    "StepUnprotected", "CorruptStep", "RollbackIncomplete", "StepError", "HoldRequired", "SafeguardDenied", "PathError", "StoreBusy",
]
