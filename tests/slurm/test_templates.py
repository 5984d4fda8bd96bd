"""Every slurm/*.sbatch template, submitted with sbatch to a real SLURM, runs to completion and leaves metrics;
a SIGUSR1 leads to a checkpoint, a requeue and a resumed run; a Hydra -m sweep runs through submitit."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm._jobs import TEMPLATES, job_env, job_info, output_of, sbatch, start_now, state, wait_for

pytestmark = pytest.mark.usefixtures("slurm_cluster")

SMALL = "trainer.max_epochs=2 callbacks.progress_bar.refresh_rate=0 trainer.enable_model_summary=false"
# One node here: the multi-node templates are submitted with one node and two ranks.
ONE_NODE = ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10")


def _check_run(run_dir: Path, world_size: int = 2) -> dict:
    assert (run_dir / "csv" / "metrics.csv").is_file(), sorted(p.name for p in run_dir.iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == world_size
    assert summary["final"]["val/acc"] > 0.5
    with (run_dir / "csv" / "metrics.csv").open() as handle:
        assert any(row.get("val/acc") for row in csv.DictReader(handle))
    return summary


@pytest.mark.parametrize("template", ["cpu-srun.sbatch", "cpu-mpiexec.sbatch"])
def test_cpu_template_runs_to_completion_and_leaves_metrics(template: str, tmp_path: Path) -> None:
    job = sbatch(TEMPLATES / template, *ONE_NODE, cwd=tmp_path, env=job_env(tmp_path / "logs", OVERRIDES=SMALL))
    assert wait_for(job, timeout=600) == "COMPLETED", output_of(tmp_path)
    summary = _check_run(tmp_path / "logs" / "digits_mlp" / "runs" / f"slurm-{job}")
    assert summary["global_step"] == 2 * _steps_per_epoch(ranks=2, batch=32)


def test_gpu_template_runs_on_cpu_without_its_gpu_request(tmp_path: Path) -> None:
    # This cluster has no GPUs: the template runs with its --gpus-per-task line dropped and ACCELERATOR=cpu;
    # everything else (one task per "GPU", srun --mpi=pmi2, the trainer switch) is the template's own.
    script = tmp_path / "gpu-dry.sbatch"
    script.write_text(
        "".join(line for line in (TEMPLATES / "gpu.sbatch").read_text().splitlines(True) if "--gpus-per" not in line)
    )
    env = job_env(tmp_path / "logs", OVERRIDES=SMALL, ACCELERATOR="cpu", EXPERIMENT="digits_cnn")
    job = sbatch(script, "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10", cwd=tmp_path, env=env)
    assert wait_for(job, timeout=600) == "COMPLETED", output_of(tmp_path)
    _check_run(tmp_path / "logs" / "digits_cnn" / "runs" / f"slurm-{job}")


def test_job_array_sweep_runs_every_point_and_compares_them_listing_a_failed_one(tmp_path: Path) -> None:
    """Point 2 (``scheduler.T_max=0``: no length for the cosine scheduler) fails while building: its array
    task fails, and the comparison lists it as failed with its error beside the two that completed."""
    points = "model.hidden=32;model.hidden=64;scheduler.T_max=0"
    env = job_env(tmp_path / "logs", OVERRIDES=SMALL, SWEEP_POINTS=points)
    job = sbatch(TEMPLATES / "sweep-array.sbatch", "--array=0-2", "--time=10", cwd=tmp_path, env=env)
    sweep = tmp_path / "logs" / "digits_mlp" / f"array-{job}"
    for task, ended in ((0, "COMPLETED"), (1, "COMPLETED"), (2, "FAILED")):
        assert wait_for(f"{job}_{task}", timeout=600) == ended, output_of(tmp_path)
    for task, hidden in ((0, 32), (1, 64)):
        summary = _check_run(sweep / str(task))
        assert f"model.hidden={hidden}" in summary["overrides"]
    # The comparison job (submitted by task 0, after the whole array).
    deadline = time.monotonic() + 300
    while not (sweep / "comparison.png").exists() and time.monotonic() < deadline:
        time.sleep(2)
    assert (sweep / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", output_of(tmp_path)
    with (sweep / "comparison.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["status"]) for row in rows] == [("0", "completed"), ("1", "completed"), ("2", "failed")]
    assert rows[2]["final"] == "" and rows[2]["error"].startswith("ValidationError: scheduler.T_max=0"), rows[2]


def test_sigusr1_checkpoints_requeues_and_the_requeued_job_ends_bit_identical_to_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    epochs = 40
    overrides = (
        f"trainer.max_epochs={epochs} model.dropout=0.2 callbacks.progress_bar.refresh_rate=0 "
        "trainer.enable_model_summary=false"
    )
    env = job_env(tmp_path / "logs", OVERRIDES=overrides)
    job = sbatch(TEMPLATES / "preemptible.sbatch", "--time=15", cwd=tmp_path, env=env)
    reference = sbatch(TEMPLATES / "preemptible.sbatch", "--time=15", cwd=tmp_path, env=env)  # never signalled
    runs = tmp_path / "logs" / "digits_mlp" / "runs"
    run_dir = runs / f"slurm-{job}"
    # Once an epoch is done (its checkpoint exists), play SLURM's "--signal=USR1@<lead>": USR1 to the job's tasks.
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "last.ckpt").exists():
        assert time.monotonic() < deadline and state(job) in ("PENDING", "RUNNING", "CONFIGURING"), output_of(tmp_path)
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    # The ranks checkpoint and exit 75, the template runs `scontrol requeue`: the job goes back to the queue (SLURM
    # holds a requeued job for a while before it may start again; let it start now instead of waiting).
    deadline = time.monotonic() + 300
    while job_info(job).get("Restarts", "0") == "0":
        assert time.monotonic() < deadline, f"job {job} was not requeued:\n{output_of(tmp_path)}"
        time.sleep(1)
    hpc = sorted(run_dir.glob("hpc_ckpt_*.ckpt"))
    assert [p.name for p in hpc] == ["hpc_ckpt_1.ckpt"], output_of(tmp_path)
    assert wait_for(job, timeout=900, on_pending=start_now) == "COMPLETED", output_of(tmp_path)
    # The reference ran meanwhile and SLURM may have forgotten it already (MinJobAge): its output tells how it ended.
    reference_out = tmp_path / f"slurm-mpistrategy-preemptible-{reference}.out"
    deadline = time.monotonic() + 900
    while "training finished" not in (text := reference_out.read_text() if reference_out.exists() else ""):
        assert time.monotonic() < deadline and "training failed" not in text, output_of(tmp_path)
        time.sleep(2)

    summary = _check_run(run_dir)
    assert summary["resumed_from"] == str(hpc[0])
    assert summary["epochs"] == epochs
    _assert_same_training_state(run_dir, runs / f"slurm-{reference}")
    out = (tmp_path / f"slurm-mpistrategy-preemptible-{job}.out").read_text()
    assert "start 1 " in out and "start 2 " in out  # one output file across the requeue
    assert "SIGUSR1 received; all ranks stop" in out and "requeueing" in out and "training finished" in out
    assert job_info(job).get("Restarts") == "1"


def _assert_same_training_state(run_dir: Path, reference_dir: Path) -> None:
    """The final checkpoints of two runs hold the same parameters, optimizer and scheduler state, bit for bit."""
    import torch

    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    reference = torch.load(reference_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["global_step"] == reference["global_step"]
    for name, value in reference["state_dict"].items():
        assert torch.equal(state["state_dict"][name], value), f"parameter {name} differs from the uninterrupted job"
    for index, values in reference["optimizer_states"][0]["state"].items():
        for key, value in values.items():
            assert torch.equal(state["optimizer_states"][0]["state"][index][key], value), f"optimizer {key} differs"
    assert state["lr_schedulers"] == reference["lr_schedulers"]


def test_hydra_multirun_through_the_submitit_launcher_runs_two_slurm_jobs(tmp_path: Path) -> None:
    env = job_env(tmp_path / "logs")
    result = subprocess.run(
        [sys.executable, "-m", "mpistrategy.recipes.train", "-m", "hydra/launcher=slurm_local", "model.hidden=32,64",
         *SMALL.split()],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-6000:]
    (sweep,) = (tmp_path / "logs" / "train" / "multiruns").iterdir()
    for job, hidden in (("0", 32), ("1", 64)):
        summary = _check_run(sweep / job)  # two MPI ranks per SLURM job (srun, SLURM_MPI_TYPE=pmi2)
        assert f"model.hidden={hidden}" in summary["overrides"]
    assert len(list((sweep / ".submitit").glob("*_0"))) == 1 and len(list((sweep / ".submitit").glob("*_1"))) == 1
    assert (sweep / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _steps_per_epoch(ranks: int, batch: int) -> int:
    from mpistrategy.recipes.data import load_digits_split

    x_train = load_digits_split()[0]
    return math.ceil(math.ceil(len(x_train) / ranks) / batch)
