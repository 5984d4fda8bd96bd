"""Reductions: ``allreduce``, ``iallreduce``, ``reduce``, ``reduce_scatter`` and ``reduce_scatter_v``.

Convention for every backward in mpistrategy: the global objective is ``L = sum_r L_r``, the sum over ranks of
each rank's own loss, and ``g_r = dL_r/dy_r`` is rank r's cotangent of the op's output. The adjoints:

- allreduce sum, ``y = sum_r x_r`` on every rank: ``dL/dx_r = sum_s g_s`` (an allreduce sum of the cotangents).
- allreduce avg, ``y = (1/P) sum_r x_r``: ``dL/dx_r = (1/P) sum_s g_s`` (an allreduce avg).
- allreduce max/min: ``y = max_r x_r`` (``min_r``) elementwise, NaN-propagating as ``torch.maximum``: a NaN on any
  rank makes the element NaN (of two NaNs the one with the larger bit pattern, and ``-0.0 < +0.0``, so every
  rank gets the same bits; see :func:`mpistrategy.comm.buffers.mpi_op`). ``dL/dx_r = [r owns y] * sum_s g_s``
  elementwise, where r owns an element when its ``x_r`` equals ``y`` there or both are NaN; where several ranks
  own it (a tie, or NaNs on several ranks), the lowest of them gets the gradient and the others zero.
- allreduce prod, ``y = prod_s x_s``: ``dL/dx_r = (sum_s g_s) * conj(prod_{s != r} x_s)``, the product of the other
  ranks' inputs computed by two scans, without dividing, so zeros get the exact gradient (see :mod:`._product`).
- reduce to ``root`` (sum): ``y_root = sum_r x_r``; ``dL/dx_r = g_root`` (a broadcast from the root); avg scales
  by 1/P; prod multiplies by ``conj(prod_{s != r} x_s)``.
- reduce_scatter (sum): ``y_r = sum_s x_s[block r]``; ``dL/dx_s[block r] = g_r`` (an allgather); avg scales by 1/P;
  prod multiplies by ``conj(prod_{t != s} x_t)``. The allgather's autograd node lives here too, beside its adjoint
  (each records the other when a backward is differentiated again; :mod:`._second_order`); the op itself is in
  :mod:`.gather`.

The logical (``land``, ``lor``, ``lxor``) and bitwise (``band``, ``bor``, ``bxor``) ops take bool and integer
tensors only, which torch never lets require grad: their results carry no gradient. Half-precision tensors are
summed (and multiplied) in float32 and rounded once; bool supports max (logical or) and min (logical and) and the
logical and bitwise ops. The forward and backward messages travel on distinct duplicates of the communicator. Sum
and avg over ranks that share a node go through shared memory instead of MPI from a size threshold on (see
:mod:`mpistrategy.comm.shm`); the ranks agree on that choice in the argument check, which itself goes
through the shared-memory flags once a communicator's ranks have them; so does the check of every other op on
that communicator (:func:`~mpistrategy.comm.checks.check_on_node`), which an allreduce's check then meets.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from mpi4py import MPI

from mpistrategy.collectives._compile import eager_under_compile
from mpistrategy.collectives._function import CollectiveFunction
from mpistrategy.collectives._layout import from_front, offsets, split_sizes, to_front
from mpistrategy.collectives._product import start_exclusive_product, times_others
from mpistrategy.collectives._second_order import recording, refuse_if_recording
from mpistrategy.collectives.handles import Handle, Link, Pending, Then
from mpistrategy.collectives.placeholder import Placeholder
from mpistrategy.comm.buffers import (
    LOGICAL_OPS,
    NATIVE_REDUCTIONS,
    REDUCE_OPS,
    check_out,
    check_tensor,
    deliver,
    empty_on_wire,
    host_ready,
    mpi_buffer,
    mpi_op,
    off_wire,
    on_wire,
    overlaps,
    receive_buffer,
    reduction_dtype,
    same_memory,
    to_mean,
)
from mpistrategy.comm.calls import CODE_NAMES
from mpistrategy.comm.checks import check_dim, check_rank, checked, grad_flag, signature
from mpistrategy.comm.communicator import Communicator, resolve
from mpistrategy.comm.pool import receive_pool
from mpistrategy.comm.shm import SharedWork, check_exchange, group_for, uses_shared_memory

_OP_CODES = {name: code for code, name in enumerate(REDUCE_OPS)}
CODE_NAMES["op"] = dict(enumerate(REDUCE_OPS))  # error messages and the call log show op=sum, not op=0


def _complete(result: torch.Tensor, op: str, size: int) -> None:
    """The last step of a reduction over ``size`` ranks, in place in MPI's result: avg divides the sum by P, and a
    logical op of integers over one rank turns the values into 1 or 0 (MPI copies a single rank's values
    unchanged; from two ranks on its logical ops give 1 or 0)."""
    if op == "avg":
        to_mean(result, size)
    elif size == 1 and op in LOGICAL_OPS and result.dtype != torch.bool:
        result.copy_(result != 0)


def _apart(tensor: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``tensor``, or a copy of it when it overlaps ``out`` without being the same elements: MPI's send and receive
    buffers must be one buffer (``MPI_IN_PLACE``) or disjoint, and torch refuses to copy between overlapping ones."""
    if out is not None and overlaps(tensor, out) and not same_memory(tensor, out):
        return tensor.clone()
    return tensor


