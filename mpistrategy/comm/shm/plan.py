"""The plan of one allreduce through shared memory: how the message is cut into chunks, which rank sums each
chunk, and where the sums go.

:func:`plan_allreduce` is a pure function of the message (elements, bytes per element), the ranks (how many, which
one this is) and where this rank's tensors are. The part that every rank must share, the chunks and who sums them
(:class:`Summing`), depends on the message and the number of ranks alone, so every rank follows the same one:

- :attr:`Summing.OWNERS` (larger messages): chunk c belongs to rank c mod P, which sums it from every rank's input
  and announces it; every other rank copies it from there. Every input is read once, with two waits for the others
  (their inputs there, their sums there).
- :attr:`Summing.EVERY_RANK` (messages of at most :data:`EVERYONE_SUMS_BYTES` of others' input per rank, and every
  message on one rank): every rank sums every chunk itself, straight into its result, with one wait.

Where this rank's sums go (:class:`Results`) depends on its own tensors too: its input in a shared window, in
private host memory or on a device (:class:`Source`), reduced in place or into another tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

#: bytes per chunk: one chunk of every rank stays in the 32 MB L3 cache with room to spare, and the Python cost
#: per chunk (a few torch calls, 20-40 µs) stays small next to moving it
CHUNK_BYTES = 1 << 20
#: bytes: chunk boundaries on cache lines
CHUNK_ALIGN = 64
#: every rank sums the whole message when it reads at most this many bytes of the others' inputs
EVERYONE_SUMS_BYTES = 256 << 10


class Summing(Enum):
    """Which rank sums which chunk (the same on every rank)."""

    EVERY_RANK = "every rank sums every chunk into its own result"
    OWNERS = "chunk c is summed by rank c mod P; the others copy its sum"


class Source(Enum):
    """Where this rank's input is, and so where the others read it."""

    WINDOW = "in a shared segment that every rank of the group takes part in: read where it is"
    HOST = "private host memory: copied into staging, but this rank reads its own chunks from the tensor"
    DEVICE = "device memory: copied into staging, where this rank reads it too"

    # a member equals only itself: hashed by identity, without the Python call of Enum's hash by name (every
    # operation looks its plan up by its source)
    __hash__ = object.__hash__


class Results(Enum):
    """Where this rank's sums go."""

    OVER_INPUT = (
        "owners, an input in a window reduced in place: each owner writes its sums over its input, and into every "
        "rank's input when every rank reduces in place (then nobody reads a rank's input afterwards)"
    )
    WRITE_BACK = (
        "every rank sums, an input in a window reduced in place: each sum waits in scratch until every rank has "
        "read that chunk, then overwrites the input"
    )
    STAGING_AND_TARGET = (
        "owners: each sum goes to this rank's staging, where the others copy it from, and to the target in the "
        "same pass"
    )
    STAGING = "owners, a target on a device: the sums go to staging and reach the target with the others' copies"
    TARGET = "every rank sums straight into its target"


# The members as module constants, for the code that compares them on every operation and chunk: before Python
# 3.12, each attribute lookup on an Enum class (``Results.TARGET``) takes the slow path of EnumType.__getattr__.
EVERY_RANK, OWNERS = Summing.EVERY_RANK, Summing.OWNERS
WINDOW, HOST, DEVICE = Source.WINDOW, Source.HOST, Source.DEVICE
OVER_INPUT, WRITE_BACK, STAGING_AND_TARGET = Results.OVER_INPUT, Results.WRITE_BACK, Results.STAGING_AND_TARGET
STAGING, TARGET = Results.STAGING, Results.TARGET


