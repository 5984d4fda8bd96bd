"""Argument checks that fail on every rank together: local checks first, then one cross-rank exchange.

Every op checks its own arguments locally (a tensor where one is needed, not on the ``meta`` device, a dtype and
op the op supports, a root inside the communicator, sizes that add up, ...). Those checks may fail on some ranks
only, so an op never raises them at once: :func:`attempt` catches the failure, and :func:`agree` folds it into the
one small exchange the op makes anyway to check that all ranks make the same call.

That exchange is a fingerprint of the call: one MAX allreduce of ``FINGERPRINT_LENGTH`` (20) int64 on the
communicator's private ``checks`` channel, the same size for every op, so that ranks calling different ops still
meet in it (never an MPI truncation error). It holds ``[d, -d, c, -c, payload]``: ``d`` a digest of the op's name
and its arguments (dtype, shape, op, root, ...; -1 for a rank whose local checks failed), ``c`` the number of
collectives this rank has called on the communicator (:mod:`mpistrategy.comm.calls`, validation off included).
Every rank learns the largest and the smallest of both; when they differ, a second exchange (an allgather, on this
error path only) tells every rank what each rank called and where (``file:line`` in the caller's code), and every
rank raises one :class:`CommunicationError` that names each rank's call, for example
``rank 0: allreduce(float32[4], op=sum) at train.py:12; rank 1: broadcast(root=0) at train.py:14``, or, when the
counts differ, which ranks are how many calls behind. The rank with a failed local check raises its own error.
No rank has sent anything yet, so the ranks stay in step and the next op works.

The exchange costs a few microseconds per op, so it is on by default; ``mpistrategy.set_validation(False)`` or
``MPISTRATEGY_VALIDATE=0`` switch it off for production runs. Then nothing is exchanged and nothing is slower, but
a problem found on one rank raises on that rank only (the others wait in the op, or pair it with the failing
rank's next call), and disagreements between ranks (ops, shapes, dtypes, roots) are not caught (the stall
watchdog, :mod:`mpistrategy.comm.watchdog`, still reports a hang). Ops that exchange sizes or a header anyway still
report what those carry (see each op).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import os
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import NoReturn, SupportsInt, TypeGuard, TypeVar, cast

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.comm import calls
from mpistrategy.comm.buffers import DTYPE_CODES
from mpistrategy.comm.calls import Call
from mpistrategy.comm.communicator import FINGERPRINT_LENGTH, Communicator
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
    """Raise unless ``value`` names a rank of ``comm`` (an integer, a NumPy one too, but not a bool)."""
    if not is_integer(value) or not 0 <= value < comm.size:
        raise ValueError(
            f"{what}: {role}={value!r} is not a rank of this communicator of size {comm.size}; "
            f"pass a {role} between 0 and {comm.size - 1}."
        )
    return value


def is_integer(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer argument: a Python or NumPy integer (``numbers.Integral``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_dim_type(dim: object, what: str) -> int:
    """``dim`` as an int; raise unless it is an integer (:func:`is_integer`)."""
    if not is_integer(dim):
        raise TypeError(f"{what}: dim must be an int, got {dim!r}.")
    return int(dim)


def check_dim(dim: object, ndim: int, what: str) -> int:
    """Normalise a possibly negative dimension index of a tensor with ``ndim >= 1`` dimensions, raising if it is not
    an integer, out of range, or the tensor is 0-dimensional (it has no dimension to split or join along)."""
    dim = check_dim_type(dim, what)
    if ndim == 0:
        raise ValueError(
            f"{what}: needs a tensor with at least one dimension, got a 0-dimensional tensor; use tensor.reshape(1)."
        )
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}: dim={dim} is out of range for a tensor of {ndim} dimensions.")
    return dim % ndim


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
    communicated), ``None`` as -1, a string by its CRC-32, a shape or other sequence as its length and its items."""
    values: list[int] = []
    for item in local:
        if isinstance(item, str):
            values.append(zlib.crc32(item.encode()))
        elif isinstance(item, torch.dtype):
            values.append(DTYPE_CODES.index(item) if item in DTYPE_CODES else -2)
        elif item is None:
            values.append(-1)
        elif isinstance(item, (tuple, list)):
            values += [len(item), *(int(v) for v in item)]
        else:
            values.append(int(cast(SupportsInt, item)))
    return values


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