def _allreduce_buffers(tensor: torch.Tensor, op: str, out: torch.Tensor | None) -> tuple[torch.Tensor, MPI.Op]:
    """What ``MPI_Allreduce(MPI_IN_PLACE, ...)`` of ``tensor`` needs: the tensor that holds ``tensor``'s values
    (in the reduction's dtype) and receives the result (``out`` when MPI can write into it), and the MPI operation.

    Every rank reduces in place, whether or not its ``out`` is ``tensor``'s own memory: the MPI standard requires
    ``MPI_IN_PLACE`` at all ranks or at none (MPI's own allreduce copies the send buffer into the receive buffer
    first, as done here)."""
    operation = NATIVE_REDUCTIONS.get((tensor.dtype, op))
    if operation is not None and host_ready(tensor, out):  # the common case: no conversion, staging or copy
        staged, result = tensor, receive_pool.empty(tensor.shape, tensor.dtype) if out is None else out
    else:
        wire_dtype = reduction_dtype(tensor.dtype, op, "allreduce")
        staged = on_wire(tensor, wire_dtype)
        result = receive_buffer(out, tuple(staged.shape), wire_dtype, tensor.device)
        operation = mpi_op(wire_dtype, op)
    if not same_memory(result, staged):
        result.copy_(staged)
    return result, operation


def _allreduce_result(
    result: torch.Tensor, tensor: torch.Tensor, op: str, size: int, out: torch.Tensor | None
) -> torch.Tensor:
    """The completed allreduce in ``tensor``'s dtype and device (or in ``out``), finished by :func:`_complete`."""
    _complete(result, op, size)
    return deliver(result, out, tensor.dtype, tensor.device, "allreduce")


