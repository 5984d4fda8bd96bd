"""A tensor-parallel (Megatron-style) MLP built on mpistrategy's differentiable collectives.

Layers, for ``P`` ranks of a communicator:

- :class:`ColumnParallelLinear` holds rows ``[r*out/P, (r+1)*out/P)`` of the dense weight (and bias): the input is
  replicated, the output is this rank's slice of the features. ``copy_to_parallel`` (identity forward,
  allreduce-sum backward) puts the replicated input on the graph so each rank's partial input gradient is summed.
- :class:`RowParallelLinear` holds columns ``[r*in/P, (r+1)*in/P)`` of the dense weight: its input is a feature
  slice (what a column-parallel layer produced), each rank computes a partial product, and ``reduce_from_parallel``
  (allreduce-sum forward, identity backward) sums them into the replicated output; the bias is replicated and
  added once after the sum.

:class:`TensorParallelMLP` alternates them (column, ReLU, row), so only one allreduce per block is needed in each
direction. Built from a dense ``nn.Sequential`` of Linear/ReLU layers (:meth:`TensorParallelMLP.from_dense`), it
computes the same function and, with the loss counted once (every rank holds the same replicated logits), every
rank's parameter gradients are exactly the matching slices of the dense model's gradients: training with
``P`` ranks equals training the dense model in one process. :meth:`TensorParallelMLP.to_dense` gathers it back.

:class:`TensorParallelMLPClassifier` is the LightningModule (``model=tp_mlp``): every rank sees the same batches;
its checkpoints hold the *dense* weights (gathered on save, sliced on load), so they load into the single-process
:class:`mpistrategy.recipes.models.MLPClassifier` and back.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpistrategy as ms
from mpistrategy.recipes.models import ClassifierModule, OptimizerFactory, SchedulerFactory, mlp


def _split(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) must be divisible by the number of tensor-parallel ranks ({parts})")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """``y[:, slice_r] = x @ W[slice_r].T + b[slice_r]`` on rank r: replicated input, feature-sharded output."""

    split_across_ranks = True  # its parameters are this rank's own: data-parallel mpi_ad refuses the module

    def __init__(self, in_features: int, out_features: int, comm: MPI.Comm | None = None, bias: bool = True) -> None:
        super().__init__()
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.in_features, self.out_features = in_features, out_features
        self.local_out = _split(out_features, self.size, "out_features of a column-parallel layer")
        self.weight = nn.Parameter(torch.empty(self.local_out, in_features))
        self.bias = nn.Parameter(torch.empty(self.local_out)) if bias else None
        self._init_like_linear()

    def _init_like_linear(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def rows(self) -> slice:
        return slice(self.rank * self.local_out, (self.rank + 1) * self.local_out)

    def load_dense(self, linear: nn.Linear) -> None:
        with torch.no_grad():
            self.weight.copy_(linear.weight[self.rows])
            if self.bias is not None:
                self.bias.copy_(linear.bias[self.rows])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(ms.copy_to_parallel(x, self.comm), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features} (this rank: {self.local_out}), ranks={self.size}"


class RowParallelLinear(nn.Module):
    """``y = sum_r x[:, slice_r] @ W[:, slice_r].T + b``: feature-sharded input, replicated output."""

    split_across_ranks = True  # its parameters are this rank's own: data-parallel mpi_ad refuses the module

    def __init__(self, in_features: int, out_features: int, comm: MPI.Comm | None = None, bias: bool = True) -> None:
        super().__init__()
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.in_features, self.out_features = in_features, out_features
        self.local_in = _split(in_features, self.size, "in_features of a row-parallel layer")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def columns(self) -> slice:
        return slice(self.rank * self.local_in, (self.rank + 1) * self.local_in)

    def load_dense(self, linear: nn.Linear) -> None:
        with torch.no_grad():
            self.weight.copy_(linear.weight[:, self.columns])
            if self.bias is not None:
                self.bias.copy_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ms.reduce_from_parallel(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in={self.in_features} (this rank: {self.local_in}), out={self.out_features}, ranks={self.size}"


class TensorParallelMLP(nn.Module):
    """Blocks of (column-parallel, ReLU, row-parallel) with ReLU between blocks: the tensor-parallel version of
    ``mpistrategy.recipes.models.mlp(in_features, hidden, 2 * depth - 1, num_classes)``.

    The dense twin of ``depth`` blocks is ``nn.Sequential(Linear(in, h), ReLU, Linear(h, h), ReLU, ..., Linear(h,
    classes))`` with ``2 * depth`` Linear layers: odd layers column-parallel, even ones row-parallel.
    """

    def __init__(
        self, in_features: int, hidden: int, depth: int, num_classes: int, comm: MPI.Comm | None = None
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"model.depth must be at least 1, got {depth}")
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        layers: list[nn.Module] = []
        width = in_features
        for block in range(depth):
            last = block == depth - 1
            layers += [
                ColumnParallelLinear(width, hidden, self.comm),
                nn.ReLU(),
                RowParallelLinear(hidden, num_classes if last else hidden, self.comm),
            ]
            if not last:
                layers.append(nn.ReLU())
            width = hidden
        self.layers = nn.Sequential(*layers)
        self.dims = (in_features, hidden, depth, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    @staticmethod
    def dense_twin(in_features: int, hidden: int, depth: int, num_classes: int) -> nn.Sequential:
        """The single-process model this one equals (same layer order, same initialisation scheme)."""
        return mlp(in_features, hidden, 2 * depth - 1, num_classes)

    def parallel_layers(self) -> list[ColumnParallelLinear | RowParallelLinear]:
        return [m for m in self.layers if isinstance(m, ColumnParallelLinear | RowParallelLinear)]

    def load_dense(self, dense: nn.Sequential) -> TensorParallelMLP:
        """Take this rank's slices of the dense twin's weights (every rank passes the same dense model)."""
        linears = [m for m in dense if isinstance(m, nn.Linear)]
        mine = self.parallel_layers()
        if len(linears) != len(mine):
            raise ValueError(f"the dense model has {len(linears)} Linear layers, this one needs {len(mine)}")
        for layer, linear in zip(mine, linears, strict=True):
            layer.load_dense(linear)
        return self

    @classmethod
    def from_dense(cls, dense: nn.Sequential, comm: MPI.Comm | None = None) -> TensorParallelMLP:
        linears = [m for m in dense if isinstance(m, nn.Linear)]
        depth = len(linears) // 2
        model = cls(linears[0].in_features, linears[0].out_features, depth, linears[-1].out_features, comm)
        return model.load_dense(dense)

    # -- dense <-> sharded state -------------------------------------------------------------------------------
    def dense_state(self) -> list[torch.Tensor]:
        """Collective: the dense twin's Linear weights and biases, ``[w0, b0, w1, b1, ...]``, on every rank."""
        comm = self.comm
        out: list[torch.Tensor] = []
        for layer in self.parallel_layers():
            w = layer.weight.detach()
            if isinstance(layer, ColumnParallelLinear):
                out.append(torch.cat(comm.allgather(w), dim=0))
                out.append(torch.cat(comm.allgather(layer.bias.detach()), dim=0))
            else:
                out.append(torch.cat(comm.allgather(w), dim=1))
                out.append(layer.bias.detach().clone())
        return out

    def to_dense(self) -> nn.Sequential:
        """Collective: the equivalent single-process ``nn.Sequential`` (a copy)."""
        dense = self.dense_twin(*self.dims)
        tensors = iter(self.dense_state())
        with torch.no_grad():
            for linear in (m for m in dense if isinstance(m, nn.Linear)):
                linear.weight.copy_(next(tensors))
                linear.bias.copy_(next(tensors))
        return dense