@functools.lru_cache(maxsize=256)
def _name_digest(what: str) -> int:
    """What an op's name adds to its signature's digest (XOR), so that different ops never agree."""
    return _digest((what,))


T = TypeVar("T")

#: takes the MAX of an agreement's two int64 over the ranks in place, or offers them and keeps the second argument,
#: which reports a disagreement on every rank, for the operation that compares them (see :func:`agree`)
Exchange = Callable[[np.ndarray, Callable[[], NoReturn]], None]

# The digest of a rank whose local checks failed: signature digests are never negative.
_FAILED_DIGEST = -1
# Where ops put a payload reduced with the fingerprint (see metadata.exchange_meta).
PAYLOAD_OFFSET = 4
# Mixes the call count into the two values offered to a shared-memory group (which carries no more).
_COUNT_MIX = 0x1F3D5B79
_MASK = (1 << 63) - 1


def _no_node_exchange(comm: Communicator) -> Exchange | None:
    return None


_node_exchange: Callable[[Communicator], Exchange | None] = _no_node_exchange


def check_on_node(find: Callable[[Communicator], Exchange | None]) -> None:
    """Check every op on a communicator through ``find(comm)`` too, when it returns an exchange (see :func:`agree`).

    :mod:`mpistrategy.comm.shm.registry` passes the shared-memory flags that an allreduce on the communicator
    checks through once its ranks have them: a rank in another op then meets that allreduce's check there, and
    both raise the error that names both calls, instead of one waiting in the flags and the other in MPI.
    """
    global _node_exchange
    _node_exchange = find


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
    try:  # as attempt() does, without its call: this is every op's hot path
        local, value = check(*args)
    except Exception as error:
        agree(comm, what, (), describe, error, exchange=exchange)  # raises on every rank
        raise
    agree(comm, what, local, describe, None, exchange=exchange)
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
    """Register the call (:func:`mpistrategy.comm.calls.enter`), then raise on every rank unless every rank passed
    its local checks and all made the same call: the same op (``what``) with the same ``local`` signature, as the
    same how-manieth collective on ``comm``.

    ``problem`` is what this rank's local checks found (see :func:`attempt`). One MAX allreduce of the fingerprint
    ``[d, -d, c, -c, payload]`` (see the module docstring) gives every rank the largest and the smallest digest and
    count, which are equal exactly when all ranks agree (up to a 2**-63 digest collision). Only when they differ
    does :func:`report` name what each rank called, or which ranks failed their checks and why. ``shared``: the
    communicator's fingerprint with a payload from ``PAYLOAD_OFFSET`` on, which goes through the same MAX reduction
    (one message for the check and a small payload). ``exchange``: what takes the MAX of two int64 (the digest
    and the count mixed, and its negation) over the ranks in place instead of that allreduce (the shared-memory
    flags of a node-local communicator); it may also only offer this rank's values and leave the comparison to
    the operation that follows, which then calls the ``report`` it was given on a disagreement. Without an
    ``exchange`` of its own, an op on a communicator whose allreduces check through shared-memory flags checks
    there too (see :func:`check_on_node`), and then, when it carries a payload, through MPI as well.

    No exchange when validation is off or the communicator has one rank: then ``problem`` is raised on this rank
    alone, unless ``deferred`` (and more than one rank), which leaves it to the caller's next exchange.
    """
    checking = agreeing(comm)
    call = calls.enter(comm, what, local, describe, near=not checking)
    if not checking:
        if problem is not None and not (deferred and comm.size > 1):
            raise alone(problem, comm, what)
        return
    if problem is not None:
        digest = _FAILED_DIGEST
    else:
        digest = _digest(local if type(local) is tuple else tuple(local)) ^ _name_digest(what)
    count = call.count
    if exchange is None:
        exchange = _node_exchange(comm)
    if exchange is not None:
        extremes = comm.agreement
        mixed = digest if digest < 0 else (digest + count * _COUNT_MIX) & _MASK
        extremes[0], extremes[1] = mixed, -mixed
        exchange(extremes, lambda: report(comm, what, local, describe, problem, call))
        if extremes[0] != -extremes[1]:
            report(comm, what, local, describe, problem, call)
    if exchange is None or shared is not None:
        values = comm.fingerprint if shared is None else shared
        values[0], values[1], values[2], values[3] = digest, -digest, count, -count
        comm.checks.Allreduce(MPI.IN_PLACE, values, op=MPI.MAX)
        if values[0] != -values[1] or values[2] != -values[3]:
            report(comm, what, local, describe, problem, call)
    if problem is not None:  # every rank failed its checks: each raises its own error
        raise with_note(problem, f"{what} raised this on rank {comm.rank}; every rank failed its argument checks.")


