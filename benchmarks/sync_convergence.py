"""Accuracy against inter-node traffic of every sync mode: scikit-learn digits, 4 ranks as 2 nodes of 2.

    python benchmarks/sync_convergence.py                 # relaunches itself under mpiexec -n 4
    mpiexec -n 4 python benchmarks/sync_convergence.py [--epochs 6] [--modes flat,daso] [--results DIR]

Every mode trains mpistrategy-train's main job (the digits MLP, SGD with momentum, cosine schedule, batch 32 per
rank), composed by Hydra exactly as ``mpistrategy-train strategy=<mode> ...`` would, with ``ranks_per_node=2``
(the same as ``MPISTRATEGY_RANKS_PER_NODE=2``), from the same seed and for the same number of epochs:

| mode | options | must be within (points of flat's final val/acc) |
| --- | --- | --- |
| ``flat`` | ``strategy=mpi_ad`` | (the reference) |
| ``hierarchical`` | ``strategy=hierarchical`` | 1 |
| ``local_sgd`` | ``strategy=local_sgd strategy.period=8`` | 2 |
| ``hierarchical_local_sgd`` | ``strategy=hierarchical_local_sgd strategy.period=4`` | 1 |
| ``daso`` | ``strategy=daso strategy.warmup_epochs=1 strategy.cooldown_epochs=1`` | 1 |
| ``gossip`` | ``strategy=gossip strategy.graph=ring`` | 2 |

After every epoch's validation it records ``val/acc`` (all ranks' predictions, each rank validating its own
replica) and the bytes sent so far by the whole job, by scope: the sum over the ranks of
``trainer.strategy.traffic`` (payload bytes handed to MPI, see :mod:`mpistrategy.comm.traffic`). Prints a table,
writes ``sync_convergence.json`` and ``sync_convergence.png`` (validation accuracy against inter-node bytes, and
against epochs) in ``--results`` (default benchmarks/results). Accuracy is the point here; no time is compared.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import RESULTS, ensure_mpi, integer_in, save, writable_directory  # noqa: E402

RANKS = 4
RANKS_PER_NODE = 2
#: mode -> (its Hydra overrides, the most points its final val/acc may lie below or above flat's)
MODES: dict[str, tuple[list[str], float | None]] = {
    "flat": (["strategy=mpi_ad"], None),
    "hierarchical": (["strategy=hierarchical"], 1.0),
    "local_sgd": (["strategy=local_sgd", "strategy.period=8"], 2.0),
    "hierarchical_local_sgd": (["strategy=hierarchical_local_sgd", "strategy.period=4"], 1.0),
    "daso": (["strategy=daso", "strategy.warmup_epochs=1", "strategy.cooldown_epochs=1"], 1.0),
    "gossip": (["strategy=gossip", "strategy.graph=ring"], 2.0),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=integer_in(1), default=6, help="epochs per mode")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes (flat first)")
    parser.add_argument("--results", type=writable_directory, default=RESULTS, help="where to write the JSON and PNG")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown or modes[0] != "flat":
        parser.error(f"--modes: start with flat and pick from {', '.join(MODES)} (unknown: {unknown})")
    ensure_mpi(RANKS)
    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning.pytorch", "lightning.fabric", "mpistrategy"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    runs = {mode: train(mode, args.epochs) for mode in modes}
    if rank != 0:
        return
    payload = summarize(runs, args.epochs)
    print_table(payload)
    save("sync_convergence", payload, args.results)
    plot(payload, args.results / "sync_convergence.png")


def train(mode: str, epochs: int) -> dict[str, Any]:
    """Fit ``mode``'s recipe on every rank; per epoch its val/acc and the job's bytes so far (rank 0's copy)."""
    import lightning as L
    import torch
    from hydra import compose, initialize_config_dir

    import mpistrategy.recipes.hydra_mpi  # noqa: F401  (registers the resolvers)
    from mpistrategy.recipes.builders import build_run
    from mpistrategy.recipes.train import CONFIG_DIR

    overrides = [
        *MODES[mode][0],
        f"strategy.ranks_per_node={RANKS_PER_NODE}",
        f"trainer.max_epochs={epochs}",
        "trainer.enable_checkpointing=false",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "logger=none",
        "callbacks=none",
        "torch_threads=1",
    ]
    with tempfile.TemporaryDirectory(prefix="sync_convergence-") as output_dir:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, f"paths.output_dir={output_dir}"])
        torch.set_num_threads(cfg.torch_threads)
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        run = build_run(cfg)
        recorder = epoch_recorder()
        run.trainer.callbacks.append(recorder)
        start = time.perf_counter()
        run.trainer.fit(run.model, datamodule=run.datamodule)
        seconds = time.perf_counter() - start
    node, inter_node = job_bytes(run.trainer.strategy)  # the strategy keeps its counter after the fit
    return {
        "overrides": MODES[mode][0],
        "epochs": recorder.epochs,
        "node_bytes": node,
        "inter_node_bytes": inter_node,
        "fit_seconds": seconds,
        "steps": run.trainer.global_step,
    }


