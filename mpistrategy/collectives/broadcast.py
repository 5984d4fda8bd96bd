"""``broadcast``: the root's tensor to every rank, with shape, dtype and requires_grad sent ahead.

Non-root ranks pass ``None`` (or any tensor whose autograd graph they want linked; its value is not used).
Adjoint (objective = sum of every rank's loss): ``y_r = x_root`` for all r, so
``dL/dx_root = sum_r g_r`` (a reduce-sum to the root). A non-root input is not read, so it gets no gradient
(``None``, torch's rule for an input the output does not depend on).
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpistrategy.collectives._compile import eager_under_compile
from mpistrategy.collectives._function import CollectiveFunction
from mpistrategy.collectives._second_order import refuse_if_recording
from mpistrategy.collectives.placeholder import anchor
from mpistrategy.collectives.reduction import _broadcast_from
from mpistrategy.comm.buffers import (
    check_out,
    check_tensor,
    empty_on_wire,
    mpi_buffer,
    mpi_op,
    off_wire,
    on_wire,
    receive_device,
    reduction_dtype,
)
from mpistrategy.comm.checks import agreeing, alone, attempt, check_rank, grad_flag, report
from mpistrategy.comm.communicator import Communicator, resolve
from mpistrategy.comm.metadata import TensorMeta, exchange_meta, header_of


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


class _Broadcast(CollectiveFunction):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, meta: TensorMeta, device: torch.device, root: int, comm: Communicator):
        ctx.root, ctx.comm = root, comm
        return _receive(tensor, meta, device, root, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_if_recording("broadcast")
        comm = ctx.comm
        wire_dtype = reduction_dtype(grad.dtype, "sum", "broadcast backward")
        send = on_wire(grad, wire_dtype)
        if comm.rank == ctx.root:
            total = empty_on_wire(tuple(send.shape), send.dtype, send.device)
            comm.backward.Reduce(mpi_buffer(send), mpi_buffer(total), op=mpi_op(wire_dtype, "sum"), root=ctx.root)
            return off_wire(total, grad.dtype, grad.device), None, None, None, None
        comm.backward.Reduce(mpi_buffer(send), None, op=mpi_op(wire_dtype, "sum"), root=ctx.root)
        return None, None, None, None, None


@eager_under_compile
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
        tensor: the value on ``root``; on other ranks ``None`` or a tensor (its value is ignored and it gets no
            gradient; passing it links its graph).
        root: the sending rank.
        device: where receivers put the result (default: their tensor's device, else the CPU).
        out: a tensor of the root's shape and dtype that receives the result and is returned (no new
            allocation; on the root, ``out=tensor`` broadcasts in place as ``torch.distributed.broadcast`` does).
            Only when the op is not recorded by autograd (the root's tensor does not require grad, or
            ``torch.no_grad()``).

    On the root the result shares memory with a contiguous ``tensor`` (MPI sends straight from it; no copy is
    made), as ``torch.distributed.broadcast`` leaves the root's tensor in place: clone before changing either in
    place. Receivers get a new tensor.

    Errors: with validation on (the default), a bad argument on any rank (a root outside the communicator, no
    tensor or a ``meta`` tensor on the root, a bad ``device`` or ``out``) and ranks that pass different roots raise
    on every rank before anything is sent, at no extra message: the root's header travels in the allreduce that
    checks the arguments. With validation off only the root's own problems reach the other ranks.

    Backward: a reduce-sum of every rank's cotangent to the root.
    """
    comm = resolve(comm)
    arguments, problem = attempt(_broadcast_arguments, tensor, root, comm, device, out)
    header, target = arguments if arguments is not None else (None, None)
    meta, out_rank = exchange_meta(comm, "broadcast", root, header, (root,), "root", problem, out_given=out is not None)
    assert target is not None  # exchange_meta raised this rank's problem
    if out_rank >= 0 and meta.requires_grad:  # out= on a receiver, refused now that it knows autograd records
        late = attempt(check_out, out, True, "broadcast")[1]
        if agreeing(comm):  # every rank knows that some rank passed out=: all raise
            report(comm, "broadcast", (root,), "root", late)
        _receive(tensor, meta, target, root, comm)  # take part, so that no rank waits for this one, then raise
        assert late is not None  # out= was given on this rank
        raise alone(late, comm, "broadcast")
    if not meta.requires_grad:  # no rank records the op: skip the autograd node
        return _receive(tensor, meta, target, root, comm, out)
    if comm.rank == root:
        return _Broadcast.apply(tensor, meta, target, root, comm)
    linked = tensor if tensor is not None and tensor.requires_grad == meta.requires_grad else None
    source = linked if linked is not None else anchor(meta.requires_grad, meta.dtype)
    return _Broadcast.apply(source, meta, target, root, comm)


def _broadcast_arguments(
    tensor: torch.Tensor | None,
    root: int,
    comm: Communicator,
    device: torch.device | str | None,
    out: torch.Tensor | None,
) -> tuple[bytes | None, torch.device]:
    """This rank's checks of a broadcast: the root's header (``None`` elsewhere) and where the result goes.

    A receiver's ``out`` is checked for its shape only once the header has told it the root's (after the op).
    """
    check_rank(root, comm, "broadcast")
    if comm.rank != root:
        if tensor is not None:  # not read, but linked into the graph
            check_tensor(tensor, "broadcast")
        check_out(out, False, "broadcast")
        return None, receive_device(tensor, device, "broadcast")
    header = header_of(tensor, root, "broadcast")
    assert tensor is not None  # header_of raised otherwise
    if out is not None:
        check_out(out, grad_flag(tensor), "broadcast", None if out is tensor else tensor.shape, tensor.dtype)
    return header, tensor.device
