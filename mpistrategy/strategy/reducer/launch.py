"""Starting the buckets of a backward pass in index order, and finishing them.

MPI matches collectives on a communicator by order, so every rank starts the buckets in the same order: their
index. During backward a bucket whose last gradient lands waits for the buckets before it; when it may go, it and
every ready bucket after it are handed to the aggregator (non-blocking). A bucket with no parameter that requires a
gradient has nothing to send and is passed over. The buckets left when backward ends (parameters this rank did not
use) are started by :meth:`InOrderStarts.start_left`, those that must be; then :meth:`InOrderStarts.finish`
completes every started bucket in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mpistrategy.aggregation.base import Aggregator, GradBucket, Work
from mpistrategy.comm.checks import validation


class InOrderStarts:
    """The buckets of one backward pass, started in index order (see the module docstring).

    Attributes:
        aggregator: the aggregator of the current (or last) pass.
        armed: a synchronised pass is under way: landing gradients start buckets.
        started_in_backward: buckets started during backward in the current pass.
        started_at_wait: buckets started by :meth:`start_left`.
    """

    def __init__(self) -> None:
        self.aggregator: Aggregator | None = None
        self.armed = False
        self.started_in_backward = 0
        self.started_at_wait = 0
        self._buckets: Sequence[GradBucket] = ()
        self._active: Sequence[int] = ()  # per bucket: its parameters that require a gradient
        self._pending: list[int] = []  # per bucket: gradients still to land
        self._works: list[Work | None] = []
        self._next = 0  # the first bucket not started (or passed over)

    def begin(self, aggregator: Aggregator | None, buckets: Sequence[GradBucket], active: Sequence[int]) -> None:
        """Begin a pass that combines ``buckets`` with ``aggregator`` (``None``: a pass without communication,
        whose gradients only accumulate); ``active``: per bucket, how many of its parameters require a gradient
        (the gradients that complete it)."""
        self.aggregator, self.armed = aggregator, aggregator is not None
        if aggregator is None:
            return
        self._buckets, self._active = buckets, active
        self._pending = list(active)
        self._works = [None] * len(buckets)
        self._next = 0
        self.started_in_backward = self.started_at_wait = 0

    @property
    def all_started(self) -> bool:
        return self._next == len(self._buckets)

    def complete(self, index: int) -> bool:
        """Whether every gradient of bucket ``index`` landed in this pass."""
        return self._pending[index] <= 0

    def gradient_ready(self, index: int) -> bool:
        """Count a gradient of bucket ``index`` that landed; start what may start. Whether this started the last
        bucket (the pass's starts are then complete)."""
        pending = self._pending
        if not self.armed or pending[index] <= 0:
            return False
        pending[index] -= 1
        if pending[index]:
            self._progress()
            return False
        return self._start_ready()

    def _start_ready(self) -> bool:
        """Start, in order, every bucket from the next one on that is ready (or has nothing to send)."""
        count, pending, aggregator = len(self._buckets), self._pending, self.aggregator
        assert aggregator is not None, "buckets start only in an armed pass"
        with validation(False):  # the layout was agreed on once, when it was built
            while self._next < count and pending[self._next] <= 0:
                if self._active[self._next]:
                    self._works[self._next] = aggregator.start(self._buckets[self._next])
                    self.started_in_backward += 1
                self._next += 1
        return self._next == count

    def _progress(self) -> None:
        """Let the first bucket in flight advance (MPI progresses non-blocking collectives inside MPI calls)."""
        works = self._works
        for index in range(self._next):
            work = works[index]
            if work is not None:
                work.test()
                return

    def start_left(self, must_start: Callable[[int], bool]) -> None:
        """Start, in order, every bucket not started yet that has a parameter requiring a gradient and for which
        ``must_start(index)`` holds (called in index order)."""
        assert self.aggregator is not None, "buckets start only in a pass"
        for index in range(self._next, len(self._buckets)):
            if self._active[index] and must_start(index):
                self._works[index] = self.aggregator.start(self._buckets[index])
                self.started_at_wait += 1
        self._next = len(self._buckets)

    def finish(self) -> None:
        """Finish every started bucket, in order."""
        assert self.aggregator is not None, "buckets finish only in a pass"
        for index, work in enumerate(self._works):
            if work is not None:
                self.aggregator.finish(self._buckets[index], work)
        self._works = [None] * len(self._buckets)
