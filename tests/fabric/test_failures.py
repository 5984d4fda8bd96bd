"""Fabric under mpi_ad: a rank that raises ends the job quickly with a non-zero exit code and its traceback printed
once; a stop signal on one rank stops every rank after the same optimizer step, where the script can save a
checkpoint, and the job exits 75. Each test runs its own ``mpiexec -n 3`` job (not under the multi-rank harness)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from mpistrategy.strategy.failures import STOPPED_EXIT_CODE
from tests.external_job import OUTER_RUN_ONLY, assert_desync_recorded, run_mpi_job

SCRIPT = Path(__file__).parent / "scripts" / "fabric_job.py"
RANKS = 3
SECONDS_TO_END = 30.0  # from the failure to the end of the job
TIMEOUT = 240.0  # generous: three ranks import torch and Lightning on a loaded 2-core machine

pytestmark = OUTER_RUN_ONLY


def _run(mode: str, directory: str, **env: str) -> tuple[int, str, float]:
    return run_mpi_job(SCRIPT, RANKS, mode, directory, timeout=TIMEOUT, **env)


def test_rank_raising_ends_every_rank_with_its_traceback(tmp_path: Path) -> None:
    code, output, ended = _run("raise", str(tmp_path))
    assert code != 0
    failed_at = re.search(r"FAILING rank=1 time=([0-9.]+)", output)
    assert failed_at, output[-4000:]
    assert ended - float(failed_at.group(1)) < SECONDS_TO_END
    assert output.count("RuntimeError: boom from rank 1 at step 3") == 1, output[-4000:]  # printed once
    assert "in train_one_step" in output and "[mpistrategy] rank 1 of 3" in output
    assert "FINISHED" not in output


def test_an_error_every_rank_raises_in_step_ends_each_rank_without_an_abort(tmp_path: Path) -> None:
    """A collective called with another shape on one rank raises on every rank, in step: each rank exits with its
    own traceback and its flight record, and nothing is aborted."""
    code, output, ended = _run("mismatch", str(tmp_path), MPISTRATEGY_FLIGHT_DIR=str(tmp_path / "flight"))
    assert code == 1, output[-4000:]
    failed_at = re.search(r"FAILING rank=1 time=([0-9.]+)", output)
    assert failed_at, output[-4000:]
    assert ended - float(failed_at.group(1)) < SECONDS_TO_END
    assert output.count("CommunicationError: allreduce: ranks disagree") == RANKS, output[-4000:]
    assert "aborting all ranks" not in output and "FINISHED" not in output
    assert_desync_recorded(tmp_path / "flight", RANKS, r"CommunicationError: allreduce: ranks disagree")


@pytest.mark.parametrize("stepped", ["usr1", "usr1_raw"], ids=["wrapper", "torch optimizer itself"])
def test_sigusr1_on_one_rank_stops_every_rank_after_the_same_step(stepped: str, tmp_path: Path) -> None:
    """Also when the loop steps the torch optimizer it gave ``fabric.setup``, past Fabric's wrapper."""
    directory = str(tmp_path)
    code, output, _ = _run(stepped, directory)
    assert code == STOPPED_EXIT_CODE, output[-4000:]
    stopped = {int(r): int(s) for r, s in re.findall(r"STOPPED rank=(\d+) step=(\d+) signal=SIGUSR1", output)}
    assert sorted(stopped) == list(range(RANKS)), output[-4000:]
    # the signal arrives before step 3; the flags posted after step 3 are read after step 4, which raises everywhere
    assert set(stopped.values()) == {4}, output[-4000:]
    checkpoint = torch.load(Path(directory) / "stop.ckpt", weights_only=True)
    assert checkpoint["step"] == 4 and set(checkpoint) == {"model", "optimizer", "step"}
    assert "aborting all ranks" not in output
