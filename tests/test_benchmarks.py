"""The benchmarks run for real (quick mode, 2 ranks under the harness's launcher) and write complete results.

No timing is asserted: the machines are shared and noisy. What is checked is that every contender ran for every
op, mode and size, and that the outputs a reader looks at (the summary, the JSON, the PNG) are there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mpistrategy.launch import mpiexec_command
from tests.mpi_harness import clean_environ

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, results: Path, *args: str) -> str:
    script_args = [str(BENCHMARKS / script), "--quick", "--results", str(results)]
    command = [*mpiexec_command(), "-n", "2", sys.executable, *script_args]
    done = subprocess.run(
        [*command, *args], env=clean_environ(), capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_collectives_benchmark_times_every_contender(tmp_path: Path) -> None:
    output = _run("collectives.py", tmp_path)
    payload = json.loads((tmp_path / "collectives.json").read_text())
    rows = payload["rows"]
    assert payload["ranks"] == 2 and payload["validation"] is True
    assert {(r["op"], r["backward"], r["bytes"]) for r in rows} == {
        (op, backward, size)
        for op in ("allreduce", "broadcast", "allgather")
        for backward in (False, True)
        for size in (1 << 10, 1 << 20, 1 << 24)
    }
    for row in rows:
        extra = set() if row["backward"] else {"ours_new", "ours_unchecked"}
        contenders = {"ours", "mpi4py", "gloo", "floor", "ours/floor", "floor/mpi4py"} | extra
        assert contenders <= set(row) and all(row[name] > 0 for name in contenders), row
    assert "forward, 1 KB: worst added latency" in output
    assert "forward, >= 1 MB: worst ours/floor" in output and "forward+backward, >= 1 MB: worst ours/floor" in output
    assert (tmp_path / "collectives.png").stat().st_size > 10_000


def test_strategy_benchmark_times_every_contender(tmp_path: Path) -> None:
    output = _run("strategy.py", tmp_path)
    payload = json.loads((tmp_path / "strategy.json").read_text())
    assert set(payload["median_ms_per_step"]) == {
        "mpi_ad",
        "ddp",
        "hand",
        "hand_cat",
        "reducer",
        "local",
        "lightning_local",
    }
    assert len(payload["rounds"]) == 3 and all(value > 0 for value in payload["median_ms_per_step"].values())
    assert payload["mpi_ad_vs_ddp"] > 0 and payload["mpi_ad_vs_hand"] > 0 and payload["mpi_ad_vs_reducer"] > 0
    assert "mpi_ad / ddp" in output and "mpi_ad / hand" in output and "lightning_local / ddp" in output
    assert 0 < payload["lightning_local_vs_ddp"] and 0 < payload["local_vs_hand"]
    assert (tmp_path / "strategy.png").stat().st_size > 10_000
