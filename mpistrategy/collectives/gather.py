"""Gathers and scatters along a dimension: ``gather``, ``gather_v``, ``scatter``, ``scatter_v``, ``allgather``,
``allgather_v``.

Rank r owns block r along ``dim``, ``sizes[r]`` long (the plain variants need equal shapes on every rank; the
``_v`` variants let the length along ``dim`` differ). Adjoints, with the convention of every mpistrategy backward
(the global objective is ``L = sum_r L_r``, the sum of every rank's own loss; ``g_r`` is rank r's cotangent):

- gather to ``root``: ``y_root = cat_r x_r``; ``dL/dx_r = g_root[block r]`` (a scatter from the root). The other
  ranks hold a :class:`Placeholder`, contribute no cotangent and still take part in backward.
- scatter from ``root``: ``y_r = x_root[block r]``; ``dL/dx_root = cat_r g_r`` (a gather to the root). Only the
  root passes a tensor: the others learn its shape, dtype and requires_grad from a header, and their inputs get no
  gradient.
- allgather: ``y_r = cat_s x_s`` on every rank; ``dL/dx_r = sum_s g_s[block r]`` (a reduce-scatter sum).

Every op returns a new tensor (``allgather`` writes into ``out=`` when given, also when this rank's tensor is a
block of it). Data moves bit for bit in every dtype the package communicates (float32, float64, float16, bfloat16,
int8, int16, int32, int64, uint8, bool, complex64, complex128); other dtypes (uint16/32/64, float8, complex32)
raise a ``TypeError`` that lists these, on every rank. The forward and backward messages travel on distinct
duplicates of the communicator.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.collectives._compile import eager_under_compile
from mpistrategy.collectives._function import CollectiveFunction
from mpistrategy.collectives._layout import from_front, offsets, split_sizes, to_front
from mpistrategy.collectives._second_order import refuse_if_recording
from mpistrategy.collectives.placeholder import Placeholder, anchor
from mpistrategy.collectives.reduction import _Allgather, _allgather_along
from mpistrategy.comm.buffers import (
    check_dtype,
    check_out,
    check_tensor,
    empty_on_wire,
    mpi_buffer,
    off_wire,
    on_wire,
    receive_device,
)
from mpistrategy.comm.checks import agree, attempt, check_dim, check_dim_type, check_rank, grad_flag, signature
from mpistrategy.comm.communicator import Communicator, resolve
from mpistrategy.comm.errors import CommunicationError
from mpistrategy.comm.metadata import exchange_meta, header_of

# ---------------------------------------------------------------------------------------------------------------
# Buffers: a tensor whose first dimension is split into blocks of ``sizes`` rows.


def _blocks(tensor: torch.Tensor, sizes: Sequence[int]) -> list:
    """``[memory, counts, displacements, datatype]`` for ``tensor`` (contiguous) cut along dim 0 into ``sizes``."""
    memory, _, datatype = mpi_buffer(tensor)
    row = math.prod(tensor.shape[1:])
    counts = [size * row for size in sizes]
    return [memory, counts, offsets(counts), datatype]


def _gather_front(
    front: torch.Tensor, sizes: Sequence[int], root: int, channel: MPI.Intracomm, rank: int
) -> torch.Tensor | None:
    """``MPI_Gatherv`` of blocks along the first dimension to ``root``; ``None`` on the other ranks."""
    send = on_wire(front)
    if rank != root:
        channel.Gatherv(mpi_buffer(send), None, root=root)
        return None
    result = empty_on_wire((sum(sizes), *send.shape[1:]), send.dtype, front.device)
    channel.Gatherv(mpi_buffer(send), _blocks(result, sizes), root=root)
    return off_wire(result, front.dtype, front.device)


def _scatter_front(
    front: torch.Tensor | None,
    sizes: Sequence[int],
    rest: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    root: int,
    channel: MPI.Intracomm,
    rank: int,
) -> torch.Tensor:
    """``MPI_Scatterv`` from ``root`` of ``front`` (significant at the root only) cut along dim 0 into ``sizes``.

    ``rest`` is the shape of the other dimensions; the result lives on ``device``.
    """
    result = empty_on_wire((sizes[rank], *rest), dtype, device)
    send = on_wire(front) if front is not None else None
    channel.Scatterv(_blocks(send, sizes) if send is not None else None, mpi_buffer(result), root=root)
    return off_wire(result, dtype, device)


# ---------------------------------------------------------------------------------------------------------------
# Argument checks shared with alltoall.py. They raise, and the ops run them through ``attempt``: each rank first
# tells the others whether its checks passed (in the ``agree`` message, or as a negative length in an exchange of
# sizes), so that a problem on one rank raises on every rank instead of leaving the others blocked in the
# collective.


def check_along(tensor: object, dim: int, what: str) -> int:
    """Local checks of a tensor to communicate along ``dim``; returns ``dim`` normalised (0 <= dim < ndim)."""
    check_tensor(tensor, what)
    assert isinstance(tensor, torch.Tensor)  # check_tensor raised otherwise
    check_dtype(tensor.dtype, what)
    return check_dim(dim, tensor.dim(), what)


def check_sizes(
    sizes: object, parts: int, what: str, name: str = "sizes", total: int | None = None, dim: int = 0
) -> list[int]:
    """``sizes`` as a list of ints; raises unless it gives one non-negative length per rank (adding up to
    ``total`` if given)."""
    try:
        values = [operator.index(size) for size in sizes]  # type: ignore[attr-defined]
    except TypeError:
        raise TypeError(f"{what}: {name} must be a sequence of ints (one per rank), got {sizes!r}.") from None
    if len(values) != parts or min(values, default=0) < 0:
        raise ValueError(
            f"{what}: {name}={values} must give one non-negative length per rank of the communicator ({parts})."
        )
    if total is not None and sum(values) != total:
        raise ValueError(
            f"{what}: {name}={values} add up to {sum(values)}, but dimension {dim} of the tensor has length "
            f"{total}; they must add up to it."
        )
    return values


def raise_if_flagged(values: Sequence[int], what: str, problem: Exception | None) -> None:
    """After an exchange of lengths in which a rank with a problem sent -1: raise on every rank."""
    if problem is not None:
        raise problem
    flagged = [rank for rank, value in enumerate(values) if value < 0]
    if flagged:
        raise CommunicationError(
            f"{what}: rank(s) {flagged} passed invalid arguments (see the error raised there); nothing was sent."
        )


def _exchange_lengths(comm: Communicator, what: str, length: int, problem: Exception | None) -> list[int]:
    """Every rank's length along the communicated dimension, by one small allgather (-1 marks a problem)."""
    mine = np.array([length if problem is None else -1], dtype=np.int64)
    every = np.empty(comm.size, dtype=np.int64)
    comm.forward.Allgather(mine, every)
    values = every.tolist()
    raise_if_flagged(values, what, problem)
    return values


