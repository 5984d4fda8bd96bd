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

import numpy as np
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


def signature(tensor: torch.Tensor | None, *extra: int, skip_dim: int | None = None) -> list[int]:
    """Integers that must be equal on all ranks: dtype, shape (but ``skip_dim``) and ``extra`` arguments."""
    if tensor is None:
        return [-1, *extra]
    shape = [s for d, s in enumerate(tensor.shape) if d != skip_dim]
    return [
        DTYPE_CODES.index(tensor.dtype) if tensor.dtype in DTYPE_CODES else -2,
        len(shape),
        *shape,
        *extra,
    ]


def grad_flag(tensor: object) -> int:
    """1 when the op's result will take part in autograd on this rank (every rank must agree on it)."""
    return int(isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled())


@functools.lru_cache(maxsize=4096)
def _digest(values: tuple[int, ...]) -> int:
    """A 63-bit digest of a signature (CRC-32 and Adler-32 of its int64 bytes; the same on every process).

    Cached: a training loop repeats a few signatures, and an op then pays one dictionary lookup.
    """
    data = array("q", values).tobytes()
    return ((zlib.crc32(data) & 0x7FFFFFFF) << 32) | zlib.adler32(data)


def agree(comm: Communicator, what: str, local: Sequence[int], describe: str = "dtype and shape") -> None:
    """Raise :class:`CommunicationError` on every rank unless all ranks pass the same ``local`` signature.

    One allreduce (MAX) of two int64 values per call: ``[d, -d]`` for the signature's digest ``d`` gives every
    rank the largest and the smallest digest, which are equal exactly when all ranks agree (up to a 2**-63
    digest collision). Only when they differ does a second exchange, an allgather of the signatures, name what
    each rank passed. A no-op when validation is off or the communicator has one rank.
    """
    if comm.size == 1 or not validation_enabled():
        return
    digest = _digest(tuple(local))
    extremes = np.array([digest, -digest], dtype=np.int64)
    comm.forward.Allreduce(MPI.IN_PLACE, extremes, op=MPI.MAX)
    if extremes[0] == -extremes[1]:
        return
    rows = [tuple(row) for row in comm.forward.allgather(local)]
    listing = "; ".join(f"rank {rank}: {row}" for rank, row in enumerate(rows))
    raise CommunicationError(
        f"{what}: ranks disagree on the {describe} ({listing}). Every rank must call {what} with the same {describe}."
    )


def agree_checked(
    comm: Communicator,
    what: str,
    local: Sequence[int],
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
        agree(comm, what, [*local, int(problem is not None)], f"{describe} and argument validity")
    except CommunicationError as error:
        if problem is not None:
            raise problem from error
        raise
    checked = validation_enabled() and comm.size > 1
    if problem is not None and (checked or comm.size == 1 or not deferred):
        raise problem
