"""A pipeline-parallel MLP: one stage per rank, joined by mpistrategy's differentiable ``send``/``recv``.

The dense twin is ``mpistrategy.recipes.models.mlp(in_features, hidden, P * layers_per_stage - 1, num_classes)``: ``P *
layers_per_stage`` Linear layers with ReLU between them. Stage ``r`` (rank ``r``) holds Linear layers
``[r * k, (r + 1) * k)`` (``k = layers_per_stage``), the last stage also the classification head.

One training step (GPipe schedule, all forwards then one backward):

- the batch is cut into ``micro_batches`` pieces; stage 0 runs each through its layers and sends the activation
  to stage 1 (``send``), which receives it (``recv``; the received tensor requires grad), runs its layers and sends
  on, and so on;
- the last stage computes the loss of each micro-batch, weighted by its share of the batch, and sums them;
- backward: the last stage's ``loss.backward()`` sends each activation gradient back (``recv``'s adjoint);
  the other stages run backward through the :class:`~mpistrategy.Placeholder` their ``send`` returned
  (``send``'s adjoint receives the gradient from the next stage) - Lightning's ``loss.backward()`` does this,
  because the value returned by :meth:`PipelineMLP.forward_backward_loss` on those stages is ``0 + placeholders``.

Under the sum-of-losses convention (``L = sum_r L_r`` with only the last stage's ``L_r`` non-zero) the gradients on
every stage are exactly the dense twin's gradients for that stage's layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import mpistrategy as ms
from mpistrategy.recipes.models import ClassifierModule, OptimizerFactory, SchedulerFactory, mlp
from mpistrategy.recipes.tensor_parallel import gather_model_parallel_state, restore_rank_optimizer_state

ACTIVATION_TAG = 7


class PipelineMLP(nn.Module):
    """This rank's stage of the pipeline MLP over ``comm`` (default ``MPI.COMM_WORLD``)."""

    split_across_ranks = True  # its parameters are this rank's own: data-parallel mpi_ad refuses the module

    def __init__(
        self,
        in_features: int,
        hidden: int,
        layers_per_stage: int,
        num_classes: int,
        comm: MPI.Comm | None = None,
        dense: nn.Sequential | None = None,
    ) -> None:
        super().__init__()
        if layers_per_stage < 1:
            raise ValueError(f"model.layers_per_stage must be at least 1, got {layers_per_stage}")
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.dims = (in_features, hidden, layers_per_stage, num_classes)
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        dense = (
            dense
            if dense is not None
            else self.dense_twin(in_features, hidden, layers_per_stage, num_classes, self.size)
        )
        linears = [m for m in dense if isinstance(m, nn.Linear)]
        if len(linears) != self.size * layers_per_stage:
            raise ValueError(
                f"the dense model has {len(linears)} Linear layers, {self.size} stages need "
                f"{self.size * layers_per_stage}"
            )
        mine = linears[self.rank * layers_per_stage : (self.rank + 1) * layers_per_stage]
        layers: list[nn.Module] = []
        for i, linear in enumerate(mine):
            copy = nn.Linear(linear.in_features, linear.out_features)
            copy.load_state_dict(linear.state_dict())
            layers.append(copy)
            if not (self.last and i == len(mine) - 1):
                layers.append(nn.ReLU())
        self.stage = nn.Sequential(*layers)

    @staticmethod
    def dense_twin(
        in_features: int, hidden: int, layers_per_stage: int, num_classes: int, stages: int
    ) -> nn.Sequential:
        """The single-process model this pipeline equals."""
        return mlp(in_features, hidden, stages * layers_per_stage - 1, num_classes)

    def _micro(self, tensor: torch.Tensor | None, parts: int) -> list[Any]:
        return list(torch.tensor_split(tensor, parts)) if tensor is not None else [None] * parts

    def forward_backward_loss(
        self, x: torch.Tensor | None, y: torch.Tensor | None, micro_batches: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the forward of every micro-batch through this stage.

        Returns ``(loss, logits)``: on the last stage the batch's mean cross-entropy and the logits; on the others
        a zero-valued scalar that carries the sends' placeholders (call ``.backward()`` on it on every stage) and
        ``None``. ``x`` is needed on the first stage, ``y`` on the last.
        """
        batch = None
        if self.first:
            assert x is not None, "the first stage needs the inputs"
            batch = x.shape[0]
        if self.last:
            assert y is not None, "the last stage needs the labels"
            batch = y.shape[0]
        parts = max(1, int(micro_batches))
        xs, ys = self._micro(x if self.first else None, parts), self._micro(y if self.last else None, parts)
        placeholders = []
        losses, logits = [], []
        for i in range(parts):
            h = xs[i] if self.first else ms.recv(self.rank - 1, tag=ACTIVATION_TAG, comm=self.comm)
            h = self.stage(h)
            if not self.last:
                placeholders.append(ms.send(h, self.rank + 1, tag=ACTIVATION_TAG, comm=self.comm))
            else:
                logits.append(h)
                losses.append(F.cross_entropy(h, ys[i], reduction="sum"))
        if self.last:
            return torch.stack(losses).sum() / batch, torch.cat(logits)
        total = torch.zeros(())
        for p in placeholders:
            total = total + p
        return total, None

    def forward(self, x: torch.Tensor | None, micro_batches: int = 1) -> torch.Tensor | None:
        """Inference: the logits on the last stage, ``None`` elsewhere."""
        parts = max(1, int(micro_batches))
        xs = self._micro(x if self.first else None, parts)
        out = []
        for i in range(parts):
            h = xs[i] if self.first else ms.recv(self.rank - 1, tag=ACTIVATION_TAG, comm=self.comm)
            h = self.stage(h)
            if self.last:
                out.append(h)
            else:
                ms.send(h, self.rank + 1, tag=ACTIVATION_TAG, comm=self.comm)
        return torch.cat(out) if self.last else None

    # -- dense <-> staged state ----------------------------------------------------------------------------------
    def dense_state(self) -> list[torch.Tensor]:
        """Collective: ``[w0, b0, w1, b1, ...]`` of the dense twin, on every rank."""
        mine = [t.detach() for m in self.stage if isinstance(m, nn.Linear) for t in (m.weight, m.bias)]
        return [t for stage in self.comm.allgather(mine) for t in stage]

    def to_dense(self) -> nn.Sequential:
        dense = self.dense_twin(*self.dims, self.size)
        tensors = iter(self.dense_state())
        with torch.no_grad():
            for linear in (m for m in dense if isinstance(m, nn.Linear)):
                linear.weight.copy_(next(tensors))
                linear.bias.copy_(next(tensors))
        return dense


class PipelineMLPClassifier(ClassifierModule):
    """``model=pipeline_mlp``: one pipeline stage per rank of ``MPI.COMM_WORLD``; every rank sees the same batches.

    The last stage's logits and loss are broadcast (detached) so every rank logs the same values; checkpoints
    hold the dense twin's weights (``dense_state``) and each rank's optimizer state.
    """

    def __init__(
        self,
        in_features: int = 64,
        hidden: int = 128,
        layers_per_stage: int = 1,
        num_classes: int = 10,
        micro_batches: int = 2,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__(num_classes, optimizer, scheduler)
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.micro_batches = micro_batches
        self.net = PipelineMLP(in_features, hidden, layers_per_stage, num_classes)

    def _shared(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """The last stage's (detached) tensor on every rank."""
        with torch.no_grad():
            return ms.broadcast(tensor.detach() if tensor is not None else None, root=self.net.size - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._shared(self.net(x, self.micro_batches))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss, logits = self.net.forward_backward_loss(x, y, self.micro_batches)
        shared_logits = self._shared(logits)
        shared_loss = self._shared(loss if self.net.last else None)
        self.train_acc(shared_logits, y)
        self.log("train/loss", shared_loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def loss_and_logits(self, batch):
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits, y), logits, y

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        gather_model_parallel_state(self, checkpoint, self.net.dense_state())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        dense = PipelineMLP.dense_twin(*self.net.dims, self.net.size)
        tensors = iter(checkpoint.pop("dense_state"))
        with torch.no_grad():
            for linear in (m for m in dense if isinstance(m, nn.Linear)):
                linear.weight.copy_(next(tensors))
                linear.bias.copy_(next(tensors))
        staged = PipelineMLP(*self.net.dims, comm=self.net.comm, dense=dense)
        prefix = "net."
        state = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(prefix)}
        state.update({prefix + k: v for k, v in staged.state_dict().items()})
        checkpoint["state_dict"] = state
        restore_rank_optimizer_state(checkpoint)