def _prepare_along(
    what: str,
    tensor: torch.Tensor,
    dim: int,
    comm: Communicator,
    sizes: Sequence[int] | None,
    *,
    equal: bool,
    describe: str,
    root: int | None = None,
    out: torch.Tensor | None = None,
) -> tuple[int, list[int]]:
    """Check the arguments of a gather or allgather on every rank; return the normalised dim and the block sizes.

    The v-variants without ``sizes`` learn the lengths with one small allgather, which also reports a problem
    when validation is off.
    """

    def local_checks() -> tuple[tuple, int, int, list[int] | None]:
        """The signature all ranks must share, the normalised dim, this rank's length along it, the sizes given."""
        normalised = check_along(tensor, dim, what)
        shape, dtype = tensor.shape, tensor.dtype
        length = shape[normalised]
        extra = () if root is None else (check_rank(root, comm, what),)
        recorded = grad_flag(tensor)
        if equal:
            if out is not None:
                gathered = list(shape)
                gathered[normalised] *= comm.size
                check_out(out, recorded, what, torch.Size(gathered), dtype)
            return (dtype, shape, recorded, normalised, *extra), normalised, length, None  # signature(), built inline
        known = None if sizes is None else check_sizes(sizes, comm.size, what)
        if known is not None and known[comm.rank] != length:
            raise ValueError(
                f"{what}: sizes[{comm.rank}]={known[comm.rank]}, but this rank's tensor has length {length} along "
                f"dim {normalised}; pass the same sizes on every rank, sizes[r] being rank r's length."
            )
        listed = (-1,) if known is None else (len(known), *known)
        return signature(tensor, recorded, normalised, *extra, *listed, skip_dim=normalised), normalised, length, known

    result, problem = attempt(local_checks)
    local, normalised, length, known = result if result is not None else ((), 0, -1, None)
    exchanged = not equal and sizes is None
    agree(comm, what, local, describe, problem, deferred=exchanged)
    if not exchanged:
        return normalised, known if known is not None else [length] * comm.size
    return normalised, _exchange_lengths(comm, what, length, problem)


