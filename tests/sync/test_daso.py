"""DASO's schedule and merge weights against heat's formulas, and its steps on a real 2-node job."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mpistrategy.aggregation import MeanAggregator
from mpistrategy.comm.topology import topology
from mpistrategy.sync import DASO, SyncConfigurationError, SyncContext


def heat_schedule(losses: list[float], warmup: int, cooldown: int, total: int) -> list[tuple[int, int, int]]:
    """(global_skip, local_skip, batches_to_wait) for the epoch after each of ``losses``: heat's
    ``epoch_loss_logic`` with its defaults (initial skips 4/1/1, max 8, factors 2 and 4, patience 2, 5 %)."""
    gs = ls = btw = 0
    best, bad = math.inf, 0
    out = []
    for epoch, loss in enumerate(losses):
        upcoming = epoch + 1
        if upcoming < warmup:
            gs = ls = btw = 0
            out.append((gs, ls, btw))
            continue
        if upcoming == warmup:
            gs, ls, btw = 4, 1, 1
        if upcoming >= total - cooldown:
            gs = ls = btw = 0
            out.append((gs, ls, btw))
            continue
        if loss < best * 0.95:
            best, bad = loss, 0
        else:
            bad += 1
        stable = bad > 2
        if stable:
            bad = 0
        if stable and gs > 1:
            gs, ls, btw = gs // 2, ls // 2, btw - 1
            if gs > 0:
                btw, ls = max(btw, 1), max(ls, 1)
        elif stable and gs == 1:
            gs, ls, btw = 8, 2, 2
        out.append((gs, ls, btw))
    return out


def test_schedule_follows_heat_on_a_scripted_loss_sequence() -> None:
    improving = [1.0 * 0.8**k for k in range(5)]
    flat = [0.3] * 16  # a long plateau: halving to 1, then the reset to the maximum, then halving again
    losses = improving + flat + [0.1, 0.09, 0.2, 0.2, 0.2, 0.2]
    total = len(losses) + 1
    daso = DASO(warmup_epochs=3, cooldown_epochs=2)
    got = []
    phases = []
    for epoch, loss in enumerate(losses):
        daso.state.epoch, daso.state.total_epochs = epoch, total
        daso.schedule_next_epoch(loss)
        got.append((daso.state.global_skip, daso.state.local_skip, daso.state.batches_to_wait))
        phases.append(daso.state.phase)
    assert got == heat_schedule(losses, warmup=3, cooldown=2, total=total)
    assert {s[0] for s in got} >= {0, 1, 2, 4, 8}, "the sequence must exercise halving and the reset"
    assert phases[:2] == ["warmup"] * 2 and phases[2] == "cycling" and phases[-2:] == ["cooldown"] * 2


def test_warmup_zero_starts_cycling_at_once() -> None:
    daso = DASO(warmup_epochs=0, global_skip=2, batches_to_wait=1)
    assert (daso.state.phase, daso.state.global_skip, daso.state.batches_to_wait) == ("cycling", 2, 1)


@pytest.mark.parametrize(
    "options, field",
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


def _delta(node: int, step: int) -> float:
    """The update every rank of ``node`` makes in optimizer step ``step`` (the test's stand-in for training)."""
    return 10.0 * node + step * step + 1.0


@pytest.mark.mpi(ranks=(4,), timeout=60)
def test_steps_send_merge_and_block_with_heats_weights() -> None:
    """2 nodes of 2: the parameter after each step equals heat's merge of the stale mean, step by step."""
    topo = topology(ranks_per_node=2)
    module = nn.Linear(3, 1, bias=False).double()
    nn.init.zeros_(module.weight)
    daso = DASO(warmup_epochs=0, cooldown_epochs=0, global_skip=3, batches_to_wait=2, downcast=None)
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
        elif step % 3 == 0:  # a send; nothing is merged on this step
            sent[step] = mean
            assert after == before
        elif step - wait in sent:  # received B = 2 steps after the send: x <- (2B x + N x_bar) / (N + 2B)
            want = (2 * wait * before + nodes * sent[step - wait]) / (nodes + 2 * wait)
            assert after == pytest.approx(want, abs=1e-12)
        else:
            assert after == before
        assert torch.equal(module.weight, module.weight.flatten()[0].expand_as(module.weight))
    assert daso.state.syncs == {"blocking": 1, "sent": 3, "merged": 2}