class TensorParallelMLPClassifier(ClassifierModule):
    """``model=tp_mlp``: the tensor-parallel MLP as a LightningModule, sharded over ``MPI.COMM_WORLD``.

    Initialisation: every rank builds the dense twin with the same seed and keeps its slices, so the model starts
    exactly where ``MLPClassifier(in_features, hidden, 2 * depth - 1, num_classes)`` starts in one process.
    Checkpoints store the dense twin's state dict under ``net_dense.*`` keys plus each rank's optimizer state.
    """

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 128,
        depth: int = 1,
        num_classes: int = 10,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__(num_classes, optimizer, scheduler)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        dense = TensorParallelMLP.dense_twin(in_features, hidden, depth, num_classes)
        self.net = TensorParallelMLP.from_dense(dense)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        gather_model_parallel_state(self, checkpoint, self.net.dense_state())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        dense = TensorParallelMLP.dense_twin(*self.net.dims)
        tensors = iter(checkpoint.pop("dense_state"))
        with torch.no_grad():
            for linear in (m for m in dense if isinstance(m, nn.Linear)):
                linear.weight.copy_(next(tensors))
                linear.bias.copy_(next(tensors))
        shard = TensorParallelMLP.from_dense(dense, self.net.comm)
        prefix = "net."
        state = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(prefix)}
        state.update({prefix + k: v for k, v in shard.state_dict().items()})
        checkpoint["state_dict"] = state
        restore_rank_optimizer_state(checkpoint)


def gather_model_parallel_state(module: nn.Module, checkpoint: dict[str, Any], dense_state: list[torch.Tensor]) -> None:
    """Collective (``dump_checkpoint`` runs on every rank): put the dense weights and every rank's optimizer state
    into the checkpoint rank 0 writes."""
    checkpoint["dense_state"] = dense_state
    states = checkpoint.get("optimizer_states")
    if states is not None:
        checkpoint["optimizer_states_per_rank"] = MPI.COMM_WORLD.allgather(states)


def restore_rank_optimizer_state(checkpoint: dict[str, Any]) -> None:
    per_rank = checkpoint.pop("optimizer_states_per_rank", None)
    if per_rank is not None:
        rank = MPI.COMM_WORLD.Get_rank()
        if rank >= len(per_rank):
            raise ValueError(
                f"the checkpoint was written by {len(per_rank)} model-parallel ranks; this job has more: resume with "
                "the same number of ranks"
            )
        checkpoint["optimizer_states"] = per_rank[rank]
