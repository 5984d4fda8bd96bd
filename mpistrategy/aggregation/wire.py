"""Non-blocking exchanges of compressed gradients on an aggregator's communicator, outside autograd.

- :func:`start_allgather`: every rank contributes one byte message of the same length and receives all of them,
  as a ``(ranks, nbytes)`` uint8 tensor (``MPI_Iallgather``). The payload this rank hands to MPI is ``nbytes``.
- :func:`start_sum`: an in-place sum over the ranks (``MPI_Iallreduce``). float16 and bfloat16 are summed as
  2-byte values on the wire by a user-defined MPI operation (each pairwise addition rounded once to the 2-byte
  type, as NCCL sums them), so half precision really halves the payload; the collectives' own ``allreduce``
  instead widens them to float32 for accuracy.

Messages travel on the communicator's forward channel, like the collectives' forward traffic; every rank must start
the same exchanges in the same order (the reducer starts buckets in the same order on every rank). Tensors on a
device MPI cannot address are staged through host memory.
"""

from __future__ import annotations

import threading

import torch
from mpi4py import MPI

from mpistrategy.collectives.handles import Pending
from mpistrategy.comm.buffers import empty_on_wire, mpi_buffer, on_wire
from mpistrategy.comm.communicator import Communicator

HALF_DTYPES = (torch.float16, torch.bfloat16)
_NATIVE_SUMS = (torch.float32, torch.float64)
_half_sums: dict[torch.dtype, MPI.Op] = {}
_lock = threading.Lock()


def start_allgather(comm: Communicator, message: torch.Tensor) -> Pending:
    """Post the allgather of this rank's ``message`` (1-D uint8, the same length on every rank); ``wait()`` returns
    the ``(comm.size, len(message))`` uint8 tensor of every rank's message, by rank, on ``message``'s device."""
    if message.dtype != torch.uint8 or message.dim() != 1:
        raise ValueError(f"allgather of messages: expected a 1-D uint8 tensor, got {message.dtype} {message.shape}.")
    sent = on_wire(message)
    received = empty_on_wire((comm.size, message.numel()), torch.uint8, message.device)
    send_buffer = mpi_buffer(sent)  # the receive count is per rank, as for the send
    request = comm.forward.Iallgather(send_buffer, [mpi_buffer(received)[0], send_buffer[1], send_buffer[2]])
    return Pending([request], lambda: received.to(message.device), keepalive=(sent, received))


def start_sum(comm: Communicator, tensor: torch.Tensor) -> Pending:
    """Post the in-place sum of ``tensor`` (float16, bfloat16, float32 or float64) over the ranks of ``comm``;
    ``wait()`` leaves the sum in ``tensor`` and returns it. The payload is ``tensor.nbytes``."""
    staged = on_wire(tensor)
    request = comm.forward.Iallreduce(MPI.IN_PLACE, mpi_buffer(staged), _sum(tensor.dtype))

    def finish() -> torch.Tensor:
        if staged is not tensor:
            tensor.copy_(staged)
        return tensor

    return Pending([request], finish, keepalive=(staged,))


def _sum(dtype: torch.dtype) -> MPI.Op:
    if dtype in _NATIVE_SUMS:
        return MPI.SUM
    if dtype not in HALF_DTYPES:
        raise TypeError(f"sum on the wire: expected float16, bfloat16, float32 or float64, got {dtype}.")
    with _lock:
        operation = _half_sums.get(dtype)
        if operation is None:
            operation = _half_sums[dtype] = MPI.Op.Create(_half_adder(dtype), commute=True)
        return operation


def _half_adder(dtype: torch.dtype):
    """The body of the MPI operation ``inout += in`` on buffers of ``dtype`` elements."""

    def add(incoming, inout, datatype) -> None:
        if len(incoming):
            torch.frombuffer(inout, dtype=dtype).add_(torch.frombuffer(incoming, dtype=dtype))

    return add
