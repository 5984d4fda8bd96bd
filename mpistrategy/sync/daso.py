"""DASO: node-local data parallelism every step, non-blocking model averaging across nodes every few steps.

Distributed Asynchronous and Selective Optimization (Coquelin et al., J. Big Data 2022; heat's ``DASO``), with
heat's schedule and defaults:

- Node level: gradients are averaged inside each node (shared memory, or a torch.distributed group) on every step
  (every ``local_skip``-th step when ``local_skip > 1``).
- Phases, decided per epoch: ``warmup_epochs`` and the last ``cooldown_epochs`` epochs average the model across
  nodes after every step, blocking (in ``downcast`` precision). In between, the *cycling* phase: after step ``b``
  of an epoch with ``b % global_skip == 0`` (and after its last step) the model is sent (a non-blocking
  allreduce among the node leaders, in chunks of ``sending_chunk_size`` elements), and it is received
  ``B = batches_to_wait`` steps later (never later than the epoch's last step) and merged with heat's staleness
  weights, ``N`` being the number of nodes:

      x <- (2B x + N x_bar_stale) / (N + 2B)        (x <- x_bar when B = 0)

  where ``x_bar_stale`` is the mean over all ranks of the state sent ``B`` steps earlier. The epoch's last step
  always ends with a blocking average (a send still in flight is completed and dropped, as in heat).
- Adaptation at each epoch's end (heat's ``epoch_loss_logic``): the epoch's training loss, averaged over all
  ranks, feeds a plateau detector (patience 2, relative threshold ``stability_level``); on a plateau
  ``global_skip`` and ``local_skip`` are divided by ``skip_reduction_factor`` and ``batches_to_wait`` decreases
  by one (at least 1 while ``global_skip > 0``); at ``global_skip == 1`` they are reset to ``max_global_skips``,
  ``max_global_skips // local_skip_factor`` and ``max_global_skips // local_skip_factor``.

Differences from heat, on purpose: the model state averaged is every trainable parameter of every parameter group
plus the floating-point buffers (heat: ``param_groups[0]`` only, no BatchNorm statistics); ``downcast_all_phases``
also compresses the cycling phase's sends (heat compresses only its blocking phases); with ``warmup_epochs=0``
cycling starts at the first epoch (heat would stay blocking); the node leaders send (heat rotates the sending
local rank); the whole state, the plateau detector and a send in flight (completed, its mean kept) go into the
checkpoint; the epoch loss comes from the training loop (nothing to call by hand).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from mpistrategy.aggregation.base import Aggregator, GradBucket
from mpistrategy.sync.averaging import Averaging, ModelAverager
from mpistrategy.sync.base import SyncConfigurationError, SyncContext, SyncMode
from mpistrategy.sync.levels import NodeMeanAggregator
from mpistrategy.sync.local_sgd import check_positive
from mpistrategy.sync.transport import node_transport

log = logging.getLogger(__name__)

DOWNCAST_TYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": None, None: None}
WARMUP, CYCLING, COOLDOWN = "warmup", "cycling", "cooldown"


@dataclass
class PlateauDetector:
    """Whether a loss has stopped improving (heat's ``DetectMetricPlateau`` in ``min``/``rel`` mode).

    A loss improves when it is below ``best * (1 - threshold)`` (``best * (1 + threshold)`` for a negative
    best). After more than ``patience`` epochs without improvement :meth:`plateaued` answers ``True`` once and
    starts counting afresh.
    """

    patience: int = 2
    threshold: float = 0.05
    best: float = math.inf
    bad_epochs: int = 0

    def plateaued(self, loss: float) -> bool:
        limit = self.best * (1.0 - self.threshold) if self.best >= 0 else self.best * (1.0 + self.threshold)
        if loss < limit:
            self.best, self.bad_epochs = loss, 0
        else:
            self.bad_epochs += 1
        if self.bad_epochs > self.patience:
            self.bad_epochs = 0
            return True
        return False


@dataclass
class DASOState:
    """Everything DASO needs to continue a run exactly (all of it goes into the checkpoint).

    Attributes:
        phase: ``"warmup"``, ``"cycling"`` or ``"cooldown"``.
        global_skip: steps between two sends (0 in the blocking phases).
        local_skip: node-local gradient averaging every ``local_skip`` steps (0 or 1: every step).
        batches_to_wait: steps between a send and its merge.
        epoch: the current epoch; ``step_in_epoch``: optimizer steps done in it; ``steps_in_epoch``: its length;
            ``epoch_ended``: its end was processed (the schedule of the next epoch is set).
        loss_sum, loss_count: this rank's training losses of the current epoch.
        plateau: the plateau detector.
        pending_due, pending_wait: the step at which the send in flight is merged, and its ``B``.
        syncs: counts of blocking averages, sends and merges so far.
    """

    phase: str = WARMUP
    global_skip: int = 0
    local_skip: int = 0
    batches_to_wait: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    steps_in_epoch: int | None = None
    epoch_ended: bool = False
    total_epochs: int | None = None
    loss_sum: float = 0.0
    loss_count: int = 0
    plateau: PlateauDetector = field(default_factory=PlateauDetector)
    pending_due: int | None = None
    pending_wait: int = 0
    syncs: dict[str, int] = field(default_factory=lambda: {"blocking": 0, "sent": 0, "merged": 0})


class DASO(SyncMode):
    """Distributed Asynchronous and Selective Optimization (see the module docstring). heat's defaults.

    Args:
        warmup_epochs: epochs of blocking averaging after every step at the start (>= 0).
        cooldown_epochs: epochs of blocking averaging after every step at the end (>= 0).
        global_skip: steps between sends when cycling starts (heat: 4).
        batches_to_wait: steps between a send and its merge when cycling starts (heat: 1).
        local_skip: node-local gradient averaging every ``local_skip`` steps when cycling starts (heat: 1).
        max_global_skips: the value ``global_skip`` is reset to after it reached 1 on a plateau (heat: 8).
        stability_level: the plateau detector's relative threshold (heat: 0.05).
        skip_reduction_factor: divides the skips on a plateau (heat: 2).
        local_skip_factor: ``max_global_skips // local_skip_factor`` is the reset value of ``local_skip`` and
            ``batches_to_wait`` (heat: 4).
        sending_chunk_size: the most elements per inter-node message (heat: 10 000 000).
        downcast: ``"bfloat16"`` (heat), ``"float16"`` or ``None``/``"float32"``: the precision of the blocking
            phases' inter-node averages.
        downcast_all_phases: also send the cycling phase's models in ``downcast`` precision.
    """

    name = "daso"
    replicas = "rank"
    sums_in_node = True
    uses_loss = True

    def __init__(
        self,
        warmup_epochs: int = 4,
        cooldown_epochs: int = 4,
        global_skip: int = 4,
        batches_to_wait: int = 1,
        local_skip: int = 1,
        max_global_skips: int = 8,
        stability_level: float = 0.05,
        skip_reduction_factor: int = 2,
        local_skip_factor: int = 4,
        sending_chunk_size: int = 10_000_000,
        downcast: str | None = "bfloat16",
        downcast_all_phases: bool = False,
    ) -> None:
        self.warmup_epochs = check_positive(self.name, "warmup_epochs", warmup_epochs, minimum=0)
        self.cooldown_epochs = check_positive(self.name, "cooldown_epochs", cooldown_epochs, minimum=0)
        self.global_skip = check_positive(self.name, "global_skip", global_skip)
        self.batches_to_wait = check_positive(self.name, "batches_to_wait", batches_to_wait, minimum=0)
        self.local_skip = check_positive(self.name, "local_skip", local_skip)
        self.max_global_skips = check_positive(self.name, "max_global_skips", max_global_skips)
        self.skip_reduction_factor = check_positive(self.name, "skip_reduction_factor", skip_reduction_factor, 2)
        self.local_skip_factor = check_positive(self.name, "local_skip_factor", local_skip_factor)
        self.sending_chunk_size = check_positive(self.name, "sending_chunk_size", sending_chunk_size)
        if isinstance(stability_level, bool) or not isinstance(stability_level, (int, float)) or stability_level < 0:
            raise SyncConfigurationError(f"daso: stability_level={stability_level!r} must be a number >= 0.")
        self.stability_level = float(stability_level)
        if downcast not in DOWNCAST_TYPES:
            valid = ", ".join(repr(k) for k in DOWNCAST_TYPES)
            raise SyncConfigurationError(f"daso: downcast={downcast!r} is not one of {valid}.")
        self.downcast = DOWNCAST_TYPES[downcast]
        self.downcast_all_phases = bool(downcast_all_phases)
        self.state = self._initial_state()
        self._pending: Averaging | None = None

    def _initial_state(self) -> DASOState:
        state = DASOState(plateau=PlateauDetector(threshold=self.stability_level))
        if self.warmup_epochs == 0:
            self._enter_cycling(state)
        return state

    def _enter_cycling(self, state: DASOState) -> None:
        state.phase = CYCLING
        state.global_skip, state.local_skip, state.batches_to_wait = (
            self.global_skip,
            self.local_skip,
            self.batches_to_wait,
        )

    # --------------------------------------------------------------------------------------------- setup

    def setup(self, context: SyncContext) -> None:
        super().setup(context)
        topology = context.topology
        if not topology.even_nodes:
            raise SyncConfigurationError(
                f"daso: needs nodes of equal size (heat's merge weights count nodes), but the nodes have "
                f"{list(topology.node_sizes)} ranks; launch the same number of ranks on every node "
                "(or set ranks_per_node to a divisor of the ranks per node)."
            )
        if len(context.optimizers) > 1:
            raise SyncConfigurationError(
                f"daso: averages the model after each optimizer step, which is ambiguous with "
                f"{len(context.optimizers)} optimizers; use one optimizer."
            )
        self.transport = node_transport(topology, context.node_transport)
        self.node_mean = NodeMeanAggregator(self.transport)
        self.averager = ModelAverager(context.module, topology, context.traffic, "nodes", self.sending_chunk_size)

    def setup_buckets(self, buckets: list[GradBucket]) -> None:
        topology = self.ctx.topology
        self.node_mean.setup(self.aggregation_context(buckets, topology.node_gradients, spans_nodes=False))

    # --------------------------------------------------------------------------------------------- steps

    def gradient_aggregator(self) -> Aggregator | None:
        skip = self.state.local_skip
        if skip <= 1 or self.state.step_in_epoch % skip == 0:
            return self.node_mean
        return None

    def begin_epoch(self, epoch: int, steps: int | None, total_epochs: int | None) -> None:
        """Start ``epoch``; a run resumed inside ``epoch`` keeps its step count, and one resumed after an epoch
        whose end was not yet processed processes it first."""
        state = self.state
        state.steps_in_epoch, state.total_epochs = steps, total_epochs
        if epoch == state.epoch and state.step_in_epoch > 0:
            return
        if epoch > state.epoch and not state.epoch_ended and state.step_in_epoch > 0:
            self.end_epoch()
        state.epoch, state.step_in_epoch, state.epoch_ended = epoch, 0, False
        if total_epochs is not None and self.cooldown_epochs and epoch >= total_epochs - self.cooldown_epochs:
            self._enter_blocking(COOLDOWN)

    def _enter_blocking(self, phase: str) -> None:
        state = self.state
        state.phase, state.global_skip, state.local_skip, state.batches_to_wait = phase, 0, 0, 0

    def record_loss(self, loss: float) -> None:
        self.state.loss_sum += float(loss)
        self.state.loss_count += 1

    def after_optimizer_step(self) -> None:
        state = self.state
        step = state.step_in_epoch
        last = state.steps_in_epoch is not None and step >= state.steps_in_epoch - 1
        if state.global_skip == 0:
            self._blocking_average()
        elif step % state.global_skip == 0 or last:
            wait = state.batches_to_wait
            if state.steps_in_epoch is not None:
                wait = min(wait, state.steps_in_epoch - 1 - step)
            if wait <= 0 or last:
                self._drop_pending()
                self._blocking_average()
            else:
                previous, previous_wait = self._pending, state.pending_wait
                self._pending = self.averager.start(self.downcast if self.downcast_all_phases else None)
                state.syncs["sent"] += 1
                if previous is not None:
                    self._merge(previous, previous_wait)
                state.pending_due, state.pending_wait = step + wait, wait
        elif self._pending is not None and state.pending_due is not None and step >= state.pending_due:
            pending, self._pending = self._pending, None
            self._merge(pending, state.pending_wait)
            state.pending_due = None
        state.step_in_epoch += 1

    def _blocking_average(self) -> None:
        self.averager.assign(self.averager.average(self.downcast))
        self.state.syncs["blocking"] += 1

    def _drop_pending(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self.state.pending_due = None

    def _merge(self, pending: Averaging, wait: int) -> None:
        """``x <- (2B x + N x_bar) / (N + 2B)``, heat's staleness weights (``B = wait``; ``2B`` is 1 when B = 0)."""
        nodes = self.ctx.topology.num_nodes
        numerator = 2.0 * wait if wait > 0 else 1.0
        denominator = nodes + numerator
        self.averager.merge(pending.result(), own=numerator / denominator, other=nodes / denominator)
        if self.state.local_skip > 1:
            self.averager.equalize_in_node()
        self.state.syncs["merged"] += 1

    # --------------------------------------------------------------------------------------------- epochs

    def end_epoch(self) -> None:
        """heat's ``epoch_loss_logic`` for the next epoch, on the epoch's loss averaged over all ranks."""
        state = self.state
        if state.epoch_ended:
            return
        mean = self._mean_epoch_loss()
        state.loss_sum, state.loss_count, state.epoch_ended = 0.0, 0, True
        self.schedule_next_epoch(mean)

    def _mean_epoch_loss(self) -> float:
        state = self.state
        local = state.loss_sum / state.loss_count if state.loss_count else math.nan
        control = self.ctx.topology.control
        values = control.allgather(local) if control.Get_size() > 1 else [local]
        finite = [v for v in values if not math.isnan(v)]
        return sum(finite) / len(finite) if finite else math.nan

    def schedule_next_epoch(self, loss: float) -> None:
        """Set the phase and skips of the epoch after ``state.epoch`` from its mean loss ``loss``."""
        state = self.state
        upcoming = state.epoch + 1
        if upcoming < self.warmup_epochs:
            self._enter_blocking(WARMUP)
            return
        if upcoming == self.warmup_epochs:
            self._enter_cycling(state)
        if state.total_epochs is not None and upcoming >= state.total_epochs - self.cooldown_epochs:
            self._enter_blocking(COOLDOWN)
            return
        plateau = not math.isnan(loss) and state.plateau.plateaued(loss)
        factor = self.skip_reduction_factor
        if plateau and state.global_skip > 1:
            state.global_skip //= factor
            state.local_skip //= factor
            state.batches_to_wait -= 1
            if state.global_skip > 0:
                state.batches_to_wait = max(state.batches_to_wait, 1)
                state.local_skip = max(state.local_skip, 1)
        elif plateau and state.global_skip == 1:
            state.global_skip = self.max_global_skips
            state.local_skip = self.max_global_skips // self.local_skip_factor
            state.batches_to_wait = self.max_global_skips // self.local_skip_factor
        log.info(
            "daso: epoch %d: loss %.4f, next: %s, global_skip %d, local_skip %d, batches_to_wait %d",
            state.epoch,
            loss,
            state.phase,
            state.global_skip,
            state.local_skip,
            state.batches_to_wait,
        )

    def finish(self) -> None:
        self._drop_pending()
        self.averager.close()

    # ---------------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The state, with a send in flight completed: its mean (the same on every rank) is stored."""
        state = asdict(self.state)
        state["pending_mean"] = [t.clone() for t in self._pending.result()] if self._pending is not None else None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        pending = state.pop("pending_mean")
        state["plateau"] = PlateauDetector(**state["plateau"])
        self.state = DASOState(**state)
        self._pending = None
        if pending is not None:
            self._pending = Averaging(self.averager, [t.clone() for t in pending], [], done=True)

    def __repr__(self) -> str:
        return (
            f"DASO(warmup_epochs={self.warmup_epochs}, cooldown_epochs={self.cooldown_epochs}, "
            f"global_skip={self.global_skip}, batches_to_wait={self.batches_to_wait}, downcast={self.downcast})"
        )