class PendingCheck:
    """The fingerprint check of a call, posted now (a non-blocking allreduce) and compared by :meth:`finish`.

    For a step that can overlap the check with work of its own (the strategy posts the check of a gradient sync
    when backward starts and compares it once the buckets are done): every rank must :meth:`finish` it before
    its next blocking check on ``comm``. With validation off nothing is exchanged and :meth:`finish` returns.
    """

    __slots__ = ("comm", "what", "local", "describe", "call", "values", "request")

    def __init__(self, comm: Communicator, what: str, local: tuple, describe: str) -> None:
        self.comm, self.what, self.local, self.describe = comm, what, local, describe
        self.call = calls.enter(comm, what, local, describe)
        calls.leave()
        self.request: MPI.Request | None = None
        self.values = np.zeros(FINGERPRINT_LENGTH, dtype=np.int64)  # its own: other checks may run meanwhile
        if agreeing(comm):
            digest, count = _digest(local) ^ _name_digest(what), self.call.count
            self.values[:4] = digest, -digest, count, -count
            self.request = comm.checks.Iallreduce(MPI.IN_PLACE, self.values, op=MPI.MAX)

    def finish(self) -> None:
        """Wait for the exchange; raise on every rank (see :func:`agree`) unless all ranks made the same call."""
        if self.request is None:
            return
        self.request.Wait()
        self.request = None
        values = self.values
        if values[0] != -values[1] or values[2] != -values[3]:
            report(self.comm, self.what, self.local, self.describe, None, self.call)


def report(
    comm: Communicator,
    what: str,
    local: Sequence[object],
    describe: str,
    problem: Exception | None,
    call: Call | None = None,
) -> NoReturn:
    """Raise on every rank once all ranks know that something is wrong (collective: every rank must call it).

    One allgather, on the checks channel, of every rank's call (op, arguments, call site, count, the call before
    it) and problem. A rank with a problem raises it (its cause names every failing rank); the others raise a
    :class:`CommunicationError` naming each failing rank and its problem, or, when no rank failed its checks, each
    rank's call: which ranks are behind (fewer calls on this communicator), which called another op, or how their
    arguments differ.
    """
    failure = None if problem is None else f"{type(problem).__name__}: {problem}"
    if call is None:
        call = calls.last if calls.last is not None else calls.enter(comm, what, local, describe)
    previous = _previous_on(call)
    mine = (call.what, str(call), call.count, None if previous is None else str(previous), tuple(local or ()))
    rows = comm.checks.allgather((mine, failure, calls.phase))
    failed = [(rank, text) for rank, (_, text, _) in enumerate(rows) if text is not None]
    if failed:
        ranks = ", ".join(str(rank) for rank, _ in failed)
        listing = "; ".join(f"on rank {rank}: {text}" for rank, text in failed)
        error = CommunicationError(
            f"{what}: rank{'s' if len(failed) > 1 else ''} {ranks} failed the argument checks, so no rank "
            f"communicated ({listing})."
        )
    else:
        uneven = calls.explain_phases({rank: phase for rank, (_, _, phase) in enumerate(rows)})
        message = _disagreement(what, describe, [row for row, _, _ in rows])
        error = CommunicationError(message if uneven is None else f"{message} {uneven}")
    if problem is not None:
        raise with_note(problem, f"{what} raised this on rank {comm.rank}; every other rank raised too.") from error
    raise error