def _resized(shape: torch.Size, dim: int, length: int) -> tuple[int, ...]:
    return (*shape[:dim], length, *shape[dim + 1 :])


# ---------------------------------------------------------------------------------------------------------------
# gather

_DESCRIBE_EQUAL = "dtype, shape, requires_grad, dim, root"
_DESCRIBE_V = "dtype, shape (but along dim), requires_grad, dim, root, sizes"


class _Gather(CollectiveFunction):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], dim: int, root: int, comm: Communicator):
        ctx.sizes, ctx.dim, ctx.root, ctx.comm = sizes, dim, root, comm
        front = to_front(tensor, dim)
        ctx.rest = tuple(front.shape[1:])
        result = _gather_front(front, sizes, root, comm.forward, comm.rank)
        if result is None:
            return tensor.new_empty(0)
        return from_front(result, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_if_recording("gather")
        comm = ctx.comm
        front = to_front(grad, ctx.dim) if comm.rank == ctx.root else None
        block = _scatter_front(front, ctx.sizes, ctx.rest, grad.dtype, grad.device, ctx.root, comm.backward, comm.rank)
        return from_front(block, ctx.dim), None, None, None, None


def _gather(
    what: str,
    tensor: torch.Tensor,
    root: int,
    dim: int,
    comm: MPI.Comm | Communicator | None,
    sizes: Sequence[int] | None,
    equal: bool,
) -> torch.Tensor | Placeholder:
    comm = resolve(comm)
    dim, sizes = _prepare_along(
        what, tensor, dim, comm, sizes, equal=equal, describe=_DESCRIBE_EQUAL if equal else _DESCRIBE_V, root=root
    )
    result = _Gather.apply(tensor, sizes, dim, root, comm)
    if comm.rank == root:
        return result
    return Placeholder(what, root, _resized(tensor.shape, dim, sum(sizes)), tensor.dtype, result)


@eager_under_compile
def gather(
    tensor: torch.Tensor, root: int = 0, dim: int = 0, comm: MPI.Comm | Communicator | None = None
) -> torch.Tensor | Placeholder:
    """Concatenate every rank's ``tensor`` along ``dim`` (in rank order) on ``root``.

    Every rank passes a tensor of the same shape and dtype. The root gets the concatenation; the other ranks get a
    :class:`Placeholder` naming the root, which they pass to backward (``placeholder.backward()`` or
    ``loss + placeholder``) so that the backward collective runs on every rank.

    Backward: the root's cotangent is scattered; rank r's input gets block r of it.
    """
    return _gather("gather", tensor, root, dim, comm, None, equal=True)


@eager_under_compile
def gather_v(
    tensor: torch.Tensor,
    root: int = 0,
    dim: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    *,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor | Placeholder:
    """:func:`gather` where the length along ``dim`` may differ between ranks (it may be 0).

    The lengths are learned with one small allgather, unless every rank passes the same ``sizes`` (``sizes[r]`` is
    rank r's length along ``dim``). All other dimensions and the dtype must agree.
    """
    return _gather("gather_v", tensor, root, dim, comm, sizes, equal=False)


# ---------------------------------------------------------------------------------------------------------------
# scatter


class _Scatter(CollectiveFunction):
    @staticmethod
    def forward(
        ctx,
        source: torch.Tensor,
        sizes: list[int],
        dim: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        root: int,
        comm: Communicator,
    ):
        ctx.sizes, ctx.dim, ctx.root, ctx.comm = sizes, dim, root, comm
        rest = (*shape[:dim], *shape[dim + 1 :])
        front = to_front(source, dim) if comm.rank == root else None
        block = _scatter_front(front, sizes, rest, dtype, device, root, comm.forward, comm.rank)
        return from_front(block, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_if_recording("scatter")
        comm = ctx.comm
        full = _gather_front(to_front(grad, ctx.dim), ctx.sizes, ctx.root, comm.backward, comm.rank)
        grad_in = from_front(full, ctx.dim) if full is not None else None
        return grad_in, None, None, None, None, None, None, None


_DESCRIBE_SCATTER = "root, dim and variant (scatter or scatter_v)"


def _scatter_arguments(
    what: str,
    tensor: torch.Tensor | None,
    root: int,
    dim: int,
    comm: Communicator,
    sizes: Sequence[int] | None,
    device: torch.device | str | None,
    equal: bool,
) -> tuple[bytes | None, torch.device, list[int] | None]:
    """This rank's checks of a scatter: the root's header, where the block goes, and the root's block sizes
    (``None`` on the other ranks, which learn them from the root)."""
    check_rank(root, comm, what)
    check_dim_type(dim, what)
    if comm.rank != root:
        return None, receive_device(tensor, device, what), None
    header = header_of(tensor, root, what)
    assert tensor is not None  # header_of raised otherwise
    dim = check_along(tensor, dim, what)
    length = tensor.shape[dim]
    if not equal:
        chosen = sizes if sizes is not None else split_sizes(length, comm.size)
        return header, tensor.device, check_sizes(chosen, comm.size, what, total=length, dim=dim)
    if length % comm.size:
        raise ValueError(
            f"{what}: dimension {dim} of the root's tensor has length {length}, not divisible by the "
            f"{comm.size} ranks; use scatter_v for uneven blocks."
        )
    return header, tensor.device, [length // comm.size] * comm.size


def _scatter(
    what: str,
    tensor: torch.Tensor | None,
    root: int,
    dim: int,
    comm: MPI.Comm | Communicator | None,
    sizes: Sequence[int] | None,
    device: torch.device | str | None,
    equal: bool,
) -> torch.Tensor:
    comm = resolve(comm)
    arguments, problem = attempt(_scatter_arguments, what, tensor, root, dim, comm, sizes, device, equal)
    header, target, sizes = arguments if arguments is not None else (None, None, None)
    meta, _ = exchange_meta(comm, what, root, header, (root, dim, equal), _DESCRIBE_SCATTER, problem)
    dim %= len(meta.shape)  # the root checked dim against its tensor
    if equal:
        sizes = [meta.shape[dim] // comm.size] * comm.size
    elif comm.size > 1:  # the root's sizes, checked there
        buffer = np.array(sizes, dtype=np.int64) if comm.rank == root else np.empty(comm.size, dtype=np.int64)
        comm.forward.Bcast(buffer, root=root)
        sizes = buffer.tolist()
    if comm.rank == root:
        return _Scatter.apply(tensor, sizes, dim, meta.shape, meta.dtype, target, root, comm)
    own = tensor if isinstance(tensor, torch.Tensor) else None
    linked = own if own is not None and own.requires_grad == meta.requires_grad else None
    source = linked if linked is not None else anchor(meta.requires_grad, meta.dtype)
    return _Scatter.apply(source, sizes, dim, meta.shape, meta.dtype, target, root, comm)


@eager_under_compile
def scatter(
    tensor: torch.Tensor | None,
    root: int = 0,
    dim: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Split the root's ``tensor`` into equal blocks along ``dim``; rank r gets block r.

    Args:
        tensor: the value on ``root`` (its length along ``dim`` divisible by the number of ranks); ``None`` on the
            other ranks, which learn shape, dtype and requires_grad from the root (a tensor passed there is not
            read, gets no gradient, and is linked into the graph when its requires_grad matches the root's).
        device: where non-root ranks put their block (default: their tensor's device, else the CPU).

    Errors: the root checks its tensor, ``dim`` and the block sizes before it sends the header; with validation
    on that header travels in the allreduce that checks every rank's arguments (root, dim, ``device``), so a
    mistake on any rank, or ranks that disagree on the root, raise on every rank before anything is sent.

    Backward: every rank's cotangent is gathered to the root's input; the other ranks' inputs get none. Every rank
    must run this backward: ``loss.backward()`` does; ``torch.autograd.grad(loss, inputs)`` skips nodes that do not
    lead to ``inputs``, so there a non-root passes a tensor on the path to its inputs (or anything derived from them).
    """
    return _scatter("scatter", tensor, root, dim, comm, None, device, equal=True)


@eager_under_compile
def scatter_v(
    tensor: torch.Tensor | None,
    root: int = 0,
    dim: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    *,
    sizes: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`scatter` with blocks of ``sizes`` along ``dim`` (rank r gets ``sizes[r]``, which may be 0).

    ``sizes`` is read and checked on the root only, and sent after the header (default: as even as possible, the
    first blocks one longer, like ``torch.tensor_split``); it must add up to the root's length along ``dim``.
    """
    return _scatter("scatter_v", tensor, root, dim, comm, sizes, device, equal=False)


# ---------------------------------------------------------------------------------------------------------------
# allgather


@eager_under_compile
def allgather(
    tensor: torch.Tensor,
    dim: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every rank gets every rank's ``tensor`` concatenated along ``dim`` in rank order (equal shapes everywhere).

    ``out``: a tensor of the result's shape and dtype to write into and return (no new allocation; MPI writes
    into it directly for ``dim=0``). Only outside autograd (``torch.no_grad()`` or an input without grad).

    Backward: a reduce-scatter sum: rank r's input gets the sum over ranks of block r of their cotangents.
    """
    comm = resolve(comm)
    dim, sizes = _prepare_along(
        "allgather", tensor, dim, comm, None, equal=True, describe="dtype, shape, requires_grad, dim", out=out
    )
    if not grad_flag(tensor):  # autograd does not record the op here: skip the autograd node
        return _allgather_along(tensor, sizes, dim, comm, out)
    return _Allgather.apply(tensor, sizes, dim, comm)


@eager_under_compile
def allgather_v(
    tensor: torch.Tensor,
    dim: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    *,
    sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """:func:`allgather` where the length along ``dim`` may differ between ranks (it may be 0).

    The lengths are learned with one small allgather, unless every rank passes the same ``sizes``.
    """
    comm = resolve(comm)
    dim, sizes = _prepare_along(
        "allgather_v",
        tensor,
        dim,
        comm,
        sizes,
        equal=False,
        describe="dtype, shape (but along dim), requires_grad, dim, sizes",
    )
    if not grad_flag(tensor):  # autograd does not record the op here: skip the autograd node
        return _allgather_along(tensor, sizes, dim, comm)
    return _Allgather.apply(tensor, sizes, dim, comm)
