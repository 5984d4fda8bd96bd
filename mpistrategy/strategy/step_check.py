"""The strategy's gradient sync through the collectives' cross-rank check and the call log.

When a synchronised backward pass begins, the ranks that combine its gradients (the gradient aggregator's span:
every rank, or a node under hierarchical local SGD) post the same fingerprint check as every collective
(:class:`mpistrategy.comm.checks.PendingCheck`, non-blocking: it overlaps the backward pass) of the training batch
they are at (Trainer: counted before each batch, once however many times an optimizer's closure runs
``training_step``) or of their backward pass (Fabric); it is compared once the gradient buckets are finished. A
rank that skipped a backward pass, or ran ahead, raises one :class:`~mpistrategy.comm.errors.CommunicationError`
on every rank naming each rank's batch, instead of averaging gradients of different batches. While the buckets
finish, the call log shows the gradient sync as the rank's current call, so the stall watchdog names it. Off with
validation (``mpistrategy.set_validation(False)``).
"""

from __future__ import annotations

from mpi4py import MPI

from mpistrategy.comm import calls
from mpistrategy.comm.checks import PendingCheck
from mpistrategy.comm.communicator import resolve


class StepCheck:
    """Counts batches and backward passes, and checks them across the ranks that combine the gradients."""

    def __init__(self) -> None:
        self.batches = 0  # training batches begun (counted by the Trainer strategy)
        self.passes = 0  # synchronised backward passes
        self._pending: PendingCheck | None = None

    def begin_batch(self) -> None:
        """A training batch begins (the Trainer strategy's ``on_train_batch_start``)."""
        self.batches += 1

    def begin_sync(self, span: MPI.Intracomm | None) -> None:
        """A backward pass whose gradients are combined over the ranks of ``span`` begins (``None``: a pass
        without communication, which is not checked): post the check."""
        if span is None or span.Get_size() == 1:
            return
        self.passes += 1
        comm = resolve(span)  # collective the first time: every rank of span is here
        if self.batches:
            self._pending = PendingCheck(comm, "gradient sync", (self.batches - 1,), "training batch")
        else:
            self._pending = PendingCheck(comm, "gradient sync", (self.passes - 1,), "backward pass")

    def waiting(self) -> None:
        """The rank now waits for the gradient sync (the watchdog names it as the current call)."""
        if self._pending is not None:
            calls.hold(self._pending.call)

    def end_sync(self) -> None:
        """The buckets are finished: compare the check (raises on every rank if the ranks are at other batches)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.finish()
            finally:
                calls.release()
