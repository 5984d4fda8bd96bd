"""The rank-order sum of the shared-memory allreduce, compiled: ``((x_0 + x_1) + ...) * scale`` for float32 and
float64, written to every place that needs it in one pass.

torch sums P inputs in P - 1 passes over memory (each reads two operands and writes one), then copies the sum to
every place it goes (P - 1 more passes when an owner writes its sums into every rank's tensor). The kernel
(``rank_sum.c``) reads each input once and writes each output once, a block of 512 elements at a time in a private
buffer, so an output may be one of the inputs (a block is read whole before it is written). It performs the same
IEEE operations in the same order as that torch chain (no reassociation, no fused multiply-add:
``-ffp-contract=off``), so its results are bitwise the same.

It is built on first use with the system's C compiler (``$CC``, else ``cc``) into a cache directory
(``$MPISTRATEGY_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpistrategy``, else ``~/.cache/mpistrategy``, else, without a
home directory, ``mpistrategy-<uid>`` in the temporary directory), under a name made of a hash of the source, the
flags and the machine type, written under a temporary name and renamed: ranks that build it at the same time do
not clash, and nodes of another architecture that share the directory build their own. Where it cannot be built
(no compiler, no writable cache), or with ``MPISTRATEGY_NATIVE=0``, :func:`available` is False and the callers sum
with torch (one warning per process says why).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

NATIVE_VARIABLE = "MPISTRATEGY_NATIVE"
CACHE_VARIABLE = "MPISTRATEGY_CACHE_DIR"
_SOURCE = Path(__file__).with_suffix(".c")
#: -O2 with vectorisation: -O3's transformations made the loops 2x slower here (gcc 12)
_FLAGS = ("-O2", "-ftree-vectorize", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off")
_DTYPES = {torch.float32: 0, torch.float64: 1}
SUPPORTED_DTYPES = tuple(_DTYPES)
_BUILD_SECONDS = 120
_wanted = [True]  # see compiled()


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_VARIABLE)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if base.startswith("~"):  # no home directory
        return Path(tempfile.gettempdir()) / f"mpistrategy-{os.getuid()}"
    return Path(base) / "mpistrategy"


def _build(compiler: list[str]) -> Path:
    """The compiled kernel's path (built now unless a matching build is in the cache)."""
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((*compiler, *_FLAGS, platform.machine())).encode()).hexdigest()[:16]
    directory = _cache_dir()
    library = directory / f"rank_sum-{platform.machine()}-{key}.so"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as building:
        target = Path(building) / library.name
        command = [*compiler, *_FLAGS, str(_SOURCE), "-o", str(target)]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=_BUILD_SECONDS)
        os.replace(target, library)
    return library


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:
    if os.environ.get(NATIVE_VARIABLE, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    compiler = shlex.split(os.environ.get("CC") or "cc")
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as failure:
        detail = str(getattr(failure, "stderr", None) or failure).strip()[:300]
        where = f"with {shlex.join(compiler)!r} into {_cache_dir()}"
        fixes = f"install a C compiler or set $CC, set {CACHE_VARIABLE} to a writable directory"
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
    _kernel()(
        _DTYPES[first.dtype],
        first.numel(),
        len(inputs),
        address,
        len(outputs),
        address + len(inputs) * ctypes.sizeof(ctypes.c_void_p),
        scale,
    )
