"""Torch tensors as MPI buffers: the dtype table, contiguity and host staging for device tensors.

Every collective goes through :func:`mpi_buffer`, which hands MPI the tensor's own memory (zero copy for
contiguous host tensors). Reductions use :func:`reduction_dtype` to decide in which dtype the sum is taken:
float16 and bfloat16 are reduced in float32 (never as integer bit patterns) and rounded once at the end.

The reduction ops (:data:`REDUCE_OPS`): arithmetic ``sum``, ``avg`` and ``prod`` (numbers, not bool); ``max`` and
``min`` (real numbers and bool, where they are logical or / and; on floats they propagate NaN, as ``torch.maximum``
does, and give the same bits on every rank: see :func:`mpi_op`); logical ``land``, ``lor``, ``lxor`` and bitwise
``band``, ``bor``, ``bxor`` (bool and integer tensors only: a logical op treats nonzero as true and gives 1 or 0 in
the tensor's dtype, as ``MPI_LAND``; on bool the bitwise ops are the logical ones).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.comm.pool import receive_pool

_NATIVE_TYPES: dict[torch.dtype, MPI.Datatype] = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int8: MPI.INT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.uint8: MPI.UINT8_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}

# Half-precision floats are summed in float32 so that MPI never adds their bit patterns.
_REDUCED_AS: dict[torch.dtype, torch.dtype] = {torch.float16: torch.float32, torch.bfloat16: torch.float32}

# Codes that identify a dtype in the small integer headers sent ahead of a tensor (see metadata.py).
DTYPE_CODES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)

_CPU = torch.device("cpu")

LOGICAL_OPS: dict[str, MPI.Op] = {"land": MPI.LAND, "lor": MPI.LOR, "lxor": MPI.LXOR}
BITWISE_OPS: dict[str, MPI.Op] = {"band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
REDUCE_OPS: dict[str, MPI.Op] = {
    "sum": MPI.SUM,
    "avg": MPI.SUM,
    "max": MPI.MAX,
    "min": MPI.MIN,
    "prod": MPI.PROD,
    **LOGICAL_OPS,
    **BITWISE_OPS,
}
# MPI defines only the logical ops on its bool type: max/min and the bitwise ops of bools are logical or/and/xor.
_BOOL_OPS: dict[str, MPI.Op] = {
    "max": MPI.LOR,
    "min": MPI.LAND,
    **LOGICAL_OPS,
    "band": MPI.LAND,
    "bor": MPI.LOR,
    "bxor": MPI.LXOR,
}


@functools.cache
def _opaque_type(itemsize: int) -> MPI.Datatype:
    """An MPI datatype of ``itemsize`` raw bytes, for dtypes MPI has no name for (bfloat16, float16)."""
    return MPI.BYTE.Create_contiguous(itemsize).Commit()


_SUPPORTED = frozenset(DTYPE_CODES)


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise a clear error for dtypes no MPI transfer can carry."""
    if dtype not in _SUPPORTED:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        raise TypeError(f"{what}: tensors of dtype {dtype} cannot be communicated; supported dtypes: {supported}.")


