"""DASO: node-local data parallelism, non-blocking model averaging across nodes every few steps (heat's schedule).

Distributed Asynchronous and Selective Optimization (Coquelin et al., J. Big Data 2022; heat's ``DASO``), step by
step as heat's ``DASO.step`` and ``epoch_loss_logic`` decide it. ``N`` is the number of nodes, ``R`` the ranks per
node, ``b`` the step in the epoch (0-based), ``L`` the epoch's last step.

- Phases, one per epoch: the first ``warmup_epochs`` and the last ``cooldown_epochs`` epochs are *blocking* (the
  model is averaged across nodes after every step, sent in ``downcast`` precision); the epochs between *cycle*
  with the skips ``global_skip`` (``gs``), ``local_skip`` (``ls``) and ``batches_to_wait`` (``w``).
- Cycling step ``b``, with ``w_b = min(w, L - b)`` (heat clips the wait again at every step) and ``k = b % gs``:

  * ``k == 0`` or ``b == L``: the model is sent (the mean over the nodes, a non-blocking allreduce among the node
    leaders, in chunks of ``sending_chunk_size`` elements, in full precision: heat downcasts only in the blocking
    phases). On ``b == L`` or with ``w == 0`` it is received at once and replaces the model (blocking); a send
    still in flight is dropped. Otherwise a send still in flight is merged now and this one waits.
  * ``0 < k == w_b`` (and ``(b + 1) % gs != 0``): the send in flight is received and merged with heat's staleness
    weights, ``B`` being ``w_b`` at the send:

        x <- (2B x + N x_bar_stale) / (N + 2B)        (2B replaced by 1 when B = 0)

    A send whose ``k`` never meets ``w_b`` (near the epoch's end, or ``w >= gs``) is merged at the next send or
    dropped on ``L``.
  * Node-local gradient averaging (heat's DDP ``require_backward_grad_sync``) is a switch that persists from step
    to step, left as it is by a send: switched on for a step that sends (``(b + 1) % gs == 0``) and for the
    last step; with ``ls == 1`` on for every step after the wait; with ``ls > 1`` off after a merge and after
    steps with ``b % ls == 0``, on after steps with ``(b + 1) % ls == 0`` (docs/daso.md has the exact order).
- Which rank of a node sends: heat rotates it (local rank ``0, 1, ..., R - 1``, back to 0 at each epoch's end),
  and at a merge and at a send the node takes the model of the rank that sent before (heat's broadcast inside the
  node). Until a step runs without node-local averaging, all ranks of a node hold the same model and optimizer
  state: the broadcast is skipped and the node's mean is sent (the same parameters; the BatchNorm statistics of
  every rank).
- Adaptation at each epoch's end (``epoch_loss_logic``): the epoch's training loss, averaged over the ranks (NaN if
  any rank's is), feeds a plateau detector (patience 2, relative threshold ``stability_level``; a NaN loss is a bad
  epoch) when the next epoch cycles; on a plateau ``gs`` and ``ls`` are divided by ``skip_reduction_factor`` and
  ``w`` decreases by one (``w`` and ``ls`` at least 1 while ``gs > 0``); at ``gs == 1`` they are reset to
  ``max_global_skips``, ``max_global_skips // local_skip_factor`` and ``max_global_skips // local_skip_factor``.
- Every average received is checked: a parameter that was not finite when sent (NaN or infinity; heat checks the
  sender's NaNs) raises :class:`FloatingPointError` on every rank (every rank holds the same mean), unless
  ``check_finite=False``.

The decisions are a pure function of the state (:func:`plan_step`, :func:`epoch_phase`, :func:`adapt_skips`);
:class:`DASO` carries them out.

Differences from heat, on purpose: the averaged state is every parameter that requires a gradient plus the
floating-point buffers (heat: the parameters that require a gradient; BatchNorm statistics are left alone);
``downcast_all_phases`` also sends the cycling phase's models in ``downcast`` precision; with ``warmup_epochs=0``
cycling starts at the first epoch (heat would stay blocking); with one rank per node a send in flight is merged by
the rules above (heat needs several GPUs per node); the sending rank's model reaches the node leader through the
node sum (the leaders send; the bytes between nodes are the same); the schedule, the plateau detector and a send
in flight (completed, its mean kept) go into the checkpoint; the epoch loss comes from the training loop (nothing
to call by hand); the initial skips are options (heat: 4, 1, 1).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

import torch

from mpistrategy.aggregation.base import Aggregator, GradBucket
from mpistrategy.aggregation.rank_state import gather_rank_states, own_rank_state
from mpistrategy.sync.averaging import Averaging, ModelAverager
from mpistrategy.sync.base import SyncConfigurationError, SyncContext, SyncMode
from mpistrategy.sync.levels import NodeMeanAggregator
from mpistrategy.sync.local_sgd import check_positive
from mpistrategy.sync.transport import NodeTransport, node_transport

log = logging.getLogger(__name__)

DOWNCAST_TYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": None, None: None}
#: the layout of :meth:`DASO.state_dict`; checkpoints of layout 1 (no ``version`` key) are converted on loading
STATE_VERSION = 3


class Phase(str, Enum):
    """The phase of an epoch."""

    WARMUP = "warmup"
    CYCLING = "cycling"
    COOLDOWN = "cooldown"

    @property
    def blocking(self) -> bool:
        """Whether the model is averaged across nodes after every step, blocking."""
        return self is not Phase.CYCLING


@dataclass(frozen=True)
class Skips:
    """The cycling schedule: steps between sends, node-local averaging period, steps between a send and its merge.
    All zero in the blocking phases."""

    global_skip: int
    local_skip: int
    batches_to_wait: int


BLOCKING = Skips(0, 0, 0)


def epoch_phase(epoch: int, total_epochs: int | None, warmup_epochs: int, cooldown_epochs: int) -> Phase:
    """The phase of ``epoch`` (0-based) in a run of ``total_epochs`` (``None``: unknown, no cool-down)."""
    if epoch < warmup_epochs:
        return Phase.WARMUP
    if total_epochs is not None and epoch >= total_epochs - cooldown_epochs:
        return Phase.COOLDOWN
    return Phase.CYCLING


def adapt_skips(skips: Skips, plateaued: bool, max_global_skips: int, reduction: int, local_factor: int) -> Skips:
    """heat's adaptation of the cycling schedule after an epoch: on a plateau divide ``global_skip`` and
    ``local_skip`` by ``reduction`` and decrease ``batches_to_wait`` by one (both at least 1 while
    ``global_skip > 0``); at ``global_skip == 1`` reset to ``max_global_skips`` and ``max_global_skips //
    local_factor`` (twice)."""
    if not plateaued:
        return skips
    if skips.global_skip > 1:
        gs, ls, wait = skips.global_skip // reduction, skips.local_skip // reduction, skips.batches_to_wait - 1
        if gs > 0:
            ls, wait = max(ls, 1), max(wait, 1)
        return Skips(gs, ls, wait)
    if skips.global_skip == 1:
        reset = max_global_skips // local_factor
        return Skips(max_global_skips, reset, reset)
    return skips


@dataclass
class PlateauDetector:
    """Whether a loss has stopped improving (heat's ``DetectMetricPlateau`` in ``min``/``rel`` mode).

    A loss improves when it is below ``best * (1 - threshold)`` (``best * (1 + threshold)`` for a negative
    best); a NaN loss never improves. After more than ``patience`` epochs without improvement :meth:`plateaued`
    answers ``True`` once and starts counting afresh.
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
        phase: the current epoch's phase.
        cycle: the cycling schedule (in force in cycling epochs; adapted at the end of each epoch followed by one).
        epoch: the current epoch; ``step_in_epoch``: optimizer steps done in it; ``steps_in_epoch``: its length;
            ``total_epochs``: the run's length; ``epoch_ended``: its end was processed.
        loss_sum, loss_count: this rank's training losses of the current epoch (a checkpoint keeps every rank's:
            the epoch's mean loss averages the ranks' own means).
        plateau: the plateau detector.
        local_sync: whether the next step averages gradients inside the node.
        node_diverged: whether some step ran without node-local gradient averaging: from then on the ranks of a
            node may hold different models and optimizer states, and heat's sending rank and broadcast apply.
        sender: the rank of each node whose model the next send carries; ``previous_sender``: that of the last
            non-blocking send of this epoch (``None``: none).
        pending_wait, pending_step: ``B`` and the step of the send in flight (``None``: none in flight).
        syncs: counts of blocking averages, sends and merges so far.
    """

    phase: Phase = Phase.WARMUP
    cycle: Skips = Skips(4, 1, 1)
    epoch: int = 0
    step_in_epoch: int = 0
    steps_in_epoch: int | None = None
    epoch_ended: bool = False
    total_epochs: int | None = None
    loss_sum: float = 0.0
    loss_count: int = 0
    plateau: PlateauDetector = field(default_factory=PlateauDetector)
    local_sync: bool = True
    node_diverged: bool = False
    sender: int = 0
    previous_sender: int | None = None
    pending_wait: int | None = None
    pending_step: int | None = None
    syncs: dict[str, int] = field(default_factory=lambda: {"blocking": 0, "sent": 0, "merged": 0})

    @property
    def skips(self) -> Skips:
        """The schedule in force: zeros in the blocking phases."""
        return BLOCKING if self.phase.blocking else self.cycle


@dataclass(frozen=True)
class Send:
    """Average the model across nodes: ``source`` is the rank of each node whose model is sent (``None``: the
    node's mean, all its ranks holding the same model), ``downcast`` whether it travels in the ``downcast`` dtype,
    ``wait`` its ``B``."""

    source: int | None
    downcast: bool
    wait: int


@dataclass(frozen=True)
class StepPlan:
    """What DASO does after an optimizer step, in this order: ``send``; then either ``blocking`` (receive that send
    at once and replace the model; a send in flight is dropped) or ``broadcast_from`` (every rank of the node takes
    the model of this rank) and ``merge`` (merge the send in flight with heat's weights), the new send staying in
    flight. The remaining fields are the state for the next step."""

    send: Send | None = None
    blocking: bool = False
    broadcast_from: int | None = None
    merge: bool = False
    local_sync: bool = True
    node_diverged: bool = False
    sender: int = 0
    previous_sender: int | None = None


def plan_step(state: DASOState, ranks_per_node: int, downcast_all_phases: bool = False) -> StepPlan:
    """heat's ``DASO.step`` decisions after step ``state.step_in_epoch``: a pure function of the state."""
    gs, ls, wait = state.skips.global_skip, state.skips.local_skip, state.skips.batches_to_wait
    step, steps = state.step_in_epoch, state.steps_in_epoch
    last_step = None if steps is None else steps - 1
    is_last = last_step is not None and step >= last_step
    next_is_last = last_step is not None and step + 1 == last_step
    k = step % gs if gs > 0 else 0
    wait_now = wait if last_step is None or wait + step <= last_step else max(last_step - step, 0)
    diverged = ranks_per_node > 1 and (state.node_diverged or not state.local_sync)
    broadcast = state.previous_sender if diverged else None
    pending = state.pending_wait is not None
    if is_last or k == 0:
        send = Send(state.sender if diverged else None, gs == 0 or downcast_all_phases, wait_now)
        following = 0 if is_last else (state.sender + 1) % ranks_per_node
        if is_last or wait == 0:
            return StepPlan(send, blocking=True, local_sync=state.local_sync, node_diverged=diverged, sender=following)
        return StepPlan(
            send,
            broadcast_from=broadcast,
            merge=pending,
            local_sync=state.local_sync,
            node_diverged=diverged,
            sender=following,
            previous_sender=state.sender,
        )
    local_sync, receive = state.local_sync, False
    if (step + 1) % gs == 0:
        local_sync = True
    elif k < wait_now:
        local_sync = local_sync or next_is_last
    else:
        receive = k == wait_now
        if receive and ls > 1:
            local_sync = False
        if ls == 1 and not next_is_last:
            local_sync = True
        else:
            if ls == 0 or step % ls == 0:
                local_sync = False
            elif (step + 1) % ls == 0:
                local_sync = True
            local_sync = local_sync or next_is_last
    return StepPlan(
        None,
        broadcast_from=broadcast if receive else None,
        merge=receive and pending,
        local_sync=local_sync,
        node_diverged=diverged,
        sender=state.sender,
        previous_sender=state.previous_sender,
    )


def advance(state: DASOState, plan: StepPlan) -> None:
    """Record in ``state`` what ``plan`` did after step ``state.step_in_epoch``, and move to the next step."""
    if plan.blocking:
        state.pending_wait = state.pending_step = None
        state.syncs["blocking"] += 1
    else:
        if plan.merge:
            state.pending_wait = state.pending_step = None
            state.syncs["merged"] += 1
        if plan.send is not None:
            state.pending_wait, state.pending_step = plan.send.wait, state.step_in_epoch
            state.syncs["sent"] += 1
    state.local_sync, state.node_diverged = plan.local_sync, plan.node_diverged
    state.sender, state.previous_sender = plan.sender, plan.previous_sender
    state.step_in_epoch += 1


def merge_weights(wait: int, nodes: int) -> tuple[float, float]:
    """heat's staleness weights ``(own, other)`` of ``x <- own x + other x_bar``: ``2B / (N + 2B)`` and
    ``N / (N + 2B)``, with ``2B`` replaced by 1 when ``B = 0``."""
    numerator = 2.0 * wait if wait > 0 else 1.0
    denominator = nodes + numerator
    return numerator / denominator, nodes / denominator


class DASO(SyncMode):
    """Distributed Asynchronous and Selective Optimization (see the module docstring). heat's defaults.

    Args:
        warmup_epochs: epochs of blocking averaging after every step at the start (>= 0).
        cooldown_epochs: epochs of blocking averaging after every step at the end (>= 0).
        global_skip: steps between sends when cycling starts (heat: 4).
        batches_to_wait: steps between a send and its merge when cycling starts (heat: 1).
        local_skip: node-local gradient averaging period when cycling starts (heat: 1, every step).
        max_global_skips: the value ``global_skip`` is reset to after it reached 1 on a plateau (heat: 8).
        stability_level: the plateau detector's relative threshold (heat: 0.05).
        skip_reduction_factor: divides the skips on a plateau (heat: 2).
        local_skip_factor: ``max_global_skips // local_skip_factor`` is the reset value of ``local_skip`` and
            ``batches_to_wait`` (heat: 4).
        sending_chunk_size: the most elements per inter-node message (heat: 10 000 000).
        downcast: ``"bfloat16"`` (heat), ``"float16"`` or ``None``/``"float32"``: the precision of the blocking
            phases' inter-node averages.
        downcast_all_phases: also send the cycling phase's models in ``downcast`` precision (heat: no; it halves
            the bytes between nodes but rounds the model to ``downcast`` at every cycling epoch's end).
        check_finite: raise :class:`FloatingPointError` on every rank when an average received holds a value that
            is not finite (heat raises on NaN); ``False`` lets it through.
    """

    name = "daso"
    one_optimizer_fix = "use one optimizer"
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
        check_finite: bool = True,
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
        self.check_finite = bool(check_finite)
        self.state = self._initial_state()
        self.transport: NodeTransport | None = None
        self.node_mean: NodeMeanAggregator | None = None
        self.averager: ModelAverager | None = None
        self._pending: Averaging | None = None

    @property
    def initial_skips(self) -> Skips:
        """The cycling schedule of the first cycling epoch (before the plateau detector's first answer)."""
        return Skips(self.global_skip, self.local_skip, self.batches_to_wait)

    def _initial_state(self) -> DASOState:
        phase = epoch_phase(0, None, self.warmup_epochs, self.cooldown_epochs)
        return DASOState(phase=phase, cycle=self.initial_skips, plateau=PlateauDetector(threshold=self.stability_level))

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
        self.transport = node_transport(topology, context.node_transport, context.device)
        self.node_mean = NodeMeanAggregator(self.transport)
        self.averager = ModelAverager(context.module, topology, context.traffic, "nodes", self.sending_chunk_size)

    def _parts(self) -> tuple[NodeMeanAggregator, ModelAverager]:
        if self.node_mean is None or self.averager is None:
            raise RuntimeError("DASO.setup() was not called.")
        return self.node_mean, self.averager

    def setup_buckets(self, buckets: list[GradBucket]) -> None:
        node_mean, _ = self._parts()
        node_mean.setup(self.aggregation_context(buckets, self.ctx.topology.node_gradients, spans_nodes=False))

    # --------------------------------------------------------------------------------------------- steps

    def uses_aggregator(self) -> bool:
        """DASO averages gradients inside nodes (exactly) and models across nodes: no step uses the aggregator."""
        return False

    def gradient_aggregator(self) -> Aggregator | None:
        node_mean, _ = self._parts()
        return node_mean if self.state.local_sync else None

    def begin_epoch(self, epoch: int, steps: int | None, total_epochs: int | None) -> None:
        """Start ``epoch`` in its phase; a run resumed inside ``epoch`` keeps its step count, and one resumed after
        an epoch whose end was not yet processed processes it first."""
        state = self.state
        state.steps_in_epoch, state.total_epochs = steps, total_epochs
        if epoch == state.epoch and state.step_in_epoch > 0:
            return
        if epoch > state.epoch and not state.epoch_ended and state.step_in_epoch > 0:
            self.end_epoch()
        state.epoch, state.step_in_epoch, state.epoch_ended = epoch, 0, False
        state.phase = epoch_phase(epoch, total_epochs, self.warmup_epochs, self.cooldown_epochs)

    def record_loss(self, loss: float) -> None:
        self.state.loss_sum += float(loss)
        self.state.loss_count += 1

    def after_optimizer_step(self) -> None:
        plan = plan_step(self.state, self.ctx.topology.local_size, self.downcast_all_phases)
        self._apply(plan)
        advance(self.state, plan)

    def _apply(self, plan: StepPlan) -> None:
        """Carry out ``plan``'s communication and model updates (see :class:`StepPlan` for the order)."""
        _, averager = self._parts()
        step = self.state.step_in_epoch
        sent = None
        if plan.send is not None:
            sent = averager.start(self.downcast if plan.send.downcast else None, plan.send.source)
        if plan.blocking:
            assert sent is not None
            pending, self._pending = self._pending, None
            mean = sent.result()
            if pending is not None:  # dropped, checked
                self._check(pending.result(), self.state.pending_step)
            averager.assign(self._check(mean, step))
            return
        if plan.broadcast_from is not None:
            averager.broadcast_in_node(plan.broadcast_from)
        if plan.merge and self._pending is not None and self.state.pending_wait is not None:
            pending, self._pending = self._pending, None
            own, other = merge_weights(self.state.pending_wait, self.ctx.topology.num_nodes)
            averager.merge(self._check(pending.result(), self.state.pending_step), own=own, other=other)
        if sent is not None:
            self._pending = sent

    def _check(self, mean: list[torch.Tensor], sent_at: int | None) -> list[torch.Tensor]:
        """``mean``, an average received, checked to be finite (the same on every rank, so every rank raises)."""
        if self.check_finite:
            bad = sum(int((~torch.isfinite(flat)).sum()) for flat in mean)
            if bad:
                raise FloatingPointError(
                    f"daso: the model averaged across nodes (sent at step {sent_at} of epoch {self.state.epoch}) "
                    f"holds {bad} values that are NaN or infinite: a rank's parameters were not finite when sent, "
                    "or the nodes' sum exceeded the downcast dtype (float16: 65504) (the loss diverged: lower the "
                    "learning rate or clip the gradients; downcast='bfloat16' has float32's range; "
                    "check_finite=False lets it through)."
                )
        return mean

    # --------------------------------------------------------------------------------------------- epochs

    def end_epoch(self) -> None:
        """heat's ``epoch_loss_logic`` for the next epoch, on the epoch's loss averaged over all ranks."""
        state = self.state
        if state.epoch_ended:
            return
        loss = self._mean_epoch_loss()
        state.loss_sum, state.loss_count, state.epoch_ended = 0.0, 0, True
        self.schedule_next_epoch(loss)

    def _mean_epoch_loss(self) -> float | None:
        """The mean over the ranks of each rank's mean loss in the epoch (NaN if any is NaN; ranks without a loss
        left out; ``None`` if no rank recorded one)."""
        state = self.state
        local = state.loss_sum / state.loss_count if state.loss_count else None
        control = self.ctx.topology.control
        values = [v for v in (control.allgather(local) if control.Get_size() > 1 else [local]) if v is not None]
        return sum(values) / len(values) if values else None

    def schedule_next_epoch(self, loss: float | None) -> None:
        """Adapt the cycling schedule after epoch ``state.epoch`` with mean loss ``loss`` when the next epoch
        cycles (``None``: no loss was recorded, the plateau detector is not fed)."""
        state = self.state
        upcoming = epoch_phase(state.epoch + 1, state.total_epochs, self.warmup_epochs, self.cooldown_epochs)
        if upcoming is Phase.CYCLING:
            plateaued = loss is not None and state.plateau.plateaued(loss)
            state.cycle = adapt_skips(
                state.cycle, plateaued, self.max_global_skips, self.skip_reduction_factor, self.local_skip_factor
            )
        log.info("daso: epoch %d: loss %s, next: %s, cycling skips %s", state.epoch, loss, upcoming.value, state.cycle)

    def finish(self) -> None:
        """Complete a send in flight (dropped: training ended) and free the shared memory (collective)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self.state.pending_wait = self.state.pending_step = None
        if self.averager is not None:
            self.averager.close()

    # ---------------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The state, with a send in flight completed: its mean (the same on every rank) is stored; once set up,
        every rank's losses of the epoch so far under ``"rank_losses"`` (collective over the world; complete on
        rank 0)."""
        state = asdict(self.state)
        state["phase"] = self.state.phase.value
        state["version"] = STATE_VERSION
        state["pending_mean"] = [t.clone() for t in self._pending.result()] if self._pending is not None else None
        if self.context is not None:
            topology = self.context.topology
            losses = {"loss_sum": self.state.loss_sum, "loss_count": self.state.loss_count}
            state["rank_losses"] = gather_rank_states("daso", losses, topology.control, topology.rank, topology.size)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        pending = state.pop("pending_mean")
        version = state.pop("version", 1)
        if version == 1:
            state = self._from_layout_1(state, pending is not None)
        elif version not in (2, STATE_VERSION):
            raise ValueError(
                f"daso: the checkpoint's state has layout {version}; this version reads layouts 1 to "
                f"{STATE_VERSION}: resume with the mpistrategy version that wrote it."
            )
        rank_losses = state.pop("rank_losses", None)
        if rank_losses is not None and self.context is not None:  # not set up: the saving rank's own, as stored
            state.update(self._own_losses(rank_losses))
        unknown = set(state) - {f.name for f in fields(DASOState)}
        if unknown:
            raise ValueError(f"daso: the checkpoint's state has unknown fields {sorted(unknown)}.")
        state["phase"] = Phase(state["phase"])
        state["cycle"] = Skips(**state["cycle"])
        state["plateau"] = PlateauDetector(**state["plateau"])
        self.state = DASOState(**state)
        self._pending = None
        if pending is not None:
            _, averager = self._parts()
            self._pending = Averaging(averager, [t.clone() for t in pending], [], done=True)

    def _own_losses(self, rank_losses: dict[str, Any]) -> dict[str, Any]:
        """This rank's losses of the epoch so far from a checkpoint's ``"rank_losses"``; written by another number
        of ranks, those of saved rank ``rank % saved ranks`` (rank 0 warns)."""
        topology = self.ctx.topology
        saved = rank_losses["world_size"]
        if saved == topology.size:
            return own_rank_state("daso", rank_losses, topology.rank, topology.size)
        if topology.rank == 0:
            log.warning(
                "daso: the checkpoint holds the epoch's losses so far of %d ranks and this run has %d: rank r "
                "continues the epoch's loss from saved rank r %% %d, so the plateau detector sees another mean loss "
                "for this epoch than an uninterrupted run.",
                saved,
                topology.size,
                saved,
            )
        return rank_losses["ranks"][topology.rank % saved]

    def _from_layout_1(self, state: dict[str, Any], pending: bool) -> dict[str, Any]:
        """A checkpoint without ``version``: the skips in force instead of the cycling schedule, the step of the
        merge instead of heat's per-step rule, no node-local switch or sender."""
        state = dict(state)
        skips = Skips(state.pop("global_skip"), state.pop("local_skip"), state.pop("batches_to_wait"))
        state["cycle"] = asdict(skips if state["phase"] == Phase.CYCLING.value else self.initial_skips)
        due = state.pop("pending_due")
        state["pending_wait"] = state["pending_wait"] if pending else None
        state["pending_step"] = None if due is None or not pending else due - state["pending_wait"]
        state["local_sync"] = skips.local_skip <= 1 or state["step_in_epoch"] % skips.local_skip == 0
        state["node_diverged"] = skips.local_skip > 1
        state["previous_sender"] = 0 if pending else None
        return state

    def __repr__(self) -> str:
        return (
            f"DASO(warmup_epochs={self.warmup_epochs}, cooldown_epochs={self.cooldown_epochs}, "
            f"global_skip={self.global_skip}, batches_to_wait={self.batches_to_wait}, downcast={self.downcast})"
        )
