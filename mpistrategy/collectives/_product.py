"""The adjoint of the product over ranks, computed without dividing.

For ``y = prod_s x_s`` (elementwise) and the sum-of-losses convention (``g_t = dL_t/dy`` on rank t), the adjoint
is ``dL/dx_r = (sum_t g_t) * conj(E_r)`` with ``E_r = prod_{s != r} x_s``, the product of every *other* rank's
input (``conj`` is the identity on real tensors; on complex ones it gives torch's convention for holomorphic
functions). ``E_r`` is the exclusive prefix product ``prod_{s < r} x_s`` (``MPI_Exscan``) times the exclusive
suffix product ``prod_{s > r} x_s`` (the same scan on a copy of the communicator with the ranks in reverse
order). Dividing ``y`` by ``x_r`` would fail where ``x_r`` is zero and lose accuracy where ``y`` under- or
overflows; the scans give the exact product of the other factors, so any number of zeros on any ranks gets the
exact gradient (nonzero only where ``x_r`` is the single zero factor).

The scans run in the forward pass, posted before and overlapped with the product itself, and only when autograd
records the op; backward then costs one reduction of the cotangents, as for a sum.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from mpistrategy.collectives.handles import Pending
from mpistrategy.comm.buffers import empty_on_wire, mpi_buffer, mpi_op, on_wire, reduction_dtype
from mpistrategy.comm.communicator import Communicator, on_release

_reversed_copies: dict[Communicator, MPI.Intracomm] = {}


def _reversed(comm: Communicator) -> MPI.Intracomm:
    """A copy of ``comm``'s forward channel with the ranks in reverse order (rank r is rank P-1-r there).

    Made once per communicator, by every rank in the first product that autograd records (collective), and freed
    with the communicator.
    """
    if comm not in _reversed_copies:
        reversed_copy = comm.forward.Split(0, comm.size - 1 - comm.rank)
        _reversed_copies[comm] = reversed_copy  # type: ignore[assignment]  # mpi4py types Split's result as Comm
    return _reversed_copies[comm]


def _free_reversed(comm: Communicator) -> None:
    copy = _reversed_copies.pop(comm, None)
    if copy is not None:
        copy.Free()


on_release(_free_reversed)


def start_exclusive_product(tensor: torch.Tensor, comm: Communicator) -> Pending:
    """Post the two scans that give ``E_r = prod_{s != r} x_s`` of ``tensor``; ``wait()`` returns ``E_r`` in the
    dtype the product is computed in (float32 for half precision), on the host or MPI-addressable device.

    Collective on ``comm``: every rank posts it at the same point of its sequence of collectives.
    """
    wire_dtype = reduction_dtype(tensor.dtype, "prod", "prod backward")
    staged = on_wire(tensor, wire_dtype)
    operation = mpi_op(wire_dtype, "prod")
    below = empty_on_wire(tuple(staged.shape), wire_dtype, tensor.device).fill_(1)  # rank 0 has no lower rank
    above = empty_on_wire(tuple(staged.shape), wire_dtype, tensor.device).fill_(1)
    backwards = _reversed(comm)  # first, so that no scan is in flight while it is made
    requests = [
        comm.forward.Iexscan(mpi_buffer(staged), mpi_buffer(below), operation),
        backwards.Iexscan(mpi_buffer(staged), mpi_buffer(above), operation),
    ]
    return Pending(requests, lambda: below.mul_(above), keepalive=(staged, below, above))


def times_others(total: torch.Tensor, others: torch.Tensor) -> torch.Tensor:
    """``total * conj(others)``: the gradient of a product from the reduced cotangent ``total`` and ``E_r``,
    multiplied in ``others``' dtype and returned in ``total``'s dtype and device."""
    product = total.to(device=others.device, dtype=others.dtype) * others.conj()
    return product.to(device=total.device, dtype=total.dtype)
