"""The mpi_ad Lightning strategy against Lightning's DDP (gloo) and a hand-written mpi4py loop, in one run.

    python benchmarks/strategy.py                 # relaunches itself under mpiexec -n 2
    mpiexec -n 2 python benchmarks/strategy.py [--steps 60] [--rounds 5] [--quick]

Same model (MLP 784-1024-1024-10, float32), same synthetic data (batch 64 per rank, DataLoader with a
DistributedSampler), same optimizer (SGD, momentum 0.9), same number of steps and the same torch threads per rank
(``cpu_count // 2``) for every contender:

- ``mpi_ad``: ``Trainer(strategy="mpi_ad")``;
- ``ddp``: ``Trainer(strategy=DDPStrategy(process_group_backend="gloo"))`` in the same MPI job, with the
  LightningEnvironment variables (MASTER_ADDR/PORT, LOCAL_RANK, NODE_RANK, WORLD_SIZE) set by this script; its
  process group is destroyed after each round, because Lightning adds per-step work (a SIGTERM broadcast) to
  every Trainer while torch.distributed is initialised, which would slow the other contenders down;
- ``hand``: a plain loop: backward, one in-place allreduce of one flat gradient buffer that the ``.grad`` are
  views of (zeroed in place), step. ``hand_cat`` is the common variant that flattens with ``torch.cat`` and copies
  the result back;
- ``reducer`` (for reference): the same plain loop with mpi_ad's gradient machinery instead of the allreduce
  (``GradientReducer`` with the default buckets and ``MeanAggregator``): what mpi_ad's sync costs without
  Lightning's loop around it, so ``mpi_ad / reducer`` is the price of the Trainer itself;
- the floors, with no synchronisation at all (every rank trains alone, side by side with the others, so that they
  share the cores and memory as in the other contenders): ``local`` (the plain loop without the allreduce) and
  ``lightning_local`` (``Trainer(devices=1)``, Lightning's single-device strategy). No data-parallel loop can be
  faster than ``local``, nor any Lightning strategy than ``lightning_local``: ``lightning_local / ddp`` is the
  least ``mpi_ad / ddp`` can be on this machine.

Trainer runs are timed by a callback (time between consecutive ``on_train_batch_start``, i.e. the full step
including data loading and every Lightning hook); the loops time whole iterations the same way. The contenders
run in interleaved rounds, so that background load hits them alike; each round's first ``--warmup`` steps are
dropped and its median step time kept. Reported: per contender the median over rounds (and the range), and each
ratio as the median over rounds of the per-round ratio (and its range). The contenders run in a new (seeded) order
every round. Writes benchmarks/results/strategy.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import (  # noqa: E402
    QUIET_TRAINER,
    add_results_argument,
    check_timed_steps,
    ensure_mpi,
    integer_in,
    lightning_environment,
    paired_range,
    quick_defaults,
    results_of,
    save,
)

TARGET_VS_DDP = 0.8
TARGET_VS_HAND = 1.05
BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=integer_in(1), default=30, help="steps per round and contender")
    parser.add_argument("--warmup", type=integer_in(0), default=5, help="steps dropped at the start of every round")
    parser.add_argument("--rounds", type=integer_in(1), default=20, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="3 rounds of 20 steps")
    add_results_argument(parser, "the JSON and PNG")
    args = parser.parse_args()
    quick_defaults(parser, args, steps=20, rounds=3)
    check_timed_steps(parser, args)
    args.results = results_of(args)
    ensure_mpi(2)

    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    threads = max(1, len(os.sched_getaffinity(0)) // size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    contenders = {
        "mpi_ad": _trainer_run("mpi_ad"),
        "ddp": _trainer_run("ddp"),
        "hand": _hand_run(False),
        "hand_cat": _hand_run(True),
        "reducer": _reducer_run(),
        "local": _local_run(),
        "lightning_local": _trainer_run("local"),
    }
    rounds: list[dict[str, float]] = []
    order = list(contenders.items())
    shuffler = random.Random(0)  # the same order on every rank
    for _ in range(args.rounds):
        medians_of_round = {}
        shuffler.shuffle(order)  # so that no contender always runs after the same one
        for name, run in order:
            comm.Barrier()
            medians_of_round[name] = statistics.median(run(args.steps)[args.warmup :]) * 1e3
        rounds.append(medians_of_round)
    rounds = comm.bcast(rounds, root=0)
    if rank != 0:
        return

    medians = {name: statistics.median(r[name] for r in rounds) for name in contenders}
    ratio_ddp = paired_range(rounds, "mpi_ad", "ddp")
    ratio_hand = paired_range(rounds, "mpi_ad", "hand")
    ratio_cat = paired_range(rounds, "mpi_ad", "hand_cat")
    ratio_reducer = paired_range(rounds, "reducer", "hand")
    ratio_trainer = paired_range(rounds, "mpi_ad", "reducer")
    floor_ddp = paired_range(rounds, "lightning_local", "ddp")
    floor_hand = paired_range(rounds, "local", "hand")
    exposed = statistics.median(r["mpi_ad"] - r["lightning_local"] for r in rounds)
    print(f"\nmpi_ad strategy benchmark: {size} ranks, {threads} torch thread(s) per rank, MLP 784-1024-1024-10,")
    print(f"batch {BATCH} per rank, {args.rounds} interleaved rounds x {args.steps} steps ({args.warmup} warm-up)\n")
    print(f"{'contender':<10} {'median ms/step':>15} {'range over rounds':>20}")
    for name, value in medians.items():
        low, high = min(r[name] for r in rounds), max(r[name] for r in rounds)
        print(f"{name:<10} {value:>15.2f} {low:>11.2f} - {high:<7.2f}")
    print("\nratios: median over rounds of the per-round ratio (min - max)")
    for label, (ratio, low, high), target in (
        ("mpi_ad / ddp ", ratio_ddp, TARGET_VS_DDP),
        ("mpi_ad / hand", ratio_hand, TARGET_VS_HAND),
    ):
        verdict = "met" if ratio <= target else "MISSED"
        print(f"{label} = {ratio:.2f}  ({low:.2f} - {high:.2f})   target <= {target}: {verdict}")
    print(f"mpi_ad / hand_cat = {ratio_cat[0]:.2f}  ({ratio_cat[1]:.2f} - {ratio_cat[2]:.2f})   (the torch.cat loop)")
    print(
        f"reducer / hand = {ratio_reducer[0]:.2f}  ({ratio_reducer[1]:.2f} - {ratio_reducer[2]:.2f})   "
        "(mpi_ad's gradient sync in the plain loop)"
    )
    print(
        f"mpi_ad / reducer = {ratio_trainer[0]:.2f}  ({ratio_trainer[1]:.2f} - {ratio_trainer[2]:.2f})   "
        "(what Lightning's loop adds)"
    )
    print(
        f"floors: lightning_local / ddp = {floor_ddp[0]:.2f}  ({floor_ddp[1]:.2f} - {floor_ddp[2]:.2f})   "
        f"(the least any Lightning strategy's ratio to ddp can be); local / hand = {floor_hand[0]:.2f}  "
        f"({floor_hand[1]:.2f} - {floor_hand[2]:.2f});\n        mpi_ad - lightning_local = {exposed:.2f} ms per step "
        "(what mpi_ad's synchronisation costs on top of training alone)"
    )
    path = save(
        "strategy",
        {
            "ranks": size,
            "threads_per_rank": threads,
            "batch_per_rank": BATCH,
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": rounds,
            "median_ms_per_step": medians,
            "mpi_ad_vs_ddp": ratio_ddp[0],
            "mpi_ad_vs_hand": ratio_hand[0],
            "mpi_ad_vs_hand_cat": ratio_cat[0],
            "reducer_vs_hand": ratio_reducer[0],
            "mpi_ad_vs_reducer": ratio_trainer[0],
            "lightning_local_vs_ddp": floor_ddp[0],
            "local_vs_hand": floor_hand[0],
            "mpi_ad_minus_lightning_local_ms": exposed,
            "targets": {"vs_ddp": TARGET_VS_DDP, "vs_hand": TARGET_VS_HAND},
        },
        args.results,
    )
    _plot(rounds, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _plot(rounds: list[dict[str, float]], path: Path) -> None:
    """Box plot of every contender's per-round median ms/step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rounds[0])
    fig, ax = plt.subplots(figsize=(9.5, 4))
    ax.boxplot([[r[name] for r in rounds] for name in names])
    ax.set_xticks(range(1, len(names) + 1), names)
    ax.set_ylabel("median ms per step (one point per round)")
    ax.set_title("MLP 784-1024-1024-10, batch 64 per rank, 2 ranks")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _dataset(steps: int, size: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    samples = BATCH * size * steps
    return TensorDataset(torch.randn(samples, 784, generator=g), torch.randint(0, 10, (samples,), generator=g))


def _trainer_run(kind: str):
    import lightning.pytorch as L
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy
    from mpi4py import MPI
    from torch import nn
    from torch.utils.data import DataLoader

    import mpistrategy  # noqa: F401  (registers "mpi_ad")

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *args) -> None:
            self.starts.append(time.perf_counter())

    size = MPI.COMM_WORLD.Get_size()

    def run(steps: int) -> list[float]:
        timer = StepTimer()
        options = dict(accelerator="cpu", max_steps=steps, callbacks=[timer], **QUIET_TRAINER)
        if kind == "ddp":
            lightning_environment(MPI.COMM_WORLD)
            strategy = DDPStrategy(process_group_backend="gloo")
            trainer = L.Trainer(
                strategy=strategy, devices=size, num_nodes=1, plugins=[LightningEnvironment()], **options
            )
        elif kind == "local":
            trainer = L.Trainer(devices=1, **options)
        else:
            trainer = L.Trainer(strategy=kind, **options)
        # alone, every rank trains on its share of the data (the length of the others' epochs)
        data = _dataset(steps, 1 if kind == "local" else size)
        trainer.fit(Classifier(), DataLoader(data, batch_size=BATCH))
        if kind == "ddp":
            # Lightning runs extra per-step work (a sigterm broadcast) whenever torch.distributed is initialised:
            # leave it uninitialised for the other contenders.
            torch.distributed.destroy_process_group()
        return [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)]

    return run


