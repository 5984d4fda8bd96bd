"""A rank that dies during a shared-memory allreduce does not leave the others waiting: they raise, naming the rank
whose process ended, even when the launcher does not end the job. Runs its own ``mpiexec -n 2`` (not under the
harness)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpistrategy.launch import mpiexec_command
from tests.mpi_harness import clean_environ

SCRIPT = Path(__file__).parent / "scripts" / "dead_peer.py"
STARTUP = 180.0  # two ranks import torch on a loaded machine

pytestmark = pytest.mark.skipif(
    os.environ.get("MPISTRATEGY_TEST_NRANKS") is not None or "PMI_RANK" in os.environ,
    reason="launches its own mpiexec; run from the plain (outer) pytest",
)


def test_a_dead_peer_makes_the_waiting_rank_raise(tmp_path: Path) -> None:
    launcher = mpiexec_command()
    help_text = subprocess.run([*launcher, "--help"], capture_output=True, text=True).stdout
    if "-disable-auto-cleanup" not in help_text:
        pytest.skip(f"{launcher[0]} cannot leave the surviving ranks running (no -disable-auto-cleanup)")
    env = clean_environ()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    command = [*launcher, "-disable-auto-cleanup", "-n", "2", sys.executable, str(SCRIPT)]
    report = tmp_path / "report.txt"  # not through the launcher's output forwarding
    env["DEAD_PEER_REPORT"] = str(report)
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=STARTUP)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"rank 0 kept waiting for the dead rank:\n{expired.stdout}")
    assert done.returncode != 0, "the job ended successfully although rank 1 ended"
    output = report.read_text() if report.exists() else ""
    launched = (done.stdout + done.stderr)[-3000:]
    assert "RAISED after" in output, f"rank 0 wrote {output!r}; the launcher printed:\n{launched}"
    assert "world rank(s) 1 has ended" in output, output
