"""Which parameters have a gradient: on this rank (:class:`GradientFlags`), and on some rank (:class:`UsageExchange`).

One byte per parameter of the module, by slot (its position in the module's parameter list). A rank learns which
parameters some rank used from a bitwise-or allreduce of its own bytes, once per synchronised pass, non-blocking,
among the ranks the step's aggregator spans (``AggregationContext.span``: all ranks for flat and hierarchical
averaging, the node for node-local averaging, so that nodes stay decoupled), through shared memory when they share
it, else on a private duplicate of that communicator (:mod:`mpistrategy.comm.shm_or`). Every rank that combines a
bucket then skips the same buckets: those in which no rank has a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from mpistrategy.aggregation.base import Aggregator
from mpistrategy.comm.shm_or import OrExchange, or_exchange


class GradientFlags:
    """This rank's bytes, by slot, for ``count`` parameters.

    Attributes:
        local: 1 where a gradient accumulated on this rank since the parameter was last combined or zeroed (in this
            pass or in the unsynchronised micro-batches before it); a ``bytearray`` that the hooks set (``numpy``
            view: :attr:`local_view`).
        stand_in: 1 where the parameter has no gradient, though its ``.grad`` may read as a zero view of its bucket
            (a stand-in for ``None``, kept so that the flat buckets need no copy per step).
        landed: 1 where a gradient landed in the current synchronised pass (a ``bytearray`` the hooks set).
        twice: the names of the parameters whose gradient landed a second time in the current synchronised pass.
    """

    def __init__(self, count: int) -> None:
        self.local = bytearray(count)
        self.local_view = np.frombuffer(self.local, dtype=np.uint8)
        self.stand_in = np.zeros(count, dtype=np.uint8)
        self.landed = bytearray(count)
        self.twice: list[str] = []

    def begin_synchronised_pass(self) -> None:
        """No gradient landed in the pass yet."""
        self.landed[:] = bytes(len(self.landed))
        self.twice.clear()

    def raise_if_landed_twice(self) -> None:
        """After a synchronised pass: raise if a parameter's gradient landed in parts (its first part was counted
        towards its bucket, which may have been combined before the others arrived)."""
        if not self.twice:
            return
        names = ", ".join(repr(name) for name in dict.fromkeys(self.twice))
        self.twice.clear()
        raise RuntimeError(
            f"parameter(s) {names} got their gradient in more than one part in one backward pass, and the first "
            "part counted towards the gradient bucket, which is combined over the ranks as soon as it is "
            "complete: the gradients of this step are not the average. A module used in more than one reentrant "
            "activation checkpoint (torch.utils.checkpoint.checkpoint(..., use_reentrant=True)) does this: each "
            "checkpoint runs a backward pass of its own. Use use_reentrant=False (DDP refuses this case too)."
        )

    def drop_stand_ins(self, params: Sequence[nn.Parameter], used: np.ndarray) -> None:
        """Set ``.grad`` back to ``None`` where it is a stand-in and ``used`` says that no rank has a gradient."""
        for slot in np.flatnonzero(self.stand_in > used).tolist():
            params[slot].grad = None

    def clear(self) -> None:
        """Every gradient is combined now, or absent."""
        self.local_view.fill(0)
        self.stand_in.fill(0)


class UsageExchange:
    """The exchange of :attr:`GradientFlags.local` among the ranks of each pass's aggregator, for ``count``
    parameters.

    Attributes:
        sent: the snapshot of this rank's bytes posted last.
        used: 1 where some rank has a gradient (the result of the last exchange, once :meth:`finish` returned).
        posted: whether the current pass posted its exchange.
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self.sent = np.zeros(count, dtype=np.uint8)
        self.used = np.zeros(count, dtype=np.uint8)
        self.posted = False
        self._by_span: dict[int, OrExchange] = {}  # one per communicator an aggregator spans
        self._current: OrExchange | None = None  # the pass's
        self._in_flight: OrExchange | None = None  # possibly an earlier pass's

    def begin_pass(self, aggregator: Aggregator) -> None:
        """Use the exchange over the ranks ``aggregator`` combines (shared memory on one node, else a private
        communicator): created on first use, collectively over those ranks, which all reach this step together."""
        assert aggregator.context is not None and aggregator.context.span is not None
        span = aggregator.context.span.comm
        key = span.py2f()
        found = self._by_span.get(key)
        if found is None:
            self.finish()
            found = self._by_span[key] = or_exchange(span, self._count)
        self._current = found
        self.posted = False

    def post(self, local: np.ndarray) -> None:
        """Post the bitwise-or allreduce of ``local`` (into :attr:`used`)."""
        self.finish()
        np.copyto(self.sent, local)
        assert self._current is not None, "a pass begins before it posts"
        self._current.post(self.sent, self.used)
        self._in_flight = self._current
        self.posted = True

    def finish(self) -> None:
        """Wait for the exchange in flight, if any."""
        if self._in_flight is not None:
            self._in_flight.wait()
            self._in_flight = None

    def close(self) -> None:
        """Finish and free every exchange (collective over each one's ranks)."""
        self.finish()
        for exchange in self._by_span.values():
            exchange.close()
        self._by_span = {}
        self._current = None
