"""DASO against heat: the epoch schedule and the step decisions (single process, pure functions) and a replay of
heat's steps on real ranks (4 ranks as 2 nodes of 2, 6 ranks as 3 nodes of 2) comparing every step's decisions
and parameters with :mod:`tests.sync.heat_daso`, the precision of every average, and non-finite parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from mpistrategy.aggregation import MeanAggregator
from mpistrategy.comm.topology import Topology, topology
from mpistrategy.sync import DASO, SyncConfigurationError, SyncContext
from mpistrategy.sync.daso import (
    BLOCKING,
    DASOState,
    Phase,
    Skips,
    adapt_skips,
    advance,
    epoch_phase,
    merge_weights,
    plan_step,
)
from tests.sync.heat_daso import Event, HeatDASO

# ------------------------------------------------------------------------------------- single process


@pytest.mark.parametrize(
    ("skips", "plateaued", "want"),
    [
        (Skips(8, 2, 2), True, Skips(4, 1, 1)),
        (Skips(4, 1, 1), True, Skips(2, 1, 1)),  # local_skip 0 and batches_to_wait 0 are raised to 1
        (Skips(2, 1, 1), True, Skips(1, 1, 1)),
        (Skips(1, 1, 1), True, Skips(8, 2, 2)),  # the reset: max_global_skips and max // local_skip_factor
        (Skips(3, 2, 2), True, Skips(1, 1, 1)),
        (Skips(4, 1, 1), False, Skips(4, 1, 1)),
    ],
)
def test_adapt_skips_follows_heats_formulas(skips: Skips, plateaued: bool, want: Skips) -> None:
    assert adapt_skips(skips, plateaued, max_global_skips=8, reduction=2, local_factor=4) == want


def test_merge_weights_are_heats_staleness_weights() -> None:
    assert merge_weights(2, 3) == pytest.approx((4 / 7, 3 / 7))
    assert merge_weights(0, 2) == pytest.approx((1 / 3, 2 / 3))  # 2B replaced by 1


def test_phases_of_epochs() -> None:
    phases = [epoch_phase(e, 7, warmup_epochs=2, cooldown_epochs=3) for e in range(7)]
    assert phases == [Phase.WARMUP] * 2 + [Phase.CYCLING] * 2 + [Phase.COOLDOWN] * 3
    assert epoch_phase(5, None, 2, 3) is Phase.CYCLING  # unknown length: no cool-down
    assert epoch_phase(0, 2, 0, 4) is Phase.COOLDOWN


def test_epoch_schedule_follows_heat_on_a_scripted_loss_sequence() -> None:
    """Halving to 1, the reset to the maximum, halving again; a NaN epoch loss counts as a bad epoch."""
    improving = [1.0 * 0.8**k for k in range(5)]
    flat = [0.3] * 16
    losses = improving + flat + [0.1, math.nan, 0.09, math.nan, 0.2, 0.2, 0.2]
    total = len(losses) + 1
    heat = HeatDASO(1, 1, total, warmup_epochs=3, cooldown_epochs=2, first_skips=(4, 1, 1))
    daso = DASO(warmup_epochs=3, cooldown_epochs=2)
    got, phases = [], []
    for epoch, loss in enumerate(losses):
        daso.state.epoch, daso.state.total_epochs = epoch, total
        daso.schedule_next_epoch(loss)
        phase = epoch_phase(epoch + 1, total, 3, 2)
        got.append(BLOCKING if phase.blocking else daso.state.cycle)
        phases.append(phase)
        heat.epoch = epoch + 1
        heat.epoch_loss_logic([loss])
    assert [(s.global_skip, s.local_skip, s.batches_to_wait) for s in got] == heat.schedules
    assert {s.global_skip for s in got} >= {0, 1, 2, 4, 8}, "the sequence must exercise halving and the reset"
    assert phases[:2] == [Phase.WARMUP] * 2 and phases[2] is Phase.CYCLING and phases[-2:] == [Phase.COOLDOWN] * 2


def test_a_nan_loss_is_a_bad_epoch_and_no_loss_feeds_nothing() -> None:
    daso = DASO(warmup_epochs=0, cooldown_epochs=0)
    for loss in (1.0, math.nan, math.nan):
        daso.schedule_next_epoch(loss)
    assert daso.state.plateau.bad_epochs == 2 and daso.state.cycle == Skips(4, 1, 1)
    daso.schedule_next_epoch(None)
    assert daso.state.plateau.bad_epochs == 2
    daso.schedule_next_epoch(math.nan)  # the third bad epoch in a row: a plateau halves the skips
    assert daso.state.cycle == Skips(2, 1, 1) and daso.state.plateau.bad_epochs == 0


def test_warmup_zero_starts_cycling_at_once() -> None:
    daso = DASO(warmup_epochs=0, global_skip=2, batches_to_wait=1)
    assert (daso.state.phase, daso.state.skips) == (Phase.CYCLING, Skips(2, 1, 1))
    assert daso.state.phase == "cycling"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"global_skip": 0}, "global_skip"),
        ({"warmup_epochs": -1}, "warmup_epochs"),
        ({"batches_to_wait": 1.5}, "batches_to_wait"),
        ({"downcast": "int8"}, "downcast"),
        ({"stability_level": -0.1}, "stability_level"),
        ({"skip_reduction_factor": 1}, "skip_reduction_factor"),
    ],
)
def test_bad_options_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(SyncConfigurationError, match=field):
        DASO(**options)


#: (initial skips, epoch lengths) of the decision replays; heat's own (4, 1, 1), the values after a reset
#: (8, 2, 2) and settings off heat's path (a wait beyond the skip, no wait, local_skip 3)
SETTINGS = {
    "4-1-1": ((4, 1, 1), [3, 20, 7, 1, 9, 12, 2, 5, 16]),
    "8-2-2": ((8, 2, 2), [4, 20, 11, 9, 17, 6, 3, 10, 19]),
    "1-1-1-reset": ((1, 1, 1), [5, 6, 4, 3, 19, 20, 13, 8, 15, 2]),
    "3-2-2": ((3, 2, 2), [2, 14, 5, 18, 7, 1, 13]),
    "2-1-3": ((2, 1, 3), [1, 10, 4, 13, 20]),
    "4-1-0": ((4, 1, 0), [6, 9, 3, 11]),
    "6-3-1": ((6, 3, 1), [2, 16, 11, 20, 7]),
}


def _same_decisions(plan, event: Event, sender: int, diverged: bool) -> None:
    """``plan`` (mpistrategy) takes heat's decisions ``event``; where no step skipped node-local averaging yet,
    every rank of a node holds the same model, so the node's mean is sent and heat's broadcast is skipped."""
    assert (plan.send is not None) == (event.send_mod is not None)
    if plan.send is not None:
        assert sender == event.send_mod
        assert plan.send.source == (event.send_mod if diverged else None)
        assert plan.send.downcast == event.downcast
    assert plan.blocking == event.blocking
    assert plan.merge == event.merged
    assert plan.broadcast_from == (event.broadcast_from if diverged else None)
    assert plan.local_sync == event.local_sync_next


@pytest.mark.parametrize("per_node", [2, 3])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_plan_step_takes_heats_decisions(setting: str, per_node: int) -> None:
    """Every cycling epoch length from 1 to 20 in turn, the switches and the sender carried across epochs."""
    skips, _ = SETTINGS[setting]
    heat = HeatDASO(2, per_node, total_epochs=99, warmup_epochs=1, cooldown_epochs=0, first_skips=skips)
    heat.x = [torch.zeros(1, dtype=torch.float64) for _ in range(heat.size)]
    heat.global_skip, heat.local_skip, heat.batches_to_wait = skips
    state = DASOState(phase=Phase.CYCLING, cycle=Skips(*skips))
    diverged = False
    for length in [*range(1, 21), *range(20, 0, -3)]:
        heat.last_batch, state.steps_in_epoch, state.step_in_epoch = length - 1, length, 0
        for step in range(length):
            diverged = diverged or not heat.require_backward_grad_sync
            sender = state.sender
            plan = plan_step(state, per_node)
            heat.train_step(lambda x, r, t: torch.zeros_like(x), step)
            _same_decisions(plan, heat.events[-1], sender, diverged)
            advance(state, plan)
            assert state.node_diverged == diverged


def test_blocking_phases_send_in_the_downcast_dtype_cycling_epochs_in_full_precision() -> None:
    """heat downcasts only while global_skip < 1: a cycling epoch's last average travels in full precision."""
    cycling = DASOState(phase=Phase.CYCLING, cycle=Skips(4, 1, 1), steps_in_epoch=6, step_in_epoch=5)
    warmup = DASOState(phase=Phase.WARMUP, steps_in_epoch=6, step_in_epoch=5)
    for state, want in ((cycling, False), (warmup, True)):
        plan = plan_step(state, 2)
        assert plan.blocking and plan.send is not None and plan.send.downcast is want
    plan = plan_step(cycling, 2, downcast_all_phases=True)
    assert plan.send is not None and plan.send.downcast


