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

Every op returns a new tensor; data moves bit for bit, whatever the dtype. The forward and backward messages
travel on distinct duplicates of the communicator.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.collectives._layout import from_front, offsets, split_sizes, to_front
from mpistrategy.collectives.placeholder import Placeholder, anchor
from mpistrategy.collectives.reduction import _allgather_front, _reduce_scatter_front
from mpistrategy.comm.buffers import check_dtype, deliver, empty_on_wire, mpi_buffer, off_wire, on_wire, out_problem
from mpistrategy.comm.checks import agree, agree_checked, check_rank, grad_flag, signature
from mpistrategy.comm.communicator import Communicator, resolve
from mpistrategy.comm.errors import CommunicationError
from mpistrategy.comm.metadata import exchange_meta

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
# Argument checks shared with alltoall.py. Problems found locally are not raised at once: each rank first tells the
# others (a flag in the ``agree`` signature, or a negative length in an exchange of sizes), so that a problem on one
# rank raises on every rank instead of leaving the others blocked in the collective.


def check_dim_argument(dim: object, what: str) -> None:
    """Raise unless ``dim`` is an int (the same on every rank, so this fails everywhere alike)."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{what}: dim must be an int, got {dim!r}.")


def check_along(tensor: object, dim: int, what: str) -> tuple[int | None, Exception | None]:
    """Local checks of a tensor to communicate along ``dim``: ``(normalised dim, None)`` or ``(None, problem)``."""
    if not isinstance(tensor, torch.Tensor):
        return None, TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}.")
    try:
        check_dtype(tensor.dtype, what)
    except TypeError as error:
        return None, error
    ndim = tensor.dim()
    if ndim == 0:
        return None, ValueError(
            f"{what}: needs a tensor with at least one dimension, got a 0-dimensional tensor; use tensor.reshape(1)."
        )
    if not -ndim <= dim < ndim:
        return None, ValueError(f"{what}: dim={dim} is out of range for a tensor of {ndim} dimensions.")
    return dim % ndim, None


def check_sizes(
    sizes: object, parts: int, what: str, name: str = "sizes", total: int | None = None, dim: int = 0
) -> tuple[list[int] | None, Exception | None]:
    """``(list of ints, None)`` if ``sizes`` gives one non-negative length per rank (adding up to ``total`` if
    given), else ``(None, problem)``."""
    try:
        values = [operator.index(size) for size in sizes]  # type: ignore[union-attr]
    except TypeError:
        return None, TypeError(f"{what}: {name} must be a sequence of ints (one per rank), got {sizes!r}.")
    if len(values) != parts or min(values, default=0) < 0:
        return None, ValueError(
            f"{what}: {name}={values} must give one non-negative length per rank of the communicator ({parts})."
        )
    if total is not None and sum(values) != total:
        return None, ValueError(
            f"{what}: {name}={values} add up to {sum(values)}, but dimension {dim} of the tensor has length "
            f"{total}; they must add up to it."
        )
    return values, None


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
    extra: Sequence[int] = (),
    describe: str,
    out_problem: Exception | None = None,
) -> tuple[int, list[int]]:
    """Check the arguments of a gather or allgather on every rank; return the normalised dim and the block sizes."""
    check_dim_argument(dim, what)
    normalised, problem = check_along(tensor, dim, what)
    problem = problem or out_problem
    length = tensor.shape[normalised] if problem is None else -1
    known: list[int] | None = None
    if not equal and sizes is not None:
        known, sizes_problem = check_sizes(sizes, comm.size, what)
        if problem is None and sizes_problem is None and known[comm.rank] != length:
            sizes_problem = ValueError(
                f"{what}: sizes[{comm.rank}]={known[comm.rank]}, but this rank's tensor has length {length} along "
                f"dim {normalised}; pass the same sizes on every rank, sizes[r] being rank r's length."
            )
        problem = problem or sizes_problem
    present = tensor if isinstance(tensor, torch.Tensor) else None
    if equal:
        local = signature(present, grad_flag(tensor), dim, *extra)
    else:
        listed = (-1,) if sizes is None else ((len(known), *known) if known is not None else (-2,))
        local = signature(present, grad_flag(tensor), dim, *extra, *listed, skip_dim=normalised)
    agree_checked(comm, what, local, describe, problem, deferred=not equal and sizes is None)
    if equal:
        return normalised, [length] * comm.size
    if known is not None:
        return normalised, known
    return normalised, _exchange_lengths(comm, what, length, problem)


def _resized(shape: torch.Size, dim: int, length: int) -> tuple[int, ...]:
    return (*shape[:dim], length, *shape[dim + 1 :])


# ---------------------------------------------------------------------------------------------------------------
# gather

_DESCRIBE_EQUAL = "dtype, shape, requires_grad, dim, root"
_DESCRIBE_V = "dtype, shape (but along dim), requires_grad, dim, root, sizes"


class _Gather(torch.autograd.Function):
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
    check_rank(root, comm, what)
    dim, sizes = _prepare_along(
        what,
        tensor,
        dim,
        comm,
        sizes,
        equal=equal,
        extra=(root,),
        describe=_DESCRIBE_EQUAL if equal else _DESCRIBE_V,
    )
    result = _Gather.apply(tensor, sizes, dim, root, comm)
    if comm.rank == root:
        return result
    return Placeholder(what, root, _resized(tensor.shape, dim, sum(sizes)), tensor.dtype, result)


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


class _Scatter(torch.autograd.Function):
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
        comm = ctx.comm
        full = _gather_front(to_front(grad, ctx.dim), ctx.sizes, ctx.root, comm.backward, comm.rank)
        grad_in = from_front(full, ctx.dim) if full is not None else None
        return grad_in, None, None, None, None, None, None, None


def _broadcast_sizes(
    sizes: Sequence[int] | None, length: int, dim: int, is_root: bool, root: int, comm: Communicator, what: str
) -> list[int]:
    """The root's block sizes (default: an even split of ``length``) on every rank, -1 marking a bad argument."""
    buffer = np.full(comm.size, -1, dtype=np.int64)
    problem: Exception | None = None
    if is_root:
        chosen = sizes if sizes is not None else split_sizes(length, comm.size)
        values, problem = check_sizes(chosen, comm.size, what, total=length, dim=dim)
        if values is not None:
            buffer[:] = values
    comm.forward.Bcast(buffer, root=root)
    if problem is not None:
        raise problem
    if buffer[0] < 0:
        raise ValueError(f"{what}: the root rank {root} passed invalid sizes (see the error raised there).")
    return buffer.tolist()


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
    check_rank(root, comm, what)
    check_dim_argument(dim, what)
    agree(comm, what, (root, dim, equal), "root, dim and variant (scatter or scatter_v)")
    is_root = comm.rank == root
    sent = tensor if is_root else None
    if isinstance(sent, torch.Tensor) and not torch.is_grad_enabled():
        sent = sent.detach()  # no graph on the root: the receivers must not expect a backward
    meta = exchange_meta(sent, is_root, root, comm.forward, what)
    ndim = len(meta.shape)
    if ndim == 0 or not -ndim <= dim < ndim:
        raise ValueError(
            f"{what}: dim={dim} is out of range for the root's tensor of shape {tuple(meta.shape)}; "
            "it needs at least one dimension."
        )
    dim %= ndim
    length = meta.shape[dim]
    if equal:
        if length % comm.size:
            raise ValueError(
                f"{what}: dimension {dim} of the root's tensor has length {length}, not divisible by the "
                f"{comm.size} ranks; use scatter_v for uneven blocks."
            )
        sizes = [length // comm.size] * comm.size
    else:
        sizes = _broadcast_sizes(sizes, length, dim, is_root, root, comm, what)
    if is_root:
        return _Scatter.apply(tensor, sizes, dim, meta.shape, meta.dtype, tensor.device, root, comm)
    own = tensor if isinstance(tensor, torch.Tensor) else None
    target = torch.device(device) if device is not None else (own.device if own is not None else torch.device("cpu"))
    linked = own if own is not None and own.requires_grad == meta.requires_grad else None
    source = linked if linked is not None else anchor(meta.requires_grad, meta.dtype)
    return _Scatter.apply(source, sizes, dim, meta.shape, meta.dtype, target, root, comm)


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

    Backward: every rank's cotangent is gathered to the root's input; the other ranks' inputs get none. Every rank
    must run this backward: ``loss.backward()`` does; ``torch.autograd.grad(loss, inputs)`` skips nodes that do not
    lead to ``inputs``, so there a non-root passes a tensor on the path to its inputs (or anything derived from them).
    """
    return _scatter("scatter", tensor, root, dim, comm, None, device, equal=True)


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

    ``sizes`` is read on the root only and sent with the header (default: as even as possible, the first blocks
    one longer, like ``torch.tensor_split``); it must add up to the root's length along ``dim``.
    """
    return _scatter("scatter_v", tensor, root, dim, comm, sizes, device, equal=False)


# ---------------------------------------------------------------------------------------------------------------
# allgather


def _allgather_along(
    tensor: torch.Tensor, sizes: list[int], dim: int, comm: Communicator, out: torch.Tensor | None = None
) -> torch.Tensor:
    if dim == 0:  # the blocks are already where MPI puts them: receive straight into out
        return _allgather_front(tensor, sizes, comm.forward, out)
    gathered = from_front(_allgather_front(to_front(tensor, dim), sizes, comm.forward), dim)
    return deliver(gathered, out, tensor.dtype, tensor.device, "allgather")


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], dim: int, comm: Communicator):
        ctx.sizes, ctx.dim, ctx.comm = sizes, dim, comm
        return _allgather_along(tensor, sizes, dim, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        front = to_front(grad, ctx.dim)
        block = _reduce_scatter_front(front, ctx.sizes, "sum", comm.backward, comm.rank, comm.size)
        return from_front(block, ctx.dim), None, None, None


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
    recorded = grad_flag(tensor)
    dim, sizes = _prepare_along(
        "allgather",
        tensor,
        dim,
        comm,
        None,
        equal=True,
        describe="dtype, shape, requires_grad, dim",
        out_problem=out_problem(out, recorded, "allgather"),
    )
    if not recorded:  # autograd does not record the op here: skip the autograd node
        return _allgather_along(tensor, sizes, dim, comm, out)
    return _Allgather.apply(tensor, sizes, dim, comm)


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
