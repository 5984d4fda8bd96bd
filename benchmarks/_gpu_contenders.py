"""The GPU benchmark's workload (a transformer encoder on synthetic tokens) and its contenders, each a function
``run(steps) -> {"step": [seconds], ...}`` that trains a fresh model for ``steps`` steps on this rank's device."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
from _launch import QUIET_TRAINER, shared_port
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpistrategy  # registers "mpi_ad"
from mpistrategy.aggregation import build_aggregator
from mpistrategy.comm.cuda_ipc import VARIABLE as CUDA_IPC
from mpistrategy.strategy import MPIADStrategy

VOCAB = 32
CLASSES = 10
LR = 0.01
MOMENTUM = 0.9
PHASES = ("device_to_host", "mpi", "host_to_device")
MIXED_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

Run = Callable[[int], dict[str, list[float]]]


@dataclass(frozen=True)
class Workload:
    """What every contender trains: the model's shape, the batch per rank, the precision and the device."""

    layers: int
    d_model: int
    heads: int
    seq: int
    batch: int
    precision: str
    device: torch.device

    def model(self) -> nn.Module:
        """A fresh encoder on the device, the same parameters on every rank and in every contender (seed 0)."""
        torch.manual_seed(0)
        with self.device:
            return Encoder(self)

    def dataset(self, steps: int, replicas: int) -> TensorDataset:
        """``steps`` batches for each of ``replicas`` ranks: token ids (batch, seq) and class labels, on the host."""
        g = torch.Generator().manual_seed(1)
        samples = self.batch * steps * replicas
        tokens = torch.randint(0, VOCAB, (samples, self.seq), generator=g)
        return TensorDataset(tokens, torch.randint(0, CLASSES, (samples,), generator=g))

    def clock(self) -> float:
        """Seconds on a monotonic clock once the device has finished the work queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class Encoder(nn.Module):
    """Token embedding (32 ids), ``layers`` (post-norm) ``nn.TransformerEncoderLayer`` (feed-forward 4 x d_model,
    no dropout), mean over the sequence, a linear head to 10 classes."""

    def __init__(self, shape: Workload) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, shape.d_model)
        layer = nn.TransformerEncoderLayer(shape.d_model, shape.heads, 4 * shape.d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, shape.layers, enable_nested_tensor=False)
        self.head = nn.Linear(shape.d_model, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def rank_device(kind: str) -> torch.device:
    """``cuda:<rank on this machine mod visible GPUs>`` (as mpi_ad picks it), made current, or the CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    from mpistrategy.comm.topology import topology

    device = torch.device("cuda", topology().machine_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's and its cores."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"


def versions() -> dict[str, Any]:
    """The versions of what a GPU figure depends on."""
    import lightning

    from mpistrategy.comm.buffers import cuda_aware

    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "mpistrategy": mpistrategy.__version__,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi_cuda_aware": cuda_aware(),
    }


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


# --------------------------------------------------------------------------------------------- Lightning


class RankAsNode(ClusterEnvironment):
    """The MPI job as Lightning's DDP sees it: every rank a node of one process (local rank 0), so that each takes
    the one device it is given, also where ranks share a GPU (Lightning would otherwise index its list of devices
    by the local rank); the rendezvous is on 127.0.0.1 at ``port``."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self._port = port

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return self._port

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return MPI.COMM_WORLD.Get_size()

    def set_world_size(self, size: int) -> None:
        """MPI fixed it."""

    def global_rank(self) -> int:
        return MPI.COMM_WORLD.Get_rank()

    def set_global_rank(self, rank: int) -> None:
        """MPI fixed it."""

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return MPI.COMM_WORLD.Get_rank()


class Classifier(L.LightningModule):
    """The workload's encoder with cross-entropy and SGD with momentum."""

    def __init__(self, workload: Workload) -> None:
        super().__init__()
        self.net = workload.model()

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        return nn.functional.cross_entropy(self.net(tokens), labels)

    def configure_optimizers(self):
        return _optimizer(self)


