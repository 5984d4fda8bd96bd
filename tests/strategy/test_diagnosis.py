"""Training that goes astray on one rank is diagnosed instead of hanging, under the Trainer and Fabric and several
sync modes: a skipped backward pass raises on every rank naming each rank's batch; a rank with a batch more, or
stuck in its data loader, is reported by the stall watchdog, which ends the job (tests/strategy/scripts/
desync_training.py; the late rank is the last one)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mpistrategy.comm import flight
from mpistrategy.comm.watchdog import STALL_EXIT_CODE
from tests.external_job import OUTER_RUN_ONLY, assert_desync_recorded, marked_line, run_mpi_job

pytestmark = OUTER_RUN_ONLY

SCRIPT = Path(__file__).parent / "scripts" / "desync_training.py"
STALL_TIMEOUT = 3


def _line_of(marker: str) -> str:
    return marked_line(SCRIPT, marker)


def _run(framework: str, case: str, sync: str, ranks: int, tmp_path: Path) -> tuple[int, str]:
    code, output, ended = run_mpi_job(
        SCRIPT,
        ranks,
        framework,
        case,
        sync,
        timeout=120,
        MPISTRATEGY_STALL_TIMEOUT=str(STALL_TIMEOUT),
        MPISTRATEGY_FLIGHT_DIR=str(tmp_path),
    )
    began = re.search(r"HANG (\d+\.\d+)", output)
    assert began, output[-4000:]
    assert ended - float(began.group(1)) <= STALL_TIMEOUT + 10, f"ended {ended - float(began.group(1)):.1f} s late"
    return code, output


def _reported_soon(framework: str, case: str, ranks: int, tmp_path: Path) -> str:
    """Run a case with the stall timeout at its default (300 s): the job must end with the watchdog's exit code
    within a minute of the case's beginning; its output."""
    code, output, ended = run_mpi_job(
        SCRIPT, ranks, framework, case, "flat", timeout=120, MPISTRATEGY_FLIGHT_DIR=str(tmp_path)
    )
    assert code == STALL_EXIT_CODE, output[-4000:]
    began = float(re.search(r"HANG (\d+\.\d+)", output).group(1))
    assert ended - began < 60, f"ended {ended - began:.1f} s after the case began"
    return output


def _stack_of(output: str, rank: int) -> str:
    return output[output.index(f"rank {rank}'s stack (MainThread)") :].split("[mpistrategy]")[0]


def test_trainer_rank_skipping_a_backward_pass_raises_on_every_rank(tmp_path: Path) -> None:
    """The gradient sync's check finds the ranks at different batches and raises on every rank together."""
    code, output = _run("trainer", "skip_backward", "flat", 2, tmp_path)
    assert code == 1, output[-4000:]
    site = re.escape(_line_of("manual backward"))
    message = (
        rf"gradient sync: ranks disagree on the training batch \(rank 0: gradient sync\(training batch=1\) at "
        rf"\S*{site}; rank 1: gradient sync\(training batch=2\) at \S*{site}\)"
    )
    assert re.search(message, output), output[-4000:]
    assert "aborting all ranks" not in output  # every rank raised it in step: each exits with its own error
    assert_desync_recorded(tmp_path, 2, r"CommunicationError: gradient sync: ranks disagree on the training batch")


def test_trainer_rank_running_the_optimizer_closure_once_more_raises_on_every_rank(tmp_path: Path) -> None:
    """Automatic optimization counts batches, not closure calls: the last rank's extra closure at batch 1 meets the
    others' sync of batch 2 and every rank raises, instead of pairing the ranks' later batches one apart."""
    code, output = _run("trainer", "extra_closure", "flat", 2, tmp_path)
    assert code == 1, output[-4000:]
    message = (
        r"gradient sync: ranks disagree on the training batch \(rank 0: gradient sync\(training batch=2\) at \S+; "
        r"rank 1: gradient sync\(training batch=1\) at \S+\)"
    )
    assert re.search(message, output), output[-4000:]
    assert "[mpistrategy] stall" not in output, output[-4000:]