@dataclass(frozen=True)
class Plan:
    """One rank's plan of one allreduce (built by :func:`plan_allreduce`). What follows from the attributes is
    worked out once per plan (the plans are remembered, and operations repeat).

    Attributes:
        size: the ranks P.
        rank: this rank.
        numel: the elements of the message.
        step: the elements per chunk (the last chunk may be shorter).
        chunks: the number of chunks, ``ceil(numel / step)``.
        summing: which rank sums which chunk.
        source: where this rank's input is.
        results: where this rank's sums go.
    """

    size: int
    rank: int
    numel: int
    step: int
    chunks: int
    summing: Summing
    source: Source
    results: Results

    @functools.cached_property
    def owners(self) -> tuple[int, ...]:
        """For every chunk, the rank whose sum of it this rank's result gets: rank ``chunk mod P``, which sums it
        for every rank, or this rank itself when every rank sums every chunk."""
        if self.summing is Summing.OWNERS:
            return tuple(chunk % self.size for chunk in range(self.chunks))
        return (self.rank,) * self.chunks

    @functools.cached_property
    def summed_here(self) -> range:
        """The chunks this rank sums, in order: its own (``rank``, ``rank + P``, ...) or all."""
        if self.summing is Summing.OWNERS:
            return range(self.rank, self.chunks, self.size)
        return range(self.chunks)

    @functools.cached_property
    def copies_in(self) -> bool:
        """Whether this rank copies its input into staging (else the others read it where it is)."""
        return self.source is not Source.WINDOW

    @functools.cached_property
    def staged(self) -> tuple[int, ...]:
        """The chunks of its input this rank copies into staging, in order: every chunk of an input that is copied
        in, but for a host input not its own chunks when each chunk has an owner (only it reads them, from the
        tensor)."""
        if self.source is Source.WINDOW:
            return ()
        if self.source is Source.HOST and self.summing is Summing.OWNERS:
            return tuple(chunk for chunk in range(self.chunks) if chunk % self.size != self.rank)
        return tuple(range(self.chunks))

    @functools.cached_property
    def sums_in_staging(self) -> bool:
        """Whether this rank's sums go to its staging (where the others copy them from)."""
        return self.results in (Results.STAGING_AND_TARGET, Results.STAGING)

    @functools.cached_property
    def waits_for_readers(self) -> bool:
        """Whether this rank completes only once every rank has: the others still read its tensor after they
        have its chunks (its sums in its input, or its input in a window that the caller may change afterwards)
        and no later wait of this rank's tells it they are done."""
        if self.results is Results.OVER_INPUT:
            return True
        return self.results is Results.TARGET and self.source is Source.WINDOW and self.size > 1


def everyone_sums(nbytes: int, size: int) -> bool:
    """Whether every rank sums the whole message of ``nbytes`` over ``size`` ranks itself (one wait for the
    others' inputs, ``size`` inputs read per rank) rather than each chunk's owner (two waits, one input's worth
    read): up to :data:`EVERYONE_SUMS_BYTES` of others' input per rank."""
    return nbytes * (size - 1) <= EVERYONE_SUMS_BYTES


def chunk_elements(numel: int, itemsize: int, size: int, summing: Summing) -> int:
    """Elements per chunk, cache-line aligned: at most :data:`CHUNK_BYTES`; when each chunk has an owner, at least
    one chunk per rank if the message allows it."""
    align = CHUNK_ALIGN // itemsize
    wanted = -(-numel // size) if summing is Summing.OWNERS else numel
    return max(min(CHUNK_BYTES // itemsize, -(-wanted // align) * align), align)


@functools.lru_cache(maxsize=256)
def plan_allreduce(
    numel: int, itemsize: int, size: int, rank: int, source: Source, in_place: bool, target_on_host: bool
) -> Plan:
    """The plan of rank ``rank`` of ``size`` in an allreduce of ``numel`` elements of ``itemsize`` bytes, its
    input at ``source``, reduced ``in_place`` (the result overwrites the input) or into a target in host memory
    (``target_on_host``) or on a device. Pure (and remembered: operations repeat)."""
    summing = Summing.EVERY_RANK if everyone_sums(numel * itemsize, size) else Summing.OWNERS
    step = chunk_elements(numel, itemsize, size, summing)
    results = _results(summing, source is Source.WINDOW and in_place, size, target_on_host)
    return Plan(size, rank, numel, step, -(-numel // step), summing, source, results)


def _results(summing: Summing, in_window_in_place: bool, size: int, target_on_host: bool) -> Results:
    owners = summing is Summing.OWNERS
    if owners and in_window_in_place:
        return Results.OVER_INPUT
    if in_window_in_place and size > 1:
        return Results.WRITE_BACK
    if owners:
        return Results.STAGING_AND_TARGET if target_on_host else Results.STAGING
    return Results.TARGET
