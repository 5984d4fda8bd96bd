"""One allreduce on a group: its plan, where its chunks are, and how far it got.

A non-blocking operation goes through the :class:`Phase` values in order; a blocking one runs from
:attr:`Phase.RUNNING` to :attr:`Phase.COMPLETE` in one call. While it runs, :attr:`Operation.next_sum` and
:attr:`Operation.next_collect` say which chunk it sums, and which sum it copies into its target, next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from mpistrategy.comm.buffers import deliver
from mpistrategy.comm.shm.plan import Plan

Chunks = tuple[torch.Tensor, ...]


class Phase(Enum):
    """How far an operation got on this rank."""

    CHECKING = "its argument check is not compared yet: it reads no other rank's data"
    RUNNING = "it sums its chunks and collects the others' sums as they become ready"
    ANNOUNCED = "this rank is done with it (DONE published); it waits until no rank reads its tensors any more"
    COMPLETE = "its result is ready"


# The members as module constants, for the code that compares them on every step (see plan.OWNERS)
CHECKING, RUNNING, ANNOUNCED, COMPLETE = Phase.CHECKING, Phase.RUNNING, Phase.ANNOUNCED, Phase.COMPLETE


@dataclass(eq=False, slots=True)
class Views:
    """Where an operation's chunks are on this rank: tuples of flat views, one per chunk."""

    source: Chunks = ()  # this rank's input in shared memory: a window, or its staging
    own: Chunks = ()  # where this rank sums its own input from: the source, or the host tensor itself
    result: Chunks = ()  # where this rank's sums go for the others to copy (each chunk has an owner)
    target: Chunks = ()  # where every sum ends up on this rank
    inputs: list[Chunks] | None = None  # every rank's input, once the others' descriptors are read
    results: list[Chunks] | None = None  # every rank's result, likewise (each chunk has an owner)


@dataclass(eq=False, slots=True)
class Operation:
    """One allreduce on this rank.

    Attributes:
        plan: its plan.
        blocking: completed in one call (:meth:`SharedMemoryGroup.allreduce`), else step by step.
        scale: what the sum is multiplied by: 1 (sum) or 1/P (avg).
        dtype, device: the input's, which the result keeps.
        out: the caller's ``out`` tensor, or ``None``.
        target: the result tensor (``out`` itself where it can take the sums).
        seq: its number on the group (1, 2, ...; 0: an empty message, which is not numbered).
        base: the chunks of the group's operations before it: its chunk c is counted as ``base + c + 1``.
        views: where its chunks are.
        phase: how far it got.
        next_sum: the next chunk this rank sums (from ``plan.summed_here``).
        sum_in_scratch: the sum of ``next_sum`` waits in scratch until every rank has read that chunk
            (:attr:`~mpistrategy.comm.shm.plan.Results.WRITE_BACK`).
        next_collect: the next chunk whose sum this rank copies into its target (each chunk has an owner).
        pushed: every rank reduces in place in a window
            (:attr:`~mpistrategy.comm.shm.plan.Results.OVER_INPUT`), so every owner writes its sums into every
            rank's input (known once the others' descriptors are read).
        waits_for_readers: this rank must see every rank's DONE before completing
            (:attr:`~mpistrategy.comm.shm.plan.Plan.waits_for_readers`), unless the sums were pushed: then no
            rank reads another's tensor afterwards.
    """

    plan: Plan
    blocking: bool
    scale: float
    dtype: torch.dtype
    device: torch.device
    out: torch.Tensor | None
    target: torch.Tensor | None
    seq: int = 0
    base: int = 0
    views: Views = field(default_factory=Views)
    phase: Phase = CHECKING
    next_sum: int = 0
    sum_in_scratch: bool = False
    next_collect: int = 0
    pushed: bool = False
    waits_for_readers: bool = False

    def result(self) -> torch.Tensor:
        """The allreduce's result, once complete: ``out`` or a new tensor, in the input's dtype and device."""
        assert self.target is not None, "released"
        return deliver(self.target, self.out, self.dtype, self.device, "allreduce")

    def release(self) -> None:
        """Drop the references to the tensors it used."""
        views = self.views
        views.source = views.own = views.result = views.target = ()
        views.inputs = views.results = None
        self.out = self.target = None