def check_tensor(tensor: object, what: str) -> None:
    """Raise unless ``tensor`` is a torch.Tensor with data (not on the ``meta`` device); its dtype is checked by
    the op (:func:`check_dtype`, :func:`reduction_dtype`)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.is_meta:
        raise ValueError(_META.format(what=what, name="the tensor is"))
    refuse_transformed(tensor, what)


def refuse_transformed(tensor: torch.Tensor, what: str) -> None:
    """Raise if ``tensor`` is wrapped by a torch.func transform (a batch of ``vmap``, a level of ``grad``): MPI
    needs a tensor with memory, and a batched call would send once for many values."""
    functorch = torch._C._functorch
    if functorch.is_functorch_wrapped_tensor(tensor) or functorch.is_legacy_batchedtensor(tensor):
        raise TypeError(
            f"{what}: called inside a torch.func transform (vmap, grad, jacrev, jacfwd, or jacobian/hessian with "
            "vectorize=True), which the MPI collectives do not support; use torch.autograd.functional.jacobian "
            "with vectorize=False, or loop over the batch."
        )


_META = (
    "{what}: {name} on the meta device, which holds no data to communicate; create it on the CPU or a GPU "
    "(for example torch.empty_like(tensor, device='cpu'))."
)


def receive_device(own: object, device: torch.device | str | None, what: str) -> torch.device:
    """Where a receiver of broadcast or scatter puts the result: ``device`` if given, else the device of its own
    tensor (if it passed one), else the CPU; never the meta device."""
    if device is not None:
        target = torch.device(device)
    else:
        target = own.device if isinstance(own, torch.Tensor) else _CPU
    if target.type == "meta":
        raise ValueError(_META.format(what=what, name="the result would be"))
    return target


def transfer_type(dtype: torch.dtype) -> MPI.Datatype:
    """The MPI datatype that moves one element of ``dtype`` unchanged (no arithmetic)."""
    native = _NATIVE_TYPES.get(dtype)
    if native is not None:
        return native
    check_dtype(dtype, "MPI transfer")
    return _opaque_type(torch.empty((), dtype=dtype).element_size())


def _check_reduction_dtype(dtype: torch.dtype, op: str, what: str) -> torch.dtype:
    if op not in REDUCE_OPS:
        raise ValueError(f"{what}: unknown reduction op {op!r}; choose one of {sorted(REDUCE_OPS)}.")
    check_dtype(dtype, what)
    if op in LOGICAL_OPS and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            f"{what}: op={op!r} is a logical op, defined for bool and integer tensors, got {dtype}; pass a bool "
            "tensor (for example tensor != 0)."
        )
    if op in BITWISE_OPS and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            f"{what}: op={op!r} is a bitwise op, defined for bool and integer tensors, got {dtype}; cast the tensor "
            "to an integer dtype first (or reinterpret its bits with tensor.view(torch.int32) for float32)."
        )
    if dtype == torch.bool and op not in _BOOL_OPS:
        raise TypeError(
            f"{what}: op={op!r} is not defined for torch.bool; use op='lor' (logical or), 'land' (logical and) or "
            "'lxor', or cast the tensor to an integer dtype first."
        )
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(
            f"{what}: op='avg' needs a floating-point tensor, got {dtype}; use op='sum' or cast to a float dtype."
        )
    if dtype.is_complex and op in ("max", "min"):
        raise TypeError(f"{what}: op={op!r} is not defined for complex tensors; use 'sum' or 'avg'.")
    return _REDUCED_AS.get(dtype, dtype)


def _valid_reductions() -> dict[tuple[torch.dtype, str], torch.dtype]:
    valid = {}
    for dtype in DTYPE_CODES:
        for op in REDUCE_OPS:
            try:
                valid[dtype, op] = _check_reduction_dtype(dtype, op, "")
            except TypeError:
                continue
    return valid


_REDUCTION_DTYPES = _valid_reductions()


def reduction_dtype(dtype: torch.dtype, op: str, what: str) -> torch.dtype:
    """The dtype in which MPI performs the reduction ``op`` of ``dtype`` tensors; raises if it is not defined."""
    wire_dtype = _REDUCTION_DTYPES.get((dtype, op))
    return wire_dtype if wire_dtype is not None else _check_reduction_dtype(dtype, op, what)


def to_mean(total: torch.Tensor, size: int) -> torch.Tensor:
    """Turn ``total``, a sum over ``size`` ranks, into their mean in place: ``total *= 1/size``.

    A multiply by the reciprocal instead of a divide: on large float tensors it is about 25% faster, and for a
    power-of-two ``size`` it gives the same bits (otherwise within one rounding of ``total / size``).
    """
    return total.mul_(1.0 / size)


# The bit patterns of MPI.FLOAT and MPI.DOUBLE elements, by size in bytes, for the float max and min below.
_FLOAT_BITS: dict[int, tuple[type[np.floating], type[np.unsignedinteger]]] = {
    4: (np.float32, np.uint32),
    8: (np.float64, np.uint64),
}


def _float_extremum(largest: bool) -> MPI.Op:
    """The max (``largest``) or min of float32/float64 elements under a total order, as a commutative MPI op.

    ``MPI_MAX`` compares with ``>``, which is false for a NaN, so MPI keeps or drops a NaN depending on the order
    in which its algorithm combines the ranks (different on different ranks), and of ``-0.0`` and ``+0.0`` it keeps
    either. Here NaN wins over every number, as with ``torch.maximum`` and ``torch.minimum``; of two NaNs the one
    with the larger bit pattern wins, and ``-0.0 < +0.0``. A max or min under a total order is commutative and
    associative bit for bit, so every order of combining gives every rank the same bits. ``np.maximum(a, b)``
    already gives that result except where it returns its first argument (equal numbers, or two NaNs): those
    elements, found as the ones where ``np.maximum(b, a)`` has other bits, are resolved by their bit patterns
    (the larger for two NaNs; for ``±0`` the smaller, ``+0.0``, for max and the larger, ``-0.0``, for min).
    """
    pick = np.maximum if largest else np.minimum

    def combine(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:  # mpi4py's buffers of MPI's memory
        floats, bits = _FLOAT_BITS[datatype.Get_size()]
        a, b = np.frombuffer(inbuf, floats), np.frombuffer(inoutbuf, floats)
        swapped = pick(b, a)
        pick(a, b, out=b)
        ties = np.flatnonzero(b.view(bits) != swapped.view(bits))
        if ties.size:
            first, second = b.view(bits)[ties], swapped.view(bits)[ties]
            chosen = np.maximum(first, second)
            if largest:  # +0.0 has the smaller bit pattern of the zeros
                chosen = np.where(np.isnan(b[ties]), chosen, np.minimum(first, second))
            b.view(bits)[ties] = chosen

    return MPI.Op.Create(combine, commute=True)


_FLOAT_EXTREMA: dict[str, MPI.Op] = {"max": _float_extremum(True), "min": _float_extremum(False)}


def mpi_op(dtype: torch.dtype, op: str) -> MPI.Op:
    """The MPI operation for the reduction ``op`` on tensors of ``dtype`` (already in reduction dtype).

    Float max and min are user-defined ops that propagate NaN and give the same bits on every rank (see
    :func:`_float_extremum`); every other op is MPI's own.
    """
    if dtype == torch.bool:
        return _BOOL_OPS[op]
    if dtype.is_floating_point and op in _FLOAT_EXTREMA:
        return _FLOAT_EXTREMA[op]
    return REDUCE_OPS[op]


# The MPI operation for each (dtype, op) that MPI reduces in the tensor's own dtype (no float32 detour).
NATIVE_REDUCTIONS: dict[tuple[torch.dtype, str], MPI.Op] = {
    (dtype, op): mpi_op(dtype, op) for (dtype, op), wire in _REDUCTION_DTYPES.items() if wire == dtype
}


def materialized(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with torch's lazy conjugate and negative bits applied (a copy only when one is set): the memory of
    ``x.conj()`` holds ``x``'s values, which MPI, reading memory, would send unconjugated."""
    return tensor.resolve_conj().resolve_neg()


