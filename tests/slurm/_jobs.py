"""Submitting and waiting for SLURM jobs from tests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tests.recipes._cli import clean_env

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "slurm"
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def job_env(log_dir: Path, **extra: str) -> dict[str, str]:
    """The submitting environment (sbatch exports it to the job): this venv first on PATH, one thread per rank."""
    env = clean_env(MPISTRATEGY_LOG_DIR=str(log_dir), PYTHON=sys.executable, **extra)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def sbatch(script: Path, *args: str, cwd: Path, env: dict[str, str], prefix: Sequence[str] = ()) -> str:
    """Submit ``script``; its job id. ``prefix`` (here and below): what runs a client of another SLURM cluster than
    this machine's, e.g. ``SlurmCluster.command([])`` of benchmarks/slurm_cluster.py."""
    result = subprocess.run(
        [*prefix, "sbatch", "--parsable", f"--chdir={cwd}", *args, str(script)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, f"sbatch {script.name} failed: {result.stderr}"
    return result.stdout.strip().split(";")[0]


def job_info(job: str, prefix: Sequence[str] = ()) -> dict[str, str]:
    result = subprocess.run([*prefix, "scontrol", "show", "job", job], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout))


def state(job: str, prefix: Sequence[str] = ()) -> str:
    return job_info(job, prefix).get("JobState", "UNKNOWN")


def wait_for(
    job: str,
    timeout: float,
    states: set[str] = FINISHED,
    poll: float = 2.0,
    on_pending: Callable[[str], None] | None = None,
    prefix: Sequence[str] = (),
) -> str:
    """Wait until ``job`` is in one of ``states``; returns the state. ``on_pending(job)`` runs at every poll that
    finds the job pending."""
    deadline = time.monotonic() + timeout
    last = "UNKNOWN"
    while time.monotonic() < deadline:
        last = state(job, prefix)
        if last in states:
            return last
        if last == "PENDING" and on_pending is not None:
            on_pending(job)
        time.sleep(poll)
    reason = job_info(job, prefix).get("Reason", "?")
    subprocess.run([*prefix, "scancel", job], timeout=30)
    raise AssertionError(f"job {job} still {last} (reason {reason}) after {timeout:.0f} s (cancelled)")


_first_seen_pending: dict[str, float] = {}

#: seconds a requeued job stays pending before :func:`start_now` lets it start: slurmd refuses a batch job whose
#: credential is not newer than the kill of its last run in whole seconds ("Job credential revoked", the job then
#: FAILS); started 30 ms after the requeue, the relaunch fell in the same second once
REQUEUE_SETTLE_SECONDS = 2.0


def start_now(job: str) -> None:
    """Let a pending job start soon: SLURM holds a requeued job back (Reason=BeginTime) before it may run again.
    Called at every poll that finds the job pending; it lifts the hold once the job has been seen pending for
    :data:`REQUEUE_SETTLE_SECONDS`."""
    first_seen = _first_seen_pending.setdefault(job, time.monotonic())
    if time.monotonic() - first_seen >= REQUEUE_SETTLE_SECONDS:
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True, timeout=30)


def output_of(cwd: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(cwd.glob("slurm-*.out")))
