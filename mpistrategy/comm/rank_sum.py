"""The rank-order sum of the shared-memory allreduce, compiled: ``((x_0 + x_1) + ...) * scale`` for float32 and
float64, written to every place that needs it in one pass.

torch sums P inputs in P - 1 passes over memory (each reads two operands and writes one), then copies the sum to
every place it goes (P - 1 more passes when an owner writes its sums into every rank's tensor). The kernel
(``rank_sum.c``) reads each input once and writes each output once, a block of 512 elements at a time in a private
buffer, so an output may be one of the inputs (a block is read whole before it is written). It performs the same
IEEE operations in the same order as that torch chain (no reassociation, no fused multiply-add:
``-ffp-contract=off``), so its results are bitwise the same.

It is built on first use with the system's C compiler (``$CC``, else ``cc``) and kept in a per-user cache
(``$MPISTRATEGY_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpistrategy``, else ``~/.cache/mpistrategy``), one build per
source, compiler, flags and machine type; it is loaded from the cache only when no one but the user can have
changed it (:mod:`~mpistrategy.comm.kernel_cache` lists the checks), else built for the process alone. Where it
cannot be built (no compiler), or with ``MPISTRATEGY_NATIVE=0``, :func:`available` is False and the callers sum
with torch (one warning per process says why).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import shlex
import subprocess
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from mpistrategy.comm import kernel_cache

NATIVE_VARIABLE = "MPISTRATEGY_NATIVE"
CACHE_VARIABLE = kernel_cache.CACHE_VARIABLE
_SOURCE = Path(__file__).with_suffix(".c")
#: -O2 with vectorisation: -O3's transformations made the loops 2x slower here (gcc 12)
_FLAGS = ("-O2", "-ftree-vectorize", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off")
_DTYPES = {torch.float32: 0, torch.float64: 1}
SUPPORTED_DTYPES = tuple(_DTYPES)
_wanted = [True]  # see compiled()


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def cached_library(cache: Path | None = None) -> Path | None:
    """Where the kernel built with ``$CC`` lies in ``cache`` (default: the configured cache directory; None where
    there is none): remove its directory to have it built again."""
    cache = cache if cache is not None else kernel_cache.cache_directory()
    if cache is None:
        return None
    return kernel_cache.build_directory(cache, _SOURCE, _compiler(), _FLAGS) / kernel_cache.LIBRARY


@functools.cache
def _kernel() -> Callable[..., None] | None:
    if os.environ.get(NATIVE_VARIABLE, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    compiler = _compiler()
    try:
        library = kernel_cache.load(_SOURCE, compiler, _FLAGS)
    except (OSError, subprocess.SubprocessError) as failure:
        detail = str(getattr(failure, "stderr", None) or failure).strip()[:300]
        where = f"with {shlex.join(compiler)!r}"
        fixes = "install a C compiler or set $CC"
        warnings.warn(
            f"mpistrategy: the compiled sum of the shared-memory allreduce could not be built {where} ({detail}); "
            f"summing with torch instead (slower). To fix it, {fixes}; to silence this, set {NATIVE_VARIABLE}=0.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    kernel = library.rank_sum
    kernel.restype = None
    kernel.argtypes = [
        ctypes.c_int,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_double,
    ]
    return kernel


def available(dtype: torch.dtype) -> bool:
    """Whether :func:`sum_to` can sum tensors of ``dtype`` (float32 or float64, the kernel built and wanted)."""
    return dtype in _DTYPES and _wanted[0] and _kernel() is not None


@contextlib.contextmanager
def compiled(enabled: bool) -> Iterator[None]:
    """Use the compiled kernel (where it is built) or torch's chain inside a ``with`` block, in this process: to
    compare the two. Ranks may differ: the results are the same bits."""
    saved = _wanted[0]
    _wanted[0] = bool(enabled)
    try:
        yield
    finally:
        _wanted[0] = saved


def sum_to(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
    """Write ``((inputs[0] + inputs[1]) + ...) * scale`` into every tensor of ``outputs``.

    All contiguous CPU tensors of one dtype that :func:`available` accepts, with the same number of elements; an
    output may be an input, but must not overlap one otherwise. ``scale`` 1 multiplies nothing.
    """
    pointers = (ctypes.c_void_p * (len(inputs) + len(outputs)))(
        *[tensor.data_ptr() for tensor in inputs], *[tensor.data_ptr() for tensor in outputs]
    )
    address = ctypes.addressof(pointers)
    first = inputs[0]
    kernel = _kernel()
    assert kernel is not None, "sum_to needs available(dtype)"
    kernel(
        _DTYPES[first.dtype],
        first.numel(),
        len(inputs),
        address,
        len(outputs),
        address + len(inputs) * ctypes.sizeof(ctypes.c_void_p),
        scale,
    )