def _holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory holds its values (no lazy conjugate or negative bit)."""
    return not tensor.is_conj() and not tensor.is_neg()


def _plain(tensor: torch.Tensor) -> bool:
    """A contiguous host tensor whose memory holds its values."""
    return tensor.is_cpu and tensor.is_contiguous() and _holds_values(tensor)


def host_ready(tensor: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether MPI can use ``tensor``'s memory as it is (a contiguous host tensor whose memory holds its values),
    and ``out``'s, when given, to receive a result of ``tensor``'s shape and dtype: the fast path of the ops, with
    no staging or copies."""
    return _plain(tensor) and (out is None or (out.dtype == tensor.dtype and out.shape == tensor.shape and _plain(out)))


_from_address = MPI.buffer.fromaddress


def mpi_buffer(tensor: torch.Tensor) -> list:
    """``[memory, count, datatype]`` over the tensor's own storage; the tensor must be contiguous.

    The tensor must live on the host, or on a device when MPI is CUDA-aware (see :func:`cuda_aware`).
    """
    assert _holds_values(tensor), "a tensor with a lazy conjugate or negative bit reached MPI (see materialized)"
    count = tensor.numel()
    datatype = _NATIVE_TYPES.get(tensor.dtype) or transfer_type(tensor.dtype)
    if not count:
        return [MPI.BOTTOM, 0, datatype]
    return [_from_address(tensor.data_ptr(), tensor.nbytes, readonly=False), count, datatype]


@functools.cache
def cuda_aware() -> bool:
    """Whether MPI can read and write CUDA memory directly.

    Set ``MPISTRATEGY_CUDA_AWARE=1`` or ``0`` to override the detection, which asks the MPI library through
    ``MPIX_Query_cuda_support`` (MPICH and Open MPI export it when built with CUDA).
    """
    forced = os.environ.get("MPISTRATEGY_CUDA_AWARE")
    if forced is not None:
        return forced.strip().lower() in ("1", "true", "yes", "on")
    try:
        query = ctypes.CDLL(None).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        return False
    query.restype = ctypes.c_int
    return bool(query())


