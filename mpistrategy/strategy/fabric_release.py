"""Freeing what the Fabric strategies a program has dropped still hold.

Fabric never calls its strategy's ``teardown``. A :class:`~mpistrategy.strategy.fabric_mpi_ad.MPIADFabricStrategy`
holds, through its models' engines, communicators (MPICH has 2,048 context ids per process) and shared-memory
windows, and freeing those is collective. So each strategy keeps what it holds in a :class:`Held`, registered here
with a weak reference to the strategy, when its first model is set up; there (collective, as the setup is) the
ranks first agree, in two small allreduces over the control communicator, on which registered strategies the
garbage collector has taken on every rank, and free what those held, oldest first (the same order on every rank).
A program that makes a Fabric object per trial (Optuna, a sweep in one process) holds the resources of the Fabric
objects it still references and of a few dropped ones (see :func:`release_dropped`), no more.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.comm.topology import Topology
from mpistrategy.strategy.engine import DataParallelEngine
from mpistrategy.strategy.failures import StopSignals


@dataclass(eq=False)
class Held:
    """What one Fabric strategy holds that needs freeing: its models' engines (buckets, shared-memory windows,
    communicators), the gradient communicators of its second and later models, the optimizers whose class it
    routed (with their own class), its stop-signal handlers and the optimizers' step hooks of its stop check."""

    engines: list[tuple[nn.Module, DataParallelEngine]] = field(default_factory=list)
    own_channels: list[Topology] = field(default_factory=list)
    routed: list[tuple[torch.optim.Optimizer, type]] = field(default_factory=list)
    stop: StopSignals | None = None
    step_hooks: list[Any] = field(default_factory=list)

    def release(self) -> None:
        """Collective over the strategy's ranks: tear the engines down, free the communicators, give the optimizers
        their class and the signals their handlers back, remove the step hooks. The lists are emptied in place (the
        strategy reads them)."""
        for _, engine in self.engines:
            engine.teardown()
        self.engines.clear()
        for topology in self.own_channels:
            topology.free_gradient_channels()
        self.own_channels.clear()
        for optimizer, original in self.routed:
            optimizer.__class__ = original
        self.routed.clear()
        if self.stop is not None:
            self.stop.release()
        for handle in self.step_hooks:
            handle.remove()
        self.step_hooks.clear()


@dataclass(eq=False)
class _Entry:
    strategy: weakref.ref[Any]
    held: Held
    control: MPI.Intracomm


_entries: list[_Entry] = []

#: registered strategies still alive after a collection of the young generations from which a full collection runs
#: (about 0.5 s in a process with torch and Lightning; a dropped Fabric object sits in a reference cycle)
FULL_COLLECTION_FROM = 4


def register(strategy: Any, held: Held, control: MPI.Intracomm) -> None:
    """Free ``held`` at a later :func:`release_dropped` over ``control`` once ``strategy`` is gone on every rank."""
    _entries.append(_Entry(weakref.ref(strategy), held, control))


def release_dropped(control: MPI.Intracomm) -> int:
    """Collective over ``control``: release what the strategies registered over it held, for those the garbage
    collector has taken on every rank; returns how many. Ranks whose registries differ in length (a program that
    made Fabric objects on some ranks only) release nothing."""
    mine = [entry for entry in _entries if entry.control is control]
    _collect(mine)
    counts = np.array([len(mine), -len(mine)], dtype=np.int64)
    control.Allreduce(MPI.IN_PLACE, counts, op=MPI.MAX)
    if counts[0] != -counts[1] or not mine:
        return 0
    dropped = np.array([entry.strategy() is None for entry in mine], dtype=np.int8)
    control.Allreduce(MPI.IN_PLACE, dropped, op=MPI.MIN)
    released = [entry for entry, gone in zip(mine, dropped, strict=True) if gone]
    for entry in released:
        _entries.remove(entry)
        entry.held.release()
    return len(released)


def _collect(entries: list[_Entry]) -> None:
    """Let the garbage collector take the dropped strategies: a Fabric object is freed by the collector, not when
    the program drops it. The young generations first (about a millisecond), all of them only when
    :data:`FULL_COLLECTION_FROM` registered strategies are still alive (those of objects the program still holds,
    and dropped ones that have aged into the oldest generation)."""
    if not any(entry.strategy() is not None for entry in entries):
        return
    gc.collect(1)
    if sum(entry.strategy() is not None for entry in entries) >= FULL_COLLECTION_FROM:
        gc.collect()
