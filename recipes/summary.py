"""End-of-run summary (table, ``summary.json``, ``curves.png``) and the sweep comparison (``comparison.png``).

Rank 0 only: the callers check the rank. Reads what Lightning's CSVLogger wrote (``<run dir>/csv/metrics.csv``).
Each run writes its outcome to ``<job dir>/status.json``: ``started`` when it starts, ``completed`` or ``failed``
(with the error) when it ends, ``stopped`` when a stop signal ended it after a checkpoint (resumable), so that a
run killed on the way (a time limit, a rank's abort) stays ``started``.
In a sweep the comparison is rewritten as each point ends, over the points done so far: a point that fails (which
makes Hydra's sweeper stop before its end-of-sweep callback) leaves the comparison of the others, with itself
listed as failed. A job array's points are single runs (their statuses are read by
``python -m mpistrategy.recipes.summary <sweep dir>``, where a point still ``started`` is listed as not ended).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback as HydraCallback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

SUMMARY_FILE = "summary.json"
CURVES_FILE = "curves.png"
COMPARISON_PNG = "comparison.png"
COMPARISON_CSV = "comparison.csv"
STATUS_FILE = "status.json"
STARTED, COMPLETED, FAILED, STOPPED = "started", "completed", "failed", "stopped"


# --- reading metrics --------------------------------------------------------------------------------------------------


def read_metrics(csv_path: str | Path) -> dict[str, list[tuple[float, float, float]]]:
    """``{metric: [(step, epoch, value), ...]}`` from a CSVLogger ``metrics.csv`` (empty if there is none)."""
    path = Path(csv_path)
    series: dict[str, list[tuple[float, float, float]]] = {}
    if not path.is_file():
        return series
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            step = _number(row.get("step"))
            epoch = _number(row.get("epoch"))
            for key, text in row.items():
                if key in ("step", "epoch") or key is None:
                    continue
                value = _number(text)
                if value is not None:
                    series.setdefault(key, []).append((step or 0.0, epoch or 0.0, value))
    return series


def _number(text: Any) -> float | None:
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def _epoch_key(series: dict[str, Any], name: str) -> str | None:
    """The per-epoch series of ``name``: ``name_epoch`` if the module logged both step and epoch values."""
    for key in (f"{name}_epoch", name):
        if key in series:
            return key
    return None


# --- one run ----------------------------------------------------------------------------------------------------------


def summarize_run(
    run_dir: str | Path,
    *,
    metrics_csv: str | Path | None = None,
    extra: dict[str, Any] | None = None,
    objective: str = "val/acc",
    mode: str = "max",
    plot: bool = True,
    table: bool = True,
) -> dict[str, Any]:
    """Write ``summary.json`` (and ``curves.png``) in ``run_dir``; print a table. Returns the summary.

    The final values come from the CSV log's last epoch; without one (``logger=none``), from ``extra["metrics"]``
    (the Trainer's last logged values), and the best value is then unknown."""
    run_dir = Path(run_dir)
    series = read_metrics(metrics_csv or run_dir / "csv" / "metrics.csv")
    summary: dict[str, Any] = dict(extra or {})
    logged = summary.get("metrics") or {}
    final: dict[str, float] = {}
    for name in ("train/loss", "train/acc", "val/loss", "val/acc", "test/loss", "test/acc"):
        key = _epoch_key(series, name)
        if key and series[key]:
            final[name] = series[key][-1][2]
        elif not series and (key := _epoch_key(logged, name)) is not None:
            final[name] = float(logged[key])
    summary["final"] = final
    key = _epoch_key(series, objective)
    if key and series[key]:
        values = [v for _, _, v in series[key]]
        summary["best"] = {objective: max(values) if mode == "max" else min(values)}
    summary["objective"] = {"name": objective, "value": final.get(objective)}
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    if plot and series:
        try:
            plot_curves(series, run_dir / CURVES_FILE, title=str(summary.get("experiment", "")))
        except Exception as exc:  # a plot must never fail a finished run
            log.warning("could not plot the curves: %s", exc)
    if table:
        print_table(summary)
    return summary


def bytes_sent(strategy: Any) -> dict[str, Any]:
    """``{"bytes_sent": {"total", "node", "inter_node"}}``: the payload bytes this rank sent while fitting, from
    ``strategy.traffic`` (mpi_ad's :class:`~mpistrategy.comm.traffic.TrafficCounter`, which counts gradient and model
    averaging); empty without one, and without data parallelism (a model's own collectives are not counted)."""
    traffic = getattr(strategy, "traffic", None)
    if traffic is None or getattr(strategy, "data_parallel", True) is False:
        return {}
    return {"bytes_sent": {"total": traffic.total, "node": traffic.total_node, "inter_node": traffic.total_inter_node}}


def parallel_layout(strategy: Any) -> dict[str, Any]:
    """The nodes (and ranks on each) an mpistrategy strategy ran on, its sync mode and its aggregator, as the run
    summary records them; empty for another strategy."""
    sync, aggregator = getattr(strategy, "sync", None), getattr(strategy, "aggregator", None)
    if sync is None or aggregator is None:
        return {}
    topology = strategy.topology
    return {
        "nodes": topology.num_nodes,
        "ranks_per_node": list(topology.node_sizes),
        "sync": repr(sync),
        "aggregator": repr(aggregator),
    }


def _megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def print_table(summary: dict[str, Any]) -> None:
    rows: list[tuple[str, str]] = []
    for key in ("experiment", "world_size", "strategy", "epochs", "global_step", "fit_seconds", "samples_per_second"):
        if key in summary:
            rows.append((key, str(summary[key])))
        if key == "strategy" and "nodes" in summary:
            sizes = " + ".join(map(str, summary["ranks_per_node"]))
            rows.append(("nodes", f"{summary['nodes']} ({sizes} ranks)"))
            rows += [("sync", summary["sync"]), ("aggregator", summary["aggregator"])]
    if "bytes_sent" in summary:
        sent = summary["bytes_sent"]
        split = f"node {_megabytes(sent['node'])}, inter-node {_megabytes(sent['inter_node'])}"
        rows.append(("bytes sent (rank 0)", f"{_megabytes(sent['total'])} ({split})"))
    for name, value in summary.get("final", {}).items():
        rows.append((f"final {name}", f"{value:.4f}"))
    for name, value in summary.get("best", {}).items():
        rows.append((f"best {name}", f"{value:.4f}"))
    if "run_dir" in summary:
        rows.append(("run dir", str(summary["run_dir"])))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="Run summary", show_header=False)
        table.add_column("what", style="bold")
        table.add_column("value")
        for row in rows:
            table.add_row(*row)
        Console(width=100).print(table)
    except ImportError:
        width = max(len(k) for k, _ in rows) if rows else 0
        print("Run summary")
        for key, value in rows:
            print(f"  {key.ljust(width)}  {value}")


