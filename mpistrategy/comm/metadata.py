"""Fixed-size integer headers that carry a tensor's dtype, shape and requires_grad to ranks that lack them.

A receiver cannot size its buffer before it knows what is coming, so ops whose receivers pass no tensor
(broadcast, scatter, recv) first move one header of ``HEADER_LENGTH`` int64 values:
``[dtype code, requires_grad, ndim, size_0, ..., size_{ndim-1}, 0 padding]``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.comm.buffers import DTYPE_CODES, check_dtype
from mpistrategy.comm.checks import grad_flag

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
    def decode(cls, header: Sequence[int]) -> TensorMeta:
        """The metadata in a received header (its values as a list, or an int64 array or tensor)."""
        values = header.tolist() if hasattr(header, "tolist") else list(header)
        ndim = values[2]
        return cls(tuple(values[3 : 3 + ndim]), DTYPE_CODES[values[0]], bool(values[1]))


_NO_TENSOR, _UNSENDABLE = -1, -2
_HEADER_BYTES = HEADER_LENGTH * 8


@functools.lru_cache(maxsize=1024)
def _header(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, what: str) -> bytes:
    """The encoded header of a tensor (cached: a training loop sends a few kinds of tensor over and over)."""
    return np.array(TensorMeta(tuple(shape), dtype, requires_grad).encode(what), dtype=np.int64).tobytes()


def _flag(code: int) -> bytes:
    return np.array([code] + [0] * (HEADER_LENGTH - 1), dtype=np.int64).tobytes()


@functools.lru_cache(maxsize=1024)
def _decoded(header: bytes) -> TensorMeta | int:
    """The metadata in a received header, or its flag (``_NO_TENSOR``, ``_UNSENDABLE``) when the sender had none."""
    values = np.frombuffer(header, dtype=np.int64).tolist()
    return values[0] if values[0] < 0 else TensorMeta.decode(values)


def exchange_meta(
    tensor: torch.Tensor | None, is_sender: bool, root: int, channel: MPI.Intracomm, what: str
) -> TensorMeta:
    """Broadcast the sender's :class:`TensorMeta` from ``root``.

    If the root has nothing it can send (``None``, an unsupported dtype, too many dimensions), every rank raises
    instead of the receivers waiting forever.
    """
    problem: Exception | None = None
    if not is_sender:
        header = bytearray(_HEADER_BYTES)
    elif not isinstance(tensor, torch.Tensor):
        header = bytearray(_flag(_NO_TENSOR))
    else:
        try:
            header = bytearray(_header(tensor.shape, tensor.dtype, bool(grad_flag(tensor)), what))
        except (TypeError, ValueError) as error:
            problem, header = error, bytearray(_flag(_UNSENDABLE))
    channel.Bcast([header, MPI.BYTE], root=root)
    meta = _decoded(bytes(header))
    if isinstance(meta, TensorMeta):
        return meta
    if meta == _NO_TENSOR:
        raise ValueError(f"{what}: the sending rank {root} passed no tensor; it must pass the tensor to send.")
    if problem is not None:
        raise problem
    raise TypeError(f"{what}: the tensor on the sending rank {root} cannot be sent (see the error on rank {root}).")