def test_trainer_rank_skipping_a_backward_pass_of_a_resumable_loader_ends_the_job_at_once(tmp_path: Path) -> None:
    """The same through Lightning's DistributedSampler, whose loader decides the stop signals before every batch:
    the ranks raised having posted different numbers of those decisions, so the job ends with exit code 1 and every
    rank's traceback at once (not in a wait for the missing decision at teardown, ended by the stall watchdog)."""
    code, output = _run("trainer", "skip_backward_sampled", "flat", 2, tmp_path)
    assert code == 1, output[-4000:]
    assert output.count("CommunicationError: gradient sync: ranks disagree on the training batch") == 2, output[-4000:]
    assert "[mpistrategy] stall" not in output, output[-4000:]


def _uneven_report(output: str, rank: int) -> str:
    found = re.search(rf"uneven training data \(found on rank \d, reported on rank {rank}\)", output)
    assert found, output[-4000:]
    return output[found.start() :]


def test_trainer_rank_with_a_batch_more_raises_on_every_rank_before_the_first_batch(tmp_path: Path) -> None:
    """Rank 0's loader has five batches, the others' four (sized map-style loaders): the ranks compare the counts
    when the epoch starts, and every rank raises before any batch is read, each with its own traceback."""
    code, output, _ = run_mpi_job(SCRIPT, 3, "trainer", "extra_step", "hierarchical", timeout=120)
    assert code == 1, output[-4000:]
    message = (
        "ValueError: mpi_ad: the ranks' training data of epoch 0 has different numbers of batches (rank 0: 5; "
        "ranks 1-2: 4)"
    )
    assert output.count(message) == 3, output[-4000:]
    assert "use_distributed_sampler=True" in output and "limit_train_batches" in output, output[-4000:]
    assert "HANG" not in output and "aborting all ranks" not in output, output[-4000:]


def test_an_uneven_iterable_dataset_is_reported_long_before_the_stall_timeout(tmp_path: Path) -> None:
    """The last rank's stream has six batches, the others' four; with the stall timeout at its default (300 s),
    every rank reports both counts and the job ends within seconds, before the first epoch's extra batches could
    be paired with the next epoch's collectives of the other ranks."""
    output = _reported_soon("trainer", "uneven_stream", 2, tmp_path)
    for rank in range(2):
        report = _uneven_report(output, rank)
        assert re.search(
            r"\(rank 0: its data ended after 4; rank 1: (its data ended after 6|started batch [56])\)", report
        ), report
    assert "FINISHED" not in output


def test_a_checkpoint_saved_on_rank_zero_only_is_reported_long_before_the_stall_timeout(tmp_path: Path) -> None:
    """Rank 0 alone calls ``trainer.save_checkpoint`` in the training step of batch_idx 1 and waits there for the
    others' parts; the others wait in that batch's gradient sync. With the stall timeout at its default (300 s),
    every rank names the call, the line that made it and the fix, within seconds."""
    output = _reported_soon("trainer", "save_on_rank_zero", 3, tmp_path)
    site = re.escape(_line_of("save"))
    for rank in range(3):
        found = re.search(
            rf"trainer.save_checkpoint called on some ranks only \(found on rank [12], reported on rank {rank}\): "
            rf"rank 0 called it \(its call #1\) at \S*{site}, in epoch 0 at batch_idx 1; rank [12] has waited "
            r"\d+\.\d s in gradient sync\(training batch=1\) #\d+ at \S+ without it \(0 such calls there\)",
            output,
        )
        assert found, output[-4000:]
        report = output[found.start() :]
        assert "not under `if trainer.is_global_zero:`" in report.splitlines()[0]
        assert re.search(r"entered unequally \(rank 0: 1; ranks 1-2: 0\)", report), report
    assert "FINISHED" not in output and not (tmp_path / "saved.ckpt").exists()


@pytest.mark.parametrize("framework", ["trainer", "fabric"])
def test_a_checkpoint_saved_on_every_rank_at_different_times_is_no_desync(framework: str, tmp_path: Path) -> None:
    """Every rank saves at batch 1, the last one 1.5 s after the others (which wait for it): the run finishes."""
    code, output, _ = run_mpi_job(
        SCRIPT, 2, framework, "save_on_every_rank", "flat", timeout=120, MPISTRATEGY_FLIGHT_DIR=str(tmp_path)
    )
    assert code == 0, output[-4000:]
    assert output.count("FINISHED") == 2 and (tmp_path / "saved.ckpt").exists()


