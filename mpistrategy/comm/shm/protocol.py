"""The steps of a group's allreduces, each taken once the shared counters say it may be.

Every rank publishes, on its own counters of :mod:`mpistrategy.comm.shm_flags`:

- ``ARRIVED``: the chunks of its inputs that the others can read (numbered across operations: chunk c of an
  operation counts as ``base + c + 1``);
- ``REDUCED``: the chunks it has summed, so that it has read every rank's part of them (and, for a write-back,
  which chunks it has read);
- ``DONE``: the operations it has completed, so that it reads no other rank's tensors of them any more;
- a :class:`Descriptor` of each operation in flight, which tells the others where its input and sums are.

A chunk step (:meth:`CounterProtocol._sum_step`, :meth:`~CounterProtocol._write_back_step`,
:meth:`~CounterProtocol._collect_step`) moves one chunk; the same steps serve both ways of running an operation.
A non-blocking operation (:meth:`CounterProtocol.advance`) takes each step as soon as the counters of that chunk
allow, so that its chunks make a pipeline: a rank sums chunk c while the others still copy in chunk c + 1, and a
summed chunk is still in the shared cache when the others copy it. A blocking one (:meth:`CounterProtocol.run`)
waits once per stage for every rank's whole message, then takes the stage's steps in one straight pass.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from mpistrategy.comm.buffers import DTYPE_CODES
from mpistrategy.comm.errors import CommunicationError
from mpistrategy.comm.shm.operation import ANNOUNCED, CHECKING, COMPLETE, RUNNING, Operation
from mpistrategy.comm.shm.placement import Places
from mpistrategy.comm.shm.plan import OVER_INPUT, OWNERS, STAGING, STAGING_AND_TARGET, TARGET, WRITE_BACK
from mpistrategy.comm.shm.sums import Scratch, rank_order_sum
from mpistrategy.comm.shm_flags import ARRIVED, DONE, REDUCED, Flags, reached

_BLOCKING, _SUMMED_IN_PLACE = 1, 2  # bits of a descriptor's last field
_KIND = {False: "non-blocking", True: "blocking"}

#: the protocols with operations in flight in this process: a rank that waits advances them all
_busy: set[CounterProtocol] = set()


class Descriptor(NamedTuple):
    """What a rank tells the others about one operation: its number, message, and where its input and its sums
    are (segment id and byte offset; segment -1: sums that nobody else reads)."""

    seq: int
    numel: int
    dtype_code: int
    input_segment: int
    input_offset: int
    result_segment: int
    result_offset: int
    blocking: bool
    summed_in_place: bool  # its sums overwrite its input in a window (Results.OVER_INPUT)

    @classmethod
    def read(cls, flags: Flags, rank: int, seq: int) -> Descriptor:
        """Rank ``rank``'s descriptor in the slot of operation ``seq``."""
        number, numel, code, input_segment, input_offset, result_segment, result_offset, bits = flags.descriptor(
            rank, seq
        )
        blocking, summed_in_place = bool(bits & _BLOCKING), bool(bits & _SUMMED_IN_PLACE)
        return cls(
            number, numel, code, input_segment, input_offset, result_segment, result_offset, blocking, summed_in_place
        )


def publish_descriptor(
    flags: Flags,
    seq: int,
    numel: int,
    dtype_code: int,
    input_at: tuple[int, int],
    result_at: tuple[int, int],
    blocking: bool,
    summed_in_place: bool,
) -> None:
    """Write this rank's :class:`Descriptor` of operation ``seq`` into its slot (``input_at`` and ``result_at``:
    segment id and byte offset)."""
    bits = blocking * _BLOCKING | summed_in_place * _SUMMED_IN_PLACE
    flags.describe(seq, (seq, numel, dtype_code, *input_at, *result_at, bits))


