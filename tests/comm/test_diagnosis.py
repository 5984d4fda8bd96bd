"""Desynchronised ranks diagnosed: fingerprints name every rank's call and place, the stall watchdog reports a rank
that never arrives (in Python and in a C call) and ends the job, the flight records name the first divergence.

Each job runs tests/comm/scripts/desync.py: three desync cases that every rank survives, then a stall; or
tests/comm/scripts/unmatched_at_exit.py: communication no peer completes, waited for at exit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpistrategy.comm.flight import main as flight_main
from mpistrategy.comm.stall_report import STALL_EXIT_CODE
from mpistrategy.comm.stall_settings import set_stall_timeout, stall_timeout
from tests.external_job import OUTER_RUN_ONLY, marked_line, run_mpi_job

pytestmark = OUTER_RUN_ONLY

SCRIPT = Path(__file__).parent / "scripts" / "desync.py"
UNMATCHED = Path(__file__).parent / "scripts" / "unmatched_at_exit.py"
STALL_TIMEOUT = 3


def _line_of(marker: str) -> str:
    return marked_line(SCRIPT, marker)


def _caught(output: str, case: str, rank: int) -> str:
    found = re.search(rf"CAUGHT {case} {rank} (.*?)(?=CAUGHT |PASSED |$)", output, re.MULTILINE)
    assert found, f"rank {rank} raised nothing in {case}:\n{output[-3000:]}"
    return found.group(1)


@pytest.mark.parametrize(("ranks", "late_in"), [(3, "sleep"), (2, "spin")])
def test_desynchronised_ranks_are_named_and_a_rank_that_never_arrives_ends_the_job(
    ranks: int, late_in: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    late = ranks - 1
    code, output, ended = run_mpi_job(
        SCRIPT,
        ranks,
        late_in,
        timeout=90,
        MPISTRATEGY_STALL_TIMEOUT=str(STALL_TIMEOUT),
        MPISTRATEGY_FLIGHT_DIR=str(tmp_path),
    )
    others = range(late)
    for rank in range(ranks):
        message = _caught(output, "different_ops", rank)
        assert "ranks called different collectives" in message
        for other in others:
            assert f"rank {other}: allreduce(float32[4], op=sum) at " in message
            assert _line_of("allreduce") in message
        assert f"rank {late}: broadcast(root=0) at " in message and _line_of("broadcast") in message

        message = _caught(output, "other_arguments", rank)
        assert "rank 0: allreduce(float32[4], op=sum) at " in message
        assert f"rank {late}: allreduce(float32[5], op=max) at " in message and _line_of("other arguments") in message

        message = _caught(output, "skipped_call", rank)
        assert "rank 0: allgather(float32[4], dim=0) at " in message and _line_of("skipped") in message
        assert f"rank {late}: allreduce(float32[4], op=sum) at " in message and _line_of("after skipped") in message

        message = _caught(output, "behind", rank)
        assert f"rank {late} is 1 call behind" in message
        assert "rank 0: iallreduce(float32[4], op=sum) at " in message and _line_of("unchecked") in message

    # every rank ends itself with 86 (each says so); mpiexec reports 9 instead when its cleanup after the first
    # rank's exit killed a rank that was about to exit
    assert code in (STALL_EXIT_CODE, 9), output[-4000:]
    assert output.count(f"ends with exit code {STALL_EXIT_CODE}") == ranks, output[-4000:]
    assert "UNREACHED" not in output
    started = float(re.search(r"HANG (\d+\.\d+)", output).group(1))
    assert ended - started <= STALL_TIMEOUT + 10, f"the job ended {ended - started:.1f} s after the stall began"
    for rank in range(ranks):
        report = output[output.index(f"stall (reported on rank {rank})") :]
        assert "in allreduce(float32[4], op=sum) (call #7 on its communicator) at " in report
        assert f"not arrived: rank {late}\n" in report
        assert re.search(
            rf"rank {late} \(.*\): not in a collective, now at \S*{_line_of(late_in)} \(in <module>\); "
            r"last entered allreduce\(float32\[4\], op=sum\) #6",
            report,
        )
        for other in others:
            assert re.search(rf"rank {other} \(.*\): waiting \d+\.\d s in allreduce\(float32\[4\], op=sum\) #7", report)
        assert f"rank {rank} ends with exit code {STALL_EXIT_CODE}" in report
        record = (tmp_path / f"rank{rank}.json").resolve()
        assert (
            f"rank {rank}'s flight record: {record} (compare the ranks': mpistrategy-flight {record.parent})" in report
        )
    own_stack = output[output.index(f"rank {late}'s stack (MainThread)") :]
    expected = "time.sleep(120)" if late_in == "sleep" else "while time.time() < deadline:"
    assert expected in own_stack.split("[mpistrategy]")[0]
    assert _line_of(late_in).replace("desync.py:", "line ") in own_stack.split("[mpistrategy]")[0]

    assert sorted(path.name for path in tmp_path.glob("rank*.json")) == [f"rank{r}.json" for r in range(ranks)]
    capsys.readouterr()
    assert flight_main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"rank {late} (" in printed and "stall): 6 calls recorded, after #6 allreduce(float32[4], op=sum)" in printed
    assert "inside #7 allreduce(float32[4], op=sum) at " in printed and _line_of("waits") in printed
    # the first divergence of the ranks' calls: the op that the late rank called differently
    assert "call #1 differs: rank 0: allreduce(float32[4], op=sum) at " in printed
    assert f"rank {late}: broadcast(root=0) at " in printed


def test_in_warn_mode_a_stall_is_reported_once_and_the_job_goes_on(tmp_path: Path) -> None:
    code, output, _ = run_mpi_job(
        SCRIPT,
        2,
        "late",
        timeout=90,
        MPISTRATEGY_STALL_TIMEOUT="2",
        MPISTRATEGY_STALL_ACTION="warn",
        MPISTRATEGY_FLIGHT_DIR=str(tmp_path),
    )
    assert code == 0, output[-4000:]
    assert "ARRIVED 0" in output and "ARRIVED 1" in output
    assert output.count("stall (reported on rank 0)") == 1 and output.count("stall (reported on rank 1)") == 1
    assert "not arrived: rank 1" in output and "ends with exit code" not in output


@pytest.mark.parametrize("seconds", [-1, float("nan"), "10", True])
def test_a_stall_timeout_that_is_no_number_of_seconds_is_refused(seconds: object) -> None:
    with pytest.raises(ValueError, match="not a number of seconds >= 0"):
        set_stall_timeout(seconds)  # type: ignore[arg-type]


def test_an_unknown_stall_action_is_refused() -> None:
    with pytest.raises(ValueError, match="stall action: 'exit' is not one of"):
        set_stall_timeout(stall_timeout(), "exit")


def test_a_rank_waiting_in_an_object_reduction_on_a_strategy_communicator_answers(tmp_path: Path) -> None:
    """mpi4py makes a communicator's context for object reductions at the first one, holding the GIL while it
    waits for the other ranks; the strategy's communicators have it made when they are built, so a rank whose
    peers never join such a reduction (Lightning's reduce_boolean_decision after an uneven epoch) still answers."""
    code, output, _ = run_mpi_job(
        SCRIPT,
        2,
        "objects",
        timeout=90,
        MPISTRATEGY_STALL_TIMEOUT=str(STALL_TIMEOUT),
        MPISTRATEGY_FLIGHT_DIR=str(tmp_path),
    )
    assert code == STALL_EXIT_CODE, output[-4000:]
    report = output[output.index("stall (reported on rank 0)") :]
    assert "did not answer" not in report, report[:3000]
    assert re.search(rf"rank 1 \(.*\): not in a collective, now at \S*{_line_of('objects')} \(in <module>\)", report)
    assert sorted(path.name for path in tmp_path.glob("rank*.json")) == ["rank0.json", "rank1.json"]


@pytest.mark.parametrize(("case", "hook"), [("gradient", "_complete_at_exit"), ("dropped", "_complete_parked")])
def test_communication_no_peer_completes_is_reported_at_exit_instead_of_holding_the_process(
    case: str, hook: str
) -> None:
    """A gradient sent in backward that the peer never receives, a dropped non-blocking allreduce the peer never
    joins: the rank waits for it at exit while its watchdog still watches, so the job ends with a stall report
    naming the wait (an unwatched wait would hold the process until the launcher's time limit)."""
    started = time.time()
    code, output, ended = run_mpi_job(UNMATCHED, 2, case, timeout=90, MPISTRATEGY_STALL_TIMEOUT=str(STALL_TIMEOUT))
    assert code == STALL_EXIT_CODE, output[-4000:]
    assert "END 0" in output and "END 1" in output, output[-4000:]
    report = output[output.index("[mpistrategy] stall") :]
    assert f"in {hook}" in report and "ended its script" in report, report[:3000]
    assert ended - started <= STALL_TIMEOUT + 30, f"the job ended {ended - started:.1f} s after it started"


def test_a_rank_that_cannot_answer_is_named_and_aborted(tmp_path: Path) -> None:
    """A rank holding the GIL in a C call cannot answer: the others name it, and the lowest of them ends it with
    MPI_Abort (mpiexec reports 86 or the SIGKILL that ended the silent rank)."""
    code, output, ended = run_mpi_job(
        SCRIPT, 3, "gil", timeout=90, MPISTRATEGY_STALL_TIMEOUT=str(STALL_TIMEOUT), MPISTRATEGY_FLIGHT_DIR=str(tmp_path)
    )
    assert code in (STALL_EXIT_CODE, 9), output[-4000:]
    started = float(re.search(r"HANG (\d+\.\d+)", output).group(1))
    assert ended - started <= STALL_TIMEOUT + 10
    for rank in (0, 1):
        report = output[output.index(f"stall (reported on rank {rank})") :]
        assert "did not answer: rank 2 (gone, or holding the GIL in a C call" in report
        assert "rank 2: did not answer" in report
    assert "stall (reported on rank 2)" not in output


@pytest.mark.parametrize(
    ("content", "problem"),
    [("{not json", "not JSON"), ("[1, 2]", "a JSON list, not an object"), ('{"rank": 0}', "missing or wrong: size")],
)
def test_the_flight_tool_refuses_a_file_that_is_no_flight_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, problem: str
) -> None:
    (tmp_path / "rank0.json").write_text(content)
    assert flight_main([str(tmp_path)]) == 2
    assert f"mpistrategy-flight: {tmp_path / 'rank0.json'}: not a flight record ({problem}" in capsys.readouterr().err
    assert flight_main([str(tmp_path / "rank0.json")]) == 2
    assert "is not a directory (give the folder of the rank*.json files)" in capsys.readouterr().err


