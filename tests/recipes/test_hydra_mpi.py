"""Hydra under mpiexec: one run directory decided by rank 0, one writer, sweeps in lockstep."""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path

import pytest

from mpistrategy.launch import mpiexec_command
from tests.recipes._cli import clean_env, run, train_command

FAST = ["experiment=debug", "trainer.max_epochs=2", "trainer.limit_val_batches=1"]


def _failing_sweep(tmp_path: Path, arguments: list[str], **env: str) -> subprocess.CompletedProcess:
    """``mpistrategy-train -m <arguments>`` on 2 ranks, logging under ``tmp_path/logs``; it must exit 1."""
    command = [*mpiexec_command(), "-n", "2", *train_command(), "-m", *arguments]
    result = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=420,
        env=clean_env(MPISTRATEGY_LOG_DIR=str(tmp_path / "logs"), **env),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-6000:]
    return result


def test_a_two_rank_run_writes_one_run_dir_with_one_config_copy_and_one_set_of_logs(tmp_path: Path) -> None:
    # Rank 1 starts 1.5 s after rank 0: left alone, Hydra would give it another timestamped run dir.
    train = train_command()
    command = [
        *mpiexec_command(), "-n", "1", *train, *FAST, ":",
        "-n", "1", "sh", "-c", 'sleep 1.5; exec "$@"', "sh", *train, *FAST,
    ]  # fmt: skip
    result = run(command, cwd=tmp_path, timeout=300, MPISTRATEGY_LOG_DIR=str(tmp_path / "logs"))

    runs = list((tmp_path / "logs" / "debug" / "runs").iterdir())
    assert len(runs) == 1, runs
    run_dir = runs[0]
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert [p.name for p in run_dir.glob("*.log")] == ["train.log"]
    assert sorted(p.name for p in (run_dir / "csv").iterdir()) == ["hparams.yaml", "metrics.csv"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch001.ckpt", "last.ckpt"]
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "MPIADStrategy"
    assert (summary["nodes"], summary["ranks_per_node"]) == (1, [2])
    assert (summary["sync"], summary["aggregator"]) == ("FlatSync()", "MeanAggregator()")
    assert re.search(r"nodes +│? *1 \(2 ranks\)", result.stdout), result.stdout[-3000:]
    log_text = (run_dir / "train.log").read_text()
    assert "rank 0 of 2" in log_text and "rank 1 of 2" not in log_text
    # Nothing anywhere else: no second run dir, no ./outputs, no lightning_logs.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    assert result.stdout.count("Run summary") == 1


def test_a_three_point_sweep_under_mpiexec_compares_its_points_and_lists_a_failed_one(tmp_path: Path) -> None:
    """Point 1 (``trainer.max_epochs=-1``: no length for the cosine scheduler) fails while building, on every rank:
    the sweep goes on, the error is printed once, every rank exits 1, and the comparison lists the point as failed
    (written as each point ends: Hydra's sweeper raises the failure before its end-of-sweep callback)."""
    result = _failing_sweep(tmp_path, ["trainer.max_epochs=2,-1,1", *FAST[:1], *FAST[2:]], MPISTRATEGY_RANK_LOGS="1")
    assert result.stderr.count("scheduler.T_max=-1 (trainer.max_epochs=-1)") == 1, result.stderr[-6000:]
    assert "Traceback" not in result.stderr
    sweeps = list((tmp_path / "logs" / "debug" / "multiruns").iterdir())
    assert len(sweeps) == 1, sweeps
    sweep = sweeps[0]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1", "2"]
    for job, epochs in zip(jobs, (2, -1, 1), strict=True):
        assert (job / ".hydra" / "config.yaml").is_file()
        # Per-rank logs (MPISTRATEGY_RANK_LOGS=1) are named by rank: rank 1 ran this same point in this same dir.
        assert sorted(p.name for p in job.glob("*.log")) == ["train.log", "train.rank1.log"]
        assert f"rank 1 of 2: debug trainer.max_epochs={epochs} " in (job / "train.rank1.log").read_text()
        if epochs > 0:
            summary = json.loads((job / "summary.json").read_text())
            assert f"trainer.max_epochs={epochs}" in summary["overrides"] and summary["epochs"] == epochs
            assert (job / "csv" / "metrics.csv").is_file()
    assert not (jobs[1] / "summary.json").exists()
    assert [p.name for p in sweep.glob("*.yaml")] == ["multirun.yaml"]
    assert (sweep / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with (sweep / "comparison.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "completed"), ("1", "failed"), ("2", "completed")]
    assert all(row["objective"] == "val/acc" and float(row["final"]) >= 0 for row in (rows[0], rows[2]))
    assert rows[1]["final"] == "" and rows[1]["error"].startswith("ValidationError: scheduler.T_max=-1")
    assert result.stdout.count("Launching 3 jobs locally") == 1  # Hydra's own messages: rank 0 only


def test_a_sweep_point_failing_inside_fit_on_every_rank_is_listed_and_the_sweep_goes_on(tmp_path: Path) -> None:
    """Point 0 (a negative learning rate) raises in ``fit`` on every rank, in step: no abort; point 1 trains."""
    result = _failing_sweep(tmp_path, ["optimizer.lr=-0.1,0.1", *FAST])
    assert "aborting all ranks" not in result.stderr + result.stdout
    assert (result.stderr + result.stdout).count("Error executing job with overrides") == 1  # rank 0 only
    (sweep,) = (tmp_path / "logs" / "debug" / "multiruns").iterdir()
    with (sweep / "comparison.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "failed"), ("1", "completed")]
    assert rows[0]["error"] == "ValueError: Invalid learning rate: -0.1" and float(rows[1]["final"]) > 0


def test_a_sweep_over_experiments_keeps_its_points_in_one_sweep_dir(tmp_path: Path) -> None:
    """Each experiment sets its own task_name; the points still share the sweep's dir (named by the sweep's
    task_name) and its comparison."""
    command = [*mpiexec_command(), "-n", "2", *train_command(), "-m", "experiment=debug,digits_mlp", *FAST[1:]]
    command += ["trainer.max_epochs=1", "trainer.limit_train_batches=2"]
    run(command, tmp_path, timeout=420, MPISTRATEGY_LOG_DIR=str(tmp_path / "logs"))
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["train"]
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    with (sweep / "comparison.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "completed"), ("1", "completed")]
    assert [row["overrides"].split()[0] for row in rows] == ["experiment=debug", "experiment=digits_mlp"]
    assert [json.loads((sweep / job / "summary.json").read_text())["task_name"] for job in "01"] == [
        "debug",
        "digits_mlp",
    ]


def test_a_slurm_sweep_under_mpiexec_is_refused_before_any_point_is_submitted(tmp_path: Path) -> None:
    """Under mpiexec every rank would submit every point as its own SLURM job, into one sweep dir."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    result = _failing_sweep(tmp_path, ["hydra/launcher=slurm_local", *FAST])
    assert result.stderr.count("Error: hydra/launcher=slurm_local starts every point of the sweep itself") == 1
    assert "without mpiexec or srun: mpistrategy-train -m hydra/launcher=slurm_local" in result.stderr
    assert not list(tmp_path.rglob(".submitit")), "a point was submitted"


@pytest.mark.parametrize("ranks", [2])
def test_the_main_job_reaches_95_percent(tmp_path: Path, ranks: int) -> None:
    """The default job (no arguments) on 2 ranks: digits MLP, mpi_ad, >= 95 % validation accuracy.

    How long it takes is measured by benchmarks, not asserted here; the summary must report a finite fit time.
    """
    run(
        [*mpiexec_command(), "-n", str(ranks), *train_command(), "callbacks.progress_bar.refresh_rate=0"],
        cwd=tmp_path,
        timeout=300,
        MPISTRATEGY_LOG_DIR=str(tmp_path / "logs"),
    )
    (run_dir,) = (tmp_path / "logs" / "train" / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final"]["val/acc"] >= 0.95, summary
    assert summary["world_size"] == ranks
    assert 0 < float(summary["fit_seconds"]) < float("inf"), summary
