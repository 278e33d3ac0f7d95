"""Moved to :mod:`sandbox.serving.locks` (shared by every protocol server); kept for imports."""

from ..serving.locks import INF, LOCKS_MAX, RDLCK, UNLCK, WRLCK, LockTable, Range

__all__ = ["INF", "LOCKS_MAX", "RDLCK", "UNLCK", "WRLCK", "LockTable", "Range"]