def test_fabric_save_on_rank_zero_only_is_reported_long_before_the_stall_timeout(tmp_path: Path) -> None:
    """Under Fabric rank 0 alone calls ``fabric.save``; the other rank waits in the next gradient sync: with the
    stall timeout at its default, both ranks name the save, where it was made and where the other rank waits."""
    output = _reported_soon("fabric", "save_on_rank_zero", 2, tmp_path)
    site, backward = re.escape(_line_of("fabric save")), re.escape(_line_of("backward"))
    for rank in range(2):
        assert re.search(
            rf"fabric.save called on some ranks only \(found on rank 1, reported on rank {rank}\): rank 0 called it "
            rf"\(its call #1\) at \S*{site}; rank 1 has waited \d+\.\d s in "
            rf"gradient sync\(backward pass=1\) #\d+ at \S*{backward} without it",
            output,
        ), output[-4000:]
    assert "not under `if fabric.is_global_zero:`" in output


@pytest.mark.parametrize(("framework", "sync", "ranks"), [("trainer", "daso", 2), ("fabric", "local_sgd", 3)])
def test_rank_stuck_in_its_data_loader_is_reported_with_its_stack(
    framework: str, sync: str, ranks: int, tmp_path: Path
) -> None:
    code, output = _run(framework, "loader_hang", sync, ranks, tmp_path)
    assert code == STALL_EXIT_CODE, output[-4000:]
    late = ranks - 1
    for rank in range(ranks):
        report = output[output.index(f"stall (reported on rank {rank})") :]
        assert re.search(rf"rank {late} \(.*\): not in a collective", report), report
        assert re.search(r"rank 0 \(.*\): waiting .*in _complete \(mpistrategy/sync/averaging.py:\d+\)", report)
    stack = _stack_of(output, late)
    assert "time.sleep(120)  # marker: loader" in stack and f"line {_line_of('loader').split(':')[1]}" in stack


def test_fabric_rank_skipping_a_backward_pass_is_reported(tmp_path: Path) -> None:
    """Fabric counts backward passes only: the late rank's extra step goes unnoticed until the other rank waits in
    a gradient sync that the late rank, finished, never joins; the finished rank waits at exit, answering, and both
    end by themselves."""
    code, output = _run("fabric", "skip_backward", "flat", 2, tmp_path)
    assert code == STALL_EXIT_CODE, output[-4000:]
    report = output[output.index("stall (reported on rank 0)") :]
    assert re.search(r"rank 0 has waited \d+\.\d s in gradient sync\(backward pass=3\)", report), report
    assert _line_of("backward") in report
    assert re.search(r"rank 1 \(.*\): ended its script \d+\.\d s ago, waiting at exit for the others", report), report
    assert "did not answer" not in output and "MPI_Abort" not in output, output[-4000:]


def test_strategy_options_set_the_stall_watchdog_and_the_flight_directory(tmp_path: Path) -> None:
    from mpistrategy.comm import flight, stall_settings
    from mpistrategy.strategy.mpi_ad import MPIADStrategy

    before = (stall_settings.stall_timeout(), stall_settings.stall_action(), flight.flight_directory())
    try:
        MPIADStrategy(stall_timeout=7, stall_action="warn", flight_dir=str(tmp_path))
        assert (stall_settings.stall_timeout(), stall_settings.stall_action(), flight.flight_directory()) == (
            7.0,
            "warn",
            tmp_path,
        )
        MPIADStrategy(stall_action="abort")  # the timeout stays
        assert (stall_settings.stall_timeout(), stall_settings.stall_action()) == (7.0, "abort")
        with pytest.raises(ValueError, match="stall timeout: -1 is not a number of seconds"):
            MPIADStrategy(stall_timeout=-1)
    finally:
        stall_settings.set_stall_timeout(before[0], before[1])
        flight.set_flight_directory(before[2])


