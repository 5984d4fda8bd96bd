"""fabric.save / fabric.load under mpi_ad: values round-trip (parameters and AdamW state, extra objects) and
training continues as if never saved; rank 0 writes atomically and sealed; a failed write and a corrupt file raise
on every rank; a sync mode whose replicas differ (local SGD) gets each rank's own replica back."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from mpistrategy.strategy import CorruptCheckpointError, MPIADFabricStrategy
from mpistrategy.strategy.checkpoint_files import SEAL_PREFIX, find_problem
from mpistrategy.sync import LocalSGD
from tests.fabric.helpers import COMM, RANK, SIZE, flat_parameters, launched, mlp, shared_tmpdir

STEPS = 2


def _train(fabric, model, optimizer, steps: int, seed: int) -> None:
    """``steps`` steps on per-rank random batches (drawn from ``seed``, the step and the rank)."""
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * seed + 10 * step + RANK)
        x, y = torch.randn(4, 6, dtype=torch.float64, generator=g), torch.randn(4, 2, dtype=torch.float64, generator=g)
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _set_up(fabric, seed: int):
    net = mlp(seed=seed)
    return fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1))


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
def test_save_load_round_trips_and_training_continues_identically() -> None:
    fabric = launched()
    path = os.path.join(shared_tmpdir(), "state.ckpt")
    model, optimizer = _set_up(fabric, seed=1)
    _train(fabric, model, optimizer, STEPS, seed=0)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS, "note": torch.arange(3)})

    restored_model, restored_optimizer = _set_up(fabric, seed=2)  # other weights, no optimizer state
    assert not torch.equal(flat_parameters(restored_model), flat_parameters(model))
    state = {"model": restored_model, "optimizer": restored_optimizer, "step": 0}
    remainder = fabric.load(path, state)
    assert state["step"] == STEPS and torch.equal(remainder["note"], torch.arange(3))
    assert set(remainder) == {"note"}  # nothing of the strategy's own leaks into what the user gets back
    assert torch.equal(flat_parameters(restored_model), flat_parameters(model))
    torch.testing.assert_close(restored_optimizer.state_dict(), optimizer.state_dict(), rtol=0, atol=0)

    _train(fabric, model, optimizer, STEPS, seed=1)
    _train(fabric, restored_model, restored_optimizer, STEPS, seed=1)
    assert torch.equal(flat_parameters(restored_model), flat_parameters(model))
    torch.testing.assert_close(restored_optimizer.state_dict(), optimizer.state_dict(), rtol=0, atol=0)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_rank_zero_writes_atomically_and_sealed() -> None:
    fabric = launched()
    folder = shared_tmpdir()
    path = os.path.join(folder, "weights.ckpt")
    model = fabric.setup(mlp(seed=RANK))
    fabric.save(path, {"model": model, "version": 1})
    fabric.save(path, {"model": model, "version": 2})  # replaced as a whole
    assert os.listdir(folder) == ["weights.ckpt"]  # no temporary file left, by any rank
    COMM.Barrier()
    assert find_problem(path) is None
    with open(path, "rb") as handle:
        assert SEAL_PREFIX in handle.read()[-200:]
    assert torch.load(path, weights_only=True)["version"] == 2
    assert fabric.load(path)["version"] == 2

    raw_path = os.path.join(folder, "raw.pt")  # a plain torch state dict, written without Fabric
    if RANK == 0:
        torch.save(mlp(seed=42).state_dict(), raw_path)
    fabric.barrier()
    fabric.load_raw(raw_path, model)
    assert torch.equal(flat_parameters(model), flat_parameters(mlp(seed=42)))


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_a_failed_write_and_a_corrupt_file_raise_on_every_rank() -> None:
    fabric = launched()
    folder = shared_tmpdir()
    blocker = os.path.join(folder, "a-file")
    if RANK == 0:
        with open(blocker, "w") as handle:
            handle.write("not a folder")
    fabric.barrier()
    with pytest.raises((OSError, RuntimeError)) as raised:
        fabric.save(os.path.join(blocker, "x.ckpt"), {"value": 1})
    if RANK == 0:
        assert isinstance(raised.value, OSError)
    else:
        assert "rank 0 could not write the checkpoint" in str(raised.value)

    path = os.path.join(folder, "good.ckpt")
    fabric.save(path, {"value": torch.ones(1000)})
    if RANK == 0:
        with open(path, "r+b") as handle:
            handle.seek(2000)
            byte = handle.read(1)
            handle.seek(2000)
            handle.write(bytes([byte[0] ^ 0xFF]))
    fabric.barrier()
    with pytest.raises(CorruptCheckpointError, match="good.ckpt is corrupt"):
        fabric.load(path)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_local_sgd_replicas_come_back_to_their_own_rank() -> None:
    fabric = launched(MPIADFabricStrategy(sync=LocalSGD(period=4)))
    path = os.path.join(shared_tmpdir(), "replicas.ckpt")
    model, optimizer = _set_up(fabric, seed=1)
    _train(fabric, model, optimizer, 1, seed=0)  # one local step: the replicas differ
    mine = flat_parameters(model)
    assert not all(torch.equal(mine, other) for other in COMM.allgather(mine))
    fabric.save(path, {"model": model, "optimizer": optimizer})
    _train(fabric, model, optimizer, 1, seed=1)
    fabric.load(path, {"model": model, "optimizer": optimizer})
    assert torch.equal(flat_parameters(model), mine)
    assert fabric.strategy.engines[0].sync.step == 1
    assert len(torch.load(path, weights_only=False)["mpistrategy"]["engines"][0]["replicas"]["copies"]) == SIZE


def _set_up_wide(fabric, seed: int):
    """A model of another shape than ``_set_up``'s (a replica given to the wrong model would not fit)."""
    net = mlp(hidden=5, seed=seed)
    return fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_replicas_go_to_the_models_they_were_saved_for_whatever_the_setup_order() -> None:
    """Engine states are matched to models by the names they were saved under: models set up in another order, or
    new models loaded in place of the trained ones, get their own replica and sync state."""
    fabric = launched(MPIADFabricStrategy(sync=LocalSGD(period=4)))
    path = os.path.join(shared_tmpdir(), "two_models.ckpt")
    model, optimizer = _set_up(fabric, seed=1)
    wide, wide_optimizer = _set_up_wide(fabric, seed=2)
    _train(fabric, model, optimizer, 1, seed=0)  # one local step each: the replicas differ
    _train(fabric, wide, wide_optimizer, 1, seed=3)
    _train(fabric, wide, wide_optimizer, 1, seed=4)
    mine, mine_wide = flat_parameters(model), flat_parameters(wide)
    assert not all(torch.equal(mine, other) for other in COMM.allgather(mine))
    fabric.save(path, {"model": model, "optimizer": optimizer, "wide": wide, "wide_optimizer": wide_optimizer})

    new_wide, new_wide_optimizer = _set_up_wide(fabric, seed=5)  # set up first this time
    new_model, new_optimizer = _set_up(fabric, seed=6)
    state = {"model": new_model, "optimizer": new_optimizer, "wide": new_wide, "wide_optimizer": new_wide_optimizer}
    fabric.load(path, state)
    assert torch.equal(flat_parameters(new_model), mine) and torch.equal(flat_parameters(new_wide), mine_wide)
    steps = {id(module): engine.sync.step for module, engine in fabric.strategy._engines}
    assert steps[id(new_model.module)] == 1 and steps[id(new_wide.module)] == 2
    torch.testing.assert_close(new_wide_optimizer.state_dict(), wide_optimizer.state_dict(), rtol=0, atol=0)