def test_a_checkpoint_of_the_first_layout_loads() -> None:
    daso = DASO(warmup_epochs=1, global_skip=4, local_skip=1, batches_to_wait=1)
    old = {
        "phase": "warmup",
        "global_skip": 0,
        "local_skip": 0,
        "batches_to_wait": 0,
        "epoch": 0,
        "step_in_epoch": 3,
        "steps_in_epoch": 8,
        "epoch_ended": False,
        "total_epochs": 3,
        "loss_sum": 1.5,
        "loss_count": 3,
        "plateau": {"patience": 2, "threshold": 0.05, "best": math.inf, "bad_epochs": 0},
        "pending_due": None,
        "pending_wait": 0,
        "syncs": {"blocking": 3, "sent": 0, "merged": 0},
        "pending_mean": None,
    }
    daso.load_state_dict(old)
    assert daso.state.phase is Phase.WARMUP and daso.state.cycle == Skips(4, 1, 1)
    assert daso.state.step_in_epoch == 3 and daso.state.pending_wait is None and daso.state.local_sync
    with pytest.raises(ValueError, match="layout 7"):
        daso.load_state_dict({**daso.state_dict(), "version": 7})
    with pytest.raises(ValueError, match="unknown fields"):
        daso.load_state_dict({**daso.state_dict(), "colour": 1})


