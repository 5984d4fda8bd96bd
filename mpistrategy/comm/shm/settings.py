"""When an allreduce goes through shared memory: the mode, the size thresholds, the dtypes and ops it serves.

The settings come from ``MPISTRATEGY_SHM`` and ``MPISTRATEGY_SHM_MIN_BYTES`` at import, and from
:func:`set_shared_memory` (or :func:`shared_memory`) afterwards; every rank must choose alike, which the groups
check when they are built (:func:`require_alike`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from mpi4py import MPI

from mpistrategy.comm.errors import by_rank
from mpistrategy.comm.shm_window import locate

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SUPPORTED_OPS = ("sum", "avg")

MODE_VARIABLE = "MPISTRATEGY_SHM"
MIN_BYTES_VARIABLE = "MPISTRATEGY_SHM_MIN_BYTES"
MODES = ("auto", "on", "off")
#: the smallest message that goes through shared memory in "auto" mode, by (2 ranks?, tensor already in shared
#: memory?): where it beat MPI's allreduce in benchmarks/collectives.py on a 2-core x86_64 VM (docs/shared_memory.md).
#: A tensor that must be copied in first gains later than one that lives in a shared segment (the strategy's
#: gradient buckets); with more ranks than two, MPI's busy-polling ranks lose earlier.
DEFAULT_MIN_BYTES = {(True, False): 8 << 20, (True, True): 1 << 20, (False, False): 2 << 20, (False, True): 1 << 20}


@dataclass
class _Settings:
    mode: str
    min_bytes: int | None  # None: the measured defaults


def _mode_from(text: str) -> str:
    """The mode that ``MPISTRATEGY_SHM=text`` selects."""
    value = text.strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes", "force"):
        return "on"
    raise ValueError(
        f"{MODE_VARIABLE}={text!r} is not a shared-memory mode; set it to auto (the default), 1 (always, for "
        "tests) or 0 (never)."
    )


def _min_bytes_from(text: str) -> int | None:
    """The threshold that ``MPISTRATEGY_SHM_MIN_BYTES=text`` selects (``None``: the measured defaults)."""
    if not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"{MIN_BYTES_VARIABLE}={text!r} is not a whole number of bytes; set it to e.g. 1048576, or leave it "
            "unset for the measured defaults."
        ) from None
    return max(value, 0)


_settings = _Settings(
    _mode_from(os.environ.get(MODE_VARIABLE, "")), _min_bytes_from(os.environ.get(MIN_BYTES_VARIABLE, ""))
)


def set_shared_memory(mode: str = "auto", min_bytes: int | None = None) -> None:
    """Choose when allreduce goes through shared memory, on every rank alike: ``"auto"`` (ranks that share a
    node, messages of at least :func:`min_bytes`), ``"on"`` (every size, also one rank: for tests) or ``"off"``.
    ``min_bytes``: one threshold for every case instead of the measured defaults (``None``: keep the current
    choice)."""
    if mode not in MODES:
        raise ValueError(f"set_shared_memory: mode={mode!r}; choose one of {', '.join(MODES)}.")
    _settings.mode = mode
    if min_bytes is not None:
        _settings.min_bytes = max(int(min_bytes), 0)


def shared_memory_mode() -> str:
    """The current mode (see :func:`set_shared_memory`)."""
    return _settings.mode


def min_bytes(size: int = 2, shared: bool = False) -> int:
    """The smallest message (bytes) that goes through shared memory in ``"auto"`` mode over ``size`` ranks, for
    a tensor that lives in a shared segment already (``shared``) or must be copied in."""
    if _settings.min_bytes is not None:
        return _settings.min_bytes
    return DEFAULT_MIN_BYTES[size == 2, shared]


@contextlib.contextmanager
def shared_memory(mode: str, min_bytes: int | None = None) -> Iterator[None]:
    """:func:`set_shared_memory` inside a ``with`` block (every rank must enter it alike)."""
    saved = (_settings.mode, _settings.min_bytes)
    set_shared_memory(mode, min_bytes)
    try:
        yield
    finally:
        _settings.mode, _settings.min_bytes = saved


def uses_shared_memory(tensor: torch.Tensor, op: str, size: int) -> bool:
    """Whether this rank's settings send an allreduce of ``tensor`` with ``op`` over ``size`` ranks through
    shared memory, if the ranks share memory (local: no communication; the ranks agree on it in the argument
    check, so they must pass tensors alike: all in shared memory, or none, between the two thresholds)."""
    mode, dtype = _settings.mode, tensor.dtype
    if mode == "off" or dtype not in SUPPORTED_DTYPES or op not in SUPPORTED_OPS:
        return False
    if mode == "on":
        return True
    nbytes = tensor.numel() * dtype.itemsize
    if size < 2 or nbytes < min_bytes(size, shared=True):
        return False
    return nbytes >= min_bytes(size, shared=False) or locate(tensor) is not None


def require_alike(comm: MPI.Comm, with_threshold: bool, what: str) -> None:
    """Raise the same :class:`ValueError` on every rank of ``comm`` unless all have the same mode (and, with
    ``with_threshold``, the same ``min_bytes``): collective over ``comm``, for ``what`` (the error names it)."""
    mine = f"mode {_settings.mode}" + (f", min_bytes {_settings.min_bytes}" if with_threshold else "")
    chosen = comm.allgather(mine)
    if len(set(chosen)) == 1:
        return
    listing = by_rank(chosen)
    variables = f"{MODE_VARIABLE} and {MIN_BYTES_VARIABLE}" if with_threshold else MODE_VARIABLE
    raise ValueError(
        f"{what}: ranks have different settings ({listing}); set {variables} (or call set_shared_memory) alike "
        "on every rank."
    )
