"""Schemes whose compressed messages are gathered: every rank receives every rank's message and combines them.

For compressors whose outputs cannot be summed on the wire (a different index set, scale or quantisation grid per
rank), each rank encodes its bucket into one fixed-size byte message (a :class:`~mpistrategy.aggregation.bits.
WireFormat` that depends only on the bucket's size and the options, so equal on every rank), one non-blocking
allgather delivers all ``P`` messages to every rank, and every rank decodes and combines them with the same
arithmetic on the same bytes: the combined bucket is identical on every rank. A rank's payload is its message,
``WireFormat.nbytes``; it receives ``P`` times that.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.aggregation.bits import WireFormat
from mpistrategy.aggregation.compression import CompressingAggregator, InFlight
from mpistrategy.aggregation.wire import start_allgather


class GatheredCompressor(CompressingAggregator):
    """Template of the gathered schemes: :meth:`wire_format`, :meth:`encode` and :meth:`combine` define one."""

    def __init__(self, error_feedback: bool = False) -> None:
        super().__init__(error_feedback)
        self._formats: dict[int, WireFormat] = {}

    def prepare(self, buckets: list[GradBucket]) -> None:
        self._formats = {bucket.index: self.wire_format(bucket) for bucket in buckets if not self.sends_dense(bucket)}

    def sends_dense(self, bucket: GradBucket) -> bool:
        """Whether ``bucket`` is sent uncompressed (the plain mean), because compressing it would not save bytes."""
        return False

    @abstractmethod
    def wire_format(self, bucket: GradBucket) -> WireFormat:
        """The layout of this bucket's message (the same on every rank)."""

    @abstractmethod
    def encode(self, values: torch.Tensor, bucket: GradBucket) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The message fields for ``values`` (``p``: the bucket's gradients plus residual, a flat copy in the working
        dtype the scheme may overwrite), and with error feedback the remainder ``p - C(p)`` (else ``None``)."""

    @abstractmethod
    def combine(self, fields: dict[str, torch.Tensor], bucket: GradBucket) -> torch.Tensor:
        """The combined gradients (flat, working dtype) from every rank's fields, each of shape
        ``(ranks, count)``."""

    def start(self, bucket: GradBucket) -> InFlight:
        if self.sends_dense(bucket):
            return self.start_mean(bucket)
        values = self.values_to_send(bucket)
        parts, remainder = self.encode(values, bucket)
        if self.error_feedback:
            assert remainder is not None, f"{type(self).__name__}.encode returned no remainder"
            self.memory.keep(bucket, remainder)
        wire = self._formats[bucket.index]
        message = wire.pack(parts, values.device)
        self.sent(wire.nbytes)
        assert self.context is not None
        pending = start_allgather(self.context.comm, message)

        def complete(gathered: torch.Tensor) -> None:
            bucket.buffer.copy_(self.combine(wire.unpack(gathered), bucket))

        return InFlight(pending, complete)
