"""Hang and desync diagnosis in SLURM jobs: ``srun`` ranks, one of which never arrives, are reported by every rank
that can speak, and the job ends soon after the stall timeout instead of at its time limit; on two nodes
(``sbatch -N 2`` on emulated nodes) the ranks that call different collectives are named too."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from benchmarks.slurm_cluster import SlurmCluster
from mpistrategy.comm.watchdog import STALL_EXIT_CODE
from tests.external_job import marked_line
from tests.slurm._jobs import job_env, job_info, output_of, sbatch, wait_for

DESYNC = Path(__file__).resolve().parents[1] / "comm" / "scripts" / "desync.py"
STALL_TIMEOUT = 3


@pytest.mark.usefixtures("slurm_cluster")
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


def test_a_two_node_sbatch_job_names_the_desynchronised_ranks_and_ends_at_the_stall(
    slurm_nodes: SlurmCluster, tmp_path: Path
) -> None:
    """Two ranks on each of two nodes (desync.py): every rank names the call of the rank on the other node that
    called another collective or is a call behind; then that rank sleeps in a C call, and every rank reports it and
    ends with exit code 86, which is the job's."""
    script = tmp_path / "desync.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"export MPISTRATEGY_STALL_TIMEOUT={STALL_TIMEOUT} MPISTRATEGY_FLIGHT_DIR={tmp_path}/flight\n"
        f"srun --mpi=pmi2 {sys.executable} {DESYNC} sleep\n"
    )
    client = slurm_nodes.command([])
    environment = job_env(tmp_path, **slurm_nodes.settings())
    job = sbatch(script, "--nodes=2", "--ntasks-per-node=2", "--time=5", cwd=tmp_path, env=environment, prefix=client)
    assert wait_for(job, timeout=300, poll=0.5, prefix=client) == "FAILED", output_of(tmp_path)
    ended = time.time()
    output = (tmp_path / f"slurm-{job}.out").read_text()
    assert job_info(job, client)["ExitCode"] == f"{STALL_EXIT_CODE}:0", output
    assert job_info(job, client)["NodeList"] == "node[0-1]"

    def at(marker: str) -> str:
        return f"at {DESYNC.parent}/{marked_line(DESYNC, marker)}"

    for rank in range(4):
        different = re.search(rf"CAUGHT different_ops {rank} (.*)", output).group(1)
        for other in range(3):
            assert f"rank {other}: allreduce(float32[4], op=sum) {at('allreduce')}" in different
        assert f"rank 3: broadcast(root=0) {at('broadcast')}" in different
        arguments = re.search(rf"CAUGHT other_arguments {rank} (.*)", output).group(1)
        assert f"rank 3: allreduce(float32[5], op=max) {at('other arguments')}" in arguments
        behind = re.search(rf"CAUGHT behind {rank} (.*)", output).group(1)
        assert (
            "rank 3 is 1 call behind" in behind
            and f"rank 0: iallreduce(float32[4], op=sum) {at('unchecked')}" in behind
        )
        report = output[output.index(f"stall (reported on rank {rank})") :]
        assert "not arrived: rank 3\n" in report
        assert re.search(
            rf"rank 3 \(node1, pid \d+\): not in a collective, now at \S*{marked_line(DESYNC, 'sleep')} ", report
        )
        for other, node in ((0, "node0"), (1, "node0"), (2, "node1")):
            assert re.search(
                rf"rank {other} \({node}, pid \d+\): waiting \d+\.\d s in allreduce\(float32\[4\], op=sum\) #7 "
                rf"{at('waits')}",
                report,
            ), report
        assert f"rank {rank} ends with exit code {STALL_EXIT_CODE}" in report
    stack = output[output.index("rank 3's stack (MainThread)") :].split("[mpistrategy]")[0]
    assert "time.sleep(120)  # marker: sleep" in stack
    assert re.search(rf"srun: error: node1: tasks? (3|2-3): Exited with exit code {STALL_EXIT_CODE}", output), output
    started = float(re.search(r"HANG (\d+\.\d+)", output).group(1))
    assert ended - started <= STALL_TIMEOUT + 10, f"the job ended {ended - started:.1f} s after the stall began"
    assert sorted(path.name for path in (tmp_path / "flight").glob("rank*.json")) == [
        f"rank{rank}.json" for rank in range(4)
    ]
