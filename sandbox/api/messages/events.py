"""The payload of every STDIO event (open: a later version may add fields), by name: :data:`EVENTS`."""

from __future__ import annotations

from .fields import NonNeg, Open, Pos, SafeguardKind, Stream
from .shapes import InFolder


class StepCompleted(InFolder):
    schema_name = "event.step_completed"
    step_id: int
    step_type: str = None
    exit_code: int | None
    affected_paths: list[str]
    paths_count: NonNeg = None
    unprotected: bool = None


class TerminalOutput(Open):
    schema_name = "event.terminal_output"
    stream: Stream
    data: str
    step_id: int | None = None


class AgentOutput(TerminalOutput):
    schema_name = "event.agent_output"


class Warning(InFolder):  # noqa: A001 - the event's name
    schema_name = "event.warning"
    message: str
    code: str = None


class Error(Warning):
    schema_name = "event.error"


class SafeguardTriggered(InFolder):
    """A safeguard holds a step (its processes frozen) until a client answers safeguard.confirm
    or ``timeout_seconds`` pass (then denied)."""

    schema_name = "event.safeguard_triggered"
    safeguard_id: str
    step_id: int
    kind: SafeguardKind
    count: Pos
    delete_count: int | None = None
    path: str = None
    sample_paths: list[str]
    message: str
    timeout_seconds: float = None


class ExternalModification(InFolder):
    schema_name = "event.external_modification"
    paths: list[str]
    barrier_id: int | None
    policy: str = None


class Recovery(InFolder):
    schema_name = "event.recovery"
    paths_restored: NonNeg
    step_id: int | None = None
    message: str = None


class UndoVersionMismatch(InFolder):
    schema_name = "event.undo_version_mismatch"
    message: str


#: event name -> its payload model
EVENTS: dict[str, type[Open]] = {m.schema_name: m for m in (
    StepCompleted, TerminalOutput, AgentOutput, Warning, Error, SafeguardTriggered, ExternalModification, Recovery,
    UndoVersionMismatch)}
