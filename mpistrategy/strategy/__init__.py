"""The Lightning side: the ``mpi_ad`` strategy (Trainer and Fabric), its MPI cluster environment, gradient buckets,
failure handling.

Importing this package does not import Lightning; the classes are loaded on first access
(``from mpistrategy.strategy import MPIADStrategy``).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "CorruptCheckpointError": "mpistrategy.strategy.checkpoint_files",
    "MPIADFabricStrategy": "mpistrategy.strategy.fabric_mpi_ad",
    "MPIADStrategy": "mpistrategy.strategy.mpi_ad",
    "StopRequested": "mpistrategy.strategy.failures",
    "MPIEnvironment": "mpistrategy.strategy.environment",
    "GradientReducer": "mpistrategy.strategy.reducer",
    "LaunchMismatchError": "mpistrategy.comm.topology",
    "Topology": "mpistrategy.comm.topology",
    "topology": "mpistrategy.comm.topology",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