class StepTimer(L.Callback):
    """Seconds between consecutive ``on_train_batch_start`` (the last step ends at ``on_train_end``), read once
    the device has finished."""

    def __init__(self, workload: Workload) -> None:
        self.clock = workload.clock
        self.marks: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self.marks.append(self.clock())

    def on_train_end(self, *args) -> None:
        self.marks.append(self.clock())

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def trainer_run(kind: str, workload: Workload, ddp_backend: str, aggregation: str = "mean") -> Run:
    """``kind``: ``"mpi_ad"`` (``Trainer(strategy="mpi_ad")``, or with the scheme ``aggregation`` names),
    ``"mpi_ad_host"`` (the same with CUDA buckets through host mirrors, ``MPISTRATEGY_CUDA_IPC=0``), ``"ddp"``
    (``DDPStrategy`` over ``ddp_backend``, every rank presented to Lightning as a node of one process) or
    ``"lightning_local"`` (this rank's device alone, Lightning's single-device strategy, trained on one rank's share
    of the data)."""
    comm = MPI.COMM_WORLD
    on_cuda = workload.device.type == "cuda"
    this_device = [workload.device.index] if on_cuda else 1
    cuda_ipc = os.environ.get(CUDA_IPC)  # as the run was started: mpi_ad keeps it

    def run(steps: int) -> dict[str, list[float]]:
        timer = StepTimer(workload)
        accelerator = "gpu" if on_cuda else "cpu"
        options = dict(accelerator=accelerator, precision=workload.precision, max_steps=steps, callbacks=[timer])
        options.update(QUIET_TRAINER)
        if kind in ("mpi_ad", "mpi_ad_host"):
            if kind == "mpi_ad_host":
                os.environ[CUDA_IPC] = "0"
            elif cuda_ipc is None:
                os.environ.pop(CUDA_IPC, None)
            else:
                os.environ[CUDA_IPC] = cuda_ipc
            mpi_ad = "mpi_ad" if aggregation == "mean" else MPIADStrategy(aggregator=build_aggregator(aggregation))
            trainer = L.Trainer(strategy=mpi_ad, **options)
        elif kind == "ddp":
            strategy = DDPStrategy(process_group_backend=ddp_backend)
            environment = RankAsNode(shared_port(comm))
            trainer = L.Trainer(
                strategy=strategy, devices=this_device, num_nodes=comm.size, plugins=[environment], **options
            )
        else:
            trainer = L.Trainer(devices=this_device, **options)
        data = workload.dataset(steps, 1 if kind == "lightning_local" else comm.size)
        trainer.fit(Classifier(workload), DataLoader(data, batch_size=workload.batch))
        if kind == "ddp":
            # Lightning adds per-step work (a SIGTERM broadcast) to every Trainer while torch.distributed is
            # initialised: leave it uninitialised for the other contenders.
            torch.distributed.destroy_process_group()
        return {"step": timer.steps()}

    return run


# --------------------------------------------------------------------------------------------- plain loops


class _Mixed:
    """Autocast (and loss scaling in 16-mixed) as Lightning's precision plugins apply them, for the plain loops."""

    def __init__(self, precision: str, device: torch.device) -> None:
        self.device_type = device.type
        self.dtype = MIXED_DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()


Sync = Callable[[], dict[str, float]]


def plain_run(workload: Workload, make_sync: Callable[[nn.Module], Sync]) -> Run:
    """A training loop without Lightning: this rank's share of the data (``DistributedSampler``), forward under
    the precision's autocast, backward, ``sync()`` (built by ``make_sync(model)``; it returns the seconds of
    its phases), optimizer step. Each step is timed from the end of the previous one (data loading included)."""
    comm = MPI.COMM_WORLD

    def run(steps: int) -> dict[str, list[float]]:
        model = workload.model()
        optimizer = _optimizer(model)
        mixed = _Mixed(workload.precision, workload.device)
        sync = make_sync(model)
        data = workload.dataset(steps, comm.size)
        sampler = DistributedSampler(data, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=0)
        times: dict[str, list[float]] = {"step": []}
        last = workload.clock()
        for tokens, labels in DataLoader(data, batch_size=workload.batch, sampler=sampler):
            tokens, labels = tokens.to(workload.device), labels.to(workload.device)
            optimizer.zero_grad(set_to_none=True)
            with mixed.autocast():
                loss = nn.functional.cross_entropy(model(tokens), labels)
            mixed.backward(loss)
            for phase, seconds in sync().items():
                times.setdefault(phase, []).append(seconds)
            mixed.step(optimizer)
            now = workload.clock()
            times["step"].append(now - last)
            last = now
        return times

    return run


def no_sync(model: nn.Module) -> Sync:
    """The floor: every rank trains alone (no synchronisation, no phases)."""
    return lambda: {}


def staged_allreduce(workload: Workload) -> Callable[[nn.Module], Sync]:
    """The hand-written data-parallel step: one ``torch.cat`` of the gradients into a flat device buffer, a copy
    into a host buffer (pinned on CUDA, allocated once), ``MPI.Allreduce`` in place, a copy back, the mean, a copy
    into every ``.grad``. Its phases, each ended by a device synchronisation: ``device_to_host``, ``mpi``,
    ``host_to_device`` (seconds)."""
    comm = MPI.COMM_WORLD

    def make_sync(model: nn.Module) -> Sync:
        params = list(model.parameters())
        pinned = workload.device.type == "cuda"
        host = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, pin_memory=pinned)

        def sync() -> dict[str, float]:
            grads = [p.grad for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            start = workload.clock()
            host.copy_(flat)
            copied = workload.clock()
            comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
            reduced = workload.clock()
            flat.copy_(host)
            back = workload.clock()
            flat.div_(comm.size)
            for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                grad.copy_(part.view_as(grad))
            return {"device_to_host": copied - start, "mpi": reduced - copied, "host_to_device": back - reduced}

        return sync

    return make_sync
