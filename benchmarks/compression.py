"""Gradient compression: validation accuracy against bytes sent, and the time each scheme adds per step, in one run.

    python benchmarks/compression.py              # relaunches itself under mpiexec -n 2
    mpiexec -n 2 python benchmarks/compression.py [--epochs 10] [--rounds 10] [--steps 30] [--quick]

Every aggregation scheme with its default options (``mpistrategy.aggregation.SCHEMES``), plus PowerSGD at rank 4:

- accuracy: ``Trainer(strategy=MPIADStrategy(aggregator=...))`` on the default job (scikit-learn digits, MLP
  64-256-10, SGD lr 0.05 momentum 0.9, cosine over the epochs, batch 32 per rank, seed 1234); after every epoch the
  validation accuracy and the bytes the rank has sent so far (the aggregator's traffic counter);
- time: the MLP 784-1024-1024-10 of ``benchmarks/strategy.py`` on synthetic data (batch 64 per rank, SGD momentum
  0.9) in a plain loop over the strategy's gradient reducer (so that Lightning's per-step cost does not dilute the
  aggregator's), PowerSGD compressing from the first step. The schemes run in interleaved rounds in a new (seeded)
  order every round; each round's first ``--warmup`` steps are dropped and its median step time kept. Reported per
  scheme: bytes per step, the median over rounds of the median ms/step, the overhead against the mean (ms), and the
  ratio to the mean as the median over rounds of the per-round ratio (min - max).

Writes benchmarks/results/compression.json and compression.png (accuracy against MB sent; ms/step by scheme). The
machine's load moves absolute times; the ratios and the bytes are what to compare.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import (  # noqa: E402
    add_results_argument,
    check_timed_steps,
    ensure_mpi,
    integer_in,
    paired_ratios,
    quick_defaults,
    results_of,
    save,
    share_cores,
)

BATCH = 64


def _schemes() -> dict[str, object]:
    """Name -> a function building a fresh aggregator."""
    from functools import partial

    from mpistrategy.aggregation import SCHEMES, PowerSGD

    schemes = dict(SCHEMES)
    schemes["powersgd_rank4"] = partial(PowerSGD, rank=4)
    return schemes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=integer_in(1), default=10, help="epochs of the digits job per scheme")
    parser.add_argument("--steps", type=integer_in(1), default=30, help="timed steps per round and scheme")
    parser.add_argument("--warmup", type=integer_in(0), default=5, help="steps dropped at the start of every round")
    parser.add_argument("--rounds", type=integer_in(1), default=10, help="interleaved timing rounds")
    parser.add_argument("--quick", action="store_true", help="1 epoch, 2 rounds of 10 steps")
    add_results_argument(parser, "the JSON and PNG")
    args = parser.parse_args()
    quick_defaults(parser, args, epochs=1, steps=10, warmup=3, rounds=2)
    check_timed_steps(parser, args)
    args.results = results_of(args)
    ensure_mpi(2)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    threads = share_cores(comm)

    schemes = _schemes()
    curves = {name: _digits_curve(make, args.epochs) for name, make in schemes.items()}
    rounds, bytes_per_step = _time_schemes(schemes, args.steps, args.warmup, args.rounds)
    if comm.rank != 0:
        return

    medians = {name: statistics.median(r[name] for r in rounds) for name in schemes}
    print(f"\ngradient compression: {comm.size} ranks, {threads} torch thread(s) per rank")
    print(f"time: MLP 784-1024-1024-10, batch {BATCH} per rank, {args.rounds} rounds x {args.steps} steps")
    print(f"accuracy: digits MLP 64-256-10, {args.epochs} epochs\n")
    header = f"{'scheme':<15} {'KB/step':>9} {'of mean':>8} {'ms/step':>8} {'+ms':>7} {'ratio (min-max)':>20}"
    print(header + f" {'val/acc':>8} {'MB sent':>8}")
    table = []
    for name in schemes:
        ratios = paired_ratios({n: [r[n] for r in rounds] for n in (name, "mean")}, name, "mean")
        row = {
            "scheme": name,
            "bytes_per_step": bytes_per_step[name],
            "share_of_mean": bytes_per_step[name] / bytes_per_step["mean"],
            "ms_per_step": medians[name],
            "overhead_ms": medians[name] - medians["mean"],
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "final_val_acc": curves[name][-1][1],
            "digits_mb_sent": curves[name][-1][0] / 1e6,
        }
        table.append(row)
        print(
            f"{name:<15} {row['bytes_per_step'] / 1e3:>9.1f} {row['share_of_mean']:>8.2%} {row['ms_per_step']:>8.2f} "
            f"{row['overhead_ms']:>+7.2f} {row['ratio']:>8.2f} ({row['ratio_min']:.2f} - {row['ratio_max']:.2f})"
            f" {row['final_val_acc']:>8.4f} {row['digits_mb_sent']:>8.2f}"
        )
    path = save(
        "compression",
        {
            "ranks": comm.size,
            "threads_per_rank": threads,
            "epochs": args.epochs,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "table": table,
            "curves": {name: [{"bytes": b, "val_acc": a} for b, a in curve] for name, curve in curves.items()},
            "rounds_ms_per_step": rounds,
        },
        args.results,
    )
    _plot(curves, table, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def _digits_curve(make, epochs: int) -> list[tuple[int, float]]:
    """(bytes sent so far, validation accuracy) after every epoch of the digits job through the Trainer."""
    from functools import partial

    import lightning.pytorch as L
    import torch

    from mpistrategy.recipes.data import DigitsDataModule
    from mpistrategy.recipes.models import MLPClassifier
    from mpistrategy.strategy import MPIADStrategy

    class Curve(L.Callback):
        def __init__(self) -> None:
            self.points: list[tuple[int, float]] = []

        def on_validation_end(self, trainer, module) -> None:
            traffic = trainer.strategy.aggregator.context.traffic
            self.points.append((traffic.total, float(trainer.callback_metrics["val/acc"])))

    L.seed_everything(1234, verbose=False)
    model = MLPClassifier(
        in_features=64,
        hidden=256,
        depth=1,
        optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4),
        scheduler=partial(torch.optim.lr_scheduler.CosineAnnealingLR, T_max=epochs),
    )
    curve = Curve()
    trainer = L.Trainer(
        strategy=MPIADStrategy(aggregator=make()),
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[curve],
    )
    trainer.fit(model, DigitsDataModule(batch_size=32))
    return curve.points


def _time_schemes(schemes, steps: int, warmup: int, rounds: int) -> tuple[list[dict[str, float]], dict[str, int]]:
    """Per round, each scheme's median ms per step (interleaved, shuffled); and each scheme's bytes per step."""
    import torch
    from mpi4py import MPI
    from torch import nn

    from mpistrategy.aggregation import PowerSGD
    from mpistrategy.comm.topology import topology
    from mpistrategy.strategy.reducer import GradientReducer

    comm = MPI.COMM_WORLD
    generator = torch.Generator().manual_seed(1 + comm.rank)
    batches = [(torch.randn(BATCH, 784, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))]
    batches *= 4
    loops = {}
    for name, make in schemes.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        aggregator = make()
        if isinstance(aggregator, PowerSGD):
            aggregator.start_iter = 0  # compress from the first timed step
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        reducer = GradientReducer(model, aggregator, topology())
        reducer.attach_optimizer(optimizer)
        loops[name] = (model, optimizer, reducer)

    def run(name: str) -> list[float]:
        model, optimizer, reducer = loops[name]
        starts = []
        for step in range(steps):
            x, y = batches[step % len(batches)]
            starts.append(time.perf_counter())
            optimizer.zero_grad()
            reducer.prepare(sync=True)
            nn.functional.cross_entropy(model(x), y).backward()
            reducer.wait()
            optimizer.step()
        starts.append(time.perf_counter())
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]

    per_round: list[dict[str, float]] = []
    order = list(schemes)
    shuffler = random.Random(0)  # the same order on every rank
    for _ in range(rounds):
        shuffler.shuffle(order)
        medians = {}
        for name in order:
            comm.Barrier()
            medians[name] = statistics.median(run(name)[warmup:]) * 1e3
        per_round.append(medians)
    bytes_per_step = {}
    for name, (_, _, reducer) in loops.items():
        reducer.traffic.take()
        run(name)
        bytes_per_step[name] = sum(reducer.traffic.take()) // steps
        reducer.remove()
    return comm.bcast(per_round, root=0), bytes_per_step


def _plot(curves: dict[str, list[tuple[int, float]]], table: list[dict], path: Path) -> None:
    """Left: validation accuracy against MB sent per rank (log scale). Right: ms/step by scheme."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab20").colors
    for index, (name, curve) in enumerate(curves.items()):
        style = {"color": "black", "linewidth": 2.5} if name == "mean" else {"color": colors[2 * index % 20]}
        marker = "osD^v<>"[index % 7]
        left.plot([b / 1e6 for b, _ in curve], [a for _, a in curve], marker=marker, markersize=4, label=name, **style)
    left.set_xscale("log")
    left.set_xlabel("MB sent per rank (cumulative)")
    left.set_ylabel("validation accuracy")
    left.set_title("digits MLP 64-256-10: accuracy against bytes sent")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    names = [row["scheme"] for row in table]
    right.bar(names, [row["ms_per_step"] for row in table], color="tab:blue")
    right.axhline(table[0]["ms_per_step"], color="gray", linestyle="--", linewidth=1, label="mean")
    right.set_ylabel("median ms per step")
    right.set_title("MLP 784-1024-1024-10: time per step by scheme")
    right.tick_params(axis="x", rotation=45)
    right.grid(True, axis="y", alpha=0.3)
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
