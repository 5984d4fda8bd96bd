"""Self-test of the multi-rank pytest harness in ``tests/mpi_harness.py``.

The mpi tests here run under mpiexec; the single-process tests run pytest on the
deliberately broken cases in ``tests/harness_cases/`` and check what it reports.
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
from mpi4py import MPI

from tests.mpi_harness import clean_environ

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "harness_cases"


@pytest.mark.mpi
def test_world_size_is_rank_count(mpi_nranks: int) -> None:
    assert MPI.COMM_WORLD.size == mpi_nranks


@pytest.mark.mpi
def test_allreduce_of_rank_ids() -> None:
    comm = MPI.COMM_WORLD
    n = comm.size
    assert comm.allreduce(comm.rank, op=MPI.SUM) == n * (n - 1) // 2


@pytest.mark.mpi(ranks=(2, 3))
@pytest.mark.parametrize("op", ["sum", "max"])
def test_parametrized_ids_combine(request: pytest.FixtureRequest, op: str) -> None:
    comm = MPI.COMM_WORLD
    n = comm.size
    assert request.node.name == f"test_parametrized_ids_combine[{op}-np{n}]"
    expected = {"sum": n * (n - 1) // 2, "max": n - 1}[op]
    assert comm.allreduce(comm.rank, op=MPI.SUM if op == "sum" else MPI.MAX) == expected


def _run_pytest(*args: str) -> subprocess.CompletedProcess[str]:
    """Run a fresh outer pytest from the repository root."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--rootdir={ROOT}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=clean_environ(), capture_output=True, text=True, timeout=300)


@dataclass(frozen=True)
class CaseRun:
    """Output and per-test (outcome, text) of one pytest run over all harness cases."""

    output: str
    outcomes: dict[str, tuple[str, str]]


@pytest.fixture(scope="module")
def case_run(tmp_path_factory: pytest.TempPathFactory) -> CaseRun:
    junit = tmp_path_factory.mktemp("cases") / "junit.xml"
    proc = _run_pytest("-q", f"--junitxml={junit}", *sorted(str(path) for path in CASES.glob("case_*.py")))
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        result = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        outcome = ("passed", "") if result is None else (result.tag, result.text or "")
        outcomes[case.get("name", "")] = outcome
    return CaseRun(proc.stdout, outcomes)


def test_failure_on_one_rank_reports_rank_and_traceback(case_run: CaseRun) -> None:
    outcome, text = case_run.outcomes["test_fails_on_last_rank[np3]"]
    assert outcome == "failure"
    assert "rank 2 of 3:" in text
    assert "AssertionError: deliberate failure on rank 2 (total 3)" in text
    assert "rank 0 of 3" not in text
    assert "rank 1 of 3" not in text
    assert "4 failed, 2 passed, 1 skipped" in case_run.output


def test_tests_after_an_aborted_or_killed_job_rerun(case_run: CaseRun) -> None:
    assert case_run.outcomes["test_passes_after_failure[np3]"] == ("passed", "")
    assert case_run.outcomes["test_passes_after_hang[np2]"] == ("passed", "")


def test_skip_on_every_rank_is_a_skip(case_run: CaseRun) -> None:
    outcome, text = case_run.outcomes["test_skipped_on_every_rank[np3]"]
    assert outcome == "skipped"
    assert "deliberate skip" in text


def test_raise_before_collective_aborts_the_job(case_run: CaseRun) -> None:
    outcome, text = case_run.outcomes["test_raises_before_collective[np2]"]
    assert outcome == "failure"
    assert "rank 0 of 2:" in text
    assert "RuntimeError: deliberate error before the allreduce" in text
    assert "rank 1 of 2 produced no result for this test: the MPI job was aborted after rank 0 failed" in text


def test_abrupt_exit_reports_exit_code(case_run: CaseRun) -> None:
    outcome, text = case_run.outcomes["test_rank_exits_abruptly[np2]"]
    assert outcome == "failure"
    assert "produced no result for this test: the MPI job exited with code" in text
    assert "rank 1: in tests/harness_cases/case_crash.py::test_rank_exits_abruptly[np2] (call)" in text


def test_hang_is_killed_at_the_marker_timeout(case_run: CaseRun) -> None:
    outcome, text = case_run.outcomes["test_deadlocks[np2]"]
    nodeid = "tests/harness_cases/case_hang.py::test_deadlocks[np2]"
    assert outcome == "failure"
    assert f"ranks 0, 1 of 2 produced no result for this test: {nodeid} timed out after 10 s" in text
    assert f"rank 0: in {nodeid} (call)" in text
    assert f"rank 1: in {nodeid} (call)" in text
    assert "output tail:" in text  # "after 10 s": the marker's timeout fired, not the job's 10 s + 30 s limit
    for rank in (0, 1):  # each rank's stack, written shortly before the timeout, shows where it waits
        stacks = text.split(f"rank {rank}'s threads 90% into the test's timeout:")[1].split("rank 1's threads")[0]
        assert re.search(r'case_hang\.py", line 10 in test_deadlocks', stacks), stacks


def test_rank_selection_and_ids() -> None:
    proc = _run_pytest("--collect-only", "-q", "--mpi-ranks=2", __file__)
    ids = set(proc.stdout.split())
    assert "tests/test_harness.py::test_allreduce_of_rank_ids[np2]" in ids
    assert "tests/test_harness.py::test_parametrized_ids_combine[max-np2]" in ids
    assert "tests/test_harness.py::test_rank_selection_and_ids" in ids
    assert not any("np1" in nodeid or "np3" in nodeid for nodeid in ids)


def test_no_mpi_skips_mpi_tests() -> None:
    proc = _run_pytest("-q", "-rs", "--no-mpi", str(CASES / "case_hang.py"))
    assert "2 skipped" in proc.stdout
    assert "MPI tests disabled by --no-mpi" in proc.stdout
