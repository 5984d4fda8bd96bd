"""CUDA buckets whose aggregator works on the device before MPI sees the data, started after backward.

A compressing scheme's start on a CUDA bucket queues kernels (the compression) and hands MPI a host copy of their
result (or, where MPI reads device memory, the result once the stream's work is done): the host waits for the
device. In a gradient hook that wait runs on the autograd engine's device thread and holds back the launch of the
rest of backward's kernels (the reason :mod:`~mpistrategy.strategy.reducer.staging` copies without waiting).
So such buckets are only noted while backward runs; when the reducer finishes the first of them, on the thread
that called backward, every noted bucket is started in bucket order (each start's device work queues behind all
of backward, and its MPI operations progress while the next bucket's device work runs), then each is finished.

Every rank starts its buckets in the same (bucket) order, so each communicator sees the same sequence of
operations on every rank. A host bucket (a model with parameters on the CPU too) is started where it lands, after
the noted buckets before it.

Aggregators whose start only queues work on the device's streams (NCCL inside the node:
:attr:`~mpistrategy.aggregation.Aggregator.starts_on_streams`) and those staged through host mirrors
(:attr:`~mpistrategy.aggregation.Aggregator.combines_on_host`) keep starting as the gradients land.
"""

from __future__ import annotations

from collections import deque

import torch

from mpistrategy.aggregation.base import Aggregator, GradBucket, Work
from mpistrategy.comm.checks import validation


class DeferredWork:
    """A noted bucket: its aggregator's work once it is started."""

    __slots__ = ("bucket", "owner", "inner")

    def __init__(self, bucket: GradBucket, owner: DeferredStarts) -> None:
        self.bucket, self.owner = bucket, owner
        self.inner: Work | None = None

    def test(self) -> bool:
        return self.inner is not None and self.inner.test()

    def wait(self) -> None:
        self.owner.start_noted()
        assert self.inner is not None
        self.inner.wait()


class DeferredStarts(Aggregator):
    """``inner`` with the starts of the buckets in ``deferred`` (bucket indices) put off until the pass is
    finished (see the module docstring)."""

    def __init__(self, inner: Aggregator, deferred: frozenset[int]) -> None:
        self.inner = inner
        self.context = inner.context
        self._deferred = deferred
        self._noted: deque[DeferredWork] = deque()

    def start(self, bucket: GradBucket) -> Work:
        if bucket.index not in self._deferred:
            self.start_noted()
            return self.inner.start(bucket)
        work = DeferredWork(bucket, self)
        self._noted.append(work)
        return work

    def start_noted(self) -> None:
        """Start every noted bucket, in the order they were noted."""
        noted = self._noted
        with validation(False), torch.no_grad():  # the layout was agreed on once, when it was built
            while noted:
                work = noted.popleft()
                work.inner = self.inner.start(work.bucket)

    def finish(self, bucket: GradBucket, work: Work) -> None:
        if isinstance(work, DeferredWork):
            self.start_noted()
            assert work.inner is not None
            work = work.inner
        self.inner.finish(bucket, work)

    def __repr__(self) -> str:
        return f"DeferredStarts({self.inner!r})"