def _plain_loop(make_step):
    """A training loop without Lightning on the benchmark's model, data and optimizer, started from rank 0's
    parameters as the strategies do. ``make_step(model, optimizer)`` returns ``(step, done)``: ``step(x, y)`` runs
    one training step, ``done()`` cleans up after the last."""
    import torch
    from mpi4py import MPI
    from torch.utils.data import DataLoader, DistributedSampler

    comm = MPI.COMM_WORLD

    def run(steps: int) -> list[float]:
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                comm.Bcast(p.detach().numpy(), root=0)
        step, done = make_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        data = _dataset(steps, comm.size)
        sampler = DistributedSampler(data, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=0)
        starts = []
        for x, y in DataLoader(data, batch_size=BATCH, sampler=sampler):
            starts.append(time.perf_counter())
            step(x, y)
        starts.append(time.perf_counter())
        done()
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]

    return run


def _reducer_run():
    from torch import nn

    from mpistrategy.aggregation import MeanAggregator
    from mpistrategy.comm.topology import topology
    from mpistrategy.strategy.reducer import GradientReducer

    def make_step(model, optimizer):
        reducer = GradientReducer(model, MeanAggregator(), topology())
        reducer.attach_optimizer(optimizer)

        def step(x, y) -> None:
            optimizer.zero_grad()
            reducer.prepare(sync=True)
            nn.functional.cross_entropy(model(x), y).backward()
            reducer.wait()
            optimizer.step()

        return step, reducer.remove

    return _plain_loop(make_step)


