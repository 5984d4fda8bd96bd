"""A group: the ranks of one communicator channel that share memory, and the allreduces they run together.

:class:`SharedMemoryGroup` numbers each operation, plans it (:func:`~mpistrategy.comm.shm.plan.plan_allreduce`),
puts its input where the others read it (a tensor in a window where it is, any other copied into the rank's
staging, chunk by chunk, each chunk announced as soon as it is there), describes it to the others and hands it to
its :class:`~mpistrategy.comm.shm.protocol.CounterProtocol`, which completes it. Operations complete in the order
they started; non-blocking ones progress whenever this process calls into a group (start, test, wait), as MPI's do
when the library is called.

The argument check of an allreduce goes through the group's flags too (:meth:`SharedMemoryGroup.exchange_check`);
when the allreduce that follows goes through the same group, the check is only posted
(:meth:`SharedMemoryGroup.defer_check`) and compared once that allreduce's input is copied in: one wait instead
of two.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import NoReturn

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.comm import rank_sum
from mpistrategy.comm.buffers import DTYPE_CODES, materialized, receive_buffer, same_memory
from mpistrategy.comm.communicator import world_ranks
from mpistrategy.comm.shm.operation import CHECKING, COMPLETE, RUNNING, Operation
from mpistrategy.comm.shm.placement import Places, split
from mpistrategy.comm.shm.plan import DEVICE, HOST, OVER_INPUT, WINDOW, WRITE_BACK, plan_allreduce
from mpistrategy.comm.shm.protocol import CounterProtocol, publish_descriptor
from mpistrategy.comm.shm.settings import require_alike
from mpistrategy.comm.shm.staging import Staging
from mpistrategy.comm.shm_flags import ARRIVED, CHECKED, DONE, RING, Flags
from mpistrategy.comm.shm_window import Segment


class SharedWork:
    """A shared-memory allreduce in flight (the interface of :class:`~mpistrategy.collectives.handles.Pending`)."""

    __slots__ = ("_operation", "_protocol", "_result")

    def __init__(self, protocol: CounterProtocol, operation: Operation) -> None:
        self._protocol = protocol
        self._operation = operation
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Block until the allreduce is complete; return its result."""
        if self._result is None:
            self._protocol.wait(self._operation)
            self._result = self._operation.result()
            self._operation.release()
        return self._result

    def test(self) -> bool:
        """Advance the group's work without blocking; whether this allreduce is complete."""
        return self._result is not None or self._protocol.test(self._operation)


class _ChecksDiffer(Exception):
    """The ranks' argument checks differ; ``report`` raises the error every rank raises."""

    def __init__(self, report: Callable[[], NoReturn]) -> None:
        super().__init__("ranks disagree on an allreduce")
        self.report = report