@pytest.mark.parametrize("case", ["cycled_stream", "capped_stream"])
def test_healthy_epochs_whose_loader_ends_are_not_the_epochs_end_finish(case: str, tmp_path: Path) -> None:
    """A stream Lightning cycles beside a longer loader ends before the epoch does, and a stream capped by a
    limit_train_batches above its length ends before the planned count: neither is uneven data."""
    code, output, _ = run_mpi_job(
        SCRIPT, 2, "trainer", case, "flat", timeout=120, MPISTRATEGY_STALL_TIMEOUT=str(STALL_TIMEOUT)
    )
    assert code == 0 and "uneven training data" not in output, output[-4000:]
    assert output.count("FINISHED") == 2


def test_uneven_validation_logged_per_step_names_each_ranks_batches(tmp_path: Path) -> None:
    """Rank 0 has four validation batches, rank 1 three, and the loss is logged per step with ``sync_dist``: rank
    0's fourth sync meets rank 1's sync at the end of the pass. Every rank's error names both calls and each rank's
    validation batches, with the fix."""
    code, output = _run("trainer", "uneven_validation", "flat", 2, tmp_path)
    assert code == 1, output[-4000:]
    errors = re.findall(r"CommunicationError: allreduce: ranks disagree on .*", output)
    assert len(errors) == 2, output[-4000:]
    for error in errors:
        assert re.search(
            r"The ranks' evaluation data differs \(rank 0: validation, 4 batches; rank 1: validation, 3 batches"
            r"(, ended)?\)",
            error,
        ), error
        assert "use_distributed_sampler=True" in error and "on_step=False, on_epoch=True" in error, error


def test_uneven_validation_gathered_per_batch_raises_on_every_rank_with_each_ranks_batches(
    tmp_path: Path,
) -> None:
    """The last rank's validation has two batches, the others' three, each all-gathering its loss: the last rank
    ends its pass and checks the end of the pass, which meets the others' third gather in one fingerprint check
    (before the last rank could train on). Every rank raises, naming each rank's call and pass."""
    code, output = _run("trainer", "uneven_validation_gather", "flat", 3, tmp_path)
    assert code == 1, output[-4000:]
    at = f"tests/strategy/scripts/{_line_of('validation gather')}"
    calls = [f"rank {rank}: allgather(float32[1], dim=0) at {at}" for rank in (0, 1)]
    expected = "; ".join([*calls, "rank 2: end of an evaluation pass(pass=validation) at "])
    passes = "(ranks 0-1: validation, 3 batches; rank 2: validation, 2 batches, ended)"
    # the ranks' tracebacks interleave in the output: each rank's own error is read from its flight record
    assert_desync_recorded(tmp_path, 3, r"CommunicationError: (allgather|end of an evaluation pass): ")
    for record in flight.load(tmp_path).values():
        error = record["reason"]
        assert expected in error and f"The ranks' evaluation data differs {passes}" in error, error
    assert f"The ranks' evaluation data differs {passes}" in output, output[-4000:]
    assert "aborting all ranks" not in output


def test_uneven_validation_logged_per_pass_finishes(tmp_path: Path) -> None:
    """The same uneven validation data with the loss logged per pass only: one sync at the end, which pairs."""
    code, output, _ = run_mpi_job(
        SCRIPT, 2, "trainer", "uneven_validation_per_epoch", "flat", timeout=120, MPISTRATEGY_FLIGHT_DIR=str(tmp_path)
    )
    assert code == 0 and "evaluation data differs" not in output, output[-4000:]
    assert output.count("FINISHED") == 2


def test_validation_logged_on_one_rank_only_raises_on_every_rank_when_the_pass_ends(tmp_path: Path) -> None:
    """``Trainer.validate`` where only the last rank logs its loss with ``sync_dist=True``: the others end the pass
    without that sync, and their check at the end of the pass meets the last rank's sync. Every rank raises,
    naming both calls, instead of the others going on while the last rank waits."""
    code, output = _run("trainer", "validation_logged_on_one_rank", "flat", 3, tmp_path)
    assert code == 1 and "VALIDATED" not in output, output[-4000:]
    at = f"tests/strategy/scripts/{_line_of('validate')}"
    expected = (
        f"(rank 0: end of an evaluation pass(pass=validation) at {at}; rank 1: end of an evaluation "
        f"pass(pass=validation) at {at}; rank 2: allreduce(float32[], op=avg) at {at})"
    )
    assert_desync_recorded(tmp_path, 3, r"CommunicationError: (allreduce|end of an evaluation pass): ")
    for record in flight.load(tmp_path).values():
        assert expected in record["reason"], record["reason"]
    assert "aborting all ranks" not in output


