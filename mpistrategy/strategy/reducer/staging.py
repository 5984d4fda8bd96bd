"""CUDA buckets combined through host memory, with the copies on a side stream that overlap backward.

Where MPI cannot read device memory, every CUDA bucket has a page-locked host mirror
(:attr:`~mpistrategy.strategy.reducer.memory.BucketMemory.mirrors`, in the shared segment where the node's ranks
share one, so that the shared-memory allreduce sums the mirrors in place). Per bucket and backward pass:

1. when its last gradient lands (its hook, on the stream backward runs on) the event ``ready`` is recorded there;
   the side stream waits for it, copies the bucket into its mirror (``non_blocking``) and records ``copied``.
   Neither the host nor the device waits: backward goes on.
2. The aggregator combines the mirror (MPI, or the shared-memory allreduce) once ``copied`` has completed, in
   bucket order (the same on every rank), when the reducer finishes the pass (:meth:`StagedAggregator.finish`, on
   the thread that called backward). By then backward's kernels are all queued, and the host sums run while the
   device works through them and through the copies of the later buckets. Host work inside the hooks would run
   on the autograd engine's device thread and hold back the launch of backward's kernels: on one H100 shared by
   2 ranks (100.8M parameters, 13 buckets), with the hooks driving the sums, backward returned after 178 ms where
   a whole step without synchronisation takes 28 ms.
3. When it has finished, the side stream copies the mirror back into the bucket (``non_blocking``) and the stream
   that finishes (the one the optimizer step runs on) waits for that copy's event: the step's kernels queue behind
   it, the host does not wait.

Nothing is allocated per step: the mirrors, the stream and the events live as long as the buckets. The side stream
runs the copies in order, so a mirror is written again (the next pass's step 1) only after it was read back.

Where MPI reads CUDA memory itself (:func:`~mpistrategy.comm.buffers.cuda_aware`), buckets have no mirror: the
aggregator is handed the device bucket once ``ready`` has completed, since MPI does not order its reads behind the
device's streams.

Only aggregators that combine the bucket as it is, with no computation on its device
(:attr:`~mpistrategy.aggregation.Aggregator.combines_on_host`: the mean, the node mean and the hierarchical mean
over MPI), are staged; the others get the device bucket: NCCL inside the node as the gradients land, the
compressors after backward (:mod:`~mpistrategy.strategy.reducer.deferred`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mpistrategy.aggregation.base import Aggregator, GradBucket, Work
from mpistrategy.comm.checks import validation
from mpistrategy.strategy.reducer.deferred import DeferredStarts


@dataclass
class _Lane:
    """One CUDA bucket's way through host memory: its host bucket (the mirror, or the bucket itself where MPI reads
    device memory) and its events."""

    bucket: GradBucket
    host: GradBucket
    ready: torch.cuda.Event = field(default_factory=torch.cuda.Event)
    copied: torch.cuda.Event = field(default_factory=torch.cuda.Event)
    returned: torch.cuda.Event = field(default_factory=torch.cuda.Event)

    @property
    def mirrored(self) -> bool:
        return self.host is not self.bucket


class StagedWork:
    """A staged bucket in flight: its copy into host memory, then the aggregator's work on the host bucket."""

    __slots__ = ("lane", "owner", "inner")

    def __init__(self, lane: _Lane, owner: StagedAggregator) -> None:
        self.lane, self.owner = lane, owner
        self.inner: Work | None = None  # the aggregator's work, once the host bucket is handed over

    def test(self) -> bool:
        return self.inner is not None and self.inner.test()

    def wait(self) -> None:
        self.owner.hand_over_through(self)
        assert self.inner is not None
        self.inner.wait()


