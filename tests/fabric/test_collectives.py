"""Fabric's collectives under mpi_ad against references computed from every rank's known values: all_reduce (every
op, floats, integers, booleans, collections, in place as DDP's), all_gather (shapes, collections, the adjoint with
sync_grads), broadcast, barrier, reduce_boolean_decision and torchmetrics' sync."""

from __future__ import annotations

import os
import time

import pytest
import torch
from lightning.fabric.utilities.types import ReduceOp

from mpistrategy import CommunicationError
from tests.adjoint import assert_adjoint
from tests.fabric.helpers import COMM, RANK, SIZE, launched, shared_tmpdir


def _value(rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor: distinct per rank, with negative entries."""
    return torch.tensor([[rank + 0.5, -2.0 * rank], [rank**2 - 1.0, 3.0]], dtype=torch.float64)


EVERY_VALUE = torch.stack([_value(r) for r in range(SIZE)])


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize(
    ("op", "reference"),
    [
        ("mean", EVERY_VALUE.mean(0)),
        ("sum", EVERY_VALUE.sum(0)),
        ("max", EVERY_VALUE.amax(0)),
        ("min", EVERY_VALUE.amin(0)),
        (ReduceOp.SUM, EVERY_VALUE.sum(0)),
        (ReduceOp.MAX, EVERY_VALUE.amax(0)),
    ],
    ids=["mean", "sum", "max", "min", "ReduceOp.SUM", "ReduceOp.MAX"],
)
def test_all_reduce_every_op(op: object, reference: torch.Tensor) -> None:
    fabric = launched()
    torch.testing.assert_close(fabric.all_reduce(_value(RANK), reduce_op=op), reference, rtol=0, atol=1e-12)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_all_reduce_integers_booleans_and_collections() -> None:
    fabric = launched()
    counts = torch.tensor([RANK + 1, 7 * RANK], dtype=torch.int64)
    # as DDP: an integer mean is truncated to the integer dtype
    expected_mean = torch.tensor([sum(r + 1 for r in range(SIZE)) // SIZE, sum(7 * r for r in range(SIZE)) // SIZE])
    assert torch.equal(fabric.all_reduce(counts, reduce_op="mean"), expected_mean)
    flags = torch.tensor([RANK == 0, True, False])  # as DDP: a bool sum is the logical or, in place
    assert fabric.all_reduce(flags, reduce_op="sum") is flags and flags.tolist() == [True, True, False]
    product = fabric.all_reduce(torch.tensor(RANK + 1.0), reduce_op="product")
    assert product.item() == torch.arange(1.0, SIZE + 1).prod().item()
    nested = fabric.all_reduce({"a": _value(RANK), "b": [torch.tensor(float(RANK))], "tag": "kept"}, reduce_op="sum")
    torch.testing.assert_close(nested["a"], EVERY_VALUE.sum(0), rtol=0, atol=1e-12)
    assert nested["b"][0].item() == sum(range(SIZE)) and nested["tag"] == "kept"


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_all_reduce_is_in_place_unless_differentiated() -> None:
    # as DDP: the tensor given holds the result (also an integer mean, and a non-contiguous view)
    fabric = launched()
    value = _value(RANK)
    assert fabric.all_reduce(value, reduce_op="sum") is value
    torch.testing.assert_close(value, EVERY_VALUE.sum(0), rtol=0, atol=1e-12)
    counts = torch.tensor([RANK + 1, 7 * RANK])
    fabric.all_reduce(counts, reduce_op="mean")
    assert counts.tolist() == [sum(r + 1 for r in range(SIZE)) // SIZE, sum(7 * r for r in range(SIZE)) // SIZE]
    column = _value(RANK).t()[0]
    fabric.all_reduce(column, reduce_op="max")
    torch.testing.assert_close(column, EVERY_VALUE.amax(0)[:, 0], rtol=0, atol=0)
    # a tensor that requires grad keeps its value; the result is differentiable (the mean's adjoint: the mean)
    x = _value(RANK).requires_grad_(True)
    mean = fabric.all_reduce(x, reduce_op="mean")
    torch.testing.assert_close(x.detach(), _value(RANK), rtol=0, atol=0)
    (mean * (RANK + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 2), sum(r + 1 for r in range(SIZE)) / SIZE, dtype=x.dtype))


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_all_gather_shapes_values_and_collections() -> None:
    fabric = launched()
    gathered = fabric.all_gather(_value(RANK))
    assert gathered.shape == (SIZE, 2, 2)
    assert torch.equal(gathered, EVERY_VALUE)
    scalar = fabric.all_gather(torch.tensor(float(RANK)))
    assert torch.equal(scalar, torch.arange(SIZE, dtype=torch.float32))
    nested = fabric.all_gather({"x": torch.full((3,), RANK), "y": (torch.tensor([RANK * 2.0]),)})
    assert torch.equal(nested["x"], torch.arange(SIZE).unsqueeze(1).expand(SIZE, 3))
    assert torch.equal(nested["y"][0], 2.0 * torch.arange(SIZE, dtype=torch.float32).unsqueeze(1))


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_all_gather_sync_grads_is_the_adjoint() -> None:
    fabric = launched()
    x = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(RANK))
    assert_adjoint(lambda t: fabric.all_gather(t, sync_grads=True), x)
    assert not fabric.all_gather(x.requires_grad_(True)).requires_grad  # without sync_grads: no graph


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_broadcast_objects_and_tensors_from_any_rank() -> None:
    fabric = launched()
    source = SIZE - 1
    mine = {"rank": RANK, "tensor": torch.full((2,), float(RANK)), "text": f"from {RANK}"}
    got = fabric.broadcast(mine, src=source)
    assert got["rank"] == source and got["text"] == f"from {source}"
    assert torch.equal(got["tensor"], torch.full((2,), float(source)))
    assert fabric.broadcast(RANK * 10) == 0  # src defaults to rank 0


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_barrier_waits_for_every_rank() -> None:
    fabric = launched()
    marker = os.path.join(shared_tmpdir(), "rank0-was-here")
    if RANK == 0:
        time.sleep(0.5)
        with open(marker, "w") as handle:
            handle.write("done")
    fabric.barrier("after-rank-0-wrote")
    assert os.path.exists(marker)
    COMM.Barrier()


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_a_torchmetrics_metric_outside_any_model_syncs_as_under_ddp() -> None:
    import torchmetrics

    launched()
    metric = torchmetrics.CatMetric()
    metric.update(torch.arange(RANK + 1, dtype=torch.float64))  # a different length on every rank
    assert metric.compute().tolist() == [float(i) for r in range(SIZE) for i in range(r + 1)]


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_reduce_boolean_decision() -> None:
    strategy = launched().strategy
    only_last = RANK == SIZE - 1
    assert strategy.reduce_boolean_decision(only_last, all=False) is True
    assert strategy.reduce_boolean_decision(only_last, all=True) is False
    assert strategy.reduce_boolean_decision(True, all=True) is True
    assert strategy.reduce_boolean_decision(False, all=False) is False


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("mistake", ["broadcast", "barrier", "reduce_boolean_decision"])
def test_a_control_call_on_some_ranks_raises_on_every_rank(mistake: str) -> None:
    """The culprit makes a control call the others do not make (under ``if fabric.is_global_zero:``, say), then
    all reduce a tensor: every rank raises naming both calls, instead of the culprit's message waiting for the
    others' next control call of its kind (a later broadcast then gave them its stale object). The ranks stay in
    step."""
    fabric = launched()
    strategy = fabric.strategy
    culprit = SIZE - 1
    calls = {
        "broadcast": lambda: fabric.broadcast("stale"),
        "barrier": lambda: fabric.barrier(),
        "reduce_boolean_decision": lambda: strategy.reduce_boolean_decision(True),
    }
    with pytest.raises(CommunicationError, match="ranks called different collectives") as caught:
        if RANK == culprit:
            calls[mistake]()
        fabric.all_reduce(torch.ones(2))
    text = str(caught.value)
    assert f"rank {culprit}: {mistake}(" in text and "rank 0: allreduce(float32[2], op=avg) at " in text, text
    assert fabric.broadcast(f"from {RANK}", src=culprit) == f"from {culprit}"
    with pytest.raises(ValueError if RANK == culprit else CommunicationError, match=f"src={SIZE} is not a rank"):
        fabric.broadcast("x", src=SIZE if RANK == culprit else 0)
    fabric.barrier()