def _previous_on(call: Call) -> Call | None:
    """This process's call before ``call`` on the same communicator, if still recorded."""
    for earlier in reversed(calls.recent()):
        if earlier.channel == call.channel and earlier.count == call.count - 1:
            return earlier
    return None


#: the start of the op name of a backward's check (see :class:`~mpistrategy.collectives._function.CollectiveFunction`)
BACKWARD_PREFIX = "backward of "
_BACKWARD_ADVICE = (
    " Every rank must backpropagate through the same collectives: a rank whose loss does not use an op's output "
    "skips that op's backward (autograd prunes it) while the others run it; keep such an output in the loss with "
    "weight zero (loss = loss + 0 * y.sum()) on the ranks that do not need it, and differentiate the same outputs "
    "with respect to the same inputs on every rank. Wait the handles of non-blocking ops in the same order on "
    "every rank: backward follows the order of the waits."
)


def _disagreement(what: str, describe: str, rows: list[tuple[str, str, int, str | None, tuple]]) -> str:
    """The message for ranks whose calls differ: each rank's call, and what differs (with advice when a backward
    is among them)."""
    advice = _BACKWARD_ADVICE if any(op.startswith(BACKWARD_PREFIX) for op, _, _, _, _ in rows) else ""
    return _difference(what, describe, rows) + advice


def _difference(what: str, describe: str, rows: list[tuple[str, str, int, str | None, tuple]]) -> str:
    listing = "; ".join(f"rank {rank}: {shown}" for rank, (_, shown, _, _, _) in enumerate(rows))
    counts = [count for _, _, count, _, _ in rows]
    most = max(counts)
    if min(counts) != most:
        behind = "; ".join(
            f"rank {rank} is {most - count} call{'s' if most - count > 1 else ''} behind"
            for rank, count in enumerate(counts)
            if count < most
        )
        return (
            f"{what}: ranks are at different collective calls on this communicator ({behind}; counted with validation "
            f"off too): {listing}. A rank skipped a collective, or made one the others did not; the last call each "
            f"rank made before this one: "
            + "; ".join(f"rank {rank}: {previous or 'none'}" for rank, (_, _, _, previous, _) in enumerate(rows))
            + "."
        )
    ops = {op for op, _, _, _, _ in rows}
    if len(ops) > 1:
        before = {previous for _, _, _, previous, _ in rows}
        common = f" after their last common call {before.pop()}" if len(before) == 1 and None not in before else ""
        return (
            f"{what}: ranks called different collectives as call #{most} on this communicator{common} ({listing}). "
            "Every rank must make the same collective calls in the same order: a rank took another branch or "
            "skipped a call."
        )
    if what.startswith(BACKWARD_PREFIX):
        return f"{what}: ranks are in the backward of different calls ({listing})."
    return (
        f"{what}: ranks disagree on the {describe} ({listing}). Every rank must call {what} with the same {describe}."
    )


def alone(problem: Exception, comm: Communicator, what: str) -> Exception:
    """``problem``, noted as raised on this rank only (validation off: the other ranks were not told)."""
    if comm.size == 1:
        return problem
    return with_note(
        problem,
        f"{what} raised this on rank {comm.rank} only: with validation off (mpistrategy.set_validation) the other "
        f"ranks are not told and may wait in {what}.",
    )
