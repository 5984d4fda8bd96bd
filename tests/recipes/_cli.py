"""Running ``mpistrategy-train`` (or ``python -m mpistrategy.recipes.train``) under mpiexec from a test."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from tests.mpi_harness import clean_environ

ROOT = Path(__file__).resolve().parents[2]


def train_command() -> list[str]:
    """The console script if it is installed next to this Python, else ``python -m mpistrategy.recipes.train``."""
    script = Path(sys.executable).parent / "mpistrategy-train"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mpistrategy.recipes.train"]


def clean_env(**extra: str) -> dict[str, str]:
    """pytest's startup environment without the variables of an enclosing MPI job, test harness or SLURM job."""
    env = {k: v for k, v in clean_environ().items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run(args: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=clean_env(**env))
    if result.returncode != 0:
        raise AssertionError(
            f"{shlex.join(args)} exited with {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n"
            f"--- stderr\n{result.stderr[-6000:]}"
        )
    return result
