"""``Trainer(strategy="mpi_ad")`` with the model on the GPU: it equals one process with the whole batch, every sync
mode trains, and a checkpoint resumes to the same parameters and AdamW state.

Ranks share a GPU when there are fewer GPUs than ranks (``cuda:<local rank mod GPU count>``), as they do on a
one-GPU machine.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn

from mpistrategy.aggregation import build_aggregator
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import DASO, HierarchicalLocalSGD, HierarchicalSync, LocalSGD
from tests.strategy.helpers import (
    QUIET,
    SIZE,
    assert_same_on_all_ranks,
    epoch_order,
    flat_parameters,
    loader,
    mlp,
    reference_training,
    regression_data,
    shared_tmpdir,
)

PER_RANK_BATCH = 4
STEPS = 6
LR = 0.01


class AdamWRegressor(L.LightningModule):
    """MSE regression with AdamW (weight decay on): a stateful optimizer."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        dtype = next(self.net.parameters()).dtype
        x, y = (t.to(dtype) for t in batch)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


class Autocast(nn.Module):
    """``net`` whose forward runs under autocast to ``dtype`` (as Lightning's mixed precision runs the step); a
    fresh autocast region per forward, so no cast of an earlier step's weights is reused. The output comes back in
    the input's dtype: autocast computes the MSE in float32, as it does inside Lightning's step."""

    def __init__(self, net: nn.Module, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.net, self.dtype = net, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.net(x).to(x.dtype)


def fit(
    device: torch.device,
    strategy: MPIADStrategy,
    model: L.LightningModule,
    epochs: int = 1,
    ckpt_path: str | None = None,
    **options: Any,
) -> L.Trainer:
    """``epochs`` epochs of :data:`STEPS` optimizer steps each on ``device``; returns the Trainer."""
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    trainer = L.Trainer(**{**QUIET, "accelerator": accelerator, "strategy": strategy, "max_epochs": epochs, **options})
    trainer.fit(model, loader(regression_data(SIZE * PER_RANK_BATCH * STEPS), PER_RANK_BATCH), ckpt_path=ckpt_path)
    return trainer


def one_process(device: torch.device, dtype: torch.dtype, autocast: torch.dtype | None = None) -> torch.Tensor:
    """The parameters after training ``mlp(seed=4)`` in one process with the whole batch (AdamW), on the CPU."""
    net = Autocast(mlp(seed=4).to(dtype).to(device), autocast)
    data = epoch_order(regression_data(SIZE * PER_RANK_BATCH * STEPS))
    whole = type(data)(*(t.to(device, dtype) for t in data.tensors))
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.1)
    return flat_parameters(reference_training(net, whole, SIZE * PER_RANK_BATCH, STEPS, optimizer)).cpu()


def distance_moved(trained: torch.Tensor, dtype: torch.dtype) -> float:
    """How far training moved the parameters from ``mlp(seed=4)``'s."""
    moved = float(torch.linalg.vector_norm(trained - flat_parameters(mlp(seed=4).to(dtype))))
    assert moved > 1e-3, "the reference did not train"
    return moved


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=300)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_mpi_ad_on_the_device_equals_one_process_with_the_whole_batch(precision: str, device: torch.device) -> None:
    """float64 parameters to 1e-10 in 32-true; in mixed precision, within 5 % of how far training moved them."""
    if precision == "16-mixed" and device.type != "cuda":
        pytest.skip("16-mixed trains on CUDA only")
    dtype = torch.float64 if precision == "32-true" else torch.float32
    model = AdamWRegressor(mlp(seed=4).to(dtype))
    fit(device, MPIADStrategy(), model, precision=precision)
    got = flat_parameters(model).cpu()
    assert_same_on_all_ranks(got, "parameters")

    want = one_process(device, dtype, {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision))
    moved = distance_moved(want, dtype)
    if precision == "32-true":
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    else:
        assert float(torch.linalg.vector_norm(got - want)) <= 0.05 * moved


