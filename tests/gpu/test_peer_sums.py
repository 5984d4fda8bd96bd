"""Sums of CUDA buffers through each other's device memory (``mpistrategy.comm.cuda_ipc``) equal the sum of the
CPU tensors, for odd sizes and every rank count; a rank that registers a different buffer gets a clear error on
every rank."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from mpistrategy.comm.cuda_ipc import CHUNK_ALIGN, PeerDeviceGroup, share_one_gpu

pytestmark = pytest.mark.mpi(ranks=(1, 2, 3), timeout=180)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
NUMELS = (1, CHUNK_ALIGN * SIZE + 1, 100_003)


def per_rank(numel: int, seed: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


@pytest.fixture
def cuda(device: torch.device) -> torch.device:
    if device.type != "cuda":
        pytest.skip("peer device memory needs CUDA")
    if not share_one_gpu(COMM, device):
        pytest.skip("the ranks do not share one GPU")
    return device


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("average", [False, True])
def test_sums_equal_the_cpu_sum_in_rank_order(cuda: torch.device, dtype: torch.dtype, average: bool) -> None:
    """Every registered buffer ends as ((x_0 + x_1) + ...) (/ P for the mean) on every rank, the float64 sums
    bitwise, also after three rounds on the same buffers (the fences' events are reused)."""
    buffers = [per_rank(numel, 1, RANK, dtype).to(cuda) for numel in NUMELS]
    group = PeerDeviceGroup(COMM, buffers)
    try:
        for round_ in range(3):
            for index, numel in enumerate(NUMELS):
                buffers[index].copy_(per_rank(numel, round_ + 10 * index, RANK, dtype))
                group.sum(index, average=average)
            for index, numel in enumerate(NUMELS):
                inputs = [per_rank(numel, round_ + 10 * index, rank, dtype) for rank in range(SIZE)]
                want = inputs[0].clone()
                for other in inputs[1:]:
                    want += other
                if average:
                    want /= SIZE
                got = buffers[index].cpu()
                # float64: the sums bitwise; CUDA divides by a scalar as a product with its reciprocal (1 ulp)
                tol = {torch.float64: 1e-15 if average else 0.0, torch.float32: 1e-6}.get(dtype, 1e-2)
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, r=round_: f"round {r}: {m}")
    finally:
        group.close()


def test_a_rank_registering_another_size_is_told_on_every_rank(cuda: torch.device) -> None:
    if SIZE == 1:
        pytest.skip("needs two ranks")
    numel = 1000 + (1 if RANK == SIZE - 1 else 0)
    with pytest.raises(ValueError, match="every rank must register the same buffers"):
        PeerDeviceGroup(COMM, [torch.zeros(numel, device=cuda)])


@pytest.mark.parametrize("numel", [5, 1_003])
def test_gather_copies_every_ranks_range_into_every_buffer(cuda: torch.device, numel: int) -> None:
    """Uneven ranges (the last rank's the longest): after two gathers every rank's buffer holds each rank's range
    as that rank wrote it, bitwise."""
    bounds = [rank * (numel // SIZE) for rank in range(SIZE)] + [numel]
    buffer = torch.full((numel,), -1.0, dtype=torch.float64, device=cuda)
    group = PeerDeviceGroup(COMM, [buffer])
    try:
        for round_ in range(2):
            want = torch.cat([per_rank(bounds[r + 1] - bounds[r], round_, r, torch.float64) for r in range(SIZE)])
            buffer[bounds[RANK] : bounds[RANK + 1]].copy_(want[bounds[RANK] : bounds[RANK + 1]])
            group.gather(0, bounds)
            assert torch.equal(buffer.cpu(), want), f"round {round_}"
    finally:
        group.close()
