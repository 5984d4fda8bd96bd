"""The sync modes' convergence check: every sync mode trains the digits recipe on 4 ranks as 2 nodes of 2 to within its
tolerance of flat averaging's final validation accuracy (hierarchical, hierarchical_local_sgd with period 4 and
DASO: 1 point; local_sgd with period 8 and gossip on a ring: 2 points), with the inter-node bytes they should send.

One MPI job: benchmarks/sync_convergence.py (its default epochs, seed and options), whose JSON is checked here.
"""

from __future__ import annotations

import json
import sys

import pytest

from mpistrategy.launch import mpiexec_command
from tests.recipes._cli import ROOT, run

MODES = ["flat", "hierarchical", "local_sgd", "hierarchical_local_sgd", "daso", "gossip"]
TOLERANCE = {"hierarchical": 1.0, "hierarchical_local_sgd": 1.0, "daso": 1.0, "local_sgd": 2.0, "gossip": 2.0}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("sync_convergence")
    script = ROOT / "benchmarks" / "sync_convergence.py"
    output = run([*mpiexec_command(), "-n", "4", sys.executable, str(script), "--results", str(folder)], folder, 900)
    print(output.stdout)
    assert (folder / "sync_convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((folder / "sync_convergence.json").read_text())


def _rows(results: dict) -> dict[str, dict]:
    return {row["mode"]: row for row in results["rows"]}


def test_every_mode_ends_within_its_tolerance_of_flat_averaging(results: dict) -> None:
    rows = _rows(results)
    assert list(rows) == MODES and (results["ranks"], results["ranks_per_node"]) == (4, 2)
    flat = rows["flat"]["final_val_acc"]
    assert flat >= 0.93, rows["flat"]  # the reference itself learned the task
    for mode, tolerance in TOLERANCE.items():
        points = 100.0 * (rows[mode]["final_val_acc"] - flat)
        assert abs(points) <= tolerance, f"{mode}: {points:+.2f} points against flat ({tolerance} allowed)"
        assert rows[mode]["tolerance_points"] == tolerance and rows[mode]["within_tolerance"]


def test_the_modes_send_what_they_should_between_nodes(results: dict) -> None:
    rows = _rows(results)
    steps = rows["flat"]["steps"]
    assert all(row["steps"] == steps for row in rows.values())
    # one copy per node crosses nodes (hierarchical); the model every 8 or 4 steps instead of gradients every step
    # (local SGD; its steps are a multiple of 8): the same payload per message, that many times fewer messages
    assert rows["hierarchical"]["inter_node_vs_flat"] == pytest.approx(1 / 2)
    assert rows["local_sgd"]["inter_node_vs_flat"] == pytest.approx(1 / 8)
    assert rows["hierarchical_local_sgd"]["inter_node_vs_flat"] == pytest.approx(1 / 2 / 4)
    assert rows["daso"]["inter_node_vs_flat"] < 1 / 2  # blocking in its first and last epoch only
    for row in rows.values():
        # the strategy's counter after the fit holds what the last validation saw (nothing is sent after it)
        assert row["inter_node_bytes"] == row["curve"][-1]["inter_node_bytes"] > 0
        assert [point["epoch"] for point in row["curve"]] == list(range(results["epochs"]))
