"""Exceptions raised by the MPI layer."""

from __future__ import annotations

from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class CommunicationError(RuntimeError):
    """Ranks disagree about a collective (shape, dtype, op or root), another rank's arguments failed their checks,
    or an MPI call failed."""


def with_note(error: E, note: str) -> E:
    """``error`` with ``note`` added below its message in tracebacks (PEP 678; Python 3.10 shows no note)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    return error
