"""Sharded optimizer state (ZeRO stages 1 and 2) in mpi_ad against flat mpi_ad and torch's ZeroRedundancyOptimizer.

    python benchmarks/zero.py                             # 2 and 4 ranks, both models
    python benchmarks/zero.py --ranks 2 --models mlp --quick
    python benchmarks/zero.py --accelerator gpu           # on a GPU machine (benchmarks/gpu_run.sh zero)

Every contender trains the same model (float32) on the same synthetic data (batch 64 per rank) with AdamW, the same
number of steps and the same torch threads per rank (``cpu_count // ranks``), in one MPI job per rank count:

- ``flat``: ``Trainer(strategy="mpi_ad")``, every rank keeps the whole optimizer state;
- ``stage1``: ``MPIADStrategy(shard="optimizer")``: each rank keeps and steps 1/N of the state, the updated shards
  are allgathered;
- ``stage2``: ``MPIADStrategy(shard="gradients")``: also the gradients are reduce-scattered into shards;
- ``ddp``: Lightning's DDP over gloo with AdamW;
- ``ddp_zero``: Lightning's DDP over gloo with ``torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)``.

With ``--accelerator gpu`` the models train on the GPU (ranks share one where there are fewer GPUs than ranks) and
DDP runs over NCCL when every rank has a GPU of its own, over gloo otherwise.

Models: ``mlp`` (784-1024-1024-10, 1.86M parameters) and ``mlp20m`` (784-4096-4096-10, 20.0M parameters). The
contenders run in interleaved rounds in a new seeded order each round; each round's first ``--warmup`` steps are
dropped and its median step time kept (the time between consecutive ``on_train_batch_start``: the whole step).
Reported per model: each contender's median over rounds, the ratios as the median over rounds of the per-round
ratio, and the optimizer state each rank holds (bytes of its tensors, measured after training; the largest over
the ranks). Writes benchmarks/results/zero.json and zero.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import (  # noqa: E402
    QUIET_TRAINER,
    add_results_argument,
    check_timed_steps,
    integer_in,
    lightning_environment,
    paired_range,
    quick_defaults,
    results_of,
    run_under_mpi,
    save,
    share_cores,
    shared_port,
)

BATCH = 64
MODELS = {"mlp": (784, 1024, 1024, 10), "mlp20m": (784, 4096, 4096, 10)}
CONTENDERS = ("flat", "stage1", "stage2", "ddp", "ddp_zero")
#: (name, contender, reference)
RATIOS = (
    ("stage1_vs_flat", "stage1", "flat"),
    ("stage2_vs_flat", "stage2", "flat"),
    ("stage1_vs_ddp_zero", "stage1", "ddp_zero"),
    ("ddp_zero_vs_ddp", "ddp_zero", "ddp"),
    ("flat_vs_ddp", "flat", "ddp"),
)
TARGET_STAGE1_VS_FLAT = 1.10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=integer_in(1), nargs="+", default=[2, 4], help="MPI job sizes, one job each")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--steps", type=integer_in(1), default=12, help="steps per round and contender")
    parser.add_argument("--warmup", type=integer_in(0), default=3, help="steps dropped at the start of every round")
    parser.add_argument("--rounds", type=integer_in(1), default=3, help="interleaved rounds")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu", help="where the models train")
    parser.add_argument("--quick", action="store_true", help="1 round of 6 steps (1 warm-up)")
    add_results_argument(parser, "the JSON and PNG")
    args = parser.parse_args()
    quick_defaults(parser, args, steps=6, warmup=1, rounds=1)
    check_timed_steps(parser, args)
    args.results = results_of(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 1 and not os.environ.get("MPISTRATEGY_BENCH_CHILD"):
        _launch_jobs(args)
        return
    job = _measure(args)
    if job is None:
        return
    if os.environ.get("MPISTRATEGY_BENCH_CHILD"):  # one of _launch_jobs's jobs
        save(f"zero_np{job['ranks']}", job, args.results)
    else:  # launched under mpiexec by the user: this job's rank count only
        _report([job], args)


def _launch_jobs(args: argparse.Namespace) -> None:
    """One MPI job per rank count, then the summary of all of them."""
    jobs = []
    for ranks in args.ranks:
        part = args.results / f"zero_np{ranks}.json"
        code = run_under_mpi(ranks, "--ranks", str(ranks))
        if code != 0:
            sys.exit(f"the {ranks}-rank job failed with exit code {code}")
        jobs.append(json.loads(part.read_text()))
        part.unlink()
    _report(jobs, args)


def _report(jobs: list[dict], args: argparse.Namespace) -> None:
    """Print the summary, write zero.json and zero.png."""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record = {"date": date, "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "jobs": jobs}
    path = save("zero", record, args.results)
    _summarise(jobs)
    _plot(jobs, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _measure(args: argparse.Namespace) -> dict | None:
    """This MPI job's part: every model, every contender, interleaved rounds; the results on rank 0."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    threads = share_cores(comm)

    models = {}
    for model in args.models:
        rounds: list[dict[str, float]] = []
        state_bytes: dict[str, int] = {}
        order = list(CONTENDERS)
        shuffler = random.Random(0)  # the same order on every rank
        for _ in range(args.rounds):
            shuffler.shuffle(order)
            medians = {}
            for name in order:
                comm.Barrier()
                steps, held = _train(name, MODELS[model], args.steps, args.accelerator)
                medians[name] = statistics.median(steps[args.warmup :]) * 1e3
                state_bytes[name] = max(comm.allgather(held))
            rounds.append(medians)
        rounds = comm.bcast(rounds, root=0)
        parameters = sum(a * b + b for a, b in zip(MODELS[model], MODELS[model][1:], strict=False))
        models[model] = {
            "parameters": parameters,
            "rounds": rounds,
            "median_ms_per_step": {name: statistics.median(r[name] for r in rounds) for name in CONTENDERS},
            "ratios": {label: paired_range(rounds, a, b)[0] for label, a, b in RATIOS},
            "optimizer_state_bytes_per_rank": state_bytes,
        }
    if comm.rank != 0:
        return None
    job = {"ranks": comm.size, "threads_per_rank": threads, "batch_per_rank": BATCH, "models": models}
    return {**job, "accelerator": args.accelerator, "device": _device_name(args.accelerator)}