def test_the_flight_tool_leaves_out_the_records_an_earlier_job_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job of three ranks wrote rank0-2.json, a later job of two overwrote rank0 and rank1: rank2.json, whose
    calls belong to the other job, is named and not compared."""
    call = {"call": "allreduce(float32[4], op=sum)", "site": "train.py:9", "count": 1, "communicator": "0,1#0"}
    for rank, job, written in [(0, "new", 20.0), (1, "new", 21.0), (2, "old", 10.0)]:
        record = {"rank": rank, "size": 2 if job == "new" else 3, "host": "node", "pid": rank, "reason": "stall"}
        late = {**call, "call": "broadcast(root=0)", "communicator": "0,1,2#0"}
        calls = [call] if job == "new" else [late]
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({**record, "job": job, "time": written, "calls": calls}))
    assert flight_main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("left out rank2.json: written by an earlier job than the others\n")
    assert "rank 2 (" not in printed and "no record from" not in printed
    assert "no divergence in the calls all ranks recorded" in printed


def test_in_a_slurm_job_the_flight_records_go_to_a_folder_of_the_job(tmp_path: Path) -> None:
    environment = {key: value for key, value in os.environ.items() if key != "MPISTRATEGY_FLIGHT_DIR"}
    show = "from mpistrategy.comm.flight import flight_directory; print(flight_directory())"
    shown = [
        subprocess.run(
            [sys.executable, "-c", show], env={**environment, **extra}, cwd=tmp_path, capture_output=True, text=True
        ).stdout.strip()
        for extra in ({"SLURM_JOB_ID": "4711"}, {"SLURM_JOB_ID": "4711", "MPISTRATEGY_FLIGHT_DIR": "mine"})
    ]
    assert shown == [os.path.join("mpistrategy_flight", "slurm-4711"), "mine"]


def test_a_call_site_is_the_users_line_also_where_the_package_is_imported_through_a_relative_path(
    tmp_path: Path,
) -> None:
    """A script that finds mpistrategy through a relative ``sys.path`` entry (``sys.path.insert(0, "..")``): its
    code objects' file names are not normalised (``.../run/../mpistrategy/...``), and the call log still names the
    script's line, not the package's."""
    repository = Path(__file__).resolve().parents[2]
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {os.path.relpath(repository, tmp_path)!r})\n"
        "import torch\n"
        "import mpistrategy\n"
        "from mpistrategy import allreduce\n"
        "from mpistrategy.comm import calls\n"
        "allreduce(torch.ones(2))\n"
        "print(mpistrategy.__file__, calls.recent()[-1].site)\n"
    )
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported_from, site = done.stdout.split()
    assert os.path.normpath(imported_from) != imported_from, "the package was not imported through the relative path"
    assert site == "train.py:7"