def plot_curves(series: dict[str, list[tuple[float, float, float]]], path: str | Path, title: str = "") -> None:
    """Loss (per step and per epoch) and accuracy (per epoch) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for key, style in (("train/loss_step", "-"), ("train/loss_epoch", "o-"), ("val/loss", "s-")):
        if key in series:
            steps, _, values = zip(*series[key], strict=True)
            ax_loss.plot(steps, values, style, label=key, alpha=0.6 if key.endswith("_step") else 1.0)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    for key in ("train/acc", "val/acc"):
        if key in series:
            steps, _, values = zip(*series[key], strict=True)
            ax_acc.plot(steps, values, "o-", label=key)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("accuracy")
    ax_acc.legend()
    ax_acc.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- a sweep ----------------------------------------------------------------------------------------------------------


def compare_sweep(sweep_dir: str | Path, objective: str | None = None) -> list[dict[str, Any]]:
    """Collect every job's ``summary.json`` and ``status.json`` under ``sweep_dir``; write ``comparison.csv`` and
    ``comparison.png``. A job is listed as failed, stopped (resumable) or started only (killed on the way), when
    its ``status.json`` says so (it then has no values)."""
    sweep_dir = Path(sweep_dir)
    job_dirs = {path.parent for name in (SUMMARY_FILE, STATUS_FILE) for path in sweep_dir.glob(f"*/{name}")}
    points = [_point(job, objective) for job in sorted(job_dirs, key=lambda p: _job_order(p.name))]
    if not points:
        log.warning("no %s under %s: nothing to compare", SUMMARY_FILE, sweep_dir)
        return points
    # Label each point by what differs between points (the swept overrides), not what they share.
    split = [p["overrides"].split() for p in points]
    common = set.intersection(*(set(s) for s in split)) if len(points) > 1 else set()
    for p, parts in zip(points, split, strict=True):
        p["label"] = " ".join(x for x in parts if x not in common) or p["overrides"]
    # Points that end together (a SLURM launcher) rewrite the files at once: each writes its own and renames it.
    partial = sweep_dir / f".{COMPARISON_CSV}.{os.getpid()}"
    with partial.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["job", "status", "overrides", "objective", "final", "best", "fit_seconds", "error"])
        for p in points:
            row = [p["value"], p["best"], p["fit_seconds"], p["error"]]
            writer.writerow([p["job"], p["status"], p["overrides"], p["objective"], *row])
    os.replace(partial, sweep_dir / COMPARISON_CSV)
    partial = sweep_dir / f".{os.getpid()}.{COMPARISON_PNG}"
    try:
        plot_comparison(points, partial)
        os.replace(partial, sweep_dir / COMPARISON_PNG)
    except Exception as exc:
        log.warning("could not plot the sweep comparison: %s", exc)
    return points


def _point(job_dir: Path, objective: str | None) -> dict[str, Any]:
    """One row of the comparison: the job's summary (if it wrote one) and its status (``completed`` without a
    ``status.json``, as in sweeps that ran before these files existed)."""
    summary = _read_json(job_dir / SUMMARY_FILE)
    status = _read_json(job_dir / STATUS_FILE)
    ended = status.get("status", COMPLETED) == COMPLETED
    name = objective or summary.get("objective", {}).get("name", "val/acc")
    overrides = summary.get("overrides") or status.get("overrides") or []
    return {
        "job": job_dir.name,
        "status": status.get("status", COMPLETED),
        "overrides": " ".join(overrides) or job_dir.name,
        "objective": name,
        "value": summary.get("final", {}).get(name) if ended else None,
        "best": summary.get("best", {}).get(name) if ended else None,
        "fit_seconds": summary.get("fit_seconds") if ended else None,
        "error": status.get("error", ""),
        "curve": job_dir / "csv" / "metrics.csv",
    }


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def write_status(job_dir: str | Path, overrides: list[str], state: str, error: BaseException | None = None) -> None:
    """``<job_dir>/status.json``: ``state`` (``started``, ``completed``, ``failed``, or ``stopped`` by a stop
    signal after a checkpoint, resumable; with the first line of the error that caused ``error``: Hydra's
    ``InstantiationException`` only says which target failed)."""
    status: dict[str, Any] = {"status": state, "overrides": list(overrides)}
    if error is not None:
        while error.__cause__ is not None:
            error = error.__cause__
        lines = str(error).strip().splitlines()
        status["error"] = f"{type(error).__name__}: {lines[0] if lines else ''}"
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / STATUS_FILE).write_text(json.dumps(status, indent=2, sort_keys=True) + "\n")


def _job_order(name: str) -> tuple[int, str]:
    return (int(name), name) if name.isdigit() else (1 << 30, name)


_NOT_ENDED = {FAILED: FAILED, STARTED: "did not end", STOPPED: "stopped (resumable)"}


def plot_comparison(points: list[dict[str, Any]], path: str | Path) -> None:
    """Left: the final objective of each point (bars). Right: each point's objective per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objective = points[0]["objective"]
    fig, (ax_bar, ax_curve) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"#{p['job']}: {p.get('label', p['overrides'])}" for p in points]
    values = [p["value"] if p["value"] is not None else 0.0 for p in points]
    colors = [
        {FAILED: "tab:red", STARTED: "tab:gray", STOPPED: "tab:orange"}.get(p.get("status", ""), "tab:blue")
        for p in points
    ]
    bars = ax_bar.barh(range(len(points)), values, color=colors)
    ax_bar.set_yticks(range(len(points)), labels, fontsize=8)
    ax_bar.invert_yaxis()
    ax_bar.set_xlabel(f"final {objective}")
    for bar, p in zip(bars, points, strict=True):
        text = _NOT_ENDED.get(p.get("status", ""), "n/a" if p["value"] is None else f"{p['value']:.4f}")
        ax_bar.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {text}", va="center", fontsize=8)
    for p, label in zip(points, labels, strict=True):
        series = read_metrics(p["curve"])
        key = _epoch_key(series, objective)
        if key:
            epochs = [e for _, e, _ in series[key]]
            ax_curve.plot(epochs, [v for _, _, v in series[key]], "o-", label=label, markersize=3)
    ax_curve.set_xlabel("epoch")
    ax_curve.set_ylabel(objective)
    ax_curve.grid(alpha=0.3)
    if ax_curve.lines:
        ax_curve.legend(fontsize=7)
    fig.suptitle(f"sweep comparison: {objective}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class SweepSummaryCallback(HydraCallback):
    """Hydra callback, rank 0 (or the submitting process) only: as each run starts and ends, its ``status.json``;
    as each sweep point ends, the comparison of the points done so far; after the sweep, the comparison once more
    (a sweeper that runs its points elsewhere, such as submitit's, ends its points in other processes)."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mpistrategy.recipes.hydra_mpi import rank

        if rank() == 0:
            self._write_status(config, STARTED)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        from mpistrategy.recipes.hydra_mpi import rank

        if rank() != 0:
            return
        # the failed job's exception; reading ``return_value`` would raise it (the sweeper does that, later)
        error = job_return._return_value if job_return.status == JobStatus.FAILED else None
        self._write_status(config, COMPLETED if error is None else FAILED, error)
        if OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN:
            try:
                self._compare(config)
            except Exception as exc:  # the comparison must never fail a sweep point
                log.warning("could not write the sweep comparison: %s", exc)

    @staticmethod
    def _write_status(config: DictConfig, state: str, error: BaseException | None = None) -> None:
        job_dir = OmegaConf.select(config, "hydra.runtime.output_dir")
        overrides = list(OmegaConf.select(config, "hydra.overrides.task", default=None) or [])
        try:
            write_status(job_dir, overrides, state, error)
        except OSError as exc:  # the status must never fail a run
            log.warning("could not write %s in %s: %s", STATUS_FILE, job_dir, exc)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from mpistrategy.recipes.hydra_mpi import rank

        if rank() != 0:
            return
        points = self._compare(config)
        if points:
            sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
            log.info("sweep comparison of %d points: %s", len(points), Path(sweep_dir) / COMPARISON_PNG)

    @staticmethod
    def _compare(config: DictConfig) -> list[dict[str, Any]]:
        sweep_dir = OmegaConf.select(config, "hydra.sweep.dir")
        return compare_sweep(sweep_dir, OmegaConf.select(config, "objective", default=None))


def main(argv: list[str] | None = None) -> int:
    """``python -m mpistrategy.recipes.summary <sweep dir> [objective]``: the comparison of a finished sweep (job
    arrays)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("sweep_dir", help="a folder whose sub-folders hold summary.json files")
    parser.add_argument("objective", nargs="?", default=None, help="the metric to compare (default: each run's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    points = compare_sweep(args.sweep_dir, args.objective)
    for p in points:
        outcome = f"{p['objective']} = {p['value']}" if p["status"] == COMPLETED else f"{p['status']}: {p['error']}"
        print(f"#{p['job']}: {p.get('label', p['overrides'])}: {outcome}")
    return 0 if points else 1


if __name__ == "__main__":
    raise SystemExit(main())
