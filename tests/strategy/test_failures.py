"""Failures end every rank quickly with a non-zero exit code and the original traceback (printed once), or with the
rank and exit code of a rank that called ``os._exit``; stop signals stop every rank at the same step after saving a
checkpoint, with exit code 75; a corrupt checkpoint is refused by every rank, which exits 1 without an abort. Each
test runs its own ``mpiexec -n 3`` job (not under the multi-rank harness)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

from mpistrategy.strategy.failures import STOPPED_EXIT_CODE
from tests.external_job import OUTER_RUN_ONLY, MPIJob, run_mpi_job, start_mpi_job

SCRIPT = Path(__file__).parent / "scripts" / "failing_job.py"
RANKS = 3
LIMIT = 30.0  # seconds from the failure to the end of the job
STARTUP = 240.0  # generous: three ranks import torch and Lightning on a loaded 2-core machine

pytestmark = OUTER_RUN_ONLY


def _start(mode: str, directory: str) -> MPIJob:
    return start_mpi_job(SCRIPT, RANKS, mode, directory)


def _run(mode: str, directory: str) -> tuple[int, str, float]:
    return run_mpi_job(SCRIPT, RANKS, mode, directory, timeout=STARTUP)


def _failed_at(output: str) -> float:
    found = re.search(r"FAILING rank=\d+ time=([0-9.]+)", output)
    assert found, f"the job never reached the failure point:\n{output[-4000:]}"
    return float(found.group(1))


def test_rank_raising_mid_epoch_ends_all_ranks() -> None:
    code, output, ended = _run("raise", tempfile.mkdtemp())
    assert code != 0
    assert ended - _failed_at(output) < LIMIT
    assert output.count("RuntimeError: boom from rank 1 at batch 3") == 1, output[-4000:]  # printed once
    assert "in training_step" in output and "[mpistrategy] rank 1 of 3" in output


def test_every_rank_raising_in_step_is_no_abort_and_the_ranks_train_on_together() -> None:
    """Every rank raises at the same batch (a bad hyperparameter of a sweep's point): each rank gets its own error,
    nothing is aborted, and a second fit in the same processes trains on every rank alike."""
    code, output, _ = _run("raise_everywhere", tempfile.mkdtemp())
    assert code == 0, output[-4000:]
    raised = re.findall(r"RAISED rank=(\d) ValueError: every rank at batch 3", output)
    assert sorted(raised) == ["0", "1", "2"], output[-4000:]
    assert "aborting all ranks" not in output
    second = re.findall(r"SECOND rank=(\d) step=3 weight=(-?\d+\.\d{10})", output)  # ranks' lines may interleave
    assert sorted(rank for rank, _ in second) == ["0", "1", "2"] and len({w for _, w in second}) == 1, output[-4000:]


def test_every_rank_raising_the_same_error_uncaught_prints_each_traceback_in_one_write() -> None:
    """The launcher forwards each rank's writes as they come: every rank's traceback, headed by its rank, reaches
    stderr in one write, so that the ranks' tracebacks of the same error cannot interleave within a line."""
    directory = tempfile.mkdtemp()
    code, output, _ = _run("raise_everywhere_uncaught", directory)
    assert code == 1 and "aborting all ranks" not in output, output[-4000:]
    for rank in range(RANKS):
        writes = [json.loads(line) for line in (Path(directory) / f"writes{rank}").read_text().splitlines()]
        reports = [text for text in writes if "ValueError: every rank at batch 3" in text]
        assert len(reports) == 1, writes
        assert reports[0].startswith(f"[mpistrategy] rank {rank} of {RANKS} "), reports[0]
        assert "Traceback (most recent call last)" in reports[0] and "in training_step" in reports[0], reports[0]
        assert output.count(reports[0]) == 1, output[-4000:]


def test_stop_signals_reaching_a_finished_job_while_it_exits_leave_its_exit_code_zero() -> None:
    """SLURM's lead signal may come while a job that finished takes its seconds to exit (MPI's finalisation, the
    interpreter's shutdown, where Python gives its handlers back to the default action): ignored, exit code 0."""
    code, output, _ = _run("signal_at_exit", tempfile.mkdtemp())
    assert code == 0, output[-4000:]
    assert sorted(re.findall(r"AT EXIT rank=(\d) ignored=True", output)) == ["0", "1", "2"], output[-4000:]
    assert sorted(re.findall(r"SURVIVED rank=(\d)", output)) == ["0", "1", "2"], output[-4000:]


def test_rank_calling_os_exit_ends_all_ranks_and_says_which_rank_and_code() -> None:
    code, output, ended = _run("os_exit", tempfile.mkdtemp())
    assert code != 0
    assert ended - _failed_at(output) < LIMIT
    assert "[mpistrategy] rank 1 of 3" in output and "exited with code 3 through os._exit" in output, output[-4000:]
    assert "in training_step" in output  # where it was called from


def test_rank_calling_os_exit_0_while_training_ends_the_job_with_a_failing_code() -> None:
    """The job did not finish: a batch script must not read it as done."""
    code, output, ended = _run("os_exit_0", tempfile.mkdtemp())
    assert code != 0, output[-4000:]
    assert ended - _failed_at(output) < LIMIT
    assert "exited with code 1 through os._exit before the job finished (code 0 while training" in output


@pytest.mark.parametrize("mode", ["sigterm_setup", "sigterm_sanity"])
def test_sigterm_while_fit_prepares_stops_all_at_the_first_steps_with_a_checkpoint(mode: str) -> None:
    """A preemption while ``fit`` sets up (the setup hook: before Lightning's own handlers) or in the sanity check
    (which every resumed run goes through) is a coordinated stop, not a failure nor the signal's default action on
    one rank: every rank stops at the same step, after a checkpoint, with the stop's exit code."""
    directory = tempfile.mkdtemp()
    code, output, _ = _run(mode, directory)
    assert code == STOPPED_EXIT_CODE, output[-4000:]
    assert "SIGNALLING rank=1" in output and "raised an exception" not in output, output[-4000:]
    steps = _stopped_steps(output)
    assert sorted(steps) == list(range(RANKS)) and len(set(steps.values())) == 1 and steps[0] <= 2, output[-4000:]
    assert torch.load(Path(directory) / "hpc_ckpt_1.ckpt", weights_only=False)["global_step"] == steps[0]


def test_sigterm_after_fit_takes_its_default_action() -> None:
    """Once fit is over the strategy's handler is not in the way (Lightning puts back the handler it found, the
    strategy's): SIGTERM ends the process as it would without mpistrategy."""
    code, output, _ = _run("sigterm_after_fit", tempfile.mkdtemp())
    assert code != 0, output[-4000:]
    assert "SIGNALLING rank=1" in output and "SURVIVED" not in output, output[-4000:]
    assert sorted(_stopped_steps(output).values()) == [5, 5, 5], output[-4000:]


def test_rank_killed_mid_epoch_ends_all_ranks() -> None:
    code, output, ended = _run("kill", tempfile.mkdtemp())
    assert code != 0
    assert ended - _failed_at(output) < LIMIT
    assert "STOPPED" not in output


def test_exception_outside_the_trainer_ends_all_ranks() -> None:
    code, output, ended = _run("raise_outside", tempfile.mkdtemp())
    assert code != 0
    assert ended - _failed_at(output) < LIMIT
    assert "ValueError: outside the trainer on rank 1" in output


def _stopped_steps(output: str) -> dict[int, int]:
    return {int(r): int(s) for r, s in re.findall(r"STOPPED rank=(\d+) global_step=(\d+)", output)}


@pytest.fixture(scope="module")
def stopped_by_sigusr1() -> tuple[str, int, str]:
    """A job stopped by SIGUSR1 on rank 1: its directory (with the stop checkpoint), exit code and output."""
    directory = tempfile.mkdtemp()
    code, output, _ = _run("usr1", directory)
    return directory, code, output


def test_sigusr1_on_one_rank_stops_all_at_the_same_step_with_a_checkpoint(stopped_by_sigusr1) -> None:
    stopped, code, output = stopped_by_sigusr1
    directory = shutil.copytree(stopped, tempfile.mkdtemp() + "/job")
    assert code == STOPPED_EXIT_CODE, output[-4000:]
    steps = _stopped_steps(output)
    assert sorted(steps) == list(range(RANKS)) and len(set(steps.values())) == 1, output[-4000:]
    step = steps[0]
    # The signal arrives during batch 3 (the 4th optimizer step); the flags posted before the 5th step are read
    # before the 6th, where every rank stops with global_step 5.
    assert step == 5
    checkpoint = Path(directory) / "hpc_ckpt_1.ckpt"
    assert checkpoint.exists()
    assert torch.load(checkpoint, weights_only=False)["global_step"] == step
    code, output, _ = _run("resume", directory)
    assert code == 0, output[-4000:]
    assert set(_stopped_steps(output).values()) == {30}


def test_a_signal_stops_all_ranks_that_step_the_torch_optimizer_itself() -> None:
    """Manual optimization stepping the torch optimizer past Lightning's wrapper leaves the global step at 0; the
    ranks still stop together after the same optimizer step, with a checkpoint, instead of training on to the end
    of the epoch with the signal swallowed."""
    directory = tempfile.mkdtemp()
    code, output, _ = _run("usr1_raw", directory)
    assert code == STOPPED_EXIT_CODE, output[-4000:]
    steps = re.findall(r"STOPPED rank=(\d+) global_step=0 raw_steps=(\d+)", output)
    assert sorted(rank for rank, _ in steps) == ["0", "1", "2"], output[-4000:]
    assert {int(raw) for _, raw in steps} == {5}, output[-4000:]  # as the global step of the usr1 job above
    assert (Path(directory) / "hpc_ckpt_1.ckpt").exists()


def test_sigterm_from_outside_to_one_rank_stops_all_at_the_same_step() -> None:
    directory = tempfile.mkdtemp()
    job = _start("pids", directory)
    target = Path(directory) / "pid2"
    deadline = time.time() + STARTUP
    while not target.exists() or not target.read_text():
        assert job.process.poll() is None and time.time() < deadline, "the job ended or never started training"
        time.sleep(0.2)
    os.kill(int(target.read_text()), signal.SIGTERM)
    code, output, _ = job.finish(STARTUP)
    assert code == STOPPED_EXIT_CODE, output[-4000:]
    steps = _stopped_steps(output)
    assert sorted(steps) == list(range(RANKS)) and len(set(steps.values())) == 1, output[-4000:]
    assert (Path(directory) / "hpc_ckpt_1.ckpt").exists()


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_signal_to_mpiexec_stops_all_ranks(signum: signal.Signals) -> None:
    """MPICH's mpiexec forwards SIGUSR1 and SIGTERM to every rank; they stop together."""
    directory = tempfile.mkdtemp()
    job = _start("pids", directory)
    deadline = time.time() + STARTUP
    while not all((Path(directory) / f"pid{r}").exists() for r in range(RANKS)):
        assert job.process.poll() is None and time.time() < deadline, "the job ended or never started training"
        time.sleep(0.2)
    time.sleep(0.5)
    job.process.send_signal(signum)
    code, output, _ = job.finish(STARTUP)
    assert code == STOPPED_EXIT_CODE, output[-4000:]
    steps = _stopped_steps(output)
    assert sorted(steps) == list(range(RANKS)) and len(set(steps.values())) == 1, output[-4000:]
    assert (Path(directory) / "hpc_ckpt_1.ckpt").exists()


def test_a_truncated_stop_checkpoint_is_refused_by_every_rank_without_an_abort(stopped_by_sigusr1) -> None:
    directory = shutil.copytree(stopped_by_sigusr1[0], tempfile.mkdtemp() + "/job")
    code, output, _ = _run("corrupt", directory)
    assert code == 1, output[-4000:]
    checkpoint = Path(directory) / "hpc_ckpt_1.ckpt"
    refusal = f"CorruptCheckpointError: Checkpoint {checkpoint} is corrupt: it ends early"
    for rank in range(RANKS):  # every rank raises it
        assert f"RAISED rank={rank} {refusal}" in output, output[-4000:]
    assert sorted(_stopped_steps(output)) == list(range(RANKS))  # every rank left fit by itself: no abort, no hang
    assert "aborting all ranks" not in output
