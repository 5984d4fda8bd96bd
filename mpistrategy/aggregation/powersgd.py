"""PowerSGD: rank-``r`` gradient compression by one step of subspace iteration (Vogels et al. 2019), with the
compression test, warm start, error feedback and ``start_iter`` of torch's ``powerSGD_hook``.

Every parameter of a bucket is a matrix ``M`` of ``n = shape[0]`` rows and ``m = numel / n`` columns. It is
compressed when it has at least two dimensions and passes torch's test ``(n + m) * r' * min_compression_rate < n * m``
with ``r' = min(r, n, m)``; the others (biases, small or square-ish matrices) are averaged exactly. Per round, on
every rank, for each compressed ``M`` (plus its residual ``e``, error feedback)::

    Q <- orthogonalise(Q)      Q (m x r') is the previous round's (warm start) or standard normal from a generator
                               seeded alike on every rank
    P = (M + e) Q              allreduce-mean P, together with the uncompressed values (one message)
    P <- orthogonalise(P)
    Q = (M + e)^T P            allreduce-mean Q (a second message)
    combined = P Q^T           = P P^T mean_r(M_r + e_r): the mean projected onto r' directions
    e <- (M + e) - P Q^T       this rank's residual (the paper's Algorithm 2)

Orthogonalising gives the Gram-Schmidt basis of the columns (computed by Householder QR, with the signs Gram-Schmidt
gives, so that vanishing columns need no epsilon). At full rank (``r' = min(n, m)``, ``min_compression_rate=0``)
``P P^T`` is the identity on the span of the mean, and the result is the mean. Before round ``start_iter`` every
bucket is averaged plainly, no residual kept (compressing the first, large gradients hurts accuracy most). A
rank's payload per round is ``(sum n r' + sum m r' + uncompressed numel) * itemsize``: for the MLP 784-1024-1024-10 at
rank 1, 0.4% of the dense mean's. Compute and wire dtype are float32 for half-precision buckets.

A round is one combination of the buckets (one backward with synchronisation): a bucket started whose index is not
above the previous one's begins a new round, as torch counts iterations per backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mpistrategy.aggregation.base import GradBucket
from mpistrategy.aggregation.compression import CompressingAggregator, InFlight
from mpistrategy.aggregation.options import check_flag, check_integer, check_number
from mpistrategy.collectives.reduction import allreduce, iallreduce


@dataclass(frozen=True)
class Matrix:
    """A compressed parameter: where its gradient sits in the bucket, its matrix shape and rank."""

    name: str
    offset: int
    rows: int
    cols: int
    rank: int

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter's ``rows x cols`` view of the flat bucket ``flat``."""
        return flat[self.offset : self.offset + self.rows * self.cols].view(self.rows, self.cols)


@dataclass
class Plan:
    """How one bucket is sent: its compressed matrices, and the (offset, numel) runs averaged exactly."""

    matrices: list[Matrix] = field(default_factory=list)
    exact: list[tuple[int, int]] = field(default_factory=list)

    @property
    def exact_numel(self) -> int:
        return sum(numel for _, numel in self.exact)


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """torch's test: the ``n x m`` matrix is compressed when ``(n + m) * rank * min_compression_rate < n * m``."""
    return (rows + cols) * rank * min_compression_rate < rows * cols


def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
    """Replace the columns of ``matrix`` (``k x r``, ``r <= k``) in place by their Gram-Schmidt orthonormal basis."""
    q, r = torch.linalg.qr(matrix)
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(matrix.dtype)
    return matrix.copy_(q * signs)


