"""What every compressing scheme shares: options agreed on by all ranks at setup, the buckets a scheme refuses,
error-feedback memory, per-rank checkpoint state, and the plain mean for buckets a scheme sends uncompressed.

A scheme subclasses :class:`CompressingAggregator`, names itself (``scheme``, its registry name), lists its
constructor arguments in :attr:`~CompressingAggregator.options`, and implements :meth:`~Aggregator.start`,
returning an :class:`InFlight` whose ``complete`` writes the combined gradients into the bucket when its
communication is done. Setup (collective over the aggregator's communicator) raises the same ``ValueError`` on every
rank when the ranks were given different options or when a bucket cannot be compressed by the scheme (for example
complex gradients).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from mpistrategy.aggregation.base import AggregationContext, Aggregator, GradBucket, Work
from mpistrategy.aggregation.feedback import ErrorFeedback
from mpistrategy.aggregation.mean import MeanAggregator
from mpistrategy.aggregation.options import check_flag
from mpistrategy.aggregation.rank_state import gather_rank_states, own_rank_state
from mpistrategy.aggregation.wire import HALF_DTYPES
from mpistrategy.comm.errors import by_rank

REAL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a scheme computes in for gradients of ``dtype``: float32 for half precision, else ``dtype``."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


@dataclass
class InFlight:
    """A bucket's communication in flight and what completes the bucket once it is done.

    ``complete(result)`` receives what ``pending.wait()`` returned and leaves the combined gradients in the bucket.
    """

    pending: Work
    complete: Callable[[Any], None]

    def wait(self) -> Any:
        return self.pending.wait()

    def test(self) -> bool:
        return self.pending.test()


def _nothing_more(_: Any) -> None:
    """Completion of an in-place average: the result is already in the bucket."""


class CompressingAggregator(Aggregator):
    """Base class of the compressing schemes (see the module docstring).

    Args:
        error_feedback: keep, per bucket and rank, what compression left out and add it to the next gradient
            (:mod:`~mpistrategy.aggregation.feedback`). Schemes without error feedback pass ``False``.
    """

    scheme: ClassVar[str]

    def __init__(self, error_feedback: bool = False) -> None:
        self.error_feedback = check_flag(self.scheme, "error_feedback", error_feedback)
        self.memory = ErrorFeedback()
        self._mean = MeanAggregator()
        self._loaded: dict[str, Any] | None = None

    @property
    @abstractmethod
    def options(self) -> dict[str, Any]:
        """The constructor arguments (plain values): every rank must be given the same."""

    # ------------------------------------------------------------------------------------------- setup

    def setup(self, context: AggregationContext) -> None:
        super().setup(context)
        self._mean.setup(context)
        refusals = [problem for bucket in context.buckets if (problem := self.refusal(bucket))]
        self._agree(context, refusals)
        self.memory.setup(context.buckets)
        self.prepare(context.buckets)
        if self._loaded is not None:
            state, self._loaded = self._loaded, None
            self.load_state_dict(state)

    def refusal(self, bucket: GradBucket) -> str | None:
        """Why this scheme cannot combine ``bucket``, or ``None``. By default it needs real floating-point
        gradients."""
        if bucket.buffer.dtype not in REAL_FLOATS:
            return (
                f"bucket {bucket.index} ({_names(bucket)}) holds {bucket.buffer.dtype} gradients; {self.scheme} "
                "compresses float16, bfloat16, float32 and float64 gradients only (use MeanAggregator for others)"
            )
        return None

    def prepare(self, buckets: list[GradBucket]) -> None:
        """Per-layout preparation after the checks (plans, message formats); the bucket layout may be rebuilt, and
        this called again, when parameters are unfrozen."""

    def _agree(self, context: AggregationContext, refusals: list[str]) -> None:
        """Raise the same error on every rank of ``context.comm`` when the options differ or a bucket is
        refused."""
        local = (self.options, refusals)
        comm = context.comm.comm
        everyone = comm.allgather(local) if comm.Get_size() > 1 else [local]
        if any(options != everyone[0][0] for options, _ in everyone):
            listing = by_rank(options for options, _ in everyone)
            raise ValueError(
                f"{self.scheme}: the ranks were given different options ({listing}); every rank must build the "
                "same aggregator."
            )
        problems = sorted({problem for _, theirs in everyone for problem in theirs})
        if problems:
            raise ValueError(f"{self.scheme} cannot combine these gradients: {'; '.join(problems)}.")

    # ------------------------------------------------------------------------------------------- combining

    def finish(self, bucket: GradBucket, work: InFlight) -> None:  # type: ignore[override]
        work.complete(work.wait())

    def start_mean(self, bucket: GradBucket) -> InFlight:
        """Send the bucket uncompressed: the plain in-place mean (after adding any residual the bucket still
        holds, which is then sent in full)."""
        residual = self.memory.residual(bucket)
        if residual is not None:
            bucket.buffer.add_(residual)
            self.memory.drop(bucket)
        return InFlight(self._mean.start(bucket), _nothing_more)

    def values_to_send(self, bucket: GradBucket) -> torch.Tensor:
        """A copy of the bucket's gradients in the working dtype, plus its residual with error feedback: ``p``."""
        values = bucket.buffer.to(working_dtype(bucket.buffer.dtype), copy=True)
        return self.memory.add_to(bucket, values) if self.error_feedback else values

    def sent(self, nbytes: int) -> None:
        """Record payload handed to MPI (see :meth:`AggregationContext.sent`)."""
        assert self.context is not None, f"{type(self).__name__}.setup() was not called"
        self.context.sent(nbytes)

    # ------------------------------------------------------------------------------------------- state

    @property
    def has_state(self) -> bool:
        """Whether the scheme keeps state between steps (residuals, generators, memories), given its options."""
        return self.error_feedback

    def rank_state(self) -> dict[str, Any]:
        """This rank's state (plain values and tensors)."""
        return {"residuals": self.memory.state()} if self.error_feedback else {}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`rank_state` on this rank."""
        if self.error_feedback:
            self.memory.load(state["residuals"])

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state, gathered to world rank 0 (collective over the ranks this scheme combines over:
        each of them calls it; see :mod:`~mpistrategy.aggregation.rank_state`). Empty for stateless schemes, and
        before setup or on ranks that do not take part (a hierarchy's non-leaders)."""
        if self.context is None:
            return self._loaded or {}
        if not self.has_state:
            return {}
        topology = self.context.topology
        return gather_rank_states(self.scheme, self.rank_state(), self.context.comm.comm, topology.rank, topology.size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's entry of ``state`` (a checkpoint's, holding every rank's); before setup it is kept
        and restored at setup. Raises ``ValueError`` for another scheme's state or another number of ranks."""
        if not state:
            return
        if not self.has_state:
            super().load_state_dict(state)
        if self.context is None:
            self._loaded = state
            return
        topology = self.context.topology
        self.load_rank_state(own_rank_state(self.scheme, state, topology.rank, topology.size))

    def __repr__(self) -> str:
        arguments = ", ".join(f"{key}={value!r}" for key, value in self.options.items())
        return f"{type(self).__name__}({arguments})"


def _names(bucket: GradBucket) -> str:
    shown = ", ".join(bucket.names[:3])
    return shown + (f" and {len(bucket.names) - 3} more" if len(bucket.names) > 3 else "")
