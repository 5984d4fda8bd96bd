"""Fabric under mpi_ad: a rank that raises ends the job quickly with a non-zero exit code and its traceback printed
once; a stop signal on one rank stops every rank after the same optimizer step, where the script can save a
checkpoint, and the job exits 75. Each test runs its own ``mpiexec -n 3`` job (not under the multi-rank harness)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from mpistrategy.launch import mpiexec_command
from mpistrategy.strategy.failures import STOPPED_EXIT_CODE
from tests.mpi_harness import clean_environ

SCRIPT = Path(__file__).parent / "scripts" / "fabric_job.py"
RANKS = 3
LIMIT = 30.0  # seconds from the failure to the end of the job
STARTUP = 240.0  # generous: three ranks import torch and Lightning on a loaded 2-core machine

pytestmark = pytest.mark.skipif(
    os.environ.get("MPISTRATEGY_TEST_NRANKS") is not None or "PMI_RANK" in os.environ,
    reason="launches its own mpiexec; run from the plain (outer) pytest",
)


def _run(mode: str, directory: str) -> tuple[int, str, float]:
    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    command = [*mpiexec_command(), "-n", str(RANKS), sys.executable, str(SCRIPT), mode, directory]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=STARTUP)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"the job hung (killed after {STARTUP} s):\n{str(timeout.output)[-4000:]}")
    return result.returncode, result.stdout + result.stderr, time.time()


def test_rank_raising_ends_every_rank_with_its_traceback() -> None:
    code, output, ended = _run("raise", tempfile.mkdtemp())
    assert code != 0
    failed_at = re.search(r"FAILING rank=1 time=([0-9.]+)", output)
    assert failed_at, output[-4000:]
    assert ended - float(failed_at.group(1)) < LIMIT
    assert output.count("RuntimeError: boom from rank 1 at step 3") == 1, output[-4000:]  # printed once
    assert "in train_one_step" in output and "[mpistrategy] rank 1 of 3" in output
    assert "FINISHED" not in output


def test_sigusr1_on_one_rank_stops_every_rank_after_the_same_step() -> None:
    directory = tempfile.mkdtemp()
    code, output, _ = _run("usr1", directory)
    assert code == STOPPED_EXIT_CODE, output[-4000:]
    stopped = {int(r): int(s) for r, s in re.findall(r"STOPPED rank=(\d+) step=(\d+) signal=SIGUSR1", output)}
    assert sorted(stopped) == list(range(RANKS)), output[-4000:]
    # the signal arrives before step 3; the flags posted after step 3 are read after step 4, which raises everywhere
    assert set(stopped.values()) == {4}, output[-4000:]
    checkpoint = torch.load(Path(directory) / "stop.ckpt", weights_only=True)
    assert checkpoint["step"] == 4 and set(checkpoint) == {"model", "optimizer", "step"}
    assert "aborting all ranks" not in output