class PowerSGD(CompressingAggregator):
    """Low-rank gradient compression (see the module docstring).

    Args:
        rank: ``r``, the approximation rank (1-4 are typical).
        start_iter: rounds of plain averaging before compression starts (torch's ``start_powerSGD_iter``; torch
            defaults to 1000 for long trainings, 10% of the steps is its advice).
        min_compression_rate: compress a matrix only if it shrinks at least this much (torch's default 2).
        warm_start: start each round's power iteration from the previous round's ``Q`` (else a fresh random one).
        error_feedback: keep each rank's approximation error and add it to the next gradient.
        seed: seed of the generator for the initial ``Q``, the same on every rank.
    """

    scheme = "powersgd"

    def __init__(
        self,
        rank: int = 1,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        error_feedback: bool = True,
        seed: int = 0,
    ) -> None:
        self.rank = check_integer(self.scheme, "rank", rank, 1, meaning="the approximation rank")
        self.start_iter = check_integer(self.scheme, "start_iter", start_iter, 0, meaning="rounds of plain averaging")
        self.min_compression_rate = check_number(self.scheme, "min_compression_rate", min_compression_rate, 0.0)
        self.warm_start = check_flag(self.scheme, "warm_start", warm_start)
        self.seed = check_integer(self.scheme, "seed", seed, 0)
        super().__init__(error_feedback)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.iteration = 0
        self._previous_index = -1
        self.q_memory: dict[str, torch.Tensor] = {}
        self._plans: dict[int, Plan] = {}

    @property
    def options(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "start_iter": self.start_iter,
            "min_compression_rate": self.min_compression_rate,
            "warm_start": self.warm_start,
            "error_feedback": self.error_feedback,
            "seed": self.seed,
        }

    # ------------------------------------------------------------------------------------------- layout

    def prepare(self, buckets: list[GradBucket]) -> None:
        self._plans = {bucket.index: self.plan(bucket) for bucket in buckets}

    def plan(self, bucket: GradBucket) -> Plan:
        """Which of the bucket's parameters are compressed (the test above) and which are averaged exactly."""
        plan = Plan()
        for name, param, offset, numel in zip(bucket.names, bucket.params, bucket.offsets, bucket.numels, strict=True):
            if param.dim() >= 2 and numel:
                rows, cols = param.shape[0], numel // param.shape[0]
                rank = min(self.rank, rows, cols)
                if should_compress(rows, cols, rank, self.min_compression_rate):
                    plan.matrices.append(Matrix(name, offset, rows, cols, rank))
                    continue
            plan.exact.append((offset, numel))
        return plan

    # ------------------------------------------------------------------------------------------- rounds

    def start(self, bucket: GradBucket) -> InFlight:
        if bucket.index <= self._previous_index:
            self.iteration += 1
        self._previous_index = bucket.index
        plan = self._plans[bucket.index]
        if self.iteration < self.start_iter or not plan.matrices:
            return self.start_mean(bucket)
        assert self.context is not None
        values = self.values_to_send(bucket)
        dtype = values.dtype
        sizes = [plan.exact_numel] + [matrix.rows * matrix.rank for matrix in plan.matrices]
        message = torch.empty(sum(sizes), dtype=dtype, device=values.device)
        exact, *ps = message.split(sizes)
        if plan.exact:
            torch.cat([values[offset : offset + numel] for offset, numel in plan.exact], out=exact)
        ps = [p.view(matrix.rows, matrix.rank) for p, matrix in zip(ps, plan.matrices, strict=True)]
        for matrix, p in zip(plan.matrices, ps, strict=True):
            torch.matmul(matrix.of(values), self._initial_q(matrix, dtype, values.device), out=p)
        self.sent(message.nbytes)
        with torch.no_grad():
            handle = iallreduce(message, "avg", self.context.comm, out=message)
        return InFlight(handle, lambda _: self._project(bucket, plan, values, exact, ps))

    def _initial_q(self, matrix: Matrix, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The orthogonalised starting ``Q`` (``cols x rank``): the previous round's with warm start, else random."""
        q = self.q_memory.get(matrix.name) if self.warm_start else None
        if q is None or q.shape != (matrix.cols, matrix.rank):
            q = torch.randn(matrix.cols, matrix.rank, generator=self.generator, dtype=dtype).to(device)
        return orthogonalize(q.to(dtype=dtype, device=device, copy=True))

    def _project(
        self, bucket: GradBucket, plan: Plan, values: torch.Tensor, exact: torch.Tensor, ps: list[torch.Tensor]
    ) -> None:
        """Second half of a round, once the Ps and exact values are averaged: the Qs, the approximations, the
        residuals."""
        assert self.context is not None
        for (offset, numel), mean in zip(plan.exact, exact.split([n for _, n in plan.exact]), strict=True):
            bucket.buffer[offset : offset + numel] = mean
        qs = torch.empty(sum(m.cols * m.rank for m in plan.matrices), dtype=values.dtype, device=values.device)
        qs_by_matrix = [
            q.view(m.cols, m.rank)
            for q, m in zip(qs.split([m.cols * m.rank for m in plan.matrices]), plan.matrices, strict=True)
        ]
        for matrix, p, q in zip(plan.matrices, ps, qs_by_matrix, strict=True):
            orthogonalize(p)
            torch.matmul(matrix.of(values).T, p, out=q)
        self.sent(qs.nbytes)
        with torch.no_grad():
            allreduce(qs, "avg", self.context.comm, out=qs)
        for matrix, p, q in zip(plan.matrices, ps, qs_by_matrix, strict=True):
            approximation = p @ q.T
            matrix.of(bucket.buffer).copy_(approximation)
            if self.error_feedback:
                matrix.of(values).sub_(approximation)
            if self.warm_start:
                self.q_memory[matrix.name] = q
        if self.error_feedback:
            for offset, numel in plan.exact:
                values[offset : offset + numel] = 0
            self.memory.keep(bucket, values)

    # ------------------------------------------------------------------------------------------- state

    @property
    def has_state(self) -> bool:
        return True

    def rank_state(self) -> dict[str, Any]:
        return {
            **super().rank_state(),
            "iteration": self.iteration,
            "previous_index": self._previous_index,
            "generator": self.generator.get_state(),
            "q_memory": {name: q.clone() for name, q in self.q_memory.items()},
        }

    def load_rank_state(self, state: dict[str, Any]) -> None:
        super().load_rank_state(state)
        self.iteration = int(state["iteration"])
        self._previous_index = int(state["previous_index"])
        self.generator.set_state(state["generator"])
        self.q_memory = {name: q.clone() for name, q in state["q_memory"].items()}