@pytest.mark.parametrize(("framework", "ranks"), [("trainer", 2), ("fabric", 3)])
def test_a_gather_on_rank_zero_only_is_reported_long_before_the_stall_timeout(
    framework: str, ranks: int, tmp_path: Path
) -> None:
    """Rank 0 alone all-gathers its loss before the backward pass; the others wait in the gradient sync (another
    communicator, so no fingerprint check meets both). With the stall timeout at its default (300 s), the ranks
    find that each waits in a call the other has not entered, and every rank names both calls within seconds."""
    output = _reported_soon(framework, "gather_on_rank_zero", ranks, tmp_path)
    gather = re.escape(_line_of("gather" if framework == "trainer" else "fabric gather"))
    pass_name = "training batch" if framework == "trainer" else "backward pass"
    for rank in range(ranks):
        assert re.search(
            rf"ranks wait for each other in different collectives \(found on rank \d, reported on rank {rank}\): "
            rf"rank 0 waits in allgather\(float32\[1\], dim=0\) #\d+ at \S*{gather} \(on another communicator of "
            rf"world ranks [\d, ]+\), which rank [1-9] has not entered; rank [1-9] waits in gradient "
            rf"sync\({pass_name}=1\) #\d+ at \S+ \(on another communicator of world ranks [\d, ]+\), which rank 0 has "
            r"not entered\. Neither call can complete",
            output,
        ), output[-4000:]
    assert "`if trainer.is_global_zero:`" in output and "FINISHED" not in output


def test_fabric_rank_waiting_for_a_rank_that_ended_its_script_is_reported_long_before_the_stall_timeout(
    tmp_path: Path,
) -> None:
    """Under Fabric the last rank skips a backward pass, so rank 0 has a pass more: it waits in the gradient sync
    for a rank that has ended its script. With the stall timeout at its default (300 s), every rank names the wait
    and the rank that ended within seconds."""
    output = _reported_soon("fabric", "skip_backward", 2, tmp_path)
    for rank in range(2):
        assert re.search(
            rf"rank 0 waits for rank 1, which ended its script \(found on rank 0, reported on rank {rank}\): it has "
            rf"waited \d+\.\d s in gradient sync\(backward pass=3\) \(call #\d+ on its communicator\) at "
            rf"\S*{re.escape(_line_of('backward'))}\. It made a collective call that rank 1 did not make",
            output,
        ), output[-4000:]


def test_a_rank_with_more_epochs_than_the_others_raises_on_every_rank_at_its_next_epoch(tmp_path: Path) -> None:
    """The ranks that end training meet the longer rank's check at its next epoch in one fingerprint check: every
    rank raises naming both calls, within seconds (the others would wait in the strategy's teardown)."""
    code, output = _run("trainer", "more_epochs", "flat", 3, tmp_path)
    assert code != 0 and code != STALL_EXIT_CODE, output[-4000:]
    at = _line_of("fit")  # the call site as every rank names it: the script's path ends with it
    calls = [f"rank {rank}: training end(epoch=1, step=4) at tests/strategy/scripts/{at}" for rank in (0, 1)]
    expected = "; ".join([*calls, f"rank 2: training epoch start(epoch=1) at tests/strategy/scripts/{at})"])
    assert output.count(expected) >= 3, output[-4000:]
    assert_desync_recorded(
        tmp_path, 3, r"CommunicationError: training (end|epoch start): ranks called different collectives"
    )


def test_a_rank_with_more_steps_than_the_others_is_reported_long_before_the_stall_timeout(tmp_path: Path) -> None:
    """The ranks that end training wait in their end-of-training check while the longer rank waits in its gradient
    sync: the watchdog proves that neither call can complete."""
    output = _reported_soon("trainer", "more_steps", 2, tmp_path)
    assert "ranks wait for each other in different collectives" in output
    assert "rank 0 waits in training end(epoch=2, step=5) #" in output
    assert "rank 1 waits in gradient sync(training batch=5)" in output
