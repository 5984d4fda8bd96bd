"""Page-locking host memory that torch did not allocate, such as a shared-memory segment, for CUDA copies.

A copy between a CUDA device and pageable host memory is staged by the driver through a pinned bounce buffer and
blocks the host; into page-locked memory it runs as one DMA transfer at the bus's speed and, with
``non_blocking=True`` on a stream, without blocking the host. ``cudaHostRegister`` page-locks memory in place, so a
segment that the node's ranks share (where the shared-memory allreduce reads every rank's buffer) can be the target
of those copies too. Registration is per process and lasts until :func:`unpin`, which must come before the memory is
unmapped.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

#: ``cudaHostRegisterDefault``: page-locked, usable by the current CUDA context
_REGISTER_DEFAULT = 0


def pin(tensor: torch.Tensor) -> bool:
    """Page-lock the bytes of ``tensor`` (a contiguous host tensor) for the CUDA devices of this process.

    Returns whether this call page-locked them (then :func:`unpin` must follow); where CUDA is absent or refuses (too
    much locked memory, an unsupported mapping) the memory stays pageable: copies to and from it stay correct, only
    synchronous and slower.
    """
    if tensor.numel() == 0 or not torch.cuda.is_available():
        return False
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.nbytes, _REGISTER_DEFAULT)
    if int(error) != 0:
        log.warning(
            "could not page-lock %.1f MB of host memory for CUDA copies (cudaHostRegister: %s); copies to and from "
            "it block the host. Raise the locked-memory limit (ulimit -l) if it is low.",
            tensor.nbytes / 2**20,
            error,
        )
        return False
    return True


def unpin(tensor: torch.Tensor) -> None:
    """Undo :func:`pin` for the same ``tensor`` (before its memory is unmapped)."""
    error = torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    if int(error) != 0:
        log.warning("cudaHostUnregister failed (%s) for %.1f MB of host memory", error, tensor.nbytes / 2**20)