def _local_run():
    """The plain loop without any synchronisation: the floor of every data-parallel loop."""
    from torch import nn

    def make_step(model, optimizer):
        def step(x, y) -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        return step, lambda: None

    return _plain_loop(make_step)


def _hand_run(concatenate: bool):
    import torch
    from mpi4py import MPI
    from torch import nn

    comm = MPI.COMM_WORLD

    def make_step(model, optimizer):
        params = list(model.parameters())
        offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]

        def cat_step(x, y) -> None:
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            grads = torch.cat([p.grad.reshape(-1) for p in params])
            comm.Allreduce(MPI.IN_PLACE, grads.numpy(), op=MPI.SUM)
            grads.div_(comm.size)
            for p, offset in zip(params, offsets, strict=True):
                p.grad.copy_(grads[offset : offset + p.numel()].view_as(p))
            optimizer.step()

        if concatenate:
            return cat_step, lambda: None
        flat = torch.zeros(sum(p.numel() for p in params))
        for p, offset in zip(params, offsets, strict=True):
            p.grad = flat[offset : offset + p.numel()].view_as(p)

        def view_step(x, y) -> None:
            flat.zero_()
            nn.functional.cross_entropy(model(x), y).backward()
            comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            flat.div_(comm.size)
            optimizer.step()

        return view_step, lambda: None

    return _plain_loop(make_step)


if __name__ == "__main__":
    main()