class SharedMemoryGroup:
    """The ranks of one communicator channel that share memory: their flags, staging memory and operations.

    Built by :func:`~mpistrategy.comm.shm.registry.group_for` (collective over the channel); every rank must
    call the same operations on it in the same order.

    Attributes:
        comm: the group's own communicator (the channel's ranks, in its order).
        rank, size: this rank and the number of ranks.
        seq: the operations started (of a non-empty message).
    """

    @classmethod
    def create(cls, channel: MPI.Intracomm) -> SharedMemoryGroup | None:
        """The group of ``channel``'s ranks, or ``None`` when they do not all share this machine's memory
        (collective over ``channel``; ranks with different settings raise the same error)."""
        shared = channel.Split_type(MPI.COMM_TYPE_SHARED, key=channel.Get_rank())
        if shared.Get_size() != channel.Get_size():
            shared.Free()
            return None
        try:
            require_alike(shared, True, "shared-memory allreduce")
        except ValueError:
            shared.Free()
            raise
        return cls(shared)  # type: ignore[arg-type]  # mpi4py types Split_type's result as Comm

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._flags = Flags(comm)
        self._places = Places(world_ranks(comm))
        self._protocol = CounterProtocol(self._flags, self._places)
        self._staging = Staging(comm, self._before_staging_grows)
        self.seq = 0
        self._chunk_count = 0  # chunks of the operations started (what ARRIVED and REDUCED count)
        self._check_rounds = 0  # argument checks posted
        self._deferred: tuple[int, Callable[[], NoReturn]] | None = None  # a posted check not yet compared
        self._done_by_all = 0  # every rank has published DONE of every operation up to this one
        rank_sum.available(torch.float32)  # builds the compiled sum now rather than inside the first allreduce

    # -------------------------------------------------------------------------------------- argument check

    def exchange_check(self, extremes: np.ndarray, disagreement: Callable[[], NoReturn]) -> None:
        """Replace ``extremes`` (two int64) by their MAX over the ranks, through the flags. On a disagreement the
        group is first resynchronised (every rank gets here or to a failed comparison of a deferred check), then
        the caller reports."""
        with self._protocol.lock:
            self._compare_deferred_check()
            round_ = self._post_check(extremes)
            self._protocol.wait_until(lambda: self._flags.all_reached(CHECKED, round_))
            posted = self._flags.posted_values(round_)
            extremes[0] = max(first for first, _ in posted)
            extremes[1] = max(second for _, second in posted)
            if extremes[0] != -extremes[1]:
                self._recover(None)

    def defer_check(self, extremes: np.ndarray, disagreement: Callable[[], NoReturn]) -> None:
        """Post this rank's check values and leave ``extremes`` as they are: the allreduce that follows on this
        group compares every rank's once its own input is copied in, and calls ``disagreement`` (which raises on
        every rank) if they differ. A rank whose own checks failed exchanges at once instead."""
        if extremes[0] < 0:
            self.exchange_check(extremes, disagreement)
            return
        with self._protocol.lock:
            self._compare_deferred_check()
            self._deferred = (self._post_check(extremes), disagreement)

    def _post_check(self, extremes: np.ndarray) -> int:
        """Post this rank's two check values in the next round; the round."""
        self._check_rounds += 1
        self._flags.post_values(self._check_rounds, int(extremes[0]), int(extremes[1]))
        return self._check_rounds

    def _compare_deferred_check(self) -> None:
        """Compare every rank's values of a deferred check (waiting for them); raise :class:`_ChecksDiffer` if they
        differ, else let the operations that waited for it read the others' data."""
        if self._deferred is None:
            return
        round_, disagreement = self._deferred
        self._protocol.wait_until(lambda: self._flags.all_reached(CHECKED, round_))
        self._deferred = None
        if len(set(self._flags.posted_values(round_))) > 1:
            raise _ChecksDiffer(disagreement)
        for operation in self._protocol.flight:
            if operation.phase is CHECKING:
                operation.phase = RUNNING

    def _recover(self, cancelled: Operation | None) -> None:
        """After a failed check: drop the operation it began, finish the others, and let every rank continue
        from the same operation and chunk numbers (the largest any rank reached). Collective."""
        self._deferred = None
        if cancelled is not None:
            with contextlib.suppress(ValueError):
                self._protocol.flight.remove(cancelled)
            self._staging.undo_last()
        self._protocol.wait_until(lambda: not self._protocol.flight)
        counts = np.array([self.seq, self._chunk_count], dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.MAX)
        self.seq, self._chunk_count = int(counts[0]), int(counts[1])
        self._flags.publish(DONE, self.seq)

    # ------------------------------------------------------------------------------------------- operations

    def hold_staging(self, nbytes: int) -> None:
        """Size the staging segment now for operations of up to ``nbytes`` each, so that no later operation grows
        it (growing is collective; collective over the group, with no operation in flight)."""
        with self._protocol.lock:
            self._staging.hold(nbytes)

    def start(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None) -> SharedWork:
        """Start an allreduce of ``tensor`` (``op`` sum or avg) into ``out`` (or a new tensor), completed by the
        returned work's ``wait``. A check deferred for it (:meth:`defer_check`) is compared once the input is
        copied in, before returning."""
        with self._protocol.lock:
            operation = self._open(tensor, op, out, blocking=False)
            if operation.plan.chunks:
                self._protocol.advance()
            self._flags.poke()
            return SharedWork(self._protocol, operation)

    def allreduce(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None) -> torch.Tensor:
        """Blocking allreduce of ``tensor`` (``op`` sum or avg) into ``out`` (or a new tensor): the result.

        The same plan and sums as :meth:`start`, in one straight pass with a single wait per step for all ranks
        (no per-chunk progress bookkeeping); every rank must call this one, or every rank :meth:`start`, for an
        operation (it is part of what the ranks describe to each other)."""
        with self._protocol.lock:
            if self._protocol.flight:  # earlier operations complete first, through the flags
                self._protocol.wait_until(lambda: not self._protocol.flight)
            operation = self._open(tensor, op, out, blocking=True)
            if operation.plan.chunks:
                self._protocol.run(operation)
            self._flags.poke()
            operation.phase = COMPLETE
            result = operation.result()
            operation.release()
            return result

    def _open(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None, blocking: bool) -> Operation:
        """Begin an operation, put its input where the others read it and compare its argument check (on a
        disagreement, resynchronise the group and raise the check's error on every rank)."""
        operation = None
        try:
            operation = self._new_operation(tensor, op, out, blocking)
            if operation.plan.chunks:
                self._publish_input(operation, tensor)
            self._compare_deferred_check()
        except _ChecksDiffer as failure:
            self._recover(operation)
            failure.report()
        if operation.phase is CHECKING:
            operation.phase = RUNNING
        return operation

    def _new_operation(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None, blocking: bool) -> Operation:
        """Number the operation, plan it, find (or reserve) where its input and result live, and describe it to the
        other ranks (with whether it is blocking: the ranks must agree, as a blocking operation waits once per
        step for every rank's whole message, a non-blocking one chunk by chunk)."""
        numel, dtype, device = tensor.numel(), tensor.dtype, tensor.device
        scale = 1.0 / self.size if op == "avg" else 1.0
        if not numel:  # nothing to exchange: every rank knows (the shapes agree)
            empty = plan_allreduce(0, dtype.itemsize, self.size, self.rank, HOST, False, True)
            result = receive_buffer(out, tuple(tensor.shape), dtype, device)
            return Operation(empty, blocking, scale, dtype, device, out, result, phase=COMPLETE)
        self.seq += 1
        seq = self.seq
        if seq > RING and not self._done_everywhere(seq - RING):  # its descriptor slot's last user
            self._protocol.wait_until(lambda: self._done_everywhere(seq - RING))
        window = self._places.window_of(tensor)
        source = WINDOW if window is not None else HOST if tensor.is_cpu else DEVICE
        in_place = out is tensor or (out is not None and same_memory(out, tensor))
        # the result tensor: out itself when reduced in place in a window, else where the sums can go
        if out is not None and in_place and window is not None:
            target = out
        else:
            target = receive_buffer(out, tuple(tensor.shape), dtype, device)
        plan = plan_allreduce(numel, dtype.itemsize, self.size, self.rank, source, in_place, target.is_cpu)
        operation = Operation(plan, blocking, scale, dtype, device, out, target, seq, self._chunk_count)
        operation.next_sum, operation.waits_for_readers = plan.summed_here.start, plan.waits_for_readers
        self._chunk_count += plan.chunks
        staged_at, staging_busy_until = self._staging.reserve(seq, numel * dtype.itemsize)
        input_at, result_at = self._lay_out(operation, window, staged_at)
        busy = staging_busy_until and not self._done_everywhere(staging_busy_until)
        if busy and (plan.copies_in or plan.sums_in_staging):
            self._protocol.wait_until(lambda: self._done_everywhere(staging_busy_until))
        code, in_place_sums = DTYPE_CODES.index(dtype), plan.results is OVER_INPUT
        publish_descriptor(self._flags, seq, numel, code, input_at, result_at, blocking, in_place_sums)
        return operation

    def _lay_out(
        self, operation: Operation, window: tuple[Segment, int] | None, staged_at: tuple[int, int]
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """Set where ``operation``'s chunks are on this rank (its input in ``window``, else at ``staged_at``);
        where the others find its input and its sums (segment id and byte offset; ``(-1, 0)``: sums that nobody
        else reads)."""
        plan, views, dtype = operation.plan, operation.views, operation.dtype
        staging_offset = staged_at[1]
        if window is not None:
            segment, offset = window
            input_at = (segment.id, offset)
            views.source = segment.chunks(segment.rank, offset, plan.numel, dtype, plan.step)
        else:
            input_at = staged_at
            views.source = self._staging.chunks(staging_offset, plan.numel, dtype, plan.step)
        views.own = views.source
        result_at = (-1, 0)
        if plan.results in (OVER_INPUT, WRITE_BACK):  # the result is the input, where it is
            views.target = views.source
        else:
            assert operation.target is not None, "a new operation has its result tensor"
            views.target = split(operation.target.view(-1), plan.step)
        if plan.results is OVER_INPUT:
            views.result, result_at = views.source, input_at
        elif plan.sums_in_staging:  # over this rank's staged input, or beside a window input that must stay
            staged = (
                views.source if window is None else self._staging.chunks(staging_offset, plan.numel, dtype, plan.step)
            )
            views.result, result_at = staged, staged_at
        return input_at, result_at

    def _publish_input(self, operation: Operation, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` into staging unless it is in a window already, announcing every chunk (a non-blocking
        operation, whose chunks are summed as they arrive) or all at once (a blocking one). When each chunk has an
        owner, a host tensor's own chunks are not copied: this rank sums them from the tensor itself."""
        plan, base = operation.plan, operation.base
        if not operation.blocking:
            self._protocol.enqueue(operation)
        if not plan.copies_in:
            self._flags.publish(ARRIVED, base + plan.chunks)
            return
        flat = split(materialized(tensor.detach().reshape(-1).contiguous()), plan.step)  # summed by address
        if plan.source is HOST:
            operation.views.own = flat
        source = operation.views.source
        for chunk in plan.staged:
            source[chunk].copy_(flat[chunk])
            if not operation.blocking:
                self._flags.publish(ARRIVED, base + chunk + 1)
        if operation.blocking or plan.staged[-1:] != (plan.chunks - 1,):  # the last chunk was not announced
            self._flags.publish(ARRIVED, base + plan.chunks)

    def _done_everywhere(self, seq: int) -> bool:
        """Whether every rank has completed operation ``seq`` (``DONE``; remembered, and asked for the latest
        operation, so that most calls look at no flag)."""
        if seq - self._done_by_all <= 0:
            return True
        if self._flags.all_reached(DONE, self.seq - 1):
            self._done_by_all = self.seq - 1
        elif self._flags.all_reached(DONE, seq):
            self._done_by_all = seq
        return seq - self._done_by_all <= 0

    def _before_staging_grows(self) -> None:
        """Complete every operation before the one that grows staging, on every rank (growing is collective: only
        once every rank is known to grow here, after comparing a deferred check)."""
        self._compare_deferred_check()
        self._protocol.wait_until(lambda: not self._protocol.flight)
        self._protocol.wait_until(lambda: self._flags.all_reached(DONE, self.seq - 1))
        self._places.forget_segments()

    # ---------------------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Collective: complete what is in flight and free the flags and the staging segment."""
        with self._protocol.lock:
            self._protocol.wait_until(lambda: not self._protocol.flight)
            self._protocol.wait_until(lambda: self._flags.all_reached(DONE, self.seq))
            self._staging.free()
            self._flags.close()
            self._protocol.scratch.clear()
        self.comm.Free()
