"""benchmarks/compression.py runs for real (quick mode, 2 ranks) and writes complete results (no timing asserted):
the schema of the JSON, finite positive times and ratios that agree with the per-round times and the bytes, the
accuracy curves the table quotes, and a whole PNG."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from mpistrategy.aggregation import SCHEMES
from tests.benchmark_runs import assert_count, assert_finite, assert_positive, png_size, run_benchmark

#: what ``--quick`` runs, at 2 ranks
QUICK_SETTINGS = {"ranks": 2, "epochs": 1, "rounds": 2, "steps": 10, "warmup": 3}
ROW_KEYS = {
    "scheme",
    "bytes_per_step",
    "share_of_mean",
    "ms_per_step",
    "overhead_ms",
    "ratio",
    "ratio_min",
    "ratio_max",
    "final_val_acc",
    "digits_mb_sent",
}


def test_compression_benchmark_covers_every_scheme(tmp_path: Path) -> None:
    output = run_benchmark("compression.py", tmp_path, timeout=900)
    payload = json.loads((tmp_path / "compression.json").read_text())
    assert set(payload) == {"threads_per_rank", "table", "curves", "rounds_ms_per_step", *QUICK_SETTINGS}
    assert {key: payload[key] for key in QUICK_SETTINGS} == QUICK_SETTINGS
    assert_count(payload["threads_per_rank"], "threads_per_rank")
    schemes = {*SCHEMES, "powersgd_rank4"}
    rounds = payload["rounds_ms_per_step"]
    assert len(rounds) == QUICK_SETTINGS["rounds"] and all(set(r) == schemes for r in rounds), rounds
    for number, times in enumerate(rounds):
        for scheme, milliseconds in times.items():
            assert_positive(milliseconds, f"round {number}: {scheme}")
    _check_curves(payload["curves"], schemes, QUICK_SETTINGS["epochs"])
    rows = {row["scheme"]: row for row in payload["table"]}
    assert set(rows) == schemes and len(payload["table"]) == len(schemes)
    for scheme, row in rows.items():
        _check_row(row, rows["mean"], rounds, payload["curves"][scheme])
    assert rows["mean"]["share_of_mean"] == 1.0 and rows["topk"]["share_of_mean"] <= 0.022
    assert rows["powersgd"]["share_of_mean"] <= 0.01 and rows["sign"]["share_of_mean"] <= 1 / 32 + 1e-3
    assert "scheme" in output and "powersgd_rank4" in output
    width, height = png_size(tmp_path / "compression.png")
    assert width > height >= 300, (width, height)  # two panels side by side


def _check_curves(curves: dict, schemes: set[str], epochs: int) -> None:
    """One point per epoch and scheme: bytes sent so far (growing) and the validation accuracy."""
    assert set(curves) == schemes
    for scheme, curve in curves.items():
        assert len(curve) == epochs and all(set(point) == {"bytes", "val_acc"} for point in curve), curve
        sent = [point["bytes"] for point in curve]
        for value in sent:
            assert_count(value, f"{scheme}: bytes sent")
        assert sent == sorted(set(sent)), f"{scheme}: bytes sent do not grow: {sent}"
        assert all(type(p["val_acc"]) is float and 0 <= p["val_acc"] <= 1 for p in curve), curve


def _check_row(row: dict, mean: dict, rounds: list[dict], curve: list[dict]) -> None:
    """A table row: every key of its type; its times, ratios and accuracy those of the rounds and the curve."""
    scheme = row["scheme"]
    assert set(row) == ROW_KEYS, sorted(row)
    assert type(scheme) is str
    assert_count(row["bytes_per_step"], f"{scheme}: bytes_per_step")
    for key in ("share_of_mean", "ms_per_step", "ratio", "ratio_min", "ratio_max", "digits_mb_sent"):
        assert_positive(row[key], f"{scheme}: {key}")
    assert_finite(row["overhead_ms"], f"{scheme}: overhead_ms")
    assert math.isclose(row["share_of_mean"], row["bytes_per_step"] / mean["bytes_per_step"], rel_tol=1e-12)
    median = statistics.median(r[scheme] for r in rounds)
    assert math.isclose(row["ms_per_step"], median, rel_tol=1e-12), (scheme, row["ms_per_step"], median)
    assert math.isclose(row["overhead_ms"], median - mean["ms_per_step"], rel_tol=1e-9, abs_tol=1e-9), row
    ratios = [r[scheme] / r["mean"] for r in rounds]  # per round, against the mean in the same round
    assert math.isclose(row["ratio"], statistics.median(ratios), rel_tol=1e-12), (row, ratios)
    assert (row["ratio_min"], row["ratio_max"]) == (min(ratios), max(ratios)), (row, ratios)
    assert row["final_val_acc"] == curve[-1]["val_acc"] and 0 < row["final_val_acc"] <= 1, (row, curve)
    assert math.isclose(row["digits_mb_sent"], curve[-1]["bytes"] / 1e6, rel_tol=1e-12), (row, curve)
