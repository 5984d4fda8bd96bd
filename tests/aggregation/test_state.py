"""State: every stateful scheme's state (residuals, generators, PowerSGD's memories and round counter) round-trips
through ``state_dict`` / ``load_state_dict`` (gathered to rank 0, given back to each rank), refuses another world
size or scheme, and a run resumed from a mid-training checkpoint ends with the parameters of an uninterrupted one."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from mpistrategy.aggregation import (
    QSGD,
    LowPrecision,
    MajorityVote,
    MinMaxQuantization,
    PowerSGD,
    RandomK,
    ScaledSign,
    TopK,
)
from mpistrategy.strategy.mpi_ad import CHECKPOINT_KEY, MPIADStrategy
from tests.aggregation.helpers import COMM, RANK, SIZE, bucket, combine, everyone, setup
from tests.strategy.helpers import (
    Regressor,
    assert_same_on_all_ranks,
    flat_parameters,
    loader,
    mlp,
    regression_data,
    shared_tmpdir,
    trainer,
)
from tests.strategy.resume import fit_with_epoch_checkpoints

STATEFUL = {
    "topk": lambda: TopK(density=0.2),
    "randomk": lambda: RandomK(density=0.2, seed=5),
    "qsgd": lambda: QSGD(levels=3, block_size=8, seed=5),
    "minmax": lambda: MinMaxQuantization(bits=3, block_size=8),
    "sign": ScaledSign,
    "powersgd": lambda: PowerSGD(rank=1, start_iter=1, seed=5),
}
SHAPES = [[(6, 10), (10,), (4, 5)], [(16, 12)]]


def _buckets(shapes=SHAPES):
    return [bucket(s, index, own=len(s) == 1) for index, s in enumerate(shapes)]


def _round(aggregator, buckets, seed: int) -> torch.Tensor:
    """One combination of fixed per-rank inputs, spread over ``buckets`` in parameter order."""
    total = sum(b.buffer.numel() for b in buckets)
    mine = everyone(total, seed=seed)[RANK]
    combine(aggregator, buckets, list(mine.split([b.buffer.numel() for b in buckets])))
    return torch.cat([b.buffer.clone() for b in buckets])


def _trained(make, rounds: int = 1):
    """A set-up aggregator after ``rounds`` rounds, and its state as every rank reads it from a checkpoint (rank
    0's)."""
    aggregator = make()
    setup(aggregator, _buckets())
    for seed in range(rounds):
        _round(aggregator, aggregator.context.buckets, seed)
    return aggregator, COMM.bcast(aggregator.state_dict(), root=0)


def _plain(value: Any) -> bool:
    """Whether ``value`` is built from plain Python values and tensors only."""
    if isinstance(value, dict):
        return all(isinstance(k, str | int) and _plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | torch.Tensor)


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_round_trips_and_continues_identically(name: str) -> None:
    original = STATEFUL[name]()
    setup(original, _buckets())
    for seed in range(3):
        _round(original, original.context.buckets, seed)
    state = original.state_dict()  # collective: every rank's entry gathered to rank 0
    mine = state["ranks"]
    assert state["scheme"] == original.scheme and state["world_size"] == SIZE
    assert set(mine) == (set(range(SIZE)) if RANK == 0 else {RANK}) and _plain(state)
    state = COMM.bcast(state, root=0)  # what every rank reads from the checkpoint

    restored = STATEFUL[name]()
    setup(restored, _buckets())
    restored.load_state_dict(state)
    early = STATEFUL[name]()
    early.load_state_dict(state)  # before setup: kept and restored at setup
    setup(early, _buckets())
    fresh = STATEFUL[name]()
    setup(fresh, _buckets())
    _round(fresh, fresh.context.buckets, 0)  # past PowerSGD's start_iter, as the others are

    want = _round(original, original.context.buckets, 7)
    assert torch.equal(_round(restored, restored.context.buckets, 7), want)
    assert torch.equal(_round(early, early.context.buckets, 7), want)
    assert not torch.equal(_round(fresh, fresh.context.buckets, 7), want), "the state made no difference"
    again, reference = restored.state_dict(), original.state_dict()
    assert _equal(again["ranks"], reference["ranks"])


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_residuals_are_stored_per_parameter_and_survive_another_bucketing() -> None:
    _, state = _trained(lambda: TopK(density=0.2))
    residuals = state["ranks"][RANK]["residuals"]
    assert sorted(residuals) == ["b0.p0", "b0.p1", "b0.p2", "b1.p0"]
    assert [residuals[f"b0.p{j}"].numel() for j in range(3)] == [60, 10, 20]
    # the same parameters, each in a bucket of its own now
    rebucketed = [bucket([s], index) for index, s in enumerate([(6, 10), (10,), (4, 5), (16, 12)])]
    for b, name in zip(rebucketed, ["b0.p0", "b0.p1", "b0.p2", "b1.p0"], strict=True):
        b.names = [name]
    restored = TopK(density=0.2)
    setup(restored, rebucketed)
    restored.load_state_dict(state)
    for name, value in restored.memory.state().items():
        assert torch.equal(value, residuals[name])
    alien = {**state, "ranks": {RANK: {"residuals": {"other.weight": torch.zeros(3)}}}}
    with pytest.raises(ValueError, match=r"residuals of parameters this model does not bucket: \['other.weight'\]"):
        restored.load_state_dict(alien)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_another_world_size_or_scheme_is_refused_on_every_rank() -> None:
    _, state = _trained(lambda: PowerSGD(start_iter=0))
    wider = {**state, "world_size": SIZE + 1, "ranks": {r: state["ranks"][0] for r in range(SIZE + 1)}}
    early = PowerSGD(start_iter=0)
    early.load_state_dict(wider)  # kept until setup, which refuses it
    with pytest.raises(ValueError, match=f"state .* of {SIZE + 1} ranks, but this run has {SIZE}; resume with"):
        setup(early, _buckets())
    other = PowerSGD(start_iter=0)
    setup(other, _buckets())
    with pytest.raises(ValueError, match=f"of {SIZE + 1} ranks, but this run has {SIZE}"):
        other.load_state_dict(wider)
    with pytest.raises(ValueError, match="holds the state of the 'powersgd' aggregation scheme; resume with that"):
        topk = TopK()
        setup(topk, _buckets())
        topk.load_state_dict(state)
    with pytest.raises(ValueError, match="holds the entries of ranks .* load the state_dict\\(\\) of world rank 0"):
        other.load_state_dict({**state, "ranks": {SIZE + 5: {}}})
    stateless = LowPrecision()
    setup(stateless, _buckets())
    assert stateless.state_dict() == {} and MajorityVote().state_dict() == {}
    with pytest.raises(ValueError, match="LowPrecision is stateless but was given state"):
        stateless.load_state_dict(state)


# ------------------------------------------------------------------------------------------------------- resume


def _fit(name: str, directory: str, epochs: int, seed: int, ckpt_path: str | None = None):
    aggregator = STATEFUL[name]()
    return fit_with_epoch_checkpoints(aggregator, directory, epochs, seed, ckpt_path), aggregator


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("name", list(STATEFUL))
def test_resume_mid_training_gives_the_uninterrupted_parameters(name: str) -> None:
    directory = shared_tmpdir()
    straight, straight_aggregator = _fit(name, directory, epochs=3, seed=1)
    first = os.path.join(directory, "epoch=0.ckpt")
    saved = torch.load(first, weights_only=True)  # plain values and tensors only
    stored = saved[CHECKPOINT_KEY]["aggregator"]
    assert stored["scheme"] == name and sorted(stored["ranks"]) == list(range(SIZE))

    resumed, resumed_aggregator = _fit(name, shared_tmpdir(), epochs=3, seed=99, ckpt_path=first)  # other init
    assert_same_on_all_ranks(flat_parameters(resumed), "resumed parameters")
    assert torch.equal(flat_parameters(resumed), flat_parameters(straight))
    assert _equal(resumed_aggregator.state_dict()["ranks"], straight_aggregator.state_dict()["ranks"])

    cold = Regressor(mlp(seed=1), lr=0.1, momentum=0.9)  # resumed without the aggregator's state
    checkpoint = torch.load(first, weights_only=True)
    del checkpoint[CHECKPOINT_KEY]
    bare = os.path.join(shared_tmpdir(), "bare.ckpt")
    if RANK == 0:
        torch.save(checkpoint, bare)
    COMM.Barrier()
    trainer(strategy=MPIADStrategy(aggregator=STATEFUL[name]()), max_epochs=3).fit(
        cold, loader(regression_data(SIZE * 4 * 3), 4), ckpt_path=bare
    )
    assert not torch.equal(flat_parameters(cold), flat_parameters(straight)), "the aggregator state did not matter"
