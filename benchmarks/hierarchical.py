"""What each sync mode costs and gains on a slow inter-node link: 2 emulated nodes x 2 ranks over 1 Gbit/s links,
Lightning DDP (gloo) against mpi_ad's sync modes, the same model and data for all (needs root; see cluster.py).

    python benchmarks/hierarchical.py [--rounds 3] [--epochs 4] [--batch 32] [--rate 1gbit] [--contenders flat,daso]
                                      [--quick]

The model is an MLP 64-4608-4608-10 (21.6 M parameters, 86 MB of float32 gradients) trained on scikit-learn's
digits (standardised, the recipes' fixed 80/20 split: 1437 training images), batch 32 per rank, SGD (lr 0.02,
momentum 0.9), one torch thread per rank, from the same seed for every contender:

| contender | strategy |
| --- | --- |
| ``ddp`` | ``DDPStrategy(process_group_backend="gloo")`` across the nodes (MASTER_ADDR=node0, NODE_RANK, LOCAL_RANK) |
| ``flat`` | ``MPIADStrategy()``: one MPI allreduce of every gradient bucket over the 4 ranks |
| ``hierarchical`` | ``sync="hierarchical"``: node sum, node leaders across the link, node broadcast |
| ``local_sgd`` | ``sync=LocalSGD()`` (period 8) |
| ``hierarchical_local_sgd`` | ``sync=HierarchicalLocalSGD()`` (period 8) |
| ``daso`` | ``sync=DASO(warmup_epochs=1, cooldown_epochs=1)``, heat's other defaults (skip 4, wait 1) |
| ``gossip`` | ``sync=Gossip()`` (ring, every step) |

plus the compressing aggregators of :data:`COMPRESSORS` whose module is installed in ``mpistrategy.aggregation``
(each as ``sync="hierarchical"`` with the compressor on the node leaders' step only).

Every round is one MPI job on the emulated cluster that trains every contender in a new (seeded) order for
``--epochs`` epochs. Measured per contender and round:

- ms/step: the mean duration of the round's steps after the first ``--warmup`` (time between consecutive
  ``on_train_batch_start``, the epoch's last step ending at ``on_train_epoch_end``): the whole step with data
  loading and every hook. The mean, not the median: periodic modes have cheap and expensive steps, and throughput
  pays for both; the per-step median is reported too, and for DASO the mean over its cycling epochs (its steady
  state, which a run of a few epochs dilutes with blocking warm-up and cool-down epochs);
- the bytes each node's link carried (its ``eth0`` counters, read inside the node by its local rank 0) and the
  payload the strategy counted (``strategy.traffic``, every rank's totals summed, by scope), per step;
- validation accuracy after every epoch, against the training wall time so far (validation itself excluded): each
  rank evaluates its own replica on its quarter of the 360 validation images, and the correct answers are summed
  over the ranks.

Reported: per contender the median over rounds (and the range) of ms/step, its ratio to flat mpi_ad and to DDP
(medians of the per-round ratios), the link and counted MB per step, the final accuracy and the wall time to reach
flat's final accuracy less 1 point; the load average before and after every round. Writes hierarchical.json,
hierarchical_step_time.png and hierarchical_accuracy.png to ``--results`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import add_results_argument, integer_in, paired_ratios, quick_defaults, results_of, save  # noqa: E402
from cluster import parse_rate  # noqa: E402

NODES = 2
RANKS_PER_NODE = 2
RANKS = NODES * RANKS_PER_NODE
HIDDEN = 4608
BATCH = 32
LEARNING_RATE = 0.02
MOMENTUM = 0.9
REFERENCE = "flat"
ACCURACY_MARGIN = 1.0  # points below flat's final accuracy that count as reaching it
SPEEDUP_TARGET = 2.0  # DASO and hierarchical local SGD per step against flat mpi_ad
VS_DDP_TARGET = 0.8  # flat mpi_ad's step time against Lightning DDP's
#: name -> (sync mode name, its options); "ddp" is Lightning's DDP over gloo
SYNC_CONTENDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "flat": ("flat", {}),
    "hierarchical": ("hierarchical", {}),
    "local_sgd": ("local_sgd", {}),
    "hierarchical_local_sgd": ("hierarchical_local_sgd", {}),
    "daso": ("daso", {"warmup_epochs": 1, "cooldown_epochs": 1}),
    "gossip": ("gossip", {}),
}
#: the compressing aggregators to run under ``sync="hierarchical"`` (compressing the inter-node step only): name ->
#: (module of mpistrategy.aggregation, class, options). A contender joins where its module is installed.
COMPRESSORS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "hierarchical+powersgd": ("powersgd", "PowerSGD", {"rank": 4}),
    "hierarchical+topk": ("topk", "TopK", {"density": 0.01}),
    "hierarchical+sign": ("sign", "ScaledSign", {}),
}


def available_contenders() -> list[str]:
    """DDP, every sync mode, and the compressors whose module is installed (looked up without importing the
    package, which would start MPI in the controller)."""
    import importlib.util

    package = importlib.util.find_spec("mpistrategy")
    folder = Path(package.submodule_search_locations[0]) / "aggregation" if package else None
    compressors = [
        name for name, (module, _, _) in COMPRESSORS.items() if folder and (folder / f"{module}.py").exists()
    ]
    return ["ddp", *SYNC_CONTENDERS, *compressors]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=integer_in(1), default=3, help="interleaved rounds (one MPI job each)")
    parser.add_argument("--epochs", type=integer_in(1), default=4, help="epochs per contender and round")
    parser.add_argument("--batch", type=integer_in(1), default=BATCH, help="samples per rank and step")
    parser.add_argument("--warmup", type=integer_in(0), default=2, help="steps left out of each round's ms/step")
    parser.add_argument("--rate", default="1gbit", help="link rate, tc notation (1gbit, 10gbit, unshaped, ...)")
    parser.add_argument("--contenders", help="comma-separated subset (default: all available)")
    parser.add_argument("--quick", action="store_true", help="1 round, 4 steps per contender, a small MLP")
    add_results_argument(parser, "the JSON and PNGs")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--records", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.results = results_of(args)
    try:
        parse_rate(args.rate)
    except ValueError as error:
        parser.error(str(error))
    contenders = args.contenders.split(",") if args.contenders else available_contenders()
    unknown = sorted(set(contenders) - set(available_contenders()))
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; pick from {', '.join(available_contenders())}")
    quick_defaults(parser, args, rounds=1, epochs=1, warmup=1)
    settings = {
        "hidden": 256 if args.quick else HIDDEN,
        "epochs": args.epochs,
        "max_steps": 4 if args.quick else -1,
        "warmup": args.warmup,
        "batch": args.batch,
    }
    if args.worker:
        _worker(contenders, settings, args.round, args.records)
        return
    payload = _controller(contenders, settings, args.rounds, args.rate)
    payload["quick"] = args.quick
    path = save("hierarchical", payload, args.results)
    _plot_step_time(payload, args.results / "hierarchical_step_time.png")
    _plot_accuracy(payload, args.results / "hierarchical_accuracy.png")
    _print_table(payload)
    print(f"wrote {path}, hierarchical_step_time.png and hierarchical_accuracy.png in {args.results}")


# --------------------------------------------------------------------------------------------------- controller


def _controller(contenders: list[str], settings: dict[str, Any], rounds: int, rate: str) -> dict[str, Any]:
    """Run ``rounds`` MPI jobs on a 2-node emulated cluster and summarise their records."""
    from cluster import EmulatedCluster

    records: list[dict[str, Any]] = []
    loads: list[dict[str, Any]] = []
    # The ranks append their records here; the folder goes when the run ends (the results are in --results).
    with (
        tempfile.TemporaryDirectory(prefix="hierarchical-") as scratch,
        EmulatedCluster(nodes=NODES, rate=rate) as cluster,
    ):
        records_path = Path(scratch) / "records.jsonl"
        print(f"{cluster.describe()}; records in {records_path}", file=sys.stderr, flush=True)
        for index in range(rounds):
            command = [
                sys.executable,
                __file__,
                "--worker",
                "--round",
                str(index),
                "--contenders",
                ",".join(contenders),
            ]
            command += ["--epochs", str(settings["epochs"]), "--warmup", str(settings["warmup"])]
            command += ["--batch", str(settings["batch"])]
            command += ["--records", str(records_path)] + (["--quick"] if settings["max_steps"] > 0 else [])
            before, started = os.getloadavg(), time.perf_counter()
            done = cluster.run(
                command,
                RANKS_PER_NODE,
                env={"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                timeout=7200,
                capture_output=True,
            )
            if done.returncode != 0:
                sys.exit(f"round {index}: the job failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
            round_records = [json.loads(line) for line in records_path.read_text().splitlines()][len(records) :]
            records += round_records
            after = os.getloadavg()
            loads.append(
                {"round": index, "load_before": before, "load_after": after,
                 "seconds": time.perf_counter() - started, "order": [r["contender"] for r in round_records]}
            )  # fmt: skip
            print(f"round {index}: {len(round_records)} contenders, load average {before[0]:.1f} -> {after[0]:.1f}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return summarize(records, contenders, settings, rate, loads)


def summarize(
    records: list[dict[str, Any]], contenders: list[str], settings: dict[str, Any], rate: str, loads: list[dict]
) -> dict[str, Any]:
    """Medians over rounds, paired ratios, bytes per step and the accuracy curves."""
    by_name = {name: [r for r in records if r["contender"] == name] for name in contenders}
    rounds = len(loads)
    missing = [name for name, rows in by_name.items() if len(rows) != rounds]
    if missing:
        raise RuntimeError(f"contenders without a record in every round: {missing}")
    ms = {name: [r["mean_ms"] for r in rows] for name, rows in by_name.items()}
    rows_out: dict[str, Any] = {}
    for name, rows in by_name.items():
        row = {
            "ms_per_step": statistics.median(ms[name]),
            "ms_range": [min(ms[name]), max(ms[name])],
            "median_step_ms": statistics.median(r["median_ms"] for r in rows),
            "link_mb_per_step": statistics.median(max(r["link_sent_per_node"]) / r["steps"] / 1e6 for r in rows),
            "counted_inter_node_mb_per_step": _median_or_none([r.get("inter_node_bytes") for r in rows], rows),
            "counted_node_mb_per_step": _median_or_none([r.get("node_bytes") for r in rows], rows),
            "steps": rows[0]["steps"],
            "final_accuracy": statistics.median(r["curve"][-1]["accuracy"] for r in rows),
            "fit_seconds": statistics.median(r["curve"][-1]["seconds"] for r in rows),
            "curves": [r["curve"] for r in rows],
            "rounds_ms": ms[name],
            "rounds_step_ms": [r["step_ms"] for r in rows],
            "step_epochs": rows[0]["step_epochs"],
            "load": [r["load"] for r in rows],
            "buckets_mb": rows[0].get("buckets_mb"),
            "syncs": rows[0].get("syncs"),
        }
        if REFERENCE in ms:
            row["vs_flat"] = statistics.median(paired_ratios(ms, name, REFERENCE))
        if "ddp" in ms:
            row["vs_ddp"] = statistics.median(paired_ratios(ms, name, "ddp"))
        rows_out[name] = row
    if "daso" in rows_out:
        rows_out["daso"]["cycling_ms_per_step"] = _daso_cycling_ms(by_name["daso"], settings["epochs"])
    if REFERENCE in rows_out:
        goal = rows_out[REFERENCE]["final_accuracy"] - ACCURACY_MARGIN
        for row in rows_out.values():
            row["seconds_to_flat_accuracy"] = _median_time_to(row["curves"], goal)
    return {
        "nodes": NODES,
        "ranks_per_node": RANKS_PER_NODE,
        "rate": rate,
        "model": f"MLP 64-{settings['hidden']}-{settings['hidden']}-10",
        "parameters": _parameter_count(settings["hidden"]),
        "batch_per_rank": settings["batch"],
        "epochs": settings["epochs"],
        "warmup_steps": settings["warmup"],
        "rounds": loads,
        "contenders": rows_out,
        "targets": _targets(rows_out),
    }


def _daso_cycling_ms(rows: list[dict[str, Any]], epochs: int) -> float | None:
    """The median over rounds of DASO's mean step in its cycling epochs (after the warm-up, before the
    cool-down epochs): its steady state, which a run of a few epochs dilutes with blocking epochs."""
    _, options = SYNC_CONTENDERS["daso"]
    first, last = options["warmup_epochs"], epochs - options["cooldown_epochs"] - 1
    means = []
    for row in rows:
        cycling = [ms for ms, epoch in zip(row["step_ms"], row["step_epochs"], strict=True) if first <= epoch <= last]
        if not cycling:
            return None
        means.append(sum(cycling) / len(cycling))
    return statistics.median(means)


def _median_or_none(values: list[int | None], rows: list[dict[str, Any]]) -> float | None:
    if any(v is None for v in values):
        return None
    return statistics.median(v / r["steps"] / 1e6 for v, r in zip(values, rows, strict=True))


def _median_time_to(curves: list[list[dict[str, float]]], goal: float) -> float | None:
    """The median over rounds of the first training wall time at which the accuracy reached ``goal`` (None when a
    round never did)."""
    times = []
    for curve in curves:
        reached = [p["seconds"] for p in curve if p["accuracy"] >= goal]
        if not reached:
            return None
        times.append(reached[0])
    return statistics.median(times)


def _targets(rows: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's targets, measured: speed-ups over flat, flat against DDP, DASO's time to flat's accuracy."""
    found: dict[str, Any] = {}
    if "flat" in rows:
        for mode in ("daso", "hierarchical_local_sgd"):
            if mode in rows:
                speedup = 1.0 / rows[mode]["vs_flat"]
                found[f"{mode}_speedup"] = {
                    "value": speedup,
                    "target": f">= {SPEEDUP_TARGET}",
                    "met": speedup >= SPEEDUP_TARGET,
                }
        cycling = rows.get("daso", {}).get("cycling_ms_per_step")
        if cycling:
            speedup = rows["flat"]["ms_per_step"] / cycling
            found["daso_cycling_speedup"] = {
                "value": speedup,
                "target": f">= {SPEEDUP_TARGET} (steady state)",
                "met": speedup >= SPEEDUP_TARGET,
            }
        if "ddp" in rows:
            ratio = rows["flat"]["vs_ddp"]
            found["flat_vs_ddp"] = {"value": ratio, "target": f"<= {VS_DDP_TARGET}", "met": ratio <= VS_DDP_TARGET}
        if "daso" in rows:
            daso, flat = rows["daso"]["seconds_to_flat_accuracy"], rows["flat"]["seconds_to_flat_accuracy"]
            met = daso is not None and flat is not None and daso < flat
            found["daso_reaches_flat_accuracy_sooner"] = {"daso_seconds": daso, "flat_seconds": flat, "met": met}
    return found


