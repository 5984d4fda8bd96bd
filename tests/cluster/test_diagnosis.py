"""Hang and desync diagnosis across the nodes of the emulated cluster (benchmarks/cluster.py): the desync cases
and a rank that never arrives, with two ranks on each of two nodes and the stall reported by every rank."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from benchmarks.cluster import EmulatedCluster, missing_requirements
from mpistrategy.comm.watchdog import STALL_EXIT_CODE
from tests.mpi_harness import clean_environ

DESYNC = Path(__file__).resolve().parents[1] / "comm" / "scripts" / "desync.py"
MISSING = missing_requirements()
needs_cluster = pytest.mark.skipif(bool(MISSING), reason="emulated cluster unavailable, needs " + "; ".join(MISSING))


@needs_cluster
def test_desync_and_stall_across_nodes(tmp_path: Path) -> None:
    environment = {**clean_environ(), "MPISTRATEGY_STALL_TIMEOUT": "3", "MPISTRATEGY_FLIGHT_DIR": str(tmp_path)}
    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        done = cluster.run(
            [sys.executable, str(DESYNC), "sleep"], ranks_per_node=2, env=environment, timeout=120, capture_output=True
        )
        ended = time.time()
    output = done.stdout + done.stderr
    assert done.returncode == STALL_EXIT_CODE, output[-4000:]
    for rank in range(4):
        assert re.search(rf"CAUGHT different_ops {rank} .*rank 3: broadcast\(root=0\) at ", output), output[-4000:]
        assert re.search(rf"CAUGHT behind {rank} .*rank 3 is 1 call behind", output)
        report = output[output.index(f"stall (reported on rank {rank})") :]
        assert "not arrived: rank 3\n" in report
    started = float(re.search(r"HANG (\d+\.\d+)", output).group(1))
    assert ended - started <= 3 + 10, f"the job ended {ended - started:.1f} s after the stall began"
    assert sorted(path.name for path in tmp_path.glob("rank*.json")) == [f"rank{r}.json" for r in range(4)]


@needs_cluster
def test_training_rank_stuck_in_its_data_loader_on_another_node(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "strategy" / "scripts" / "desync_training.py"
    environment = {**clean_environ(), "MPISTRATEGY_STALL_TIMEOUT": "3", "MPISTRATEGY_FLIGHT_DIR": str(tmp_path)}
    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        done = cluster.run(
            [sys.executable, str(script), "trainer", "loader_hang", "hierarchical"],
            ranks_per_node=2,
            env=environment,
            timeout=180,
            capture_output=True,
        )
        ended = time.time()
    output = done.stdout + done.stderr
    assert done.returncode == STALL_EXIT_CODE, output[-4000:]
    started = float(re.search(r"HANG (\d+\.\d+)", output).group(1))
    assert ended - started <= 3 + 10, f"the job ended {ended - started:.1f} s after the stall began"
    for rank in range(4):
        report = output[output.index(f"stall (reported on rank {rank})") :]
        assert re.search(r"rank 3 \(.*\): not in a collective", report), report
    stack = output[output.index("rank 3's stack (MainThread)") :].split("[mpistrategy]")[0]
    assert "time.sleep(120)  # marker: loader" in stack