def _device_name(accelerator: str) -> str:
    import platform

    import torch

    if accelerator == "gpu":
        return torch.cuda.get_device_name(0)
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def _summarise(jobs: list[dict]) -> None:
    for job in jobs:
        ranks = job["ranks"]
        print(
            f"\nZeRO benchmark on {job['device']}: {ranks} ranks, {job['threads_per_rank']} torch thread(s) per rank, ",
            end="",
        )
        print(f"AdamW, batch {job['batch_per_rank']} per rank")
        for model, result in job["models"].items():
            print(f"\n{model} ({result['parameters'] / 1e6:.2f}M parameters)")
            print(f"{'contender':<10} {'median ms/step':>15} {'optimizer state per rank':>26}")
            state = result["optimizer_state_bytes_per_rank"]
            for name, value in result["median_ms_per_step"].items():
                share = state[name] / state["flat"] if name != "ddp_zero" else state[name] / state["ddp"]
                print(f"{name:<10} {value:>15.2f} {state[name] / 2**20:>14.1f} MiB ({share:.3f} of unsharded)")
            for label, ratio in result["ratios"].items():
                target = ""
                if label == "stage1_vs_flat":
                    verdict = "met" if ratio <= TARGET_STAGE1_VS_FLAT else "MISSED"
                    target = f"   target <= {TARGET_STAGE1_VS_FLAT}: {verdict}"
                print(f"{label:<20} = {ratio:.2f}{target}")
            limit = 1 / ranks * 1.01
            for name in ("stage1", "stage2"):
                share = state[name] / state["flat"]
                verdict = "met" if share <= limit else "MISSED"
                print(f"{name} optimizer state / flat's = {share:.4f}   ", end="")
                print(f"target <= 1/{ranks} + 1% = {limit:.4f}: {verdict}")


