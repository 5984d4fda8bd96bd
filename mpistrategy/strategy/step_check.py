"""The strategy's gradient sync through the collectives' cross-rank check and the call log.

Before the gradient buckets of a synchronised backward pass are finished, the ranks that combine them (the
gradient aggregator's span: every rank, or a node under hierarchical local SGD) check, with the same
fingerprint exchange as every collective (:func:`mpistrategy.comm.checks.agree`), that they are at the same training
batch (Trainer: counted in ``training_step``) or backward pass (Fabric): a rank that skipped a backward pass, or ran
ahead, raises one :class:`~mpistrategy.comm.errors.CommunicationError` on every rank naming each rank's batch,
instead of averaging gradients of different batches. While the buckets finish, the call log shows the sync as the
rank's current call, so the stall watchdog names it. Off with validation (``mpistrategy.set_validation(False)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mpi4py import MPI

from mpistrategy.comm import calls
from mpistrategy.comm.checks import agree
from mpistrategy.comm.communicator import resolve


class StepCheck:
    """Counts batches and backward passes, and checks them across the ranks that combine the gradients."""

    def __init__(self) -> None:
        self.batches = 0  # training batches begun (counted by the Trainer strategy)
        self.passes = 0  # synchronised backward passes

    def begin_batch(self) -> None:
        """A training batch begins (the Trainer strategy's ``training_step``)."""
        self.batches += 1

    @contextlib.contextmanager
    def syncing(self, span: MPI.Intracomm | None) -> Iterator[None]:
        """Around finishing a backward pass's gradient sync over the ranks of ``span`` (``None``: a pass without
        communication, which is not checked)."""
        if span is None or span.Get_size() == 1:
            yield
            return
        self.passes += 1
        comm = resolve(span)  # collective the first time: every rank of span is here
        if self.batches:
            agree(comm, "gradient sync", (self.batches - 1,), "training batch")
        else:
            agree(comm, "gradient sync", (self.passes - 1,), "backward pass")
        try:
            yield
        finally:
            calls.leave()
