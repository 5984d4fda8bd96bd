"""The Megatron-style pair of ops for tensor parallelism.

With the sum-of-losses convention, :func:`allreduce` backward sums cotangents across ranks. Tensor-parallel layers
instead compute *one* shared value split across ranks, whose loss is counted once; they need the pair:

- :func:`copy_to_parallel` (Megatron's "f"): identity forward, allreduce-sum backward. Put it where a replicated
  activation enters column-parallel weights: each rank's partial cotangents add up to the full one.
- :func:`reduce_from_parallel` (Megatron's "g"): allreduce-sum forward, identity backward. Put it where partial
  outputs of row-parallel weights are summed into one replicated activation.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpistrategy.collectives._compile import eager_under_compile
from mpistrategy.collectives._function import CollectiveFunction
from mpistrategy.collectives._second_order import recording
from mpistrategy.collectives.reduction import _allreduce, _check_reduction
from mpistrategy.comm.checks import checked, signature
from mpistrategy.comm.communicator import Communicator, resolve


class _CopyToParallel(CollectiveFunction):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if recording():  # through reduce_from_parallel's node, whose backward is this identity again
            return _ReduceFromParallel.apply(grad, ctx.comm), None
        return _allreduce(grad, "sum", ctx.comm.backward, ctx.comm.size), None


class _ReduceFromParallel(CollectiveFunction):
    collective_backward = False  # identity backward

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _allreduce(tensor, "sum", comm.forward, comm.size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if recording():  # through copy_to_parallel's node, whose backward is this allreduce again
            return _CopyToParallel.apply(grad, ctx.comm), None
        return grad, None


@eager_under_compile
def copy_to_parallel(tensor: torch.Tensor, comm: MPI.Comm | Communicator | None = None) -> torch.Tensor:
    """Identity forward; backward = allreduce-sum of the cotangents (the adjoint of replicating one value).

    The forward sends nothing, so its checks are local: a bad ``tensor`` raises on its rank only.
    """
    _check_reduction(tensor, "sum", "copy_to_parallel")
    return _CopyToParallel.apply(tensor, resolve(comm))


def _sum_arguments(tensor: torch.Tensor) -> tuple[tuple, None]:
    _check_reduction(tensor, "sum", "reduce_from_parallel")
    return signature(tensor), None


@eager_under_compile
def reduce_from_parallel(tensor: torch.Tensor, comm: MPI.Comm | Communicator | None = None) -> torch.Tensor:
    """Allreduce-sum forward; backward = identity (the value is one shared result whose loss counts once)."""
    comm = resolve(comm)
    checked(comm, "reduce_from_parallel", "dtype and shape", _sum_arguments, tensor)
    return _ReduceFromParallel.apply(tensor, comm)
