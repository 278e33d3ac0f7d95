"""Errors of the undo core. Each has a stable ``code`` (``category.name``) for APIs."""

from __future__ import annotations

import errno as _errno


class SandboxError(Exception):
    """Base of every error the sandbox raises on purpose."""

    code = "sandbox.error"

    def __init__(self, message: str, **data):
        super().__init__(message)
        self.message = message
        self.data = data


class UndoError(SandboxError):
    code = "undo.error"


class NothingToUndo(UndoError):
    code = "undo.nothing_to_undo"


class NoSuchStep(UndoError):
    """No finished step in history has this id (never made, undone, evicted or discarded)."""

    code = "undo.no_such_step"


class UndoUnavailable(UndoError):
    """The store's format version is not ours: undo is off until the store is discarded."""

    code = "undo.version_mismatch"


class BarrierInTheWay(UndoError):
    """A recorded external modification sits between now and the target step."""

    code = "undo.barrier"


class ExternalChange(BarrierInTheWay):
    """A path the rollback would touch is not as the sandbox left it."""

    code = "undo.external_change"


class StepUnprotected(UndoError):
    """The step exceeded the single-step size limit; it cannot be rolled back."""

    code = "undo.unprotected"


class CorruptStep(UndoError):
    """A step's manifest, journal or preimage is unreadable."""

    code = "undo.corrupt_step"


class RollbackIncomplete(OSError, UndoError):
    """A rollback (an undo, or recovery of a crashed step) stopped part-way and cannot be
    finished now: the working folder is between two steps. Undo and new steps are refused
    until it finishes — it is retried on every open, undo and step — or the undo history
    is discarded. ``data``: ``step_id``, ``path`` and ``errno`` (name) of the cause when
    known, ``reason``. It is also the ``OSError`` of its cause (``errno``; ``EIO`` for an
    unreadable journal), so callers that handle I/O errors handle it."""

    code = "undo.rollback_incomplete"

    def __init__(self, message: str, os_errno: int | None = None, **data):
        OSError.__init__(self, os_errno if os_errno is not None else _errno.EIO, message)
        self.message = message
        self.data = data

    def __str__(self) -> str:
        return self.message


class StepError(SandboxError):
    code = "step.error"


class HoldRequired(SandboxError):
    """A safeguard holds the operation *before* it runs; resolve it, then retry.

    ``hold`` is the :class:`~sandbox.core.safeguard.Hold` describing it.
    """

    code = "safeguard.hold"

    def __init__(self, hold):
        data = hold.as_dict()
        super().__init__(data.pop("message"), **data)
        self.hold = hold


class SafeguardDenied(OSError, SandboxError):
    """The step was denied by a safeguard and rolled back; the operation fails with EIO."""

    code = "safeguard.denied"

    def __init__(self, message: str):
        OSError.__init__(self, _errno.EIO, message)
        self.message = message
        self.data = {}

    def __str__(self) -> str:
        return self.message
