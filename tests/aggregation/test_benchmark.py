"""benchmarks/compression.py runs for real (quick mode, 2 ranks) and writes complete results (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mpistrategy.aggregation import SCHEMES
from mpistrategy.launch import mpiexec_command
from tests.mpi_harness import clean_environ

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compression.py"


def test_compression_benchmark_covers_every_scheme(tmp_path: Path) -> None:
    command = [*mpiexec_command(), "-n", "2", sys.executable, str(SCRIPT), "--quick", "--results", str(tmp_path)]
    done = subprocess.run(command, env=clean_environ(), capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"compression.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    payload = json.loads((tmp_path / "compression.json").read_text())
    rows = {row["scheme"]: row for row in payload["table"]}
    assert set(rows) == {*SCHEMES, "powersgd_rank4"} and len(payload["rounds_ms_per_step"]) == 3
    assert rows["mean"]["share_of_mean"] == 1.0 and rows["topk"]["share_of_mean"] <= 0.022
    assert rows["powersgd"]["share_of_mean"] <= 0.01 and rows["sign"]["share_of_mean"] <= 1 / 32 + 1e-3
    assert all(row["ms_per_step"] > 0 and 0 < row["final_val_acc"] <= 1 for row in rows.values())
    assert all(len(curve) == 2 for curve in payload["curves"].values())  # two epochs: two points each
    assert "scheme" in done.stdout and "powersgd_rank4" in done.stdout
    assert (tmp_path / "compression.png").stat().st_size > 10_000