def _parameter_count(hidden: int) -> int:
    return 64 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10


# --------------------------------------------------------------------------------------------------- output


def _print_table(payload: dict[str, Any]) -> None:
    print(
        f"\n{payload['model']} ({payload['parameters'] / 1e6:.1f} M parameters), digits, "
        f"batch {payload['batch_per_rank']} per rank, {payload['nodes']} nodes x {payload['ranks_per_node']} ranks, "
        f"links {payload['rate']}, "
        f"{len(payload['rounds'])} round(s) of {payload['epochs']} epoch(s)"
    )
    for load in payload["rounds"]:
        print(f"round {load['round']}: load average {load['load_before'][0]:.1f} before, "
              f"{load['load_after'][0]:.1f} after, {load['seconds']:.0f} s")  # fmt: skip
    header = f"{'contender':<24} {'ms/step':>8} {'range':>15} {'x flat':>6} {'x ddp':>6} {'link MB':>8} "
    print(header + f"{'counted MB':>10} {'acc %':>6} {'s to flat-1':>11}")
    for name, row in payload["contenders"].items():
        low, high = row["ms_range"]
        counted = row["counted_inter_node_mb_per_step"]
        reach = row.get("seconds_to_flat_accuracy")
        print(
            f"{name:<24} {row['ms_per_step']:8.0f} {low:7.0f}-{high:<7.0f} {row.get('vs_flat', float('nan')):6.2f} "
            f"{row.get('vs_ddp', float('nan')):6.2f} {row['link_mb_per_step']:8.1f} "
            f"{'-' if counted is None else f'{counted:.1f}':>10} {row['final_accuracy']:6.1f} "
            f"{'-' if reach is None else f'{reach:.0f}':>11}"
        )
    print("link MB: what a node's link sent per step; counted MB: inter-node payload of all ranks per step")
    for name, target in payload["targets"].items():
        print(f"target {name}: {target}")