# ------------------------------------------------------------------------------------------ on real ranks


def _gradient(x: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """The test's stand-in for a rank's gradient in a global step (depends on the parameters, rank and step)."""
    offset = torch.tensor([rank + 1.0, (step % 5) - 2.0, 0.25 * rank * (step % 3)], dtype=torch.float64)
    return 0.3 * (1.0 + 0.1 * rank) * x + offset


def _node_mean(topo: Topology, value: torch.Tensor) -> torch.Tensor:
    return topo.node_comm.allreduce(value) / topo.local_size


@dataclass
class Replay:
    """mpistrategy's DASO on this rank beside heat's model of every rank."""

    topo: Topology
    daso: DASO
    module: nn.Module
    heat: HeatDASO

    @property
    def index(self) -> int:
        return self.topo.node_rank * self.topo.local_size + self.topo.local_rank


def _replay(setting: str, topo: Topology) -> Replay:
    skips, lengths = SETTINGS[setting]
    module = nn.Linear(3, 1, bias=False).double()
    nn.init.zeros_(module.weight)
    options = dict(warmup_epochs=1, cooldown_epochs=1, global_skip=skips[0], local_skip=skips[1])
    daso = DASO(**options, batches_to_wait=skips[2], downcast=None)
    daso.setup(SyncContext(module, topo, MeanAggregator()))
    heat = HeatDASO(topo.num_nodes, topo.local_size, len(lengths), 1, 1, first_skips=skips, lr=0.05)
    heat.x = [torch.zeros(3, dtype=torch.float64) for _ in range(heat.size)]
    return Replay(topo, daso, module, heat)


def _run_replay(replay: Replay, lengths: list[int]) -> list[dict[str, int]]:
    daso, heat, module, topo = replay.daso, replay.heat, replay.module, replay.topo
    step_of_run, diverged, schedules = 0, False, []
    for epoch, length in enumerate(lengths):
        daso.begin_epoch(epoch, length, len(lengths))
        skips = daso.state.skips
        assert (skips.global_skip, skips.local_skip, skips.batches_to_wait) == (
            heat.global_skip,
            heat.local_skip,
            heat.batches_to_wait,
        ), f"epoch {epoch}"
        schedules.append(skips)
        heat.last_batch = length - 1
        for step in range(length):
            synced = daso.gradient_aggregator() is not None
            assert synced == heat.require_backward_grad_sync, f"epoch {epoch} step {step}"
            diverged = diverged or not synced
            weight = module.weight.data.view(-1)
            gradient = _gradient(weight.clone(), replay.index, step_of_run)
            if synced:
                gradient = _node_mean(topo, gradient)
            weight.sub_(heat.lr * gradient)
            sender, plan = daso.state.sender, plan_step(daso.state, topo.local_size)
            daso.after_optimizer_step()
            heat.train_step(_gradient, step_of_run)
            _same_decisions(plan, heat.events[-1], sender, diverged)
            torch.testing.assert_close(
                module.weight.data.view(-1), heat.x[replay.index], rtol=1e-11, atol=1e-11, msg=f"{epoch}/{step}"
            )
            daso.record_loss(1.0 + 0.01 * topo.rank)
            step_of_run += 1
        daso.end_epoch()
        heat.epoch_loss_logic([1.0 + 0.01 * rank for rank in range(topo.size)])
    daso.finish()
    return [dict(gs=s.global_skip, ls=s.local_skip, w=s.batches_to_wait) for s in schedules]


@pytest.mark.mpi(ranks=(4, 6), timeout=240)
def test_replay_of_heats_steps_on_nodes_of_two() -> None:
    """Every setting, several epochs of 1 to 20 steps with warm-up and cool-down, skips adapted on plateaus (the
    constant loss makes one every third epoch): decisions and float64 parameters of every rank at every step."""
    topo = topology(ranks_per_node=2)
    schedules = {setting: _run_replay(_replay(setting, topo), SETTINGS[setting][1]) for setting in sorted(SETTINGS)}
    assert {"gs": 8, "ls": 2, "w": 2} in schedules["1-1-1-reset"], "the run must reset the skips"
    assert {"gs": 1, "ls": 1, "w": 1} in schedules["4-1-1"], "the run must halve the skips to 1"


def _bfloat16_exact(tensor: torch.Tensor) -> bool:
    return torch.equal(tensor.to(torch.bfloat16).to(tensor.dtype), tensor)


@pytest.mark.mpi(ranks=(4, 6), timeout=120)
@pytest.mark.parametrize("downcast_all_phases", [False, True])
def test_precision_of_every_average(downcast_all_phases: bool) -> None:
    """float32 model, bfloat16 downcast: warm-up and cool-down averages are rounded to bfloat16, a cycling epoch's
    last average is not (heat) unless ``downcast_all_phases``; checked against the float64 mean of every rank."""
    topo = topology(ranks_per_node=2)
    module = nn.Linear(16, 4, bias=False)
    daso = DASO(warmup_epochs=1, cooldown_epochs=1, global_skip=2, downcast_all_phases=downcast_all_phases)
    daso.setup(SyncContext(module, topo, MeanAggregator()))
    generator = torch.Generator().manual_seed(topo.rank)
    for epoch, length in enumerate([2, 5, 2]):
        daso.begin_epoch(epoch, length, 3)
        for _ in range(length):
            with torch.no_grad():
                module.weight.add_(torch.randn(module.weight.shape, generator=generator))
            plan = plan_step(daso.state, topo.local_size, downcast_all_phases)
            mean = sum(torch.tensor(w) for w in topo.control.allgather(module.weight.double().tolist())) / topo.size
            daso.after_optimizer_step()
            if not plan.blocking:
                continue
            weight = module.weight.detach()
            rounded = plan.send is not None and plan.send.downcast
            assert rounded == (epoch != 1 or downcast_all_phases)
            error = (weight.double() - mean).abs().max().item()
            if rounded:
                assert error <= 2**-7 * mean.abs().max().item()
                if topo.num_nodes == 2:  # the mean of 2 bfloat16 node sums, scaled by a power of 2
                    assert _bfloat16_exact(weight)
            else:
                assert error <= 1e-6 * mean.abs().max().item()
                assert not _bfloat16_exact(weight)
        daso.end_epoch()
    daso.finish()


@pytest.mark.mpi(ranks=(3, 6), timeout=120)
@pytest.mark.parametrize("downcast", ["bfloat16", "float16"])
def test_a_blocking_average_on_nodes_of_three_sends_heats_model(downcast: str) -> None:
    """Nodes of 3 ranks holding the same model each (node-local averaging): the blocking average sends one rank's
    model in ``downcast`` as heat does, so it equals heat's ``(sum_n half(x_n)) / N`` exactly, and a model whose
    nodes' sum fits float16 (2 x 20000 < 65504; 6 x 20000 does not) stays finite."""
    topo = topology(ranks_per_node=3)
    half = getattr(torch, downcast)
    module = nn.Linear(16, 16, bias=False)
    node = topo.rank // 3
    with torch.no_grad():
        if downcast == "float16":
            module.weight.fill_(20000.0 + node)
        else:
            module.weight.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(node)))
    models = [torch.tensor(w) for w in topo.control.allgather(module.weight.tolist())[::3]]  # one rank per node
    heat = sum(model.to(half).float() for model in models).to(half).float() / topo.num_nodes
    daso = DASO(warmup_epochs=1, cooldown_epochs=0, downcast=downcast)
    daso.setup(SyncContext(module, topo, MeanAggregator()))
    daso.begin_epoch(0, 1, 2)
    daso.after_optimizer_step()
    daso.end_epoch()
    daso.finish()
    assert torch.equal(module.weight.detach(), heat)


