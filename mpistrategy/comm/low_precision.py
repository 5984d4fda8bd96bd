"""Sums of float16 and bfloat16 buffers on the wire, two bytes per element.

MPI has no half-precision types, and the collectives reduce half precision in float32 (4 bytes per element on
the wire). Where halving the bytes is the point (DASO's downcast parameter averaging, low-precision gradient
compression), these user-defined MPI operations add two half-precision buffers elementwise: each pairwise sum is
computed in float32 and rounded once to the half type (round to nearest even), so a reduction over P ranks rounds
P - 1 times, as torch's own half-precision addition would.
"""

from __future__ import annotations

import functools

import torch
from mpi4py import MPI

from mpistrategy.comm.buffers import transfer_type

HALF_DTYPES = (torch.float16, torch.bfloat16)


def _adder(dtype: torch.dtype):
    def add(incoming, inout, _datatype) -> None:
        target = torch.frombuffer(inout, dtype=dtype)
        if target.numel():
            target.add_(torch.frombuffer(incoming, dtype=dtype))

    return add


@functools.cache
def half_sum(dtype: torch.dtype) -> MPI.Op:
    """The MPI operation summing buffers of ``dtype`` (float16 or bfloat16) in place, pairwise in float32."""
    if dtype not in HALF_DTYPES:
        raise ValueError(f"half_sum: dtype must be torch.float16 or torch.bfloat16, got {dtype}.")
    return MPI.Op.Create(_adder(dtype), commute=True)


def half_buffer(tensor: torch.Tensor) -> list:
    """``[memory, count, datatype]`` for a contiguous host half-precision tensor, for use with :func:`half_sum`."""
    if tensor.dtype not in HALF_DTYPES or not tensor.is_contiguous() or not tensor.is_cpu:
        raise ValueError(
            f"half_buffer: expected a contiguous host float16/bfloat16 tensor, got {tensor.dtype} on {tensor.device}."
        )
    memory = MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes, readonly=False) if tensor.numel() else MPI.BOTTOM
    return [memory, tensor.numel(), transfer_type(tensor.dtype)]
