"""Exceptions raised by the MPI layer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

E = TypeVar("E", bound=BaseException)


class CommunicationError(RuntimeError):
    """Ranks disagree about a collective (shape, dtype, op or root), another rank's arguments failed their checks,
    or an MPI call failed."""


def by_rank(values: Mapping[int, object] | Iterable[object]) -> str:
    """Each rank's value (a mapping by rank, or one value per rank in rank order), ranks with the same text grouped:
    ``"ranks 0-2, 5: 64; rank 3: 128"``, the groups in the order their first rank is given. A message that lists every
    rank stays one line per distinct value, however many ranks."""
    pairs = values.items() if isinstance(values, Mapping) else enumerate(values)
    groups: dict[str, list[int]] = {}
    for rank, value in pairs:
        groups.setdefault(str(value), []).append(rank)
    return "; ".join(f"{ranks_named(ranks)}: {text}" for text, ranks in groups.items())


def ranks_named(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"ranks 0-2, 5"`` (consecutive ranks as a span), one rank as ``"rank 3"``."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    shown = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in spans)
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def with_note(error: E, note: str) -> E:
    """``error`` with ``note`` added below its message in tracebacks (PEP 678; Python 3.10 shows no note)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    return error
