"""Fixed-size integer headers that carry a tensor's dtype, shape and requires_grad to ranks that lack them.

A receiver cannot size its buffer before it knows what is coming, so ops whose receivers pass no tensor
(broadcast, scatter, recv) first move one header of ``HEADER_LENGTH`` int64 values:
``[dtype code, requires_grad, ndim, size_0, ..., size_{ndim-1}, 0 padding]``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.comm.buffers import DTYPE_CODES, check_dtype, check_tensor
from mpistrategy.comm.checks import PAYLOAD_OFFSET, agree, agreeing, alone, grad_flag
from mpistrategy.comm.communicator import FINGERPRINT_LENGTH, Communicator
from mpistrategy.comm.errors import CommunicationError, with_note

MAX_DIMS = 12
HEADER_LENGTH = 3 + MAX_DIMS


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to know about a tensor before it arrives."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        """The metadata of ``tensor``; it requires grad only if autograd records ops on it here."""
        return cls(tuple(tensor.shape), tensor.dtype, bool(grad_flag(tensor)))

    def encode(self, what: str) -> list[int]:
        """The header: ``HEADER_LENGTH`` int64 values."""
        check_dtype(self.dtype, what)
        if len(self.shape) > MAX_DIMS:
            raise ValueError(f"{what}: tensors of more than {MAX_DIMS} dimensions cannot be sent; reshape first.")
        values = [DTYPE_CODES.index(self.dtype), int(self.requires_grad), len(self.shape), *self.shape]
        return values + [0] * (HEADER_LENGTH - len(values))

    @classmethod
    def decode(cls, header: Sequence[int] | np.ndarray | torch.Tensor) -> TensorMeta:
        """The metadata in a received header (its values as a list, or an int64 array or tensor)."""
        values = header.tolist() if hasattr(header, "tolist") else list(header)
        ndim = values[2]
        return cls(tuple(values[3 : 3 + ndim]), DTYPE_CODES[values[0]], bool(values[1]))


_HEADER_BYTES = HEADER_LENGTH * 8
# The header the root broadcasts when its own checks failed (validation off): dtype code -1.
_FAILED = np.array([-1] + [0] * (HEADER_LENGTH - 1), dtype=np.int64).tobytes()

# With validation on, broadcast and scatter send the header inside the cross-rank check (see exchange_meta): the
# fingerprint's payload is [highest rank passing out= (-1: none), header], in which every rank but the root
# contributes the lowest int64 as header.
_OUT_SLOT = PAYLOAD_OFFSET
_HEADER_OFFSET = (PAYLOAD_OFFSET + 1) * 8
_HEADER_END = _HEADER_OFFSET + _HEADER_BYTES
_LOWEST = np.full(HEADER_LENGTH, np.iinfo(np.int64).min, dtype=np.int64).tobytes()
_shared: dict[Communicator, memoryview] = {}
assert PAYLOAD_OFFSET + 1 + HEADER_LENGTH <= FINGERPRINT_LENGTH


@functools.lru_cache(maxsize=1024)
def _header(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, what: str) -> bytes:
    """The encoded header of a tensor (cached: a training loop sends a few kinds of tensor over and over)."""
    return np.array(TensorMeta(tuple(shape), dtype, requires_grad).encode(what), dtype=np.int64).tobytes()


def header_of(tensor: torch.Tensor | None, root: int, what: str) -> bytes:
    """The header of the tensor the ``root`` sends, as bytes; raises unless it is a tensor that can be sent."""
    if tensor is None:
        raise ValueError(f"{what}: the root rank {root} passed no tensor; it must pass the tensor to send.")
    check_tensor(tensor, what)
    return _header(tensor.shape, tensor.dtype, bool(grad_flag(tensor)), what)


@functools.lru_cache(maxsize=1024)
def _decoded(header: bytes) -> TensorMeta:
    return TensorMeta.decode(np.frombuffer(header, dtype=np.int64).tolist())


def _shared_bytes(comm: Communicator) -> memoryview:
    """The bytes of the communicator's fingerprint, which carries a header sent with the cross-rank check."""
    found = _shared.get(comm)
    if found is None:
        found = _shared[comm] = memoryview(comm.fingerprint).cast("B")  # type: ignore[arg-type]  # numpy stubs: Buffer on 3.12+
    return found


def exchange_meta(
    comm: Communicator,
    what: str,
    root: int,
    header: bytes | None,
    local: Sequence[object],
    describe: str,
    problem: Exception | None,
    *,
    out_given: bool = False,
) -> tuple[TensorMeta, int]:
    """The root's :class:`TensorMeta` on every rank, and the highest rank that passed ``out=`` (-1: none).

    ``header`` is the root's :func:`header_of` (``None`` elsewhere); ``local`` and ``problem`` are the signature
    every rank must agree on (the root among it) and what this rank's local checks found, as for
    :func:`~mpistrategy.comm.checks.agree`.

    With validation on (and more than one rank) the header travels inside the cross-rank check, so the op still
    sends one small message: the fingerprint's MAX allreduce with the payload ``[out rank, header]``, in which the
    root contributes its header and the others the lowest int64. Every rank learns the root's header, and at once
    whether every rank passed its checks with the same ``local``; if not, every rank raises (see ``agree``).

    With validation off the root broadcasts the header (a flag if its own checks failed, so that every rank
    raises); a problem on another rank raises there alone, ranks that disagree on the root are not caught, and
    the returned out rank is this rank's own.
    """
    is_root = comm.rank == root
    if agreeing(comm):
        values, raw = comm.fingerprint, _shared_bytes(comm)
        values[_OUT_SLOT] = comm.rank if out_given else -1
        raw[_HEADER_OFFSET:_HEADER_END] = cast(bytes, header) if is_root and problem is None else _LOWEST
        agree(comm, what, local, describe, problem, shared=values)
        return _decoded(bytes(raw[_HEADER_OFFSET:_HEADER_END])), int(values[_OUT_SLOT])
    agree(comm, what, local, describe, problem, deferred=True)  # registers the call; exchanges nothing
    if problem is not None and not is_root:
        raise alone(problem, comm, what)
    if is_root:
        buffer = bytearray(cast(bytes, header) if problem is None else _FAILED)
    else:
        buffer = bytearray(_HEADER_BYTES)
    comm.forward.Bcast([buffer, MPI.BYTE], root=root)
    if problem is not None:
        raise with_note(problem, f"{what} raised this on the root, rank {root}; its header told every other rank.")
    if buffer == _FAILED:
        raise CommunicationError(
            f"{what}: the root rank {root} failed its argument checks (see the error raised there); nothing was sent."
        )
    return _decoded(bytes(buffer)), comm.rank if out_given else -1
