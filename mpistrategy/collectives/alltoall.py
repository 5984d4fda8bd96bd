"""All-to-all exchanges along a dimension: ``alltoall`` (equal blocks) and ``alltoall_v`` (blocks of given sizes).

Rank s cuts its tensor along ``dim`` into one block per destination; rank r receives block r of every rank,
concatenated in rank order: ``y_r = cat_s x_s[block r]``. Adjoint (objective = sum of every rank's loss, as in
every mpistrategy backward): ``dL/dx_s[block r] = g_r[block s]``, an all-to-all of the cotangents with the send and
receive sizes swapped. Data moves bit for bit in every dtype the package communicates (the list in
:mod:`.gather`; other dtypes raise a ``TypeError`` on every rank); forward and backward messages travel on distinct
duplicates of the communicator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.collectives._compile import eager_under_compile
from mpistrategy.collectives._function import CollectiveFunction
from mpistrategy.collectives._layout import from_front, to_front
from mpistrategy.collectives._second_order import recording
from mpistrategy.collectives.gather import _blocks, check_along, check_sizes, raise_if_flagged
from mpistrategy.comm.buffers import empty_on_wire, off_wire, on_wire
from mpistrategy.comm.checks import agree, agreeing, attempt, checked, grad_flag, signature
from mpistrategy.comm.communicator import Communicator, resolve
from mpistrategy.comm.errors import CommunicationError


def _alltoall_front(
    front: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int], channel: MPI.Intracomm
) -> torch.Tensor:
    """``MPI_Alltoallv`` of blocks along the first dimension: ``send_sizes[r]`` rows to rank r, ``recv_sizes[r]``
    rows from rank r."""
    send = on_wire(front)
    result = empty_on_wire((sum(recv_sizes), *send.shape[1:]), send.dtype, front.device)
    channel.Alltoallv(_blocks(send, send_sizes), _blocks(result, recv_sizes))
    return off_wire(result, front.dtype, front.device)


class _Alltoall(CollectiveFunction):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], dim: int, comm: Communicator):
        ctx.send_sizes, ctx.recv_sizes, ctx.dim, ctx.comm = send_sizes, recv_sizes, dim, comm
        return from_front(_alltoall_front(to_front(tensor, dim), send_sizes, recv_sizes, comm.forward), dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if recording():  # through an alltoall node with the sizes swapped, whose backward is this alltoall again
            return _Alltoall.apply(grad, ctx.recv_sizes, ctx.send_sizes, ctx.dim, ctx.comm), None, None, None, None
        front = to_front(grad, ctx.dim)
        grad_in = _alltoall_front(front, ctx.recv_sizes, ctx.send_sizes, ctx.comm.backward)
        return from_front(grad_in, ctx.dim), None, None, None, None


@eager_under_compile
def alltoall(tensor: torch.Tensor, dim: int = 0, comm: MPI.Comm | Communicator | None = None) -> torch.Tensor:
    """Cut ``tensor`` into P equal blocks along ``dim`` and send block r to rank r; rank r gets the blocks it
    received, concatenated in rank order.

    Every rank passes a tensor of the same shape and dtype, its length along ``dim`` divisible by the number of
    ranks P. Backward: an all-to-all of the cotangents (with equal blocks the same exchange).
    """
    comm = resolve(comm)
    dim, block = checked(comm, "alltoall", "dtype, shape, requires_grad, dim", _alltoall_arguments, tensor, dim, comm)
    sizes = [block] * comm.size
    return _Alltoall.apply(tensor, sizes, sizes, dim, comm)


def _alltoall_arguments(tensor: torch.Tensor, dim: int, comm: Communicator) -> tuple[tuple, tuple[int, int]]:
    """This rank's checks of an alltoall: the signature all ranks must share, and (normalised dim, block length)."""
    normalised = check_along(tensor, dim, "alltoall")
    length = tensor.shape[normalised]
    if length % comm.size:
        raise ValueError(
            f"alltoall: dimension {normalised} has length {length}, not divisible by the {comm.size} ranks; "
            "use alltoall_v for blocks of other sizes."
        )
    return signature(tensor, grad_flag(tensor), normalised), (normalised, length // comm.size)


def _exchange_counts(comm: Communicator, send_sizes: list[int] | None) -> list[int]:
    """What every rank sends to this one, by one ``MPI_Alltoall`` of the send sizes (-1 marks a bad argument)."""
    mine = np.array(send_sizes, dtype=np.int64) if send_sizes is not None else np.full(comm.size, -1, np.int64)
    theirs = np.empty(comm.size, dtype=np.int64)
    comm.forward.Alltoall(mine, theirs)
    return theirs.tolist()


@eager_under_compile
def alltoall_v(
    tensor: torch.Tensor,
    send_sizes: Sequence[int],
    dim: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    *,
    recv_sizes: Sequence[int] | None = None,
) -> torch.Tensor:
    """:func:`alltoall` with blocks of any size: ``send_sizes[r]`` slices along ``dim`` go to rank r.

    Args:
        tensor: this rank's data; its length along ``dim`` is ``sum(send_sizes)``. The other dimensions and the
            dtype must agree on every rank.
        send_sizes: one non-negative length per rank (0 sends nothing to that rank).
        recv_sizes: how much arrives from each rank, if known; otherwise learned with one small all-to-all of the
            sizes. While validation is on (see :func:`mpistrategy.set_validation`), given ``recv_sizes`` are
            checked against what the other ranks send.

    The result has ``sum(recv_sizes)`` slices along ``dim``: the block from rank 0, then rank 1, and so on.
    Backward: an all-to-all of the cotangents with ``send_sizes`` and ``recv_sizes`` swapped.
    """
    what = "alltoall_v"
    comm = resolve(comm)
    checked_sizes, problem = attempt(_alltoall_v_arguments, tensor, send_sizes, recv_sizes, dim, comm)
    local, dim, sends, receives = checked_sizes if checked_sizes is not None else ((), 0, None, None)
    describe = "dtype, shape (but along dim), requires_grad, dim, use of recv_sizes"
    agree(comm, what, local, describe, problem, deferred=recv_sizes is None)
    if recv_sizes is not None and not agreeing(comm):
        return _Alltoall.apply(tensor, sends, receives, dim, comm)
    learned = _exchange_counts(comm, sends)
    raise_if_flagged(learned, what, problem)  # validation off: a rank whose checks failed sent -1
    if receives is not None:
        _check_receives(comm, receives, learned)
    return _Alltoall.apply(tensor, sends, receives if receives is not None else learned, dim, comm)


def _check_receives(comm: Communicator, receives: list[int], learned: list[int]) -> None:
    """Validation on, ``recv_sizes`` given: raise on every rank unless every rank's ``recv_sizes`` are what the
    ranks send it (``learned``), by one allreduce of a flag on the checks channel (after the op's check, so the
    ranks are in the same call); only when some rank's are wrong, an allgather of the flags names the ranks."""
    wrong = np.array([int(receives != learned)], dtype=np.int64)
    anyone = np.empty(1, dtype=np.int64)
    comm.checks.Allreduce(wrong, anyone, op=MPI.MAX)
    if not anyone[0]:
        return
    flags = np.empty(comm.size, dtype=np.int64)
    comm.checks.Allgather(wrong, flags)
    if wrong[0]:
        raise ValueError(
            f"alltoall_v: recv_sizes={receives}, but the ranks send {learned} to rank {comm.rank}; pass the sizes "
            "they send (or leave recv_sizes out to learn them)."
        )
    flagged = [other for other, flag in enumerate(flags.tolist()) if flag]
    if flagged:
        raise CommunicationError(
            f"alltoall_v: the recv_sizes of rank(s) {flagged} differ from what the ranks send them (see the error "
            "raised there); nothing was sent."
        )


def _alltoall_v_arguments(
    tensor: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int] | None, dim: int, comm: Communicator
) -> tuple[tuple, int, list[int], list[int] | None]:
    """This rank's checks of an alltoall_v: the signature all ranks must share, the normalised dim, and the send
    and (if given) receive sizes as lists."""
    what = "alltoall_v"
    normalised = check_along(tensor, dim, what)
    sends = check_sizes(send_sizes, comm.size, what, "send_sizes", total=tensor.shape[normalised], dim=normalised)
    receives = None
    if recv_sizes is not None:
        receives = check_sizes(recv_sizes, comm.size, what, "recv_sizes")
        if receives[comm.rank] != sends[comm.rank]:
            raise ValueError(
                f"{what}: recv_sizes[{comm.rank}]={receives[comm.rank]}, but this rank sends itself "
                f"send_sizes[{comm.rank}]={sends[comm.rank]} slices; they must be equal."
            )
    local = signature(tensor, grad_flag(tensor), normalised, int(recv_sizes is not None), skip_dim=normalised)
    return local, normalised, sends, receives
