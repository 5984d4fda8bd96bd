"""Step-level sync modes: over which ranks gradients are averaged each step, and how models are averaged.

:class:`SyncMode` is the interface (see :mod:`mpistrategy.sync.base` for the hooks and their rules); one module
per mode:

========================== ============================================= =============================================
mode                       gradients every step                          models
========================== ============================================= =============================================
``flat`` (default)         all ranks                                     never (they stay equal)
``hierarchical``           all ranks, through node sums and node leaders never
``local_sgd``              none (after ``warmup_steps`` over all ranks)  averaged over all ranks every ``period`` steps
``hierarchical_local_sgd`` the node                                      averaged across nodes every ``period`` steps
``daso``                   the node                                      averaged across nodes every ``global_skip``
                                                                         steps, non-blocking, stale merge
``gossip``                 none                                          mixed with graph neighbours every ``period``
                                                                         steps
========================== ============================================= =============================================

Nothing here depends on Lightning: the Trainer strategy and Fabric drive the same hooks.
"""

from __future__ import annotations

from typing import Any

from mpistrategy.sync.base import SyncConfigurationError, SyncContext, SyncMode
from mpistrategy.sync.daso import DASO
from mpistrategy.sync.flat import FlatSync
from mpistrategy.sync.gossip import Gossip
from mpistrategy.sync.hierarchical import HierarchicalSync
from mpistrategy.sync.hierarchical_local_sgd import HierarchicalLocalSGD
from mpistrategy.sync.local_sgd import LocalSGD

SYNC_MODES: dict[str, type[SyncMode]] = {
    mode.name: mode for mode in (FlatSync, HierarchicalSync, LocalSGD, HierarchicalLocalSGD, DASO, Gossip)
}


def build_sync(sync: str | SyncMode | None, **options: Any) -> SyncMode:
    """A sync mode from its name (with its ``options``) or as given; ``None`` is the flat default."""
    if isinstance(sync, SyncMode):
        if options:
            raise SyncConfigurationError(f"sync options {sorted(options)} were given with an already built {sync!r}.")
        return sync
    name = "flat" if sync is None else sync
    mode = SYNC_MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        raise SyncConfigurationError(f"unknown sync mode {name!r}; valid modes: {', '.join(SYNC_MODES)}.")
    try:
        return mode(**options)
    except TypeError as error:
        raise SyncConfigurationError(f"sync mode {name!r}: {error}") from error


__all__ = [
    "DASO",
    "SYNC_MODES",
    "FlatSync",
    "Gossip",
    "HierarchicalLocalSGD",
    "HierarchicalSync",
    "LocalSGD",
    "SyncConfigurationError",
    "SyncContext",
    "SyncMode",
    "build_sync",
]
