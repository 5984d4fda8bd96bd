"""Running ``mpistrategy-train`` (or ``python -m recipes.train``) under mpiexec from a test."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def mpiexec() -> list[str]:
    """The launcher: $MPISTRATEGY_MPIEXEC (+ $MPISTRATEGY_MPIEXEC_ARGS), else the one next to this Python."""
    chosen = os.environ.get("MPISTRATEGY_MPIEXEC")
    if not chosen:
        beside = Path(sys.executable).parent / "mpiexec"
        chosen = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not chosen:
        raise RuntimeError("no mpiexec found (install the mpich extra or set MPISTRATEGY_MPIEXEC)")
    return [chosen, *shlex.split(os.environ.get("MPISTRATEGY_MPIEXEC_ARGS", ""))]


def train_command() -> list[str]:
    """The console script if it is installed next to this Python, else ``python -m recipes.train``."""
    script = Path(sys.executable).parent / "mpistrategy-train"
    return [str(script)] if script.exists() else [sys.executable, "-m", "recipes.train"]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the variables of an enclosing MPI job or test harness."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "OMPI_", "MPISTRATEGY_TEST_", "SLURM_"))
        and k not in ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    }
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
