"""The benchmarks run for real (quick mode, 2 ranks under the harness's launcher) and write complete results.

No timing is asserted: the machines are shared and noisy. What is checked is that every contender ran for every
op, mode and size, and that the outputs a reader looks at (the summary, the JSON, the PNG) are there.
"""

from __future__ import annotations

import json
import math
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


def test_gpu_benchmark_on_the_cpu_times_every_contender_and_writes_finite_ratios(tmp_path: Path) -> None:
    """The GPU benchmark's code with the CPU standing in for the GPU, on a 14,058-parameter encoder; a CPU run
    without a results directory is refused (it must never replace GPU figures)."""
    tiny = ("--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "8", "--batch", "4")
    output = _run("gpu.py", tmp_path, *tiny)
    payload = json.loads((tmp_path / "gpu.json").read_text())
    assert payload["device"] == "cpu" and payload["model"]["parameters"] == 14_058 and set(payload["runs"]) == {"2"}
    run = payload["runs"]["2"]
    contenders = {"mpi_ad", "ddp", "hand", "local", "lightning_local"}
    assert run["ranks"] == 2 and run["ddp_backend"] == "gloo" and run["memory"] is None
    assert len(run["rounds"]) == 2 and all(set(r) == contenders for r in run["rounds"])
    assert set(run["median_ms_per_step"]) == contenders and all(v > 0 for v in run["median_ms_per_step"].values())
    assert set(run["ratios"]) == {
        "mpi_ad/hand",
        "mpi_ad/ddp",
        "mpi_ad/lightning_local",
        "lightning_local/ddp",
        "local/hand",
    }
    values = [value for ratio in run["ratios"].values() for value in ratio.values()]
    assert all(math.isfinite(value) and value > 0 for value in values), run["ratios"]
    assert set(run["hand_phases_ms"]) == {"device_to_host", "mpi", "host_to_device"}
    assert all(math.isfinite(value) and value >= 0 for value in run["hand_phases_ms"].values())
    assert run["hidden"] is None or math.isfinite(run["hidden"])
    assert "mpi_ad/hand" in output and "target <= 0.75" in output and "hidden by mpi_ad" in output
    assert (tmp_path / "gpu.png").stat().st_size > 10_000

    refused = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), "--device", "cpu"], capture_output=True, text=True, check=False
    )
    assert refused.returncode == 2 and "--device cpu: give --results DIR" in refused.stderr