def _plot_step_time(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["contenders"])
    rows = payload["contenders"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(range(len(names)), [rows[n]["ms_per_step"] for n in names], color="#9ecae1")
    for i, name in enumerate(names):
        ax.plot([i] * len(rows[name]["rounds_ms"]), rows[name]["rounds_ms"], "k.", markersize=4)
        ax.annotate(f"{rows[name]['link_mb_per_step']:.0f} MB", (i, rows[name]["ms_per_step"]),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    if "local_sgd" in rows:  # its steps between two averages send nothing: compute and the framework alone
        floor = rows["local_sgd"]["median_step_ms"]
        ax.axhline(floor, color="grey", linestyle="--", linewidth=0.8, label="a step that sends nothing")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
    ax.set_ylabel("ms per step (bar: median over rounds; dots: rounds)")
    loads = ", ".join(f"{r['load_before'][0]:.0f}" for r in payload["rounds"])
    ax.set_title(
        f"{payload['model']}, {payload['nodes']}x{payload['ranks_per_node']} ranks, {payload['rate']} links "
        f"(labels: MB per step on a node's link; load average {loads})",
        fontsize=9,
    )
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_accuracy(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, (name, row) in enumerate(payload["contenders"].items()):
        color = f"C{index % 10}"
        for number, curve in enumerate(row["curves"]):
            ax.plot([p["seconds"] for p in curve], [p["accuracy"] for p in curve], "-o", color=color,
                    markersize=3, alpha=0.9 if number == 0 else 0.35, label=name if number == 0 else None)  # fmt: skip
    if REFERENCE in payload["contenders"]:
        goal = payload["contenders"][REFERENCE]["final_accuracy"] - ACCURACY_MARGIN
        ax.axhline(goal, color="grey", linestyle="--", linewidth=0.8, label=f"flat's final - {ACCURACY_MARGIN:g}")
    ax.set_xlabel("training wall time, s (validation excluded)")
    ax.set_ylabel("validation accuracy, %")
    ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
    ax.set_title(f"digits, {payload['model']}, {payload['nodes']}x{payload['ranks_per_node']}, {payload['rate']}",
                 fontsize=9)  # fmt: skip
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- worker


def _worker(contenders: list[str], settings: dict[str, Any], round_index: int, records: Path) -> None:
    """In every rank: train every contender once, in this round's order; rank 0 appends one JSON line per contender
    to ``records`` as soon as it is done (the controller follows the file: progress, and partial results)."""
    import logging

    import torch
    from mpi4py import MPI

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "mpistrategy"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    if world.Get_size() != RANKS:
        raise SystemExit(f"hierarchical.py --worker runs at {RANKS} ranks, not {world.Get_size()}")
    order = list(contenders)
    random.Random(round_index).shuffle(order)
    for name in order:
        load_before, started = os.getloadavg(), time.perf_counter()
        record = _train(name, settings, world)
        record["load"] = [load_before[0], os.getloadavg()[0]]
        record["job_seconds"] = time.perf_counter() - started
        if world.Get_rank() == 0:
            with records.open("a") as out:
                out.write(json.dumps({"contender": name, "round": round_index, **record}) + "\n")


def _train(name: str, settings: dict[str, Any], world) -> dict[str, Any]:
    """Fit one contender on every rank; its timings, bytes and accuracy curve (complete on rank 0)."""
    import lightning as L
    import torch

    L.seed_everything(0, verbose=False)
    x_train, y_train, x_val, y_val = _digits()
    module = _classifier(settings["hidden"])
    recorder = _recorder(x_val[world.rank :: world.size], y_val[world.rank :: world.size], len(y_val), world)
    strategy, extra = _strategy(name, world)
    trainer = L.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_epochs=settings["epochs"],
        max_steps=settings["max_steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[recorder],
        **extra,
    )
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_train, y_train), batch_size=settings["batch"], shuffle=True, drop_last=False
    )
    link_before = _link_sent(world)
    trainer.fit(module, loader)
    link_after = _link_sent(world)
    record = recorder.summary(settings["warmup"])
    record["link_sent_per_node"] = [after - before for before, after in zip(link_before, link_after, strict=True)]
    if name == "ddp":
        torch.distributed.destroy_process_group()  # Lightning adds per-step work while it is initialised
    else:
        traffic = trainer.strategy.traffic
        record["node_bytes"] = world.allreduce(traffic.total_node)
        record["inter_node_bytes"] = world.allreduce(traffic.total_inter_node)
        state = getattr(trainer.strategy.sync, "state", None)
        record["syncs"] = dict(state.syncs) if state is not None and hasattr(state, "syncs") else None
    return record


def _digits():
    from mpistrategy.recipes.data import load_digits_split

    return load_digits_split()


def _classifier(hidden: int):
    import lightning as L
    import torch
    from torch import nn

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10)
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)

    return Classifier()


