"""The step-level sync interface: whose gradients are averaged in each optimizer step, and what happens to the
parameters after it.

A :class:`SyncMode` sits beside the gradient :class:`~mpistrategy.aggregation.Aggregator`. The aggregator decides
*how* one bucket is combined over a communicator; the sync mode decides, per optimizer step, *over which ranks*
gradients are combined (all ranks, the node, or none) and whether parameters are averaged or merged after the
optimizer step. Nothing here knows about Lightning: the Trainer strategy and a Fabric strategy drive the same
hooks.

The hooks, in the order a driver calls them (every rank calls every hook, in the same order):

1. :meth:`SyncMode.setup` once, with a :class:`SyncContext` (collective: modes build communicators and groups).
2. :meth:`SyncMode.setup_buckets` whenever the gradient buckets are (re)built: the mode sets up every aggregator
   it uses with an :class:`~mpistrategy.aggregation.AggregationContext` over its communicator.
3. Per optimizer step:

   a. :meth:`SyncMode.gradient_aggregator` before the step's first backward pass: the aggregator that combines
      this step's buckets, or ``None`` for a local step (no gradient communication). The answer depends only on
      state every rank shares, so all ranks agree without communicating.
   b. backward pass(es); the reducer starts and finishes the buckets with that aggregator. Clipping and the
      optimizer step follow.
   c. :meth:`SyncMode.after_optimizer_step`: average or merge parameters, start non-blocking work, or finish work
      started in an earlier step; then the step counter advances.

4. Epochs: :meth:`SyncMode.begin_epoch` before an epoch's first step (its index, its number of optimizer steps,
   the total number of epochs) and :meth:`SyncMode.end_epoch` after its last step (collective: a mode may
   average something over the ranks). Modes with ``uses_loss`` get every training step's loss through
   :meth:`SyncMode.record_loss` (they keep what they need in their state, so it survives a checkpoint).
5. :meth:`SyncMode.state_dict` (collective) before a checkpoint is written and :meth:`SyncMode.load_state_dict`
   after it is read; :meth:`SyncMode.finish` at the end of training (completes any work in flight).

Rules:

- Parameter averaging covers every parameter that requires a gradient, of every parameter group, and every
  floating-point buffer (BatchNorm running statistics); integer buffers (``num_batches_tracked``) are left alone.
- Work in flight between steps lives on the mode's own communicators, never on the gradient communicators, so
  that it cannot be matched with gradient collectives.
- Every byte of payload is counted in ``context.traffic`` (see :mod:`mpistrategy.comm.traffic`).
- A configuration the mode cannot support raises at :meth:`setup` on every rank, naming the problem and the fix.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from mpistrategy.aggregation.base import AggregationContext, Aggregator, GradBucket
from mpistrategy.comm.topology import Topology
from mpistrategy.comm.traffic import TrafficCounter, scope_of


class SyncConfigurationError(ValueError):
    """A sync mode was configured in a way it cannot run (raised on every rank at setup)."""


@dataclass
class SyncContext:
    """What a sync mode may use.

    Attributes:
        module: the model (its parameters and buffers are what parameter averaging averages).
        topology: ranks, nodes and their communicators.
        aggregator: the user's gradient aggregator, for the level that spans nodes (or the only level).
        traffic: where every byte sent is counted.
        node_transport: ``"auto"`` (NCCL for a model on CUDA with a GPU per rank, else MPI), ``"mpi"`` (the
            node's MPI communicator), ``"gloo"`` or ``"nccl"`` (a torch.distributed group per node): how node-local
            gradient averaging travels (see :mod:`mpistrategy.sync.transport`).
        optimizers: the optimizers stepped by the driver (modes that average parameters refuse several).
    """

    module: nn.Module
    topology: Topology
    aggregator: Aggregator
    traffic: TrafficCounter = field(default_factory=TrafficCounter)
    node_transport: str = "auto"
    optimizers: list[Any] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (the CPU for a model without parameters)."""
        return next((p.device for p in self.module.parameters()), torch.device("cpu"))


class SyncMode(ABC):
    """A step-level synchronisation scheme (see the module docstring for the hooks and rules).

    Subclasses set :attr:`name` (what ``MPIADStrategy(sync="...")`` and Hydra accept), implement
    :meth:`gradient_aggregator`, and override the other hooks they need.
    """

    name: ClassVar[str] = ""
    #: whether the driver reports every training step's loss to :meth:`record_loss`
    uses_loss: ClassVar[bool] = False
    #: which ranks hold the same model and optimizer state between steps: ``"world"`` (all ranks), ``"node"``
    #: (the ranks of a node) or ``"rank"`` (each its own); a checkpoint keeps one copy per distinct replica
    replicas: ClassVar[str] = "world"
    #: whether it sums gradient buckets inside each node (over the node transport) on some steps: then the
    #: strategy keeps the buckets in shared memory also when the world spans several machines
    sums_in_node: ClassVar[bool] = False
    #: for a mode that averages the model after each optimizer step, the fix to name when it is given several
    #: optimizers (which one's step ends the period would be ambiguous); ``None``: any number of optimizers
    one_optimizer_fix: ClassVar[str | None] = None

    context: SyncContext | None = None

    def setup(self, context: SyncContext) -> None:
        """Called once on every rank before training (collective)."""
        self.check_optimizers(len(context.optimizers))
        self.context = context

    def check_optimizers(self, count: int) -> None:
        """Raise :class:`SyncConfigurationError` where this mode cannot drive ``count`` optimizers (checked at
        setup and for each optimizer added after it)."""
        if count > 1 and self.one_optimizer_fix is not None:
            raise SyncConfigurationError(
                f"{self.name}: averages the model after each optimizer step, which is ambiguous with {count} "
                f"optimizers; {self.one_optimizer_fix}."
            )

    @property
    def ctx(self) -> SyncContext:
        if self.context is None:
            raise RuntimeError(f"{type(self).__name__}.setup() was not called.")
        return self.context

    @abstractmethod
    def setup_buckets(self, buckets: list[GradBucket]) -> None:
        """Set up every aggregator this mode uses for ``buckets`` (called whenever the buckets are rebuilt)."""

    @abstractmethod
    def gradient_aggregator(self) -> Aggregator | None:
        """The aggregator combining the coming step's gradient buckets, or ``None`` for a local step."""

    def after_optimizer_step(self) -> None:  # noqa: B027 - optional hook
        """After the optimizer step: parameter work, then advance the step counter."""

    def begin_epoch(self, epoch: int, steps: int | None, total_epochs: int | None) -> None:  # noqa: B027 - optional hook
        """Before the first step of ``epoch`` (0-based), which has ``steps`` optimizer steps (``None``: unknown)."""

    def record_loss(self, loss: float) -> None:  # noqa: B027 - optional hook
        """This rank's training loss of one step (called when :attr:`uses_loss` is set)."""

    def end_epoch(self) -> None:  # noqa: B027 - optional hook
        """After the last step of an epoch (collective)."""

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Complete every operation in flight and free what the mode holds in shared memory (end of training;
        collective)."""

    def state_dict(self) -> dict[str, Any]:
        """The mode's state for a checkpoint (collective: every rank calls it; rank 0's result is stored)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result on every rank."""
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but was given state with keys {sorted(state)}.")

    def aggregation_context(self, buckets: list[GradBucket], comm, spans_nodes: bool, span=None) -> AggregationContext:
        """An :class:`AggregationContext` over ``comm`` for ``buckets``, counting into this mode's traffic; ``span``
        (default ``comm``) is the communicator of every rank whose gradients the aggregator combines."""
        ctx = self.ctx
        return AggregationContext(comm, ctx.topology, buckets, ctx.traffic, scope_of(spans_nodes), span)

    def uses_aggregator(self) -> bool:
        """Whether some step's gradients go through the strategy's aggregator, asked after :meth:`setup` (a mode
        that averages only models, or only inside nodes, leaves it unused)."""
        return True

    def options(self) -> dict[str, Any]:
        """The constructor's arguments as this mode holds them (every rank must be given the same)."""
        parameters = inspect.signature(type(self).__init__).parameters
        return {name: getattr(self, name) for name in parameters if name != "self" and hasattr(self, name)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.options().items())})"