def _plot(jobs: list[dict], path: Path) -> None:
    """Per model and rank count, every contender's median ms/step relative to flat mpi_ad's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(job["ranks"], model, result) for job in jobs for model, result in job["models"].items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.8), squeeze=False)
    for ax, (ranks, model, result) in zip(axes[0], panels, strict=True):
        medians = result["median_ms_per_step"]
        ax.bar(list(medians), [value / medians["flat"] for value in medians.values()])
        ax.axhline(TARGET_STAGE1_VS_FLAT, color="red", linestyle="--", linewidth=1, label="stage1 target")
        ax.set_title(f"{model}, {ranks} ranks")
        ax.set_ylabel("step time / flat mpi_ad")
        ax.tick_params(axis="x", rotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _train(name: str, widths: tuple[int, ...], steps: int, accelerator: str) -> tuple[list[float], int]:
    """Train contender ``name`` for ``steps`` steps on ``accelerator``; returns the step times (s) and this rank's
    optimizer-state bytes after training."""
    import lightning.pytorch as L
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy
    from mpi4py import MPI
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.utils.data import DataLoader, TensorDataset

    from mpistrategy.strategy import MPIADStrategy

    comm = MPI.COMM_WORLD

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for a, b in zip(widths, widths[1:], strict=False):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.net = nn.Sequential(*layers[:-1])

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            if name == "ddp_zero":
                return ZeroRedundancyOptimizer(self.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.state_bytes = 0

        def on_train_batch_start(self, *args) -> None:
            self.starts.append(_now())

        def on_train_end(self, trainer, *args) -> None:
            self.starts.append(_now())
            optimizer = trainer.optimizers[0]
            state = optimizer.optim.state if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer.state
            tensors = [t for entry in state.values() for t in entry.values() if torch.is_tensor(t)]
            self.state_bytes = sum(t.numel() * t.element_size() for t in tensors)

    def _now() -> float:
        if accelerator == "gpu":
            torch.cuda.synchronize()
        return time.perf_counter()

    timer = StepTimer()
    options = dict(accelerator=accelerator, max_steps=steps, callbacks=[timer], **QUIET_TRAINER)
    if name in ("ddp", "ddp_zero") and accelerator == "gpu":
        from _gpu_contenders import RankAsNode  # every rank a node of one process: ranks may share the GPU

        own_gpus = torch.cuda.device_count() >= comm.size and torch.distributed.is_nccl_available()
        strategy = DDPStrategy(process_group_backend="nccl" if own_gpus else "gloo")
        environment = [RankAsNode(shared_port(comm))]
        device = [comm.rank % torch.cuda.device_count()]
        trainer = L.Trainer(strategy=strategy, devices=device, num_nodes=comm.size, plugins=environment, **options)
    elif name in ("ddp", "ddp_zero"):
        lightning_environment(comm)
        strategy = DDPStrategy(process_group_backend="gloo")
        environment = [LightningEnvironment()]
        trainer = L.Trainer(strategy=strategy, devices=comm.size, num_nodes=1, plugins=environment, **options)
    else:
        shard = {"flat": None, "stage1": "optimizer", "stage2": "gradients"}[name]
        if accelerator == "gpu":
            torch.cuda.set_device(comm.rank % torch.cuda.device_count())
        trainer = L.Trainer(strategy=MPIADStrategy(shard=shard), **options)
    g = torch.Generator().manual_seed(1)
    samples = BATCH * comm.size * steps
    data = TensorDataset(torch.randn(samples, widths[0], generator=g), torch.randint(0, 10, (samples,), generator=g))
    trainer.fit(Classifier(), DataLoader(data, batch_size=BATCH))
    if name in ("ddp", "ddp_zero"):
        # Lightning adds per-step work while torch.distributed is initialised: leave it off for the others
        torch.distributed.destroy_process_group()
    return [b - a for a, b in zip(timer.starts, timer.starts[1:], strict=False)], timer.state_bytes


if __name__ == "__main__":
    main()
