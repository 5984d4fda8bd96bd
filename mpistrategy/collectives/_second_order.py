"""Second derivatives through the collectives.

Under ``torch.autograd.grad(..., create_graph=True)`` autograd records the backward pass itself, so a gradient can
be differentiated again (gradient penalties, Hessian-vector products). The backward of a linear op ``y = A x`` is
its adjoint ``A^T g``, itself a linear op in ``g`` whose own adjoint is ``A`` again.

* The ops whose adjoint is a collective in which every rank takes part (``allreduce`` sum, avg, max and min,
  ``iallreduce`` sum and avg, ``allgather``, ``reduce_scatter`` sum and avg, ``alltoall``, their ``_v`` variants, and
  the tensor-parallel pair) compute their gradient, when autograd records the backward, through that collective's
  own autograd node: differentiating the gradient runs ``A`` (max and min: the gradient is the reduced cotangent
  where this rank owns the extremum, zero elsewhere, so the second derivative flows through the reduced cotangent
  and the ownership mask is constant).
* The others refuse: under ``create_graph=True`` their backward raises :func:`refuse_if_recording`'s error, which
  names the op, on every rank that runs it and before anything is sent (so no rank waits). These are the rooted
  ops (``broadcast``, ``reduce``, ``gather``, ``scatter``: their adjoints run on some ranks only, so a gradient
  received from the root has second-order terms on the root that no rank would compute), the point-to-point ops,
  and ``prod``, whose gradient depends on the other ranks' inputs. A gradient computed once and then differentiated
  would silently miss those terms.
"""

from __future__ import annotations

import torch

_SUPPORTED = (
    "allreduce (sum, avg, max, min), iallreduce (sum, avg), allgather, reduce_scatter (sum, avg), alltoall, their "
    "_v variants, copy_to_parallel and reduce_from_parallel"
)


def recording() -> bool:
    """Whether autograd records the backward pass now running (``create_graph=True``)."""
    return torch.is_grad_enabled()


def refuse_if_recording(what: str) -> None:
    """Raise if autograd records the backward now running (``create_graph=True``): called first in the backward of
    an op whose gradient cannot be differentiated again (see the module doc)."""
    if recording():
        raise RuntimeError(
            f"{what}: its gradient cannot be differentiated again, so it cannot run in a backward pass with "
            f"create_graph=True (the second derivative would miss the terms that pass through other ranks). Second "
            f"derivatives pass through {_SUPPORTED}; compute the gradient without create_graph where {what} is on "
            "the path."
        )