class StagedAggregator(Aggregator):
    """``inner`` over host mirrors of CUDA buckets (see the module docstring); other buckets go to ``inner`` as
    they are."""

    def __init__(self, inner: Aggregator, lanes: Sequence[_Lane | None], stream: torch.cuda.Stream) -> None:
        self.inner = inner
        self.context = inner.context
        self._lanes = lanes
        self._stream = stream
        self._waiting: deque[StagedWork] = deque()  # copies in flight, in bucket order

    def start(self, bucket: GradBucket) -> Work:
        lane = self._lanes[bucket.index]
        if lane is None:  # a host bucket: those before it are handed over first, to keep the order
            while self._waiting:
                self.hand_over_through(self._waiting[-1])
            return self.inner.start(bucket)
        current = torch.cuda.current_stream(bucket.buffer.device)
        lane.ready.record(current)
        if lane.mirrored:
            stream = self._stream
            stream.wait_event(lane.ready)
            with torch.cuda.stream(stream):
                lane.host.buffer.copy_(bucket.buffer, non_blocking=True)
                bucket.buffer.record_stream(stream)
                lane.copied.record(stream)
        work = StagedWork(lane, self)
        self._waiting.append(work)
        return work

    def hand_over_through(self, work: StagedWork) -> None:
        """Hand over every host bucket up to ``work``'s, waiting for their copies."""
        waiting = self._waiting
        while work.inner is None:
            first = waiting.popleft()
            _copy_event(first.lane).synchronize()
            self._hand_over(first)

    def _hand_over(self, work: StagedWork) -> None:
        with validation(False), torch.no_grad():  # the layout was agreed on once, when it was built
            work.inner = self.inner.start(work.lane.host)

    def finish(self, bucket: GradBucket, work: Work) -> None:
        if not isinstance(work, StagedWork):
            self.inner.finish(bucket, work)
            return
        self.hand_over_through(work)
        lane = work.lane
        assert work.inner is not None
        self.inner.finish(lane.host, work.inner)
        if lane.mirrored:
            stream = self._stream
            with torch.cuda.stream(stream):
                bucket.buffer.copy_(lane.host.buffer, non_blocking=True)
                lane.returned.record(stream)
            torch.cuda.current_stream(bucket.buffer.device).wait_event(lane.returned)

    def __repr__(self) -> str:
        return f"StagedAggregator({self.inner!r})"


def _copy_event(lane: _Lane) -> torch.cuda.Event:
    """The event after which the host bucket holds the gradients: the copy's, or backward's without a mirror."""
    return lane.copied if lane.mirrored else lane.ready


class DeviceStaging:
    """The lanes of a bucket layout's CUDA buckets and the side stream their copies run on; :meth:`around` wraps
    a pass's aggregator in a :class:`StagedAggregator` where the aggregator can be staged, else in a
    :class:`~mpistrategy.strategy.reducer.deferred.DeferredStarts` where its start waits for the device.

    Args:
        buckets: the buckets, in launch order.
        mirrors: per bucket, its host mirror (``None``: no mirror; a CUDA bucket without one is handed to the
            aggregator as it is, once backward has written it: MPI reads CUDA memory).
    """

    def __init__(self, buckets: Sequence[GradBucket], mirrors: Sequence[torch.Tensor | None]) -> None:
        self._lanes = [_lane(bucket, mirror) for bucket, mirror in zip(buckets, mirrors, strict=True)]
        devices = {bucket.buffer.device for bucket, lane in zip(buckets, self._lanes, strict=True) if lane}
        self._stream = torch.cuda.Stream(next(iter(devices))) if devices else None
        self._wrapped: dict[int, StagedAggregator] = {}
        self._cuda_buckets = frozenset(index for index, lane in enumerate(self._lanes) if lane is not None)

    @property
    def mirrored(self) -> bool:
        """Whether some bucket goes through a host mirror."""
        return any(lane is not None and lane.mirrored for lane in self._lanes)

    def around(self, aggregator: Aggregator | None) -> Aggregator | None:
        """``aggregator`` for this pass over the CUDA buckets: staged where it combines on the host, with its starts
        deferred where it works on the device (:class:`DeferredStarts`), itself where it only queues work on the
        device's streams."""
        if aggregator is None or self._stream is None or aggregator.starts_on_streams:
            return aggregator
        if not aggregator.combines_on_host:  # new each pass: nothing noted in an interrupted pass carries over
            return DeferredStarts(aggregator, self._cuda_buckets)
        staged = self._wrapped.get(id(aggregator))
        if staged is None or staged.inner is not aggregator:
            staged = self._wrapped[id(aggregator)] = StagedAggregator(aggregator, self._lanes, self._stream)
        staged.context = aggregator.context
        return staged


def _lane(bucket: GradBucket, mirror: torch.Tensor | None) -> _Lane | None:
    if bucket.buffer.device.type != "cuda":
        return None
    if mirror is None:
        return _Lane(bucket, bucket)
    views = [mirror[offset : offset + numel] for offset, numel in zip(bucket.offsets, bucket.numels, strict=True)]
    host = GradBucket(bucket.index, mirror, bucket.names, bucket.offsets, bucket.numels, bucket.params, views)
    return _Lane(bucket, host)
