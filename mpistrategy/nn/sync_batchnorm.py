"""Batch normalisation with statistics over the global batch, built on the differentiable allgather.

In training mode the per-channel mean and variance are those of the concatenation of every rank's batch. Each
rank r computes, per channel, its count ``n_r``, mean ``mu_r`` and centred sum of squares
``M2_r = sum_i (x_i - mu_r)**2`` (in float64 for float32 and narrower inputs). One :func:`mpistrategy.allgather`
gives every rank all ranks' ``(n_r, mu_r, M2_r)`` (``1 + 2C`` numbers per rank), which every rank combines alike
with Chan et al.'s parallel formula, summed over the ranks::

    N = sum_r n_r,    mu = sum_r n_r * mu_r / N,    M2 = sum_r (M2_r + n_r * (mu_r - mu)**2),    var = M2 / N

(the pairwise update ``M2_AB = M2_A + M2_B + (mu_B - mu_A)**2 * n_A * n_B / (n_A + n_B)`` applied over all ranks
gives the same sum). Only deviations from a mean are squared, never the raw values, so the variance keeps its
precision for data whose mean is large against its spread (``E[x**2] - mu**2`` would cancel). Every rank combines
the same gathered numbers in the same way, so all get the same bits. A rank with an empty batch contributes
``n_r = 0``. Because the allgather is differentiable (its backward is a reduce-scatter sum of the cotangents), the
gradients through the statistics come out right with no hand-written backward: with the global objective the sum
of every rank's loss, rank r's input gets ``sum_s dL_s/dx_r``.

Training with N ranks and per-rank batch b therefore matches ``torch.nn.BatchNorm*d`` on one process with the
batch of N*b: the same outputs, gradients (after the strategy averages them) and running statistics (updated
with the unbiased global variance ``M2 / (N - 1)``). In eval mode, or with ``track_running_stats`` and running
statistics in use, it is plain batch norm and communicates nothing.

An input that fails the layer's checks (fewer than 2 dimensions, another number of channels) on some ranks only
raises on every rank (with validation on, see :mod:`mpistrategy.comm.checks`): the failing rank folds its error
into the argument check of the allgather the others make, so it raises its own error and they raise a
:class:`~mpistrategy.comm.errors.CommunicationError` naming it. No rank has communicated, so the ranks stay in
step and the next forward works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mpistrategy.collectives.gather import allgather
from mpistrategy.comm.calls import leave
from mpistrategy.comm.checks import agree, attempt
from mpistrategy.comm.communicator import Communicator, resolve


class SyncBatchNorm(_BatchNorm):
    """Drop-in replacement for ``nn.BatchNorm1d/2d/3d`` whose batch statistics span all ranks of ``comm``.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``.
        comm: the ranks that share statistics (default: the world). Every rank of it must run the layer the same
            number of times in training mode (a rank with an empty batch still takes part).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        comm: MPI.Comm | Communicator | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.comm = comm

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), got {input.dim()}.")

    def _check_input(self, input: torch.Tensor) -> None:
        """Raise unless ``input`` has the shape ``(N, num_features, ...)``."""
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm: expected {self.num_features} channels, got input of shape {tuple(input.shape)}."
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats:
            self._check_input(input)
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        comm = resolve(self.comm)
        _, problem = attempt(self._check_input, input)
        if problem is not None:
            _fail_together(problem, comm)
        mean, var, total = _global_stats(input, comm)
        if self.training and self.track_running_stats:
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
            self._update_running_stats(mean.detach(), var.detach(), total)
        shape = [1, -1] + [1] * (input.dim() - 2)
        out = (input - mean.to(input.dtype).view(shape)) * torch.rsqrt(var.to(input.dtype) + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, total: float) -> None:
        assert self.running_mean is not None and self.running_var is not None  # track_running_stats
        if self.momentum is None:
            assert self.num_batches_tracked is not None
            factor = 1.0 / float(self.num_batches_tracked)
        else:
            factor = self.momentum
        unbiased = var * (total / (total - 1)) if total > 1 else var
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, comm: MPI.Comm | Communicator | None = None) -> nn.Module:
        """Replace every ``_BatchNorm`` layer in ``module`` by a :class:`SyncBatchNorm` sharing its parameters and
        buffers (the same tensor objects, so optimizers and state dicts are unaffected)."""
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(
                module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, comm=comm
            )
            _share_state(module, converted)
            converted._mpistrategy_original_type = type(module)  # type: ignore[assignment]  # torch: any value
            converted.training = module.training
            result: nn.Module = converted
        else:
            result = module
        for name, child in module.named_children():
            result.add_module(name, cls.convert_sync_batchnorm(child, comm))
        return result

    @classmethod
    def revert_sync_batchnorm(cls, module: nn.Module) -> nn.Module:
        """Undo :meth:`convert_sync_batchnorm`: each :class:`SyncBatchNorm` becomes its original class again."""
        if isinstance(module, cls):
            original = getattr(module, "_mpistrategy_original_type", nn.BatchNorm2d)
            reverted = original(
                module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
            )
            _share_state(module, reverted)
            reverted.training = module.training
            result: nn.Module = reverted
        else:
            result = module
        for name, child in module.named_children():
            result.add_module(name, cls.revert_sync_batchnorm(child))
        return result


def _share_state(source: _BatchNorm, target: _BatchNorm) -> None:
    with torch.no_grad():
        if source.affine:
            target.weight = source.weight
            target.bias = source.bias
        target.running_mean = source.running_mean
        target.running_var = source.running_var
        target.num_batches_tracked = source.num_batches_tracked
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig


def _fail_together(problem: Exception, comm: Communicator) -> None:
    """Raise ``problem``, this rank's failed input check, on every rank of ``comm``: in place of the statistics'
    allgather, whose argument check on the other ranks meets this one (:func:`~mpistrategy.comm.checks.agree`
    always raises when given a problem). With validation off, or on one rank, it raises here only."""
    try:
        agree(comm, "SyncBatchNorm", (), "input", problem)
    finally:
        leave()  # the call log's duration of the call agree() entered, as every op's wrapper does


def _global_stats(input: torch.Tensor, comm: Communicator) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Per-channel mean and biased variance over every rank's batch, differentiable; and the global count.

    Every rank's ``(n_r, mu_r, M2_r)`` per channel, gathered, combined by Chan et al.'s formula (module docstring).
    """
    channels = input.shape[1]
    stat_dtype = torch.float64 if input.dtype in (torch.float32, torch.float16, torch.bfloat16) else input.dtype
    x = input.transpose(0, 1).reshape(channels, -1).to(stat_dtype)
    count = x.shape[1]
    if count:
        local_mean = x.mean(dim=1)
        local_m2 = ((x - local_mean.unsqueeze(1)) ** 2).sum(dim=1)
    else:  # zeros, still on the input's autograd path (x.mean would be nan)
        local_mean = local_m2 = x.sum(dim=1)
    n = torch.full((1,), float(count), dtype=stat_dtype, device=input.device)
    packed = torch.cat([n, local_mean, local_m2]).unsqueeze(0)
    rows = allgather(packed, 0, comm) if comm.size > 1 else packed  # row r: rank r's (n_r, mu_r, M2_r)
    counts, means, m2s = rows[:, :1], rows[:, 1 : 1 + channels], rows[:, 1 + channels :]
    total = float(counts.detach().sum())
    if total == 0:
        raise ValueError("SyncBatchNorm: every rank's batch is empty, so the batch statistics are undefined.")
    mean = (counts * means).sum(dim=0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(dim=0)
    return mean, m2 / total, total
