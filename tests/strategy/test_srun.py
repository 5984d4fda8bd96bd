"""`srun --mpi=pmi2 python train.py` works with strategy="mpi_ad" (ranks from MPI, no --ntasks-per-node needed);
`srun` without a matching PMI fails loudly instead of training one model per task. Runs on the local SLURM cluster
of tests/slurm (started by its session fixture)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi_harness import clean_environ
from tests.slurm.conftest import slurm_cluster  # noqa: F401  (the session fixture that starts the cluster)

SCRIPT = Path(__file__).parent / "scripts" / "srun_job.py"
ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("MPISTRATEGY_TEST_NRANKS") is not None or "PMI_RANK" in os.environ,
    reason="launches its own srun; run from the plain (outer) pytest",
)


def _srun(*options: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in clean_environ().items() if not k.startswith("SLURM_")}  # not inside another job's variables
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    command = ["srun", "-n", "2", "--time=5", *options, sys.executable, str(SCRIPT)]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def test_srun_pmi2_trains_with_mpi_ranks(slurm_cluster: None) -> None:  # noqa: F811
    result = _srun("--mpi=pmi2")
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line[len("REPORT ") :]) for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["world_size"] == 2 and report["local_rank"] == report["rank"]
        assert report["environment"] == "MPIEnvironment" and report["global_step"] == 4
    assert reports[0]["params"] == reports[1]["params"], "ranks trained different models"


def test_srun_without_matching_pmi_fails_loudly(slurm_cluster: None) -> None:  # noqa: F811
    result = _srun("--mpi=none")
    assert result.returncode != 0
    assert "LaunchMismatchError" in result.stderr and "srun --mpi=pmi2" in result.stderr