def _strategy(name: str, world) -> tuple[Any, dict[str, Any]]:
    """The Trainer's strategy for ``name`` and the Trainer arguments it needs."""
    if name == "ddp":
        from lightning.fabric.plugins.environments import LightningEnvironment
        from lightning.pytorch.strategies import DDPStrategy

        _lightning_environment(world)
        extra = {"devices": RANKS_PER_NODE, "num_nodes": NODES, "plugins": [LightningEnvironment()]}
        return DDPStrategy(process_group_backend="gloo"), extra
    import importlib

    from mpistrategy.strategy import MPIADStrategy
    from mpistrategy.sync import build_sync

    if name in COMPRESSORS:
        module, cls, options = COMPRESSORS[name]
        compressor = getattr(importlib.import_module(f"mpistrategy.aggregation.{module}"), cls)(**options)
        return MPIADStrategy(sync="hierarchical", aggregator=compressor), {}
    mode, options = SYNC_CONTENDERS[name]
    return MPIADStrategy(sync=build_sync(mode, **options)), {}


def rendezvous(world) -> tuple[str, int]:
    """Rank 0's host name (``node0`` on the emulated cluster) and a port free there, on every rank: where a
    torch.distributed job across the nodes meets."""
    address = port = None
    if world.rank == 0:
        address = socket.gethostname()
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    return world.bcast((address, port), root=0)