class CounterProtocol:
    """The operations of one group on this rank: those in flight, their chunk steps, and waiting for the counters.

    Args:
        flags: the group's counters.
        places: where the group's ranks' tensors are.

    Attributes:
        flight: the non-blocking operations started and not complete, in order.
        lock: held by every call that steps the group's operations (a rank may wait in several threads).
        scratch: this rank's private scratch memory for the sums.
    """

    def __init__(self, flags: Flags, places: Places) -> None:
        self.flags = flags
        self.rank, self.size = flags.rank, flags.size
        self.places = places
        self.scratch = Scratch()
        self.flight: collections.deque[Operation] = collections.deque()
        self.lock = threading.RLock()

    # ------------------------------------------------------------------------------------------------ waiting

    def wait_until(self, done: Callable[[], bool]) -> None:
        """Advance until ``done()``, asleep while nothing is ready (see :meth:`Flags.wait_until`), advancing the
        operations of the other groups between sleeps: they may be what a peer waits for."""
        self.flags.wait_until(done, self.advance, self._advance_others)

    def _advance_others(self) -> None:
        for protocol in list(_busy):
            if protocol is not self and protocol.lock.acquire(blocking=False):
                try:
                    protocol.advance()
                finally:
                    protocol.lock.release()

    def publish_and_wait_for_all(self, counter: int, value: int) -> None:
        """Publish this rank's ``counter`` at ``value`` and wait until every rank's has reached it (then what every
        rank wrote before publishing is visible here)."""
        flags = self.flags
        flags.publish(counter, value)
        if not flags.all_reached(counter, value):
            self.wait_until(lambda: flags.all_reached(counter, value))
        flags.acquire()

    def enqueue(self, operation: Operation) -> None:
        """Put a non-blocking operation in flight (after the earlier ones)."""
        self.flight.append(operation)
        _busy.add(self)

    def test(self, operation: Operation) -> bool:
        """Advance without blocking; whether ``operation`` is complete."""
        with self.lock:
            self.advance()
            return operation.phase is COMPLETE

    def wait(self, operation: Operation) -> None:
        """Block until ``operation`` is complete."""
        with self.lock:
            self.flags.poke()
            self.wait_until(lambda: operation.phase is COMPLETE)

    # ----------------------------------------------------------------------------------------- blocking: run

    def run(self, operation: Operation) -> None:
        """Complete a blocking operation in one pass: wait for every input, sum this rank's chunks, wait for every
        rank's sums (or, for a write-back, for every rank to have read the inputs), write back or copy the others'
        sums, and wait for the others to finish where they still read this rank's tensor.

        When every rank reduces a tensor in a window in place, each owner writes its sums into every rank's tensor
        instead (only the owner of a chunk reads that chunk of any rank): then, once every rank's sums are
        written, each rank's tensor holds the result and nobody reads it any more, one wait fewer."""
        flags, plan, base = self.flags, operation.plan, operation.base
        arrived = base + plan.chunks
        if not flags.all_reached(ARRIVED, arrived):
            self.wait_until(lambda: flags.all_reached(ARRIVED, arrived))
        self._resolve(operation)
        for chunk in plan.summed_here:
            self._sum_step(operation, chunk)
        if operation.pushed:
            self.publish_and_wait_for_all(REDUCED, base + plan.chunks)
            flags.publish(DONE, operation.seq)
            return
        if plan.summing is OWNERS or plan.results is WRITE_BACK:
            self.publish_and_wait_for_all(REDUCED, base + plan.chunks)  # every rank's sums written, inputs read
        else:
            flags.store(REDUCED, base + plan.chunks)
        if plan.results is WRITE_BACK:  # one chunk: every rank sums at most EVERYONE_SUMS_BYTES
            self._write_back_step(operation, 0)
        elif plan.summing is OWNERS:
            for chunk in range(plan.chunks):
                self._collect_step(operation, chunk)
        if operation.waits_for_readers:
            self.publish_and_wait_for_all(DONE, operation.seq)  # no peer reads this rank's tensor any more
        else:
            flags.publish(DONE, operation.seq)

    # ------------------------------------------------------------------------------------ non-blocking: advance

    def advance(self) -> bool:
        """Take every step that is ready (sums, copies of sums, completions) without waiting; whether any was."""
        summed = self._sum_ready_chunks()
        collected = self._collect_ready_sums()
        completed = self._complete_announced()
        return summed or collected or completed

    def _sum_ready_chunks(self) -> bool:
        """Sum each chunk of this rank's whose inputs every rank has published (announcing it in ``REDUCED``),
        and write back each sum waiting in scratch that every rank has read the inputs of; operations in order."""
        progressed = False
        flags = self.flags
        for operation in self.flight:
            if operation.phase is CHECKING:
                return progressed
            plan, base = operation.plan, operation.base
            while operation.next_sum < plan.chunks:
                chunk = operation.next_sum
                if operation.sum_in_scratch:
                    if not flags.all_reached(REDUCED, base + chunk + 1):
                        return progressed
                    self._write_back_step(operation, chunk)
                    operation.sum_in_scratch = False
                    operation.next_sum = chunk + plan.summed_here.step
                    progressed = True
                    continue
                if not flags.all_reached(ARRIVED, base + chunk + 1):
                    return progressed
                if operation.views.inputs is None:
                    self._resolve(operation)
                self._sum_step(operation, chunk)
                if plan.results is WRITE_BACK:
                    operation.sum_in_scratch = True
                else:
                    operation.next_sum = chunk + plan.summed_here.step
                flags.publish(REDUCED, base + chunk + 1)  # this rank has read every rank's chunk
                progressed = True
        return progressed

    def _collect_ready_sums(self) -> bool:
        """Copy into the target each sum that its owner has announced, in chunk order, and announce each operation
        whose sums this rank has all (``DONE``); operations in order."""
        progressed = False
        flags, rank = self.flags, self.rank
        for operation in self.flight:
            plan = operation.plan
            owners = plan.summing is OWNERS
            if operation.phase is CHECKING or (not owners and operation.next_sum < plan.chunks):
                return progressed
            while owners and operation.next_collect < plan.chunks:
                chunk = operation.next_collect
                owner = plan.owners[chunk]
                if owner == rank:
                    if operation.next_sum <= chunk:
                        return progressed
                else:
                    if not reached(flags.value(owner, REDUCED), operation.base + chunk + 1):
                        return progressed
                    flags.acquire()
                    if operation.views.inputs is None:
                        self._resolve(operation)
                self._collect_step(operation, chunk)
                operation.next_collect = chunk + 1
                progressed = True
            if operation.phase is RUNNING:
                flags.publish(DONE, operation.seq)
                operation.phase = ANNOUNCED
                progressed = True
        return progressed

    def _complete_announced(self) -> bool:
        """Complete the announced operations at the front of the flight, once no rank reads their tensors."""
        progressed = False
        while self.flight and self.flight[0].phase is ANNOUNCED:
            operation = self.flight[0]
            if operation.waits_for_readers and not self.flags.all_reached(DONE, operation.seq):
                break
            self.flight.popleft()
            operation.phase = COMPLETE
            progressed = True
        if not self.flight:
            _busy.discard(self)
        return progressed

    # ------------------------------------------------------------------------------------------- chunk steps

    def _sum_step(self, operation: Operation, chunk: int) -> None:
        """Sum ``chunk`` of every rank's input in rank order into where this rank's sum goes (see
        :class:`~mpistrategy.comm.shm.plan.Results`): scratch for a write-back, the target, or the shared result
        (and the target too, or every other rank's input when the sums are pushed)."""
        views, results = operation.views, operation.plan.results
        assert views.inputs is not None, "summed only once the others' descriptors are read"
        parts = [inputs[chunk] for inputs in views.inputs]
        outputs: tuple[torch.Tensor, ...]
        if results is WRITE_BACK:
            outputs = (self._write_back_scratch(views.target[chunk]),)
        elif results is TARGET:
            outputs = (views.target[chunk],)
        elif results is STAGING_AND_TARGET:
            outputs = (views.result[chunk], views.target[chunk])
        elif operation.pushed:
            assert views.results is not None, "pushed is known once the others' descriptors are read"
            others = (shared[chunk] for peer, shared in enumerate(views.results) if peer != self.rank)
            outputs = (views.result[chunk], *others)
        else:
            outputs = (views.result[chunk],)
        rank_order_sum(outputs, parts, operation.scale, self.rank, self.scratch)

    def _write_back_step(self, operation: Operation, chunk: int) -> None:
        """Overwrite ``chunk`` of this rank's input with its sum, kept in scratch until every rank read it."""
        target = operation.views.target[chunk]
        target.copy_(self._write_back_scratch(target))

    def _write_back_scratch(self, chunk: torch.Tensor) -> torch.Tensor:
        return self.scratch.rows(chunk.dtype, 1, chunk.numel(), "write back")[0]

    def _collect_step(self, operation: Operation, chunk: int) -> None:
        """Bring the sum of ``chunk`` into this rank's target: copied from its owner's result, unless the owner
        wrote it there (pushed, or this rank's own sum written to the target as it was summed)."""
        views, owner = operation.views, operation.plan.owners[chunk]
        if owner != self.rank:
            if not operation.pushed:
                assert views.results is not None, "collected only once the others' descriptors are read"
                views.target[chunk].copy_(views.results[owner][chunk])
        elif operation.plan.results is STAGING:
            views.target[chunk].copy_(views.result[chunk])

    # ------------------------------------------------------------------------------------ the others' chunks

    def _resolve(self, operation: Operation) -> None:
        """Every rank's input and result chunks of ``operation``, from their descriptors; raises
        :class:`CommunicationError` when a rank describes another message or the other kind of call."""
        self.flags.acquire()
        plan, views = operation.plan, operation.views
        owners = plan.summing is OWNERS
        inputs, results = [], []
        pushed = plan.results is OVER_INPUT
        layout = (plan.numel, operation.dtype, plan.step)  # of every rank's chunks
        for rank in range(self.size):
            if rank == self.rank:
                inputs.append(views.own)
                results.append(views.result)
                continue
            described = Descriptor.read(self.flags, rank, operation.seq)
            pushed = pushed and described.summed_in_place
            self._check(operation, rank, described)
            inputs.append(self.places.chunks_of(rank, described.input_segment, described.input_offset, *layout))
            if owners:
                results.append(self.places.chunks_of(rank, described.result_segment, described.result_offset, *layout))
        views.inputs = inputs
        views.results = results if owners else None
        operation.pushed = pushed
        operation.waits_for_readers = plan.waits_for_readers and not pushed

    def _check(self, operation: Operation, rank: int, described: Descriptor) -> None:
        dtype, numel = operation.dtype, operation.plan.numel
        code = described.dtype_code
        if (described.seq, described.numel, code) != (operation.seq, numel, DTYPE_CODES.index(dtype)):
            raise CommunicationError(
                f"shared-memory allreduce: rank {rank} of the node is at operation {described.seq} with "
                f"{described.numel} elements of {DTYPE_CODES[code] if 0 <= code < len(DTYPE_CODES) else code}, this "
                f"rank at operation {operation.seq} with {numel} of {dtype}; every rank must call allreduce with "
                "the same shape and dtype, in the same order."
            )
        if described.blocking != operation.blocking:  # seen alike by both ranks: both drop the operation
            self._abandon(operation)
            raise CommunicationError(
                f"shared-memory allreduce: rank {rank} of the node called the {_KIND[described.blocking]} allreduce "
                f"where this rank called the {_KIND[operation.blocking]} one (operation {described.seq}); every "
                "rank must call allreduce, or every rank iallreduce, in the same order."
            )

    def _abandon(self, operation: Operation) -> None:
        """Drop ``operation`` before any rank has read another's data, as done (every rank drops it alike)."""
        if self.flight and self.flight[0] is operation:
            self.flight.popleft()
        if not self.flight:
            _busy.discard(self)
        self.flags.publish(DONE, operation.seq)
