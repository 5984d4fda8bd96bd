"""``broadcast``: the root's tensor to every rank, with shape, dtype and requires_grad sent ahead.

Non-root ranks pass ``None`` (or any tensor whose autograd graph they want linked; its value is not used).
Adjoint (objective = sum of every rank's loss): ``y_r = x_root`` for all r, so
``dL/dx_root = sum_r g_r`` (a reduce-sum to the root) and non-root inputs get zero gradient.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpistrategy.collectives.placeholder import anchor
from mpistrategy.collectives.reduction import _broadcast_from
from mpistrategy.comm.buffers import empty_on_wire, mpi_buffer, mpi_op, off_wire, on_wire, out_problem, reduction_dtype
from mpistrategy.comm.checks import check_rank
from mpistrategy.comm.communicator import Communicator, resolve
from mpistrategy.comm.metadata import TensorMeta, exchange_meta

_CPU = torch.device("cpu")


def _receive(
    tensor: torch.Tensor | None,
    meta: TensorMeta,
    device: torch.device,
    root: int,
    comm: Communicator,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The broadcast itself: the root's ``tensor`` (ignored elsewhere) on every rank (no copy on the root)."""
    source = tensor if comm.rank == root else None
    return _broadcast_from(source, meta.shape, meta.dtype, device, root, comm.forward, out)


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, meta: TensorMeta, device: torch.device, root: int, comm: Communicator):
        ctx.root, ctx.comm, ctx.input_shape, ctx.input_dtype = root, comm, tensor.shape, tensor.dtype
        return _receive(tensor, meta, device, root, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        wire_dtype = reduction_dtype(grad.dtype, "sum", "broadcast backward")
        send = on_wire(grad, wire_dtype)
        if comm.rank == ctx.root:
            total = empty_on_wire(tuple(send.shape), send.dtype, send.device)
            comm.backward.Reduce(mpi_buffer(send), mpi_buffer(total), op=mpi_op(wire_dtype, "sum"), root=ctx.root)
            return off_wire(total, grad.dtype, grad.device), None, None, None, None
        comm.backward.Reduce(mpi_buffer(send), None, op=mpi_op(wire_dtype, "sum"), root=ctx.root)
        return torch.zeros(ctx.input_shape, dtype=ctx.input_dtype, device=grad.device), None, None, None, None


def broadcast(
    tensor: torch.Tensor | None,
    root: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    *,
    device: torch.device | str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every rank gets a copy of the root's ``tensor``; receivers need not know its shape or dtype.

    Args:
        tensor: the value on ``root``; on other ranks ``None`` or a tensor (its value is ignored and it receives
            zero gradient; passing it links its graph).
        root: the sending rank.
        device: where receivers put the result (default: their tensor's device, else the CPU).
        out: a tensor of the root's shape and dtype that receives the result and is returned (no new
            allocation; on the root, ``out=tensor`` broadcasts in place as ``torch.distributed.broadcast`` does).
            Only when the op is not recorded by autograd (the root's tensor does not require grad, or
            ``torch.no_grad()``).

    On the root the result shares memory with a contiguous ``tensor`` (MPI sends straight from it; no copy is
    made), as ``torch.distributed.broadcast`` leaves the root's tensor in place: clone before changing either in
    place. Receivers get a new tensor.

    Backward: a reduce-sum of every rank's cotangent to the root.
    """
    comm = resolve(comm)
    check_rank(root, comm, "broadcast")
    meta = exchange_meta(tensor if comm.rank == root else None, comm.rank == root, root, comm.forward, "broadcast")
    if comm.rank == root:
        target = tensor.device
    elif device is not None:
        target = torch.device(device)
    else:
        target = tensor.device if tensor is not None else _CPU
    problem = out_problem(out, meta.requires_grad, "broadcast")
    if problem is not None:  # take part in the broadcast, so that no rank waits for this one, then raise
        _receive(tensor, meta, target, root, comm)
        raise problem
    if not meta.requires_grad:  # no rank records the op: skip the autograd node
        return _receive(tensor, meta, target, root, comm, out)
    if comm.rank == root:
        return _Broadcast.apply(tensor, meta, target, root, comm)
    linked = tensor if tensor is not None and tensor.requires_grad == meta.requires_grad else None
    source = linked if linked is not None else anchor(meta.requires_grad, meta.dtype)
    return _Broadcast.apply(source, meta, target, root, comm)
