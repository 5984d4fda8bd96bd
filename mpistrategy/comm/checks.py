"""Argument checks that fail on every rank together: local checks first, then one cross-rank exchange.

Every op checks its own arguments locally (a tensor where one is needed, not on the ``meta`` device, a dtype and
op the op supports, a root inside the communicator, sizes that add up, ...). Those checks may fail on some ranks
only, so an op never raises them at once: :func:`attempt` catches the failure, and :func:`agree` folds it into the
one small exchange the op makes anyway to check that all ranks agree (same shapes, dtypes, ops and roots). That
exchange is an allreduce (MAX) of two integers, a digest of the rank's signature or -1 for a rank whose checks
failed; when the ranks differ, a second exchange (an allgather, on this error path only) tells every rank what
went wrong where. So the rank with the problem raises its own error and every other rank a
:class:`CommunicationError` naming the op, that rank and its problem; no rank has sent anything yet, so the ranks
stay in step and the next op works.

The exchange costs a few microseconds per op, so it is on by default; ``mpistrategy.set_validation(False)`` or
``MPISTRATEGY_VALIDATE=0`` switch it off for production runs. Then nothing is exchanged and nothing is slower, but
a problem found on one rank raises on that rank only (the others wait in the op, or pair it with the failing
rank's next call), and disagreements between ranks (shapes, dtypes, ops, roots) are not caught. Ops that exchange
sizes or a header anyway still report what those carry (see each op).
"""

from __future__ import annotations

import contextlib
import functools
import os
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import NoReturn, TypeVar

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.comm.buffers import DTYPE_CODES
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.errors import CommunicationError, with_note

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


T = TypeVar("T")

#: takes the MAX of an agreement's two int64 over the ranks in place, or offers them and keeps the second argument,
#: which reports a disagreement on every rank, for the operation that compares them (see :func:`agree`)
Exchange = Callable[[np.ndarray, Callable[[], NoReturn]], None]

# The digest of a rank whose local checks failed: signature digests are never negative.
_FAILED_DIGEST = -1


def attempt(check: Callable[..., T], *args: object) -> tuple[T | None, Exception | None]:
    """``(check(*args), None)``, or ``(None, error)`` when a local check inside ``check`` raised ``error``.

    Ops run their local checks through this instead of raising at once, and hand the error to :func:`agree` (or
    to the exchange they make first), which raises it on every rank.
    """
    try:
        return check(*args), None
    except Exception as error:  # whatever failed here, every rank must learn of it before anything is sent
        return None, error


def checked(
    comm: Communicator,
    what: str,
    describe: str,
    check: Callable[..., tuple[Sequence[object], T]],
    *args: object,
    exchange: Exchange | None = None,
) -> T:
    """Run ``check(*args)``, this rank's local checks of an op's arguments, which return ``(signature, value)``;
    then :func:`agree` on the signature across ranks (through ``exchange`` when given) and return ``value``. A
    check that fails on any rank raises on every rank (see :func:`agree`); ``describe`` names what the signature
    holds, for the error."""
    problem = None
    try:  # as attempt() does, without its call: this is every op's hot path
        local, value = check(*args)
    except Exception as error:
        local, value, problem = (), None, error
    agree(comm, what, local, describe, problem, exchange=exchange)
    return value


def agreeing(comm: Communicator) -> bool:
    """Whether ops on ``comm`` check their arguments across ranks before communicating (validation on, >1 rank)."""
    return comm.size > 1 and validation_enabled()


def agree(
    comm: Communicator,
    what: str,
    local: Sequence[object],
    describe: str = "dtype and shape",
    problem: Exception | None = None,
    *,
    deferred: bool = False,
    shared: np.ndarray | None = None,
    exchange: Exchange | None = None,
) -> None:
    """Raise on every rank unless every rank passed its local checks and all passed the same ``local`` signature.

    ``problem`` is what this rank's local checks found (see :func:`attempt`). One allreduce (MAX) of two int64
    values per call: ``[d, -d]`` for the signature's digest ``d`` (-1 where a check failed) gives every rank the
    largest and the smallest digest, which are equal exactly when all ranks agree (up to a 2**-63 digest
    collision). Only when they differ does :func:`report` name what each rank passed, or which ranks failed
    their checks and why. ``shared``: an int64 buffer whose first two values are used for ``[d, -d]`` and whose
    other values go through the same MAX reduction (one message for the check and a small payload).
    ``exchange``: what takes the MAX of ``[d, -d]`` over the ranks in place instead of that allreduce (the
    shared-memory flags of a node-local communicator); it may also only offer this rank's values and leave the
    comparison to the operation that follows, which then calls the ``report`` it was given on a disagreement.

    A no-op when validation is off or the communicator has one rank: then ``problem`` is raised on this rank
    alone, unless ``deferred`` (and more than one rank), which leaves it to the caller's next exchange.
    """
    if not agreeing(comm):
        if problem is not None and not (deferred and comm.size > 1):
            raise alone(problem, comm, what)
        return
    digest = _FAILED_DIGEST if problem is not None else _digest(local if type(local) is tuple else tuple(local))
    extremes = comm.agreement if shared is None else shared
    extremes[0], extremes[1] = digest, -digest
    if exchange is not None and shared is None:
        exchange(extremes, lambda: report(comm, what, local, describe, problem))
    else:
        comm.forward.Allreduce(MPI.IN_PLACE, extremes, op=MPI.MAX)
    if extremes[0] != -extremes[1]:
        report(comm, what, local, describe, problem)
    if problem is not None:  # every rank failed its checks: each raises its own error
        raise with_note(problem, f"{what} raised this on rank {comm.rank}; every rank failed its argument checks.")


def report(
    comm: Communicator, what: str, local: Sequence[object], describe: str, problem: Exception | None
) -> NoReturn:
    """Raise on every rank once all ranks know that something is wrong (collective: every rank must call it).

    One allgather of every rank's signature and problem. A rank with a problem raises it (its cause names every
    failing rank); the others raise a :class:`CommunicationError` naming the op, each failing rank and its problem,
    or, when no rank failed its checks, each rank's ``describe`` values.
    """
    failure = None if problem is None else f"{type(problem).__name__}: {problem}"
    rows = comm.forward.allgather((tuple(local or ()), failure))
    failed = [(rank, text) for rank, (_, text) in enumerate(rows) if text is not None]
    if failed:
        ranks = ", ".join(str(rank) for rank, _ in failed)
        listing = "; ".join(f"on rank {rank}: {text}" for rank, text in failed)
        error = CommunicationError(
            f"{what}: rank{'s' if len(failed) > 1 else ''} {ranks} failed the argument checks, so no rank "
            f"communicated ({listing})."
        )
    else:
        listing = "; ".join(f"rank {rank}: {_readable(row)}" for rank, (row, _) in enumerate(rows))
        error = CommunicationError(
            f"{what}: ranks disagree on the {describe} ({listing}). Every rank must call {what} with the same "
            f"{describe}."
        )
    if problem is not None:
        raise with_note(problem, f"{what} raised this on rank {comm.rank}; every other rank raised too.") from error
    raise error


def alone(problem: Exception, comm: Communicator, what: str) -> Exception:
    """``problem``, noted as raised on this rank only (validation off: the other ranks were not told)."""
    if comm.size == 1:
        return problem
    return with_note(
        problem,
        f"{what} raised this on rank {comm.rank} only: with validation off (mpistrategy.set_validation) the other "
        f"ranks are not told and may wait in {what}.",
    )
