"""Every public collective on the GPU equals the same collective on the CPU, forward and backward, at 1-3 ranks.

Each case runs twice on the same per-rank inputs and cotangents: once on CPU tensors, once on this rank's device.
Outputs and input gradients must agree (float64 to 1e-12; bfloat16 and float32 reductions, taken in float32 either
way, to their precision). Where MPI is not CUDA-aware the device path stages through host memory; where it is, MPI
reads device memory: either way the result is the CPU's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy import Placeholder

pytestmark = pytest.mark.mpi(ranks=(1, 2, 3), timeout=180)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()

Op = Callable[[torch.Tensor], "torch.Tensor | Placeholder"]


def per_rank(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A CPU tensor that differs on every rank."""
    generator = torch.Generator().manual_seed(1000 * seed + RANK)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def run(op: Op, x: torch.Tensor, device: torch.device, seed: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``op`` on ``x`` moved to ``device``, then backward with a per-rank cotangent; (output, input grad) on the CPU
    (``None`` for a placeholder output, and for the gradient of an input the op does not read, such as a
    broadcast's on a rank other than the root)."""
    leaf = x.detach().to(device).requires_grad_(True)  # a fresh leaf: on the CPU, .to returns x itself
    out = op(leaf)
    if isinstance(out, Placeholder):
        out.backward()
        value = None
    else:
        assert out.device == leaf.device, f"the result is on {out.device}, the input on {leaf.device}"
        out.backward(per_rank(tuple(out.shape), seed + 7919, out.dtype).to(device))
        value = out.detach().cpu()
    if leaf.grad is None:
        return value, None
    assert leaf.grad.device == leaf.device
    return value, leaf.grad.cpu()


def assert_same_on_device_and_cpu(op: Op, x: torch.Tensor, device: torch.device, seed: int, tol: float) -> None:
    on_cpu = run(op, x, torch.device("cpu"), seed)
    on_device = run(op, x, device, seed)
    for what, want, got in zip(("output", "input gradient"), on_cpu, on_device, strict=True):
        assert (want is None) == (got is None), f"{what}: present on one device only"
        if want is not None and got is not None:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m, w=what: f"{w}: {m}")


def chunks(rows_per_rank: int) -> tuple[int, ...]:
    return (SIZE * rows_per_rank, 3)


#: rows this rank sends to each rank in alltoall_v: uneven, and different on every rank
SEND_ROWS = [1 + (RANK + destination) % 2 for destination in range(SIZE)]


CASES: dict[str, tuple[Op, tuple[int, ...]]] = {
    "allreduce-sum": (lambda t: ms.allreduce(t, "sum"), (5, 3)),
    "allreduce-avg": (lambda t: ms.allreduce(t, "avg"), (5, 3)),
    "allreduce-max": (lambda t: ms.allreduce(t, "max"), (5, 3)),
    "iallreduce": (lambda t: ms.iallreduce(t, "sum").wait(), (4, 2)),
    "reduce-root1": (lambda t: ms.reduce(t, root=min(1, SIZE - 1)), (4, 2)),
    "reduce_scatter": (lambda t: ms.reduce_scatter(t, dim=0), chunks(2)),
    "broadcast-last": (lambda t: ms.broadcast(t, root=SIZE - 1), (3, 4)),
    "allgather": (lambda t: ms.allgather(t, dim=1), (2, 3)),
    "allgather_v": (lambda t: ms.allgather_v(t[: RANK + 1], dim=0), (SIZE, 2)),
    "gather": (lambda t: ms.gather(t, root=0, dim=0), (2, 3)),
    "scatter": (lambda t: ms.scatter(t, root=0, dim=0), chunks(2)),
    "alltoall": (lambda t: ms.alltoall(t, dim=0), chunks(2)),
    "alltoall_v": (lambda t: ms.alltoall_v(t, SEND_ROWS, dim=0), (sum(SEND_ROWS), 3)),
    "sendrecv-ring": (lambda t: ms.sendrecv(t, dst=(RANK + 1) % SIZE, src=(RANK - 1) % SIZE), (3, 3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_collective_on_the_device_equals_the_cpu(name: str, device: torch.device) -> None:
    op, shape = CASES[name]
    assert_same_on_device_and_cpu(op, per_rank(shape, seed=len(name)), device, seed=len(name), tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_half_and_single_precision_sums_match_the_cpu(dtype: torch.dtype, device: torch.device) -> None:
    x = per_rank((257,), seed=3, dtype=dtype)
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    assert_same_on_device_and_cpu(lambda t: ms.allreduce(t, "sum"), x, device, seed=3, tol=tol)


def test_a_large_allreduce_uses_the_whole_tensor(device: torch.device) -> None:
    """4 MiB of float32 (above the shared-memory threshold on the CPU): every element is every rank's sum."""
    x = torch.full((1 << 20,), float(RANK + 1), device=device)
    out = ms.allreduce(x, "sum")
    assert out.device == x.device
    assert torch.equal(out.cpu(), torch.full((1 << 20,), SIZE * (SIZE + 1) / 2))
