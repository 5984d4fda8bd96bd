"""The random state of one process: torch (CPU, and CUDA once initialised), numpy's global generator and python's
``random``, as values a checkpoint can hold.

Dropout masks and random augmentation draw from these generators, so continuing a run bit for bit after a resume
needs them back exactly as they were. Each rank has its own; a checkpoint holds every rank's (a list indexed by
rank, gathered to rank 0) and each rank takes its own back. The values are tensors, ints, floats and ``None``
only, so ``torch.load(weights_only=True)`` accepts them.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch
from mpi4py import MPI

RandomState = dict[str, Any]


def capture() -> RandomState:
    """This process's random state now."""
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())  # the MT19937 tuple
    kind, keys, position, has_gauss, cached_gaussian = legacy
    version, internal, gauss_next = random.getstate()
    state: RandomState = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: RandomState) -> None:
    """Put back a state from :func:`capture` (CUDA's only when this process sees as many devices as the saver)."""
    torch.set_rng_state(state["torch"])
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["internal"].tolist()), python_state["gauss_next"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)


def gather(state: RandomState, comm: MPI.Intracomm) -> list[RandomState] | None:
    """Collective: every rank's state, indexed by rank, on rank 0 (``None`` elsewhere)."""
    if comm.Get_size() == 1:
        return [state]
    return comm.gather(state, root=0)
