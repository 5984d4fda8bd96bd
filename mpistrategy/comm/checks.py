"""Argument checks: cheap local ones always, cross-rank agreement when validation is on.

Local checks (a root outside the communicator, an unknown op, an unsupported dtype) fail identically on every
rank, because every rank checks its own copy of the same arguments. Disagreement *between* ranks (different
shapes, dtypes or roots) can only be seen by communicating: :func:`agree` allgathers a small signature and raises
the same error on every rank. It costs one small allgather per op, so it is on by default and can be switched off
for production runs with ``mpistrategy.set_validation(False)`` or ``MPISTRATEGY_VALIDATE=0``.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from mpistrategy.comm.buffers import DTYPE_CODES
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.errors import CommunicationError

_WIDTH = 32
_validation = os.environ.get("MPISTRATEGY_VALIDATE", "1").strip().lower() not in ("0", "false", "no", "off")


def set_validation(enabled: bool) -> None:
    """Turn the cross-rank agreement checks on or off (on every rank alike)."""
    global _validation
    _validation = bool(enabled)


def validation_enabled() -> bool:
    """Whether ops check that all ranks agree on shapes, dtypes and roots before communicating."""
    return _validation


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


def agree(comm: Communicator, what: str, local: Sequence[int], describe: str = "dtype and shape") -> None:
    """Raise :class:`CommunicationError` on every rank unless all ranks pass the same ``local`` signature.

    One allgather of ``_WIDTH`` int64 values per call; a no-op when validation is off or the communicator has
    one rank.
    """
    if not _validation or comm.size == 1:
        return
    local = [int(v) for v in local]
    if len(local) >= _WIDTH:
        # Too long for one row (reduce_scatter_v's sizes on many ranks): keep the head, fold the rest into a digest.
        digest = zlib.crc32(np.asarray(local, dtype=np.int64).tobytes())
        local = [*local[: _WIDTH - 3], len(local), digest]
    row = np.full(_WIDTH, -3, dtype=np.int64)
    row[0] = len(local)
    row[1 : 1 + len(local)] = local
    gathered = np.empty((comm.size, _WIDTH), dtype=np.int64)
    comm.forward.Allgather(row, gathered)
    rows = [tuple(r[1 : 1 + r[0]]) for r in gathered.tolist()]
    if any(r != rows[0] for r in rows):
        listing = "; ".join(f"rank {rank}: {r}" for rank, r in enumerate(rows))
        raise CommunicationError(
            f"{what}: ranks disagree on the {describe} ({listing}). Every rank must call {what} with the same "
            f"{describe}."
        )