def _allreduce(
    tensor: torch.Tensor, op: str, channel: MPI.Intracomm, size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Blocking ``MPI_Allreduce`` of ``tensor`` on ``channel`` (``size`` ranks), or the shared-memory allreduce
    where it applies; the result goes to ``out`` when given (in place when ``out`` is ``tensor``'s own memory),
    else to a new tensor; an input that partly overlaps ``out`` is copied first."""
    tensor = _apart(tensor, out)
    group = group_for(channel, tensor, op)
    if group is not None:
        return group.allreduce(tensor, op, out)
    result, operation = _allreduce_buffers(tensor, op, out)
    channel.Allreduce(MPI.IN_PLACE, mpi_buffer(result), operation)
    return _allreduce_result(result, tensor, op, size, out)


def _start_allreduce(
    tensor: torch.Tensor, op: str, channel: MPI.Intracomm, size: int, out: torch.Tensor | None = None
) -> Pending | SharedWork:
    """Non-blocking :func:`_allreduce`: ``MPI_Iallreduce`` posted (or the shared-memory allreduce started), and
    what completes it."""
    tensor = _apart(tensor, out)
    group = group_for(channel, tensor, op)
    if group is not None:
        return group.start(tensor, op, out)
    result, operation = _allreduce_buffers(tensor, op, out)
    request = channel.Iallreduce(MPI.IN_PLACE, mpi_buffer(result), operation)
    return Pending([request], lambda: _allreduce_result(result, tensor, op, size, out), keepalive=(result,))


class _Allreduce(CollectiveFunction):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:
        others = start_exclusive_product(tensor, comm) if op == "prod" else None
        result = _allreduce(tensor, op, comm.forward, comm.size)
        ctx.op, ctx.comm = op, comm
        if op in ("max", "min"):
            ctx.save_for_backward(tensor, result)
        elif others is not None:
            ctx.others = others.wait()
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        if ctx.op == "prod":
            refuse_if_recording("allreduce op='prod'")
            return times_others(_allreduce(grad, "sum", comm.backward, comm.size), ctx.others), None, None
        if ctx.op in ("sum", "avg"):
            return _reduced_cotangents(grad, ctx.op, comm), None, None
        tensor, result = ctx.saved_tensors
        owns = (tensor == result) | (tensor.isnan() & result.isnan())
        candidate = torch.where(owns, comm.rank, comm.size).to(torch.int32)
        owner = _allreduce(candidate, "min", comm.backward, comm.size)
        total = _reduced_cotangents(grad, "sum", comm)
        return torch.where(owner == comm.rank, total, torch.zeros_like(total)), None, None


def _reduced_cotangents(grad: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:
    """The allreduce (``op`` sum or avg) of the cotangents in a backward pass; while autograd records the backward,
    through the allreduce's own autograd node, whose backward is that allreduce again."""
    if recording():
        return _Allreduce.apply(grad, op, comm)
    return _allreduce(grad, op, comm.backward, comm.size)


def _check_reduction(tensor: torch.Tensor, op: str, what: str, refusal: str | None = None) -> None:
    """Raise unless ``tensor`` can be reduced with ``op``. Ops that do not offer max and min pass ``refusal``, the
    end of the error for them."""
    check_tensor(tensor, what)
    reduction_dtype(tensor.dtype, op, what)
    if refusal is not None and op in ("max", "min"):
        raise ValueError(f"{what}: op={op!r} is not {refusal}.")


_ALLREDUCE_AGREES = "dtype, shape, op, requires_grad, shared memory"


def _allreduce_arguments(
    what: str, tensor: torch.Tensor, op: str, out: torch.Tensor | None, refusal: str | None, size: int
) -> tuple[tuple, int]:
    """This rank's checks of an allreduce over ``size`` ranks: the signature all ranks must share (with whether
    this rank's settings choose shared memory for it), and whether autograd records it."""
    _check_reduction(tensor, op, what, refusal)
    recorded = grad_flag(tensor)
    dtype, shape = tensor.dtype, tensor.shape
    if out is not None:
        check_out(out, recorded, what, None if out is tensor else shape, dtype)
    shared = uses_shared_memory(tensor, op, size)
    return (dtype, shape, _OP_CODES[op], recorded, shared), recorded  # signature(...), built inline


@eager_under_compile
def allreduce(
    tensor: torch.Tensor,
    op: str = "sum",
    comm: MPI.Comm | Communicator | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks of ``comm``; every rank gets the result.

    Args:
        tensor: same shape and dtype on every rank.
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"prod"``; for bool and integer tensors also the logical
            ``"land"``, ``"lor"``, ``"lxor"`` (nonzero is true; the result is 1 or 0 in the tensor's dtype) and the
            bitwise ``"band"``, ``"bor"``, ``"bxor"``.
        comm: an mpi4py communicator or :class:`Communicator` (default: the world).
        out: a tensor of the same shape and dtype to write the result into and return (no new allocation;
            ``out=tensor`` reduces in place; an ``out`` that partly overlaps ``tensor`` gets the result as if they
            were apart, at the cost of a copy of ``tensor``). Only outside autograd: under ``torch.no_grad()`` or
            for a ``tensor`` that does not require grad.

    Max and min propagate NaN (a NaN on any rank makes the element NaN, as ``torch.maximum`` does) and give every
    rank the same bits (of two NaNs the one with the larger bit pattern; ``-0.0 < +0.0``).

    Backward (objective = sum of every rank's loss): sum and avg apply the same allreduce to the cotangents;
    max and min send the summed cotangent to the rank holding the extremum, or a NaN there (the lowest such rank
    on ties or NaNs on several ranks); prod
    multiplies the summed cotangent by the conjugate product of the other ranks' inputs (exact with zeros).
    """
    comm = resolve(comm)
    recorded = checked(
        comm,
        "allreduce",
        _ALLREDUCE_AGREES,
        _allreduce_arguments,
        "allreduce",
        tensor,
        op,
        out,
        None,
        comm.size,
        exchange=check_exchange(comm.forward, tensor, op),
    )
    if not recorded:
        return _allreduce(tensor, op, comm.forward, comm.size, out)
    return _Allreduce.apply(tensor, op, comm)


@eager_under_compile
def iallreduce(
    tensor: torch.Tensor,
    op: str = "sum",
    comm: MPI.Comm | Communicator | None = None,
    *,
    out: torch.Tensor | None = None,
) -> Handle:
    """Non-blocking :func:`allreduce` with every op but max and min; ``handle.wait()`` gives the result.

    The result stays on the autograd path: its backward posts a non-blocking allreduce of the cotangents that
    completes when autograd reaches ``tensor`` (for prod, the product of the other ranks' inputs is computed
    during the forward, overlapped with it). ``out=tensor`` reduces in place (no copy); it is only allowed outside
    autograd (under ``torch.no_grad()`` or for tensors that do not require grad).
    """
    comm = resolve(comm)
    refusal = "available non-blocking; use allreduce for max and min"
    recorded = checked(
        comm,
        "iallreduce",
        _ALLREDUCE_AGREES,
        _allreduce_arguments,
        "iallreduce",
        tensor,
        op,
        out,
        refusal,
        comm.size,
        exchange=check_exchange(comm.forward, tensor, op),
    )
    agreement = (comm, comm.calls, "iallreduce")
    if op == "prod" and recorded:
        product = _NonBlockingProduct(comm)
        link = Link(product.start_forward, product.start_backward, "iallreduce op='prod'", agreement=agreement)
        return Handle(tensor, link)
    link = Link(
        lambda x: _start_allreduce(x, op, comm.forward, comm.size, out),
        lambda g: _start_allreduce(g, op, comm.backward, comm.size),
        "iallreduce",
        adjoint=lambda g: _Allreduce.apply(g, op, comm),
        agreement=agreement,
    )
    return Handle(tensor, link)


class _NonBlockingProduct:
    """iallreduce prod on the autograd path: the forward posts the product and the scans of the other ranks'
    product ``E_r``; the backward posts the allreduce-sum of the cotangents and multiplies it by ``conj(E_r)``."""

    __slots__ = ("comm", "others")

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.others: torch.Tensor | None = None

    def start_forward(self, tensor: torch.Tensor) -> Pending:
        scans = start_exclusive_product(tensor, self.comm)
        product = _start_allreduce(tensor, "prod", self.comm.forward, self.comm.size)
        assert isinstance(product, Pending)  # products never take the shared-memory allreduce

        def finish() -> torch.Tensor:
            self.others = scans.finish()
            return product.finish()

        return Pending([*scans.requests, *product.requests], finish, keepalive=(scans, product))

    def start_backward(self, grad: torch.Tensor) -> Then:
        total = _start_allreduce(grad, "sum", self.comm.backward, self.comm.size)  # through shared memory maybe
        return Then(total, lambda summed: times_others(summed, cast(torch.Tensor, self.others)))


def _broadcast_from(
    tensor: torch.Tensor | None,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    root: int,
    comm: MPI.Intracomm,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocking broadcast of ``tensor`` (significant at ``root`` only) on ``comm``, a raw MPI communicator.

    Receivers write into ``out`` when given; the root sends from ``tensor`` (and copies it into a distinct
    ``out``; first into a buffer of its own when they partly overlap).
    """
    if tensor is not None:
        tensor = _apart(tensor, out)
    if tensor is None:
        buffer = receive_buffer(out, shape, dtype, device)
    elif out is tensor and host_ready(tensor):  # in place on the root
        buffer = out
    else:
        buffer = on_wire(tensor)
    comm.Bcast(mpi_buffer(buffer), root=root)
    return deliver(buffer, out, dtype, device, "broadcast")


class _Reduce(CollectiveFunction):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, op: str, root: int, comm: Communicator) -> torch.Tensor:
        ctx.op, ctx.root, ctx.comm = op, root, comm
        ctx.shape, ctx.dtype, ctx.device = tensor.shape, tensor.dtype, tensor.device
        others = start_exclusive_product(tensor, comm) if op == "prod" and ctx.needs_input_grad[0] else None
        wire_dtype = reduction_dtype(tensor.dtype, op, "reduce")
        send = on_wire(tensor, wire_dtype)
        result = empty_on_wire(tuple(send.shape), send.dtype, send.device) if comm.rank == root else None
        receive = None if result is None else mpi_buffer(result)
        comm.forward.Reduce(mpi_buffer(send), receive, op=mpi_op(wire_dtype, op), root=root)
        ctx.others = None if others is None else others.wait()
        if result is None:
            return tensor.new_empty(0)
        _complete(result, op, comm.size)
        return off_wire(result, tensor.dtype, tensor.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_if_recording("reduce")
        comm = ctx.comm
        at_root = grad if comm.rank == ctx.root else None
        grad_in = _broadcast_from(at_root, ctx.shape, ctx.dtype, ctx.device, ctx.root, comm.backward)
        if ctx.op == "avg":
            grad_in = grad_in / comm.size
        elif ctx.op == "prod":
            grad_in = times_others(grad_in, ctx.others)
        return grad_in, None, None, None


def _reduce_arguments(tensor: torch.Tensor, op: str, root: int, comm: Communicator) -> tuple[tuple, None]:
    _check_reduction(tensor, op, "reduce", "supported by reduce; use allreduce for max and min")
    check_rank(root, comm, "reduce")
    return signature(tensor, _OP_CODES[op], root, grad_flag(tensor)), None


@eager_under_compile
def reduce(
    tensor: torch.Tensor, root: int = 0, op: str = "sum", comm: MPI.Comm | Communicator | None = None
) -> torch.Tensor | Placeholder:
    """Reduce ``tensor`` onto ``root`` with any op of :func:`allreduce` but max and min.

    The root gets the result; the other ranks get a :class:`Placeholder` naming the root, which they pass to
    backward (``placeholder.backward()`` or ``loss + placeholder``). Backward: a broadcast of the root's
    cotangent to every rank (divided by P for avg, times the conjugate product of the other ranks' inputs for
    prod).
    """
    comm = resolve(comm)
    checked(comm, "reduce", "dtype, shape, op, root, requires_grad", _reduce_arguments, tensor, op, root, comm)
    result = _Reduce.apply(tensor, op, root, comm)
    if comm.rank == root:
        return result
    return Placeholder("reduce", root, tuple(tensor.shape), tensor.dtype, result)


def _reduce_scatter_front(
    front: torch.Tensor, sizes: list[int], op: str, channel: MPI.Intracomm, rank: int, size: int
) -> torch.Tensor:
    """``MPI_Reduce_scatter`` of a tensor whose first dimension is split into blocks of ``sizes`` rows."""
    wire_dtype = reduction_dtype(front.dtype, op, "reduce_scatter")
    send = on_wire(front, wire_dtype)
    row = math.prod(send.shape[1:])
    result = empty_on_wire((sizes[rank], *send.shape[1:]), wire_dtype, front.device)
    counts = [s * row for s in sizes]
    channel.Reduce_scatter(mpi_buffer(send), mpi_buffer(result), counts, op=mpi_op(wire_dtype, op))
    _complete(result, op, size)
    return off_wire(result, front.dtype, front.device)


def _allgather_front(
    front: torch.Tensor, sizes: list[int], channel: MPI.Intracomm, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``MPI_Allgather(v)`` of blocks along the first dimension, block r having ``sizes[r]`` rows (into ``out``
    when given).

    A block that lies in ``out`` (``torch.distributed.all_gather_into_tensor(out, out.chunk(P)[rank])``, the
    in-place gather of FSDP and ZeRO) is sent from a copy: ``MPI_IN_PLACE`` would have to be used by every rank or
    none, and MPI refuses overlapping send and receive buffers.
    """
    send = front if host_ready(front) else on_wire(front)
    result = receive_buffer(out, (sum(sizes), *send.shape[1:]), send.dtype, front.device)
    if overlaps(send, result):
        send = send.clone()
    send_buffer = mpi_buffer(send)
    if sizes.count(sizes[0]) == len(sizes):
        channel.Allgather(send_buffer, [mpi_buffer(result)[0], send_buffer[1], send_buffer[2]])
    else:
        row = math.prod(send.shape[1:])
        counts = [s * row for s in sizes]
        channel.Allgatherv(send_buffer, [mpi_buffer(result)[0], counts, offsets(counts), send_buffer[2]])
    return deliver(result, out, front.dtype, front.device, "allgather")


class _ReduceScatter(CollectiveFunction):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], dim: int, op: str, comm: Communicator):
        ctx.sizes, ctx.dim, ctx.op, ctx.comm = sizes, dim, op, comm
        front = to_front(tensor, dim)
        others = start_exclusive_product(front, comm) if op == "prod" and ctx.needs_input_grad[0] else None
        result = _reduce_scatter_front(front, sizes, op, comm.forward, comm.rank, comm.size)
        ctx.others = None if others is None else others.wait()
        return from_front(result, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        if ctx.op == "prod":
            refuse_if_recording("reduce_scatter op='prod'")
        elif recording():  # through allgather's autograd node, whose backward is this reduce-scatter again
            gathered = _Allgather.apply(grad, ctx.sizes, ctx.dim, comm)
            return gathered / comm.size if ctx.op == "avg" else gathered, None, None, None, None
        full = _allgather_front(to_front(grad, ctx.dim), ctx.sizes, comm.backward)
        if ctx.op == "avg":
            full = full / comm.size
        elif ctx.op == "prod":
            full = times_others(full, ctx.others)
        return from_front(full, ctx.dim), None, None, None, None


def _allgather_along(
    tensor: torch.Tensor, sizes: list[int], dim: int, comm: Communicator, out: torch.Tensor | None = None
) -> torch.Tensor:
    if dim == 0:  # the blocks are already where MPI puts them: receive straight into out
        return _allgather_front(tensor, sizes, comm.forward, out)
    gathered = from_front(_allgather_front(to_front(tensor, dim), sizes, comm.forward), dim)
    return deliver(gathered, out, tensor.dtype, tensor.device, "allgather")


class _Allgather(CollectiveFunction):
    """``allgather`` and ``allgather_v`` on the autograd path (the adjoint pair of :class:`_ReduceScatter`)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], dim: int, comm: Communicator):
        ctx.sizes, ctx.dim, ctx.comm = sizes, dim, comm
        return _allgather_along(tensor, sizes, dim, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        if recording():  # through reduce_scatter's autograd node, whose backward is this allgather again
            return _ReduceScatter.apply(grad, ctx.sizes, ctx.dim, "sum", comm), None, None, None
        front = to_front(grad, ctx.dim)
        block = _reduce_scatter_front(front, ctx.sizes, "sum", comm.backward, comm.rank, comm.size)
        return from_front(block, ctx.dim), None, None, None


def _reduce_scatter_arguments(
    what: str, tensor: torch.Tensor, sizes: list[int] | None, dim: int, op: str, comm: Communicator, equal: bool
) -> tuple[tuple, tuple[list[int], int]]:
    """This rank's checks of a reduce-scatter: the signature all ranks must share, and (block sizes, dim)."""
    _check_reduction(tensor, op, what, f"supported by {what}; use allreduce for max and min")
    dim = check_dim(dim, tensor.dim(), what)
    length = tensor.shape[dim]
    if equal and length % comm.size:
        raise ValueError(
            f"{what}: dimension {dim} has length {length}, not divisible by the {comm.size} ranks; "
            "use reduce_scatter_v for uneven blocks."
        )
    sizes = list(sizes) if sizes is not None else split_sizes(length, comm.size)
    if len(sizes) != comm.size or sum(sizes) != length or min(sizes) < 0:
        raise ValueError(
            f"{what}: sizes={sizes} must give one non-negative block length per rank ({comm.size}) "
            f"adding up to the length {length} of dimension {dim}."
        )
    return signature(tensor, _OP_CODES[op], grad_flag(tensor), dim, *sizes), (sizes, dim)


def _reduce_scatter(
    what: str,
    tensor: torch.Tensor,
    sizes: list[int] | None,
    dim: int,
    op: str,
    comm: MPI.Comm | Communicator | None,
    *,
    equal: bool,
) -> torch.Tensor:
    comm = resolve(comm)
    sizes, dim = checked(
        comm,
        what,
        "dtype, shape, op, requires_grad, dim and sizes",
        _reduce_scatter_arguments,
        what,
        tensor,
        sizes,
        dim,
        op,
        comm,
        equal,
    )
    return _ReduceScatter.apply(tensor, sizes, dim, op, comm)


@eager_under_compile
def reduce_scatter_v(
    tensor: torch.Tensor,
    sizes: list[int] | None = None,
    dim: int = 0,
    op: str = "sum",
    comm: MPI.Comm | Communicator | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and give rank r block r of the result along ``dim``.

    ``sizes[r]`` is the length of rank r's block (they must add up to ``tensor.shape[dim]``); by default the
    dimension is split as evenly as possible, the first blocks one longer. ``op`` is any op of :func:`allreduce`
    but max and min. Backward: an allgather of the cotangent blocks along ``dim`` (divided by P for avg, times the
    conjugate product of the other ranks' inputs for prod).
    """
    return _reduce_scatter("reduce_scatter_v", tensor, sizes, dim, op, comm, equal=False)


@eager_under_compile
def reduce_scatter(
    tensor: torch.Tensor, dim: int = 0, op: str = "sum", comm: MPI.Comm | Communicator | None = None
) -> torch.Tensor:
    """:func:`reduce_scatter_v` with equal blocks: ``tensor.shape[dim]`` must be divisible by the world size."""
    return _reduce_scatter("reduce_scatter", tensor, None, dim, op, comm, equal=True)
