"""Tests that start their own ``mpiexec`` job instead of running under the multi-rank harness (to read every rank's
output, exit codes and timing): the marker that keeps them out of MPI jobs, and the runner."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpistrategy.launch import mpiexec_command
from tests.mpi_harness import NRANKS_ENV, clean_environ

ROOT = Path(__file__).parents[1]

#: for a module whose tests launch their own mpiexec: skipped inside an MPI job, run from the plain (outer) pytest
OUTER_RUN_ONLY = pytest.mark.skipif(
    os.environ.get(NRANKS_ENV) is not None or "PMI_RANK" in os.environ,
    reason="launches its own mpiexec; run from the plain (outer) pytest",
)


def run_mpi_job(script: Path, ranks: int, *args: str, timeout: float, **env: str) -> tuple[int, str, float]:
    """``mpiexec -n ranks python script *args`` in the environment pytest started with (plus ``env``, with the
    repository importable): its exit code, its output (stdout, then stderr) and when it ended. A job still running
    after ``timeout`` seconds is killed and fails the test."""
    environ = {**clean_environ(), **env}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
    command = [*mpiexec_command(), "-n", str(ranks), sys.executable, str(script), *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=environ, timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the job hung (killed after {timeout} s):\n{str(expired.output)[-4000:]}")
    return result.returncode, result.stdout + result.stderr, time.time()


def marked_line(script: Path, marker: str) -> str:
    """``<script name>:<line>`` of the line of ``script`` that ends with ``# marker: <marker>``."""
    for number, text in enumerate(script.read_text().splitlines(), start=1):
        if text.endswith(f"# marker: {marker}"):
            return f"{script.name}:{number}"
    raise AssertionError(f"no line of {script} ends with '# marker: {marker}'")
