"""sandbox — let an AI coding agent loose on a real project without fear.

The embedding API (everything else is internal and may move):

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

__all__ = [
    "Workspace", "Limits", "SafeguardConfig", "Hold",
    "SandboxError", "UndoError", "NothingToUndo", "UndoUnavailable", "BarrierInTheWay", "ExternalChange",
    "StepUnprotected", "CorruptStep", "RollbackIncomplete", "StepError", "HoldRequired", "SafeguardDenied", "PathError", "StoreBusy",
]