@pytest.mark.mpi(ranks=(4,), timeout=60)
@pytest.mark.parametrize("phase", ["blocking", "cycling"])
def test_a_parameter_that_is_not_finite_raises_on_every_rank(phase: str) -> None:
    """One rank's NaN: every rank raises, at the blocking average or at the merge of the send (step 1 of 4);
    ``check_finite=False`` lets it through."""
    topo = topology(ranks_per_node=2)
    for check in (True, False):
        module = nn.Linear(3, 1, bias=False)
        daso = DASO(warmup_epochs=int(phase == "blocking"), cooldown_epochs=0, check_finite=check)
        daso.setup(SyncContext(module, topo, MeanAggregator()))
        daso.begin_epoch(0, 4, 2)
        if topo.rank == 3:
            with torch.no_grad():
                module.weight[0, 1] = math.nan
        if check:
            with pytest.raises(FloatingPointError, match="1 values that are NaN or infinite.*check_finite=False"):
                daso.after_optimizer_step()
                daso.after_optimizer_step()
        else:
            daso.after_optimizer_step()
            daso.after_optimizer_step()
            assert math.isnan(float(module.weight[0, 1]))
        daso.finish()


def _delta(node: int, step: int) -> float:
    """The update every rank of ``node`` makes in optimizer step ``step`` (the test's stand-in for training)."""
    return 10.0 * node + step * step + 1.0