@pytest.mark.mpi(ranks=(2, 3), timeout=300)
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_sharded_optimizer_state_on_the_device_equals_one_process(shard: str, device: torch.device, path: str) -> None:
    """ZeRO stages 1 and 2 with the model on the device, the shards gathered through the peers' device memory or
    through host memory: float64 parameters to 1e-10, state on the device while training (Lightning's teardown
    moves optimizer state to the CPU)."""
    model = AdamWRegressor(mlp(seed=4).double())
    devices = Devices()
    fit(device, MPIADStrategy(shard=shard), model, callbacks=[devices])
    got = flat_parameters(model).cpu()
    assert_same_on_all_ranks(got, "parameters")
    want = one_process(device, torch.float64)
    distance_moved(want, torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert devices.state == {device.type}


COMPRESSORS = {
    "powersgd": {"rank": 2, "start_iter": 2},
    "topk": {"density": 0.25},
    "randomk": {"density": 0.25},
    "qsgd": {"levels": 8},
    "minmax": {},
    "fp16": {},
    "sign": {},
    "majority_vote": {},
}


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=300)
@pytest.mark.parametrize("scheme", sorted(COMPRESSORS))
def test_every_compressor_on_the_device_trains_as_on_the_cpu(scheme: str, device: torch.device) -> None:
    """The same AdamW steps with the compressor on the device and on the CPU: float64 parameters to 1e-9 (the
    schemes draw their random numbers on the CPU; their starts on CUDA buckets run after backward), kept on the
    device while training."""
    trained = {}
    for where in (device, torch.device("cpu")):
        model = AdamWRegressor(mlp(seed=7).double())
        devices = Devices()
        fit(
            where,
            MPIADStrategy(aggregator=build_aggregator(scheme, **COMPRESSORS[scheme])),
            model,
            callbacks=[devices],
        )
        assert devices.parameters == {where.type}
        trained[where.type] = flat_parameters(model).cpu()
    got, want = trained[device.type], trained["cpu"]
    assert_same_on_all_ranks(got, "parameters")
    assert not torch.equal(want, flat_parameters(mlp(seed=7).double())), "training did not move the parameters"
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


class Devices(L.Callback):
    """The device types of the parameters and of the optimizer's state tensors at the end of every training step
    (Lightning's teardown moves both to the CPU after ``fit``)."""

    def __init__(self) -> None:
        self.parameters: set[str] = set()
        self.state: set[str] = set()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.parameters |= {p.device.type for p in pl_module.parameters()}
        state = trainer.optimizers[0].state
        self.state |= {t.device.type for entry in state.values() for t in entry.values() if t.ndim}


SYNC_MODES = {
    "hierarchical": lambda: HierarchicalSync(),
    "local_sgd": lambda: LocalSGD(period=2),
    "hierarchical_local_sgd": lambda: HierarchicalLocalSGD(period=2),
    "daso": lambda: DASO(warmup_epochs=0, cooldown_epochs=0, global_skip=2, batches_to_wait=1),
    "gossip": lambda: "gossip",
}


@pytest.mark.mpi(ranks=(2,), timeout=300)
@pytest.mark.parametrize("mode", sorted(SYNC_MODES))
def test_every_sync_mode_trains_on_the_device(mode: str, device: torch.device) -> None:
    """Two (virtual) nodes of one rank: each mode moves the parameters, keeps them and the optimizer state on the
    device while training and finite; the modes that average every step, or whose period ends with the last step,
    leave every rank the same model."""
    model = AdamWRegressor(mlp(seed=5))
    strategy = MPIADStrategy(sync=SYNC_MODES[mode](), ranks_per_node=1)
    devices = Devices()
    fit(device, strategy, model, callbacks=[devices])
    assert devices.parameters == devices.state == {device.type}
    got = flat_parameters(model).cpu()
    assert torch.isfinite(got).all()
    assert not torch.equal(got, flat_parameters(mlp(seed=5))), "training did not move the parameters"
    if mode in ("hierarchical", "local_sgd", "hierarchical_local_sgd"):
        assert_same_on_all_ranks(got, "parameters")


@pytest.mark.mpi(ranks=(2, 3), timeout=300)
def test_a_checkpoint_on_the_device_resumes_to_the_same_parameters_and_optimizer_state(device: torch.device) -> None:
    directory = shared_tmpdir()
    straight = AdamWRegressor(mlp(seed=6))
    fit(device, MPIADStrategy(), straight, epochs=2)
    path = f"{directory}/epoch1.ckpt"
    fit(device, MPIADStrategy(), AdamWRegressor(mlp(seed=6)), epochs=1).save_checkpoint(path)
    resumed = AdamWRegressor(mlp(seed=99))  # other initial values: everything must come from the checkpoint
    fit(device, MPIADStrategy(), resumed, epochs=2, ckpt_path=path)

    assert torch.equal(flat_parameters(resumed).cpu(), flat_parameters(straight).cpu())
    want = straight.optimizers().optimizer.state_dict()["state"]
    got = resumed.optimizers().optimizer.state_dict()["state"]
    assert want.keys() == got.keys() and want
    for index in want:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[index][name].cpu(), want[index][name].cpu()), f"AdamW {name} of parameter {index}"
