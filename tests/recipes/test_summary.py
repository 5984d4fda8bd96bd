"""The comparison of a sweep's points from their ``summary.json`` and ``status.json`` files (what
``python -m mpistrategy.recipes.summary <sweep dir>`` reads after a job array)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from mpistrategy.recipes.summary import COMPLETED, FAILED, STARTED, STOPPED, main, summarize_run, write_status


def _point(sweep: Path, job: str, overrides: list[str], state: str, final: float | None = None) -> None:
    error = ValueError("model.hidden=-3 is negative\nsecond line") if state == FAILED else None
    write_status(sweep / job, overrides, state, error)
    if final is not None:
        summary = {"objective": {"name": "val/acc"}, "final": {"val/acc": final}, "best": {"val/acc": final}}
        (sweep / job / "summary.json").write_text(json.dumps({**summary, "overrides": overrides, "fit_seconds": 2.5}))


def test_a_point_that_failed_stopped_or_did_not_end_is_listed_without_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _point(tmp_path, "0", ["model.hidden=32"], COMPLETED, final=0.93)
    _point(tmp_path, "1", ["model.hidden=-3"], FAILED)
    _point(tmp_path, "2", ["model.hidden=64"], STARTED)  # killed on the way (a time limit): no summary
    _point(tmp_path, "3", ["model.hidden=128"], STOPPED)  # a stop signal ended it after a checkpoint
    (tmp_path / "10").mkdir()  # a folder without either file is not a point

    assert main([str(tmp_path)]) == 0
    with (tmp_path / "comparison.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["job"], row["status"], row["final"]) for row in rows] == [
        ("0", COMPLETED, "0.93"),
        ("1", FAILED, ""),
        ("2", STARTED, ""),
        ("3", STOPPED, ""),
    ]
    assert rows[1]["error"] == "ValueError: model.hidden=-3 is negative"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].endswith("model.hidden=32: val/acc = 0.93")
    assert printed[1].endswith("model.hidden=-3: failed: ValueError: model.hidden=-3 is negative")
    assert (tmp_path / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_point_names_the_error_that_caused_it(tmp_path: Path) -> None:
    """Hydra's ``InstantiationException`` only names the target that failed; the status names the cause."""
    from hydra.errors import InstantiationException

    try:
        try:
            raise ValueError("period=0 must be an integer >= 1\nsecond line")
        except ValueError as cause:
            raise InstantiationException("Error in call to target 'recipes.builders.mpi_ad_strategy':\n...") from cause
    except InstantiationException as error:
        write_status(tmp_path / "0", ["strategy.period=0"], FAILED, error)
    status = json.loads((tmp_path / "0" / "status.json").read_text())
    assert status["error"] == "ValueError: period=0 must be an integer >= 1"


def test_a_run_without_a_csv_log_takes_its_final_values_from_the_logged_metrics(tmp_path: Path) -> None:
    """``logger=none``: no metrics.csv, so the final values and the objective come from the Trainer's last logged
    values (an epoch value where both a step and an epoch value were logged); the best value is unknown."""
    metrics = {"val/acc": 0.91, "val/loss": 0.3, "train/loss_step": 0.5, "train/loss_epoch": 0.4, "epoch": 2.0}
    summary = summarize_run(tmp_path, extra={"metrics": metrics}, plot=False, table=False)
    assert summary["final"] == {"train/loss": 0.4, "val/loss": 0.3, "val/acc": 0.91}
    assert summary["objective"] == {"name": "val/acc", "value": 0.91} and "best" not in summary
    assert json.loads((tmp_path / "summary.json").read_text())["final"] == summary["final"]


def test_bytes_sent_are_left_out_without_data_parallelism() -> None:
    """The traffic counter counts gradient and model averaging: a tensor- or pipeline-parallel run sends in its own
    layers' collectives, so a count of 0 would mislead."""
    from types import SimpleNamespace

    from mpistrategy.comm.traffic import NODE, TrafficCounter
    from mpistrategy.recipes.summary import bytes_sent

    traffic = TrafficCounter()
    traffic.add(NODE, 1000)
    assert bytes_sent(SimpleNamespace(traffic=traffic, data_parallel=True))["bytes_sent"]["node"] == 1000
    assert bytes_sent(SimpleNamespace(traffic=traffic, data_parallel=False)) == {}