def job_bytes(strategy: Any) -> tuple[float, float]:
    """``(node, inter_node)`` payload bytes sent so far by all ranks: the sum of every rank's
    ``strategy.traffic`` totals (collective)."""
    import torch

    traffic = strategy.traffic
    sent = torch.tensor([float(traffic.total_node), float(traffic.total_inter_node)], dtype=torch.float64)
    node, inter_node = strategy.reduce(sent, reduce_op="sum").tolist()
    return node, inter_node


def epoch_recorder() -> Any:
    """A Lightning callback that, after each validation, appends to its ``epochs`` the ``val/acc`` and the bytes
    sent by all ranks so far (collective: every rank validates)."""
    import lightning as L

    class EpochRecorder(L.Callback):
        def __init__(self) -> None:
            self.epochs: list[dict[str, float]] = []

        def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            node, inter_node = job_bytes(trainer.strategy)
            self.epochs.append(
                {
                    "epoch": trainer.current_epoch,
                    "step": trainer.global_step,
                    "val_acc": float(trainer.callback_metrics["val/acc"]),
                    "node_bytes": node,
                    "inter_node_bytes": inter_node,
                }
            )

    return EpochRecorder()


def summarize(runs: dict[str, dict[str, Any]], epochs: int) -> dict[str, Any]:
    """Final accuracy, its difference to flat in points, bytes per mode and against flat; the tolerances."""
    flat = runs["flat"]
    rows = []
    for mode, run in runs.items():
        last = run["epochs"][-1]
        tolerance = MODES[mode][1]
        points = 100.0 * (last["val_acc"] - flat["epochs"][-1]["val_acc"])
        rows.append(
            {
                "mode": mode,
                "overrides": " ".join(run["overrides"]),
                "final_val_acc": last["val_acc"],
                "points_vs_flat": points,
                "tolerance_points": tolerance,
                "within_tolerance": tolerance is None or abs(points) <= tolerance,
                "inter_node_bytes": run["inter_node_bytes"],
                "node_bytes": run["node_bytes"],
                "inter_node_vs_flat": run["inter_node_bytes"] / flat["inter_node_bytes"],
                "steps": run["steps"],
                "fit_seconds": run["fit_seconds"],
                "curve": run["epochs"],
            }
        )
    return {"ranks": RANKS, "ranks_per_node": RANKS_PER_NODE, "epochs": epochs, "rows": rows}


def print_table(payload: dict[str, Any]) -> None:
    header = (
        f"{'mode':<24}{'val/acc':>9}{'vs flat':>10}{'limit':>7}{'inter-node MB':>15}{'x flat':>8}{'node MB':>10}"
        f"{'fit s':>8}"
    )
    print(f"digits MLP, {payload['ranks']} ranks as nodes of {payload['ranks_per_node']}, {payload['epochs']} epochs")
    print(header)
    for row in payload["rows"]:
        limit = "" if row["tolerance_points"] is None else f"{row['tolerance_points']:.0f}"
        verdict = "" if row["within_tolerance"] else "  OUTSIDE"
        print(
            f"{row['mode']:<24}{row['final_val_acc']:>9.4f}{row['points_vs_flat']:>+10.2f}{limit:>7}"
            f"{row['inter_node_bytes'] / 1e6:>15.2f}{row['inter_node_vs_flat']:>8.3f}{row['node_bytes'] / 1e6:>10.2f}"
            f"{row['fit_seconds']:>8.1f}{verdict}"
        )


def plot(payload: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bytes, ax_epochs) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in payload["rows"]:
        curve = row["curve"]
        accuracy = [point["val_acc"] for point in curve]
        megabytes = [max(point["inter_node_bytes"], 1.0) / 1e6 for point in curve]
        ax_bytes.plot(megabytes, accuracy, "o-", markersize=3, label=row["mode"])
        ax_epochs.plot([point["epoch"] + 1 for point in curve], accuracy, "o-", markersize=3, label=row["mode"])
    ax_bytes.set_xscale("log")
    ax_bytes.set_xlabel("inter-node bytes sent by all ranks so far (MB, log scale)")
    ax_epochs.set_xlabel("epoch")
    for ax in (ax_bytes, ax_epochs):
        ax.set_ylabel("validation accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"sync modes on digits: {payload['ranks']} ranks as nodes of {payload['ranks_per_node']}, "
        f"{payload['epochs']} epochs"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
