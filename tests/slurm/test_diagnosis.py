"""Hang diagnosis in a SLURM job: ``srun`` ranks, one of which never arrives, are reported by every rank that can
speak, and the job ends soon after the stall timeout instead of at its time limit."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.slurm._jobs import job_env, job_info, output_of, sbatch, wait_for

pytestmark = pytest.mark.usefixtures("slurm_cluster")

DESYNC = Path(__file__).resolve().parents[1] / "comm" / "scripts" / "desync.py"
STALL_TIMEOUT = 3


def test_a_rank_that_never_arrives_ends_the_srun_job_with_the_report(tmp_path: Path) -> None:
    script = tmp_path / "stall.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"export MPISTRATEGY_STALL_TIMEOUT={STALL_TIMEOUT} MPISTRATEGY_FLIGHT_DIR={tmp_path}/flight\n"
        f"srun --mpi=pmi2 {sys.executable} {DESYNC} sleep\n"
    )
    job = sbatch(
        script, "--nodes=1", "--ntasks=3", "--cpus-per-task=1", "--time=5", cwd=tmp_path, env=job_env(tmp_path)
    )
    assert wait_for(job, timeout=300, poll=0.5) == "FAILED", output_of(tmp_path)
    ended = time.time()
    output = output_of(tmp_path)
    started = float(re.search(r"HANG (\d+\.\d+)", output).group(1))
    assert ended - started <= STALL_TIMEOUT + 10, f"the job ended {ended - started:.1f} s after the stall began"
    for rank in range(3):
        report = output[output.index(f"stall (reported on rank {rank})") :]
        assert "not arrived: rank 2\n" in report
        assert f"rank {rank} ends with exit code 86" in report
    assert job_info(job).get("ExitCode", "0:0") != "0:0"
    assert sorted(path.name for path in (tmp_path / "flight").glob("rank*.json")) == [
        "rank0.json",
        "rank1.json",
        "rank2.json",
    ]
