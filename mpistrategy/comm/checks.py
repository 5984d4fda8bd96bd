"""Argument checks: cheap local ones always, cross-rank agreement when validation is on.

Local checks (a root outside the communicator, an unknown op, an unsupported dtype) fail identically on every
rank, because every rank checks its own copy of the same arguments. Disagreement *between* ranks (different
shapes, dtypes or roots) can only be seen by communicating: :func:`agree` allreduces a digest of a small
signature and raises the same error on every rank. It costs one allreduce of two integers per op (a few
microseconds), so it is on by default; ``mpistrategy.set_validation(False)`` or ``MPISTRATEGY_VALIDATE=0`` switch
it off for production runs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import zlib
from array import array
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

import torch
from mpi4py import MPI

from mpistrategy.comm.buffers import DTYPE_CODES
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.errors import CommunicationError

_validation = os.environ.get("MPISTRATEGY_VALIDATE", "1").strip().lower() not in ("0", "false", "no", "off")
_scoped: ContextVar[bool | None] = ContextVar("mpistrategy_validation", default=None)


def set_validation(enabled: bool) -> None:
    """Turn the cross-rank agreement checks on or off for the whole process (on every rank alike)."""
    global _validation
    _validation = bool(enabled)


def validation_enabled() -> bool:
    """Whether ops check that all ranks agree on shapes, dtypes and roots before communicating."""
    scoped = _scoped.get()
    return _validation if scoped is None else scoped


@contextlib.contextmanager
def validation(enabled: bool) -> Iterator[None]:
    """Turn the cross-rank checks on or off inside a ``with`` block, for the current thread (or task) only.

    For code that has checked once what it will communicate (the strategy's gradient buckets, built and agreed
    on once) and issues many ops after that; every rank must enter the block alike.
    """
    token = _scoped.set(bool(enabled))
    try:
        yield
    finally:
        _scoped.reset(token)


def check_rank(value: int, comm: Communicator, what: str, role: str = "root") -> int:
    """Raise unless ``value`` names a rank of ``comm``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < comm.size:
        raise ValueError(
            f"{what}: {role}={value!r} is not a rank of this communicator of size {comm.size}; "
            f"pass a {role} between 0 and {comm.size - 1}."
        )
    return value


def check_dim(dim: int, ndim: int, what: str) -> int:
    """Normalise a possibly negative dimension index, raising if it is out of range."""
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise ValueError(f"{what}: dim={dim} is out of range for a tensor of {ndim} dimensions.")
    return dim % max(ndim, 1)


def signature(tensor: torch.Tensor | None, *extra: object, skip_dim: int | None = None) -> tuple:
    """What must be equal on all ranks: ``tensor``'s dtype and shape (but ``skip_dim``) and the ``extra`` arguments.

    A tuple of the dtype, the shape and the extras as they are (cheap to build); :func:`_digest` turns it into
    integers only the first time a signature is seen.
    """
    if tensor is None:
        return (None, *extra)
    if skip_dim is None:
        return (tensor.dtype, tensor.shape, *extra)
    return (tensor.dtype, tuple(s for d, s in enumerate(tensor.shape) if d != skip_dim), *extra)


def _as_integers(local: Sequence[object]) -> list[int]:
    """A signature as integers, the same on every process: a dtype by its code (-2 if it cannot be
    communicated), ``None`` as -1, a shape or other sequence as its length and its items."""
    values: list[int] = []
    for item in local:
        if isinstance(item, torch.dtype):
            values.append(DTYPE_CODES.index(item) if item in DTYPE_CODES else -2)
        elif item is None:
            values.append(-1)
        elif isinstance(item, (tuple, list)):
            values += [len(item), *(int(v) for v in item)]
        else:
            values.append(int(item))
    return values


def _readable(local: Sequence[object]) -> str:
    """A signature as a rank's line in an error message."""

    def shown(item: object) -> str:
        if isinstance(item, torch.dtype):
            return str(item).removeprefix("torch.")
        return str(tuple(item)) if isinstance(item, (tuple, list)) else str(item)

    return f"({', '.join(shown(item) for item in local)})"


def grad_flag(tensor: object) -> int:
    """1 when the op's result will take part in autograd on this rank (every rank must agree on it)."""
    return int(isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled())


@functools.lru_cache(maxsize=4096)
def _digest(local: tuple) -> int:
    """A 63-bit digest of a signature (CRC-32 and Adler-32 of its int64 bytes; the same on every process).

    Cached: a training loop repeats a few signatures, and an op then pays one dictionary lookup.
    """
    data = array("q", _as_integers(local)).tobytes()
    return ((zlib.crc32(data) & 0x7FFFFFFF) << 32) | zlib.adler32(data)


def agree(comm: Communicator, what: str, local: Sequence[object], describe: str = "dtype and shape") -> None:
    """Raise :class:`CommunicationError` on every rank unless all ranks pass the same ``local`` signature.

    One allreduce (MAX) of two int64 values per call: ``[d, -d]`` for the signature's digest ``d`` gives every
    rank the largest and the smallest digest, which are equal exactly when all ranks agree (up to a 2**-63
    digest collision). Only when they differ does a second exchange, an allgather of the signatures, name what
    each rank passed. A no-op when validation is off or the communicator has one rank.
    """
    if comm.size == 1 or not validation_enabled():
        return
    digest = _digest(local if type(local) is tuple else tuple(local))
    extremes = comm.agreement
    extremes[0], extremes[1] = digest, -digest
    comm.forward.Allreduce(MPI.IN_PLACE, extremes, op=MPI.MAX)
    if extremes[0] == -extremes[1]:
        return
    rows = comm.forward.allgather(local)
    listing = "; ".join(f"rank {rank}: {_readable(row)}" for rank, row in enumerate(rows))
    raise CommunicationError(
        f"{what}: ranks disagree on the {describe} ({listing}). Every rank must call {what} with the same {describe}."
    )


def agree_checked(
    comm: Communicator,
    what: str,
    local: Sequence[object],
    describe: str,
    problem: Exception | None,
    *,
    deferred: bool = False,
) -> None:
    """:func:`agree` on ``local`` plus a flag for a local ``problem``, then raise the problem.

    The rank with the problem raises it, the others a :class:`CommunicationError`. With ``deferred=True`` and
    validation off, the problem is left to the caller, whose next exchange tells the other ranks.
    """
    try:
        agree(comm, what, (*local, problem is not None), describe + " and argument validity")
    except CommunicationError as error:
        if problem is not None:
            raise problem from error
        raise
    checked = validation_enabled() and comm.size > 1
    if problem is not None and (checked or comm.size == 1 or not deferred):
        raise problem
