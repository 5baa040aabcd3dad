"""Errors raised by the scheduler.

Every error is a :class:`SchedulerError`, itself a
:class:`transfer_engine.errors.TransferEngineError`, so one ``except`` catches the whole
project. Each docstring states what the failed call leaves behind.
"""

from __future__ import annotations

from transfer_engine.errors import TransferEngineError

__all__ = ["SchedulerError", "NoInstanceError", "UnknownPolicyError", "TraceError"]


class SchedulerError(TransferEngineError):
    """Root of every error the scheduler raises."""


class NoInstanceError(SchedulerError):
    """No live instance of the needed role can take the request (none joined, or every
    one is ejected). Nothing was dispatched; the request may be retried later."""

    def __init__(self, message: str, *, role: str) -> None:
        super().__init__(f"{message} [role={role}]")
        self.role = role


class UnknownPolicyError(SchedulerError, ValueError):
    """A routing policy name is not one of :data:`scheduler.router.POLICIES`. Nothing was
    built."""


class TraceError(SchedulerError, ValueError):
    """A request trace line is malformed (names the file and line). Nothing was loaded."""
