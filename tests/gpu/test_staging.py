"""CUDA gradient buckets, averaged on the GPU the ranks share (``mpistrategy.strategy.reducer.peer_sums``) or through
pinned host mirrors (``mpistrategy.strategy.reducer.staging``, ``MPISTRATEGY_CUDA_IPC=0``): the same gradients as
the host path, also with parameters that only some ranks use, and no memory allocated per step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn

from mpistrategy.comm.buffers import cuda_aware
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.gpu.test_training import AdamWRegressor
from tests.strategy.helpers import QUIET, RANK, SIZE, assert_same_on_all_ranks, flat_parameters, loader, regression_data

STEPS = 6
PER_RANK_BATCH = 4
WIDTH = 384  # 384 x 384 float64: 1.1 MB, a bucket above the shared-memory allreduce's threshold


class Branches(nn.Module):
    """A wide MLP with a branch that only rank 0 uses: its buckets are completed at the reducer's wait, with the
    other ranks' contributions zero."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())
        self.head = nn.Linear(WIDTH, 2)
        self.rank_zero_only = nn.Linear(WIDTH, 2)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(x)
        out = self.head(hidden)
        return out + self.rank_zero_only(hidden) if RANK == 0 else out


def train(device: torch.device, callbacks: list[L.Callback] | None = None) -> tuple[torch.Tensor, MPIADStrategy]:
    """:data:`STEPS` AdamW steps of :class:`Branches` on ``device`` with small buckets (several per pass)."""
    model = AdamWRegressor(Branches(seed=3))
    strategy = MPIADStrategy(bucket_cap_mb=0.5, first_bucket_cap_mb=0.1)
    accelerator = "gpu" if device.type == "cuda" else "cpu"
    trainer = L.Trainer(
        **{**QUIET, "accelerator": accelerator, "strategy": strategy, "max_epochs": 1, "callbacks": callbacks or []}
    )
    trainer.fit(model, loader(regression_data(SIZE * PER_RANK_BATCH * STEPS), PER_RANK_BATCH))
    return flat_parameters(model).cpu(), strategy


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=300)
def test_device_buckets_give_the_parameters_of_the_host_path(device: torch.device, path: str) -> None:
    """float64, AdamW: the model trained on the device equals the same training on the CPU to 1e-10, on every
    rank. On CUDA with ranks sharing the GPU the buckets were averaged in device memory, else (or with the path
    off) with MPI that cannot read device memory every bucket went through its host mirror."""
    on_device, strategy = train(device)
    assert_same_on_all_ranks(on_device, "parameters")
    on_host, _ = train(torch.device("cpu"))
    torch.testing.assert_close(on_device, on_host, rtol=1e-10, atol=1e-10)
    assert not torch.equal(on_host, flat_parameters(Branches(seed=3))), "training did not move the parameters"
    if strategy.reducer is not None:
        peers = device.type == "cuda" and SIZE > 1 and path == "peer device memory"
        assert strategy.reducer.sums_on_device == peers
        assert strategy.reducer.stages_through_host == (device.type == "cuda" and not cuda_aware() and not peers)


class MemoryAtStepEnd(L.Callback):
    """CUDA caching-allocator and pinned-host-pool figures at the end of every training step."""

    def __init__(self) -> None:
        self.figures: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
        self.figures.append(
            {
                "allocated bytes": torch.cuda.memory_allocated(),
                "reserved bytes": torch.cuda.memory_reserved(),
                "device allocations (cudaMalloc)": stats.get("num_device_alloc", 0),
                "pinned host allocations": host.get("num_host_alloc", 0),
            }
        )


@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_device_buckets_allocate_nothing_per_step(device: torch.device, path: str) -> None:
    """After the second step the allocator's figures stay where they are: no device or pinned host memory is
    allocated per step, by either path."""
    if device.type != "cuda":
        pytest.skip("the CUDA allocator's statistics need CUDA")
    memory = MemoryAtStepEnd()
    train(device, [memory])
    assert len(memory.figures) == STEPS
    settled = memory.figures[1]
    for step, figures in enumerate(memory.figures[2:], start=3):
        assert figures == settled, f"step {step}: {figures} after step 2: {settled}"