@pytest.mark.mpi(ranks=(4,), timeout=60)
def test_steps_send_merge_and_block_with_heats_weights() -> None:
    """2 nodes of 2, global_skip 4, batches_to_wait 2, 8 steps: the send of step 0 is merged at step 2 with heat's
    weights; the send of step 4 would be due at step 6, but heat clips the wait there to the 1 step left, so it is
    not merged and the last step's blocking average drops it."""
    topo = topology(ranks_per_node=2)
    module = nn.Linear(3, 1, bias=False).double()
    nn.init.zeros_(module.weight)
    daso = DASO(warmup_epochs=0, cooldown_epochs=0, global_skip=4, batches_to_wait=2, downcast=None)
    daso.setup(SyncContext(module, topo, MeanAggregator()))
    steps, nodes, wait = 8, topo.num_nodes, 2
    daso.begin_epoch(0, steps, total_epochs=None)
    sent: dict[int, float] = {}
    for step in range(steps):
        with torch.no_grad():
            module.weight.add_(_delta(topo.node_rank, step))
        before = float(module.weight[0, 0])
        mean = sum(topo.control.allgather(before)) / topo.size
        daso.after_optimizer_step()
        after = float(module.weight[0, 0])
        if step == steps - 1:  # the epoch's last step: a blocking average (the send in flight is dropped)
            assert after == pytest.approx(mean, abs=1e-12)
        elif step % 4 == 0:  # a send; nothing is merged on this step
            sent[step] = mean
            assert after == before
        elif step == 2:  # received B = 2 steps after the send: x <- (2B x + N x_bar) / (N + 2B)
            want = (2 * wait * before + nodes * sent[0]) / (nodes + 2 * wait)
            assert after == pytest.approx(want, abs=1e-12)
        else:
            assert after == before
        assert torch.equal(module.weight, module.weight.flatten()[0].expand_as(module.weight))
    assert daso.state.syncs == {"blocking": 1, "sent": 2, "merged": 1}
    daso.finish()