def needs_staging(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` must be copied through host memory for MPI to see it."""
    return not tensor.is_cpu and _staged_on(tensor.device)


def _staged_on(device: torch.device) -> bool:
    """Whether MPI cannot address memory on ``device``: any device but the CPU, unless CUDA and MPI is CUDA-aware."""
    return device.type != "cpu" and not (device.type == "cuda" and cuda_aware())


def on_wire(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous tensor MPI can address holding ``tensor``'s values, converted to ``dtype`` if given.

    Contiguous host tensors already in the right dtype are returned as they are (zero copy); device tensors
    are staged through host memory when MPI is not CUDA-aware. A CUDA tensor MPI reads itself is returned once the
    current stream's work is done (MPI does not order its reads behind the device's streams).
    """
    tensor = tensor.detach()
    if (dtype is None or dtype == tensor.dtype) and host_ready(tensor):
        return tensor
    tensor = materialized(tensor)
    if needs_staging(tensor):
        return staging_buffer(tensor.device, tuple(tensor.shape), dtype or tensor.dtype).copy_(tensor)
    wire = tensor.to(dtype=dtype or tensor.dtype).contiguous()
    if wire.is_cuda:
        torch.cuda.current_stream(wire.device).synchronize()
    return wire


def empty_on_wire(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised receive buffer MPI can address, for a result that will live on ``device``: host memory
    comes from the :data:`~mpistrategy.comm.pool.receive_pool` (recycled once nothing refers to it)."""
    if device.type == "cpu" or _staged_on(device):
        return staging_buffer(device, shape, dtype)
    return torch.empty(shape, dtype=dtype, device=device)


def staging_buffer(device: torch.device, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised host memory through which a tensor of ``device`` travels: page-locked for a CUDA device (from
    torch's caching host allocator: copies to and from it run at the bus's speed, 52-54 GB/s device-to-host on an
    H100 against 5-13 GB/s for pageable memory), else from the :data:`~mpistrategy.comm.pool.receive_pool`."""
    if device.type == "cuda":
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    return receive_pool.empty(shape, dtype)


def off_wire(buffer: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Move a received buffer back to the caller's dtype and device (no copy when they already match)."""
    if buffer.dtype == dtype and buffer.device == device:
        return buffer
    return buffer.to(device=device, dtype=dtype)


def check_out(
    out: object,
    recorded: int,
    what: str,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Raise if an ``out=`` argument cannot take the result: it must be a tensor with data, of the result's
    ``shape`` and ``dtype`` when they are known before communicating, and the op must run outside autograd (the
    result cannot be both ``out`` and a new autograd node)."""
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what}: out= must be a torch.Tensor, got {type(out).__name__}.")
    if out.is_meta:
        raise ValueError(_META.format(what=what, name="out= is"))
    if recorded:
        raise ValueError(
            f"{what}: out= is only allowed outside autograd (under torch.no_grad() or for inputs that do not "
            "require grad); drop out= to get a differentiable result."
        )
    if shape is not None and (out.dtype != dtype or out.shape != shape):
        raise _out_mismatch(out, shape, dtype, what)


def _out_mismatch(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None, what: str) -> ValueError:
    return ValueError(
        f"{what}: out= has shape {tuple(out.shape)} and dtype {out.dtype}, but the result has shape "
        f"{tuple(shape)} and dtype {dtype}; pass an out of that shape and dtype, or no out."
    )


def receive_buffer(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Where MPI writes a result of ``shape`` and ``dtype``: ``out`` itself when MPI can write into it directly
    (contiguous, that shape and dtype, addressable memory holding its values), else a fresh buffer that
    :func:`deliver` copies from."""
    if (
        out is not None
        and out.dtype == dtype
        and tuple(out.shape) == tuple(shape)
        and out.is_contiguous()
        and _holds_values(out)
        and not needs_staging(out)
    ):
        return out
    return empty_on_wire(tuple(shape), dtype, device)


def deliver(
    result: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype, device: torch.device, what: str
) -> torch.Tensor:
    """The op's result: ``result`` moved to ``dtype`` and ``device``, or written into ``out`` when one was given.

    An ``out`` of the wrong shape or dtype raises here, after the collective, where the result's shape was not
    known before communicating (broadcast's receivers): on its rank alone, and the ranks stay in step.
    """
    if result is out:
        return out
    if out is None:
        return off_wire(result, dtype, device)
    if not same_memory(result, out):
        if tuple(out.shape) != tuple(result.shape) or out.dtype != dtype:
            raise _out_mismatch(out, result.shape, dtype, what)
        out.copy_(result)
    return out


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory: the address ranges their elements span intersect (conservative:
    interleaved strided views that share no element count as overlapping too)."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    return a.data_ptr() < _end(b) and b.data_ptr() < _end(a)


def _end(tensor: torch.Tensor) -> int:
    """The address one past the last byte of ``tensor``'s elements (non-empty; torch's strides are >= 0)."""
    span = sum((length - 1) * stride for length, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return tensor.data_ptr() + (span + 1) * tensor.element_size()


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements in memory (one may be a detached alias of the other)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