def _lightning_environment(world) -> None:
    """LightningEnvironment's variables for a DDP across the emulated nodes."""
    address, port = rendezvous(world)
    os.environ.update(
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        NODE_RANK=str(world.rank // RANKS_PER_NODE),
        LOCAL_RANK=str(world.rank % RANKS_PER_NODE),
        WORLD_SIZE=str(world.size),
    )


def _link_sent(world) -> list[int]:
    """Per node, the bytes its ``eth0`` has sent so far (read by the node's local rank 0, gathered to all)."""
    sent = None
    if world.rank % RANKS_PER_NODE == 0:
        with open("/proc/net/dev") as table:
            for line in table:
                device, _, counters = line.partition(":")
                if device.strip() == "eth0":
                    sent = int(counters.split()[8])
    return [value for value in world.allgather(sent) if value is not None]


def _recorder(x_val, y_val, val_total: int, world):
    """A callback that times every step and, after every epoch, measures validation accuracy (collective)."""
    import lightning as L
    import torch

    class Recorder(L.Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.epochs: list[int] = []  # the epoch of every step
            self.curve: list[dict[str, float]] = []
            self.batch_start: float | None = None
            self.fit_start = 0.0
            self.validating = 0.0
            self.buckets_mb: list[float] | None = None

        def on_train_start(self, trainer, module) -> None:
            self.fit_start = time.perf_counter()
            self._validate(module)

        def on_train_end(self, trainer, module) -> None:
            engine = getattr(trainer.strategy, "_engine", None)  # mpi_ad's gradient buckets (the messages per step)
            if engine is not None and engine.reducer is not None:
                self.buckets_mb = [bucket.nbytes / 1e6 for bucket in engine.reducer.buckets]

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.batch_start is not None:
                self.steps.append(now - self.batch_start)
            self.batch_start = now
            self.epochs.append(trainer.current_epoch)

        def on_train_epoch_end(self, trainer, module) -> None:
            if self.batch_start is not None:
                self.steps.append(time.perf_counter() - self.batch_start)
                self.batch_start = None
            self._validate(module)

        def _validate(self, module) -> None:
            started = time.perf_counter()
            with torch.no_grad():
                correct = int((module.net(x_val).argmax(dim=1) == y_val).sum())
            total = world.allreduce(correct)
            seconds = started - self.fit_start - self.validating
            self.curve.append({"seconds": seconds, "accuracy": 100.0 * total / val_total})
            self.validating += time.perf_counter() - started

        def summary(self, warmup: int) -> dict[str, Any]:
            timed = self.steps[warmup:] or self.steps
            return {
                "steps": len(self.steps),
                "mean_ms": 1e3 * sum(timed) / len(timed),
                "median_ms": 1e3 * statistics.median(timed),
                "step_ms": [1e3 * s for s in self.steps],
                "step_epochs": self.epochs[: len(self.steps)],
                "curve": self.curve,
                "buckets_mb": self.buckets_mb,
            }

    return Recorder()


if __name__ == "__main__":
    main()
