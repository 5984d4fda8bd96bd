"""The memory of a bucket layout: the buckets' buffers, their parameters' ``.grad`` views, and the shared segment.

:class:`BucketMemory` turns a :class:`~mpistrategy.strategy.reducer.layout.BucketLayout` into
:class:`~mpistrategy.aggregation.GradBucket` objects. A bucket with a shared offset gets its buffer in this rank's
part of one segment over the machine's ranks (:mod:`mpistrategy.comm.shm_window`), where the node-local allreduce
reads every rank's bucket in place; a private bucket gets a zeroed tensor; an own-gradient bucket starts as a zero
stand-in of one element that takes no memory, and adopts the gradient autograd stores (:func:`place_gradient`).
Gradients the parameters already have are moved into their new places, so rebuilding keeps them. A staged CUDA
bucket (MPI cannot read device memory) also gets a host mirror of its buffer (:attr:`BucketMemory.mirrors`), in the
segment where there is one (page-locked there for this process, :mod:`mpistrategy.comm.pinned`), else in pinned
memory of its own: :mod:`~mpistrategy.strategy.reducer.staging` copies the bucket through it.

The segment is freed by :meth:`BucketMemory.retire` (when the buckets are rebuilt, and when the reducer is
removed), collectively over the machine's ranks, after every gradient still in it is copied out so that ``.grad``
stays readable; it stays allocated while other tensors still refer to it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.comm.pinned import pin, unpin
from mpistrategy.comm.shm_window import Segment, allocate, locate
from mpistrategy.strategy.reducer.layout import BucketLayout, BucketSpec

log = logging.getLogger(__name__)


def place_gradient(bucket: GradBucket, position: int, param: torch.Tensor, grad: torch.Tensor) -> None:
    """Make ``grad`` (a gradient autograd stored outside the bucket) the bucket's: in a flat bucket it is copied
    into its view; an own-gradient bucket adopts the tensor itself (contiguous), with no copy."""
    if bucket.own_gradient:
        grad = grad.contiguous()
        bucket.buffer, bucket.views[0] = grad.view(-1), grad
    else:
        bucket.views[position].copy_(grad)
        grad = bucket.views[position]
    param.grad = grad


class BucketMemory:
    """The buckets of ``layout`` over ``params`` (the module's parameters, by slot), with their buffers in one
    shared segment over ``machine`` where the layout places them (collective over ``machine``; ``None``: no shared
    memory)."""

    def __init__(self, layout: BucketLayout, params: Sequence[nn.Parameter], machine: MPI.Intracomm | None) -> None:
        self.layout = layout
        self.segment: Segment | None = None if machine is None else allocate(layout.shared_bytes, machine)
        self.buckets = [self._bucket(spec, params) for spec in layout.buckets]
        self.mirrors: list[torch.Tensor | None] = [self._mirror(spec) for spec in layout.buckets]
        self._pinned = self._pin_segment()

    def _bucket(self, spec: BucketSpec, params: Sequence[nn.Parameter]) -> GradBucket:
        members = [params[place.slot] for place in spec.places]
        numels = [place.numel for place in spec.places]
        buffer = self._buffer(spec)
        views = [buffer[p.offset : p.offset + p.numel].view_as(m) for p, m in zip(spec.places, members, strict=True)]
        offsets = [place.offset for place in spec.places]
        bucket = GradBucket(spec.index, buffer, spec.names, offsets, numels, members, views, spec.own_gradient)
        for position, param in enumerate(members):
            if param.grad is not None:
                place_gradient(bucket, position, param, param.grad)
        return bucket

    def _buffer(self, spec: BucketSpec) -> torch.Tensor:
        if spec.shared_offset is not None and not spec.staged:
            assert self.segment is not None, "a shared place lies in the shared segment"
            return self.segment.typed(self.segment.rank, spec.shared_offset, spec.numel, spec.dtype).zero_()
        if spec.own_gradient:  # no buffer of its own: it adopts the gradient autograd stores (a zero stand-in)
            return torch.zeros((), dtype=spec.dtype, device=spec.device).expand(spec.numel)
        return torch.zeros(spec.numel, dtype=spec.dtype, device=spec.device)

    def _mirror(self, spec: BucketSpec) -> torch.Tensor | None:
        """The host mirror of a staged bucket's buffer (``None`` for the others)."""
        if not spec.staged:
            return None
        if spec.shared_offset is not None:
            assert self.segment is not None, "a shared place lies in the shared segment"
            return self.segment.typed(self.segment.rank, spec.shared_offset, spec.numel, spec.dtype)
        return torch.empty(spec.numel, dtype=spec.dtype, pin_memory=True)

    def _pin_segment(self) -> torch.Tensor | None:
        """Page-lock this rank's part of the segment where mirrors lie in it; the part, if it was."""
        if self.segment is None or not any(
            spec.staged and spec.shared_offset is not None for spec in self.layout.buckets
        ):
            return None
        part = self.segment.part(self.segment.rank)[: self.layout.shared_bytes]
        return part if pin(part) else None

    def retire(self) -> None:
        """Let go of the buckets and free the shared segment when nothing else refers to it (collective over the
        machine's ranks). Gradients still in it are copied out first, so that ``.grad`` stays readable."""
        segment, self.segment = self.segment, None
        self.mirrors = [None] * len(self.mirrors)
        if self._pinned is not None:
            unpin(self._pinned)
            self._pinned = None
        if segment is None:
            return
        for bucket in self.buckets:
            for param in bucket.params:
                _copy_out(param, segment)
            bucket.buffer, bucket.views = bucket.buffer.new_empty(0), []
        if not segment.free():
            log.debug("GradientReducer: tensors still refer to %s; it stays allocated", segment)


def _copy_out(param: nn.Parameter, segment: Segment) -> None:
    """Give ``param`` a private copy of its gradient if that lives in ``segment``."""
    grad = param.grad
    if grad is not None and (where := locate(grad)) is not None and where[0] is segment:
        param.grad = grad.clone()
