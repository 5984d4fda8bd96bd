"""The gradient aggregation interface: what the bucket machinery asks of a scheme that combines gradients.

The :class:`~mpistrategy.strategy.reducer.GradientReducer` owns the buckets, the backward hooks and the timing:
it groups gradients into flat buffers, and when a bucket's last gradient lands during backward it asks the
aggregator to *start* combining that bucket; before clipping and the optimizer step it asks the aggregator to
*finish* every started bucket, in the same order. The aggregator owns everything else: which communicator(s) to
use, what to send (the gradient, a compressed form of it), and how to combine (average, hierarchical node-local
then global averaging, ...). After :meth:`Aggregator.finish`, ``bucket.buffer`` must hold the combined gradients,
in place: the parameters' ``.grad`` are views into it.

Rules every aggregator must follow, because the reducer relies on them:

- :meth:`start` is called for the buckets in the same order on every rank (the reducer guarantees it), and must
  only post non-blocking operations or cheap local work; collectives must be matched in that order.
- :meth:`finish` is called once per started bucket, in start order.
- A bucket in which no rank has a gradient to contribute (no rank used its parameters since they were last
  combined or zeroed) is not started, on any rank, in that pass: a scheme with per-bucket memory sees a step
  without it. A started bucket can still hold gradients that did not change since the last combine (a parameter
  no rank used, next to one that some rank used; zero from the ranks that did not use a parameter; an already
  combined gradient when several backward passes run before one step, as in manual optimization). Averaging is
  idempotent on equal values, so the default scheme is unaffected; a scheme with memory (error feedback,
  compression residuals) should account for it.
- Every byte of payload this rank hands to MPI is recorded with ``context.sent(nbytes)`` (the mean records the
  bucket's size; a compressor what it really sends), so that the strategy can log bytes per step.
- State that must survive a checkpoint lives in :meth:`state_dict` / :meth:`load_state_dict`, which hold plain
  Python values and tensors. They are called on every rank; a scheme whose state differs between ranks must
  gather it in :meth:`state_dict` (a collective: every rank calls it) and scatter it back when loading.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mpistrategy.comm.traffic import NODE, Scope, TrafficCounter

if TYPE_CHECKING:
    from mpistrategy.comm.communicator import Communicator
    from mpistrategy.comm.topology import Topology


class Work(Protocol):
    """An operation in flight, as returned by :meth:`Aggregator.start`."""

    def wait(self) -> Any:
        """Block until the operation completes."""

    def test(self) -> bool:
        """Whether the operation has completed (never blocks; drives MPI progress)."""


@dataclass
class GradBucket:
    """One flat gradient buffer and the parameters whose ``.grad`` are views into it.

    Attributes:
        index: position in launch order (0 is started first: the gradients that become ready first).
        buffer: the flat, contiguous gradient buffer (one dtype and device).
        names: the parameters' qualified names, in buffer order.
        offsets: where each parameter's gradient starts in ``buffer``.
        numels: how many elements each parameter's gradient has.
        own_gradient: the bucket holds one large parameter and ``buffer`` is that parameter's own ``.grad``
            (flattened): it is combined in place where autograd put it, with no flat copy. It can be a different
            tensor from one backward pass to the next (after ``zero_grad(set_to_none=True)`` autograd stores a
            new one); its shape, dtype and device never change. Until the parameter's first gradient it is a
            read-only zero stand-in that takes no memory (one element, expanded).
    """

    index: int
    buffer: torch.Tensor
    names: list[str]
    offsets: list[int]
    numels: list[int]
    params: list[torch.nn.Parameter] = field(repr=False)
    views: list[torch.Tensor] = field(repr=False)
    own_gradient: bool = False

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclass
class AggregationContext:
    """What an aggregator may use: the communicator to combine over, the node layout, the bucket layout, and
    where to count the bytes it sends.

    Attributes:
        comm: a private communicator that carries only gradient traffic: all ranks, or (when a sync mode uses
            the aggregator for one level of a hierarchy) the node, the node leaders or the ranks of equal local
            rank across nodes. Averages are over ``comm.size`` ranks.
        topology: ranks, nodes and node-local / node-leader communicators.
        buckets: every bucket, in launch order (read-only for the aggregator).
        traffic: counts this rank's payload bytes (see :mod:`mpistrategy.comm.traffic`).
        scope: whether ``comm`` stays inside a node (``"node"``) or spans nodes (``"inter_node"``).
        span: the ranks whose gradients the aggregator combines, which must agree on which buckets to start
            (default: ``comm``; a hierarchical scheme combining over the node and then across nodes spans the
            world).
    """

    comm: Communicator
    topology: Topology
    buckets: list[GradBucket]
    traffic: TrafficCounter = field(default_factory=TrafficCounter)
    scope: Scope = NODE
    span: Communicator | None = None

    def __post_init__(self) -> None:
        if self.span is None:
            self.span = self.comm

    def sent(self, nbytes: int) -> None:
        """Record ``nbytes`` of payload sent by this rank on ``comm``. Nothing on a one-rank ``comm`` of a larger
        job (a node of one rank): no other rank to send to. A one-rank job counts its payload."""
        if self.comm.size > 1 or self.topology.size == 1:
            self.traffic.add(self.scope, nbytes)


class Aggregator(ABC):
    """A gradient aggregation scheme: starts and finishes the combination of one flat bucket across ranks.

    Subclasses implement :meth:`start` (and :meth:`finish` when completing needs more than ``work.wait()``); see
    the module docstring for the rules.
    """

    context: AggregationContext | None = None
    #: the scheme only moves the bucket through MPI (or the shared-memory allreduce) and does no arithmetic on its
    #: device but scaling: the reducer may hand it a CUDA bucket's host mirror instead (see
    #: :mod:`mpistrategy.strategy.reducer.staging`)
    combines_on_host: bool = False
    #: the scheme's start on a CUDA bucket queues its first operation on the device's streams and does not wait for
    #: the device (NCCL inside the node): the reducer starts it as the gradients land. Other schemes that do not
    #: combine on the host (the compressors: device work, then MPI on host copies) start after backward (see
    #: :mod:`mpistrategy.strategy.reducer.deferred`)
    starts_on_streams: bool = False

    def setup(self, context: AggregationContext) -> None:
        """Called once by the reducer after the buckets are built, on every rank (collectives are allowed)."""
        self.context = context

    @abstractmethod
    def start(self, bucket: GradBucket) -> Work:
        """Start combining ``bucket.buffer`` across ranks without blocking; return the work in flight."""

    def finish(self, bucket: GradBucket, work: Work) -> None:
        """Complete ``work``; afterwards ``bucket.buffer`` holds the combined gradients."""
        work.wait()

    def state_dict(self) -> dict[str, Any]:
        """The scheme's state to checkpoint (empty for stateless schemes)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but was given state with keys {sorted(state)}.")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
