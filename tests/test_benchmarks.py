"""The benchmarks run for real (quick mode, 2 ranks under the harness's launcher) and write complete results.

No timing is asserted: the machines are shared and noisy. What is checked is the schema of the JSON (every key, of
its type), that every contender ran for every op, mode and size, that every time and every ratio is finite and
positive, that the summary ratios are those of the per-round times, and that the PNG is a whole image.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.benchmark_runs import BENCHMARKS, assert_count, assert_finite, assert_positive, png_size, run_benchmark

SIZES = (1 << 10, 1 << 20, 1 << 24)
OPS = ("allreduce", "broadcast", "allgather")
STRATEGY_CONTENDERS = {"mpi_ad", "ddp", "hand", "hand_cat", "reducer", "local", "lightning_local"}
STRATEGY_RATIOS = (
    "mpi_ad_vs_ddp",
    "mpi_ad_vs_hand",
    "mpi_ad_vs_hand_cat",
    "reducer_vs_hand",
    "mpi_ad_vs_reducer",
    "lightning_local_vs_ddp",
    "local_vs_hand",
)


def _collectives_row_keys(op: str, backward: bool) -> tuple[set[str], set[str]]:
    """The timed contenders (seconds per call) and the ratios a row of collectives.json holds, validation on."""
    times = {"ours", "mpi4py", "gloo", "floor"}
    ratios = {"ours/mpi4py", "gloo/ours", "ours/floor", "floor/mpi4py"}
    if op == "allreduce":
        times |= {"shm", "ours_mpi"}
        ratios |= {"mpi4py/shm", "ours/ours_mpi"}
    if op == "allreduce" and not backward:
        times |= {"shm_window", "mpi4py_window"}
        ratios.add("mpi4py/shm_window")
    if not backward:
        times |= {"ours_new", "ours_unchecked"}
        ratios.add("no-val/mpi4py")
    return times, ratios


def test_collectives_benchmark_times_every_contender(tmp_path: Path) -> None:
    output = run_benchmark("collectives.py", tmp_path)
    payload = json.loads((tmp_path / "collectives.json").read_text())
    assert set(payload) == {"ranks", "validation", "load_average", "shm_min_bytes", "rows"}
    assert payload["ranks"] == 2 and payload["validation"] is True
    assert len(payload["load_average"]) == 3 and all(
        type(load) is float and math.isfinite(load) and load >= 0 for load in payload["load_average"]
    )
    assert set(payload["shm_min_bytes"]) == {"private", "shared"}
    for kind, threshold in payload["shm_min_bytes"].items():
        assert_count(threshold, f"shm_min_bytes[{kind}]")
    rows = payload["rows"]
    assert [(r["op"], r["backward"], r["bytes"]) for r in rows] == [
        (op, backward, size) for op in OPS for backward in (False, True) for size in SIZES
    ]
    for row in rows:
        times, ratios = _collectives_row_keys(row["op"], row["backward"])
        assert set(row) == {"op", "backward", "bytes"} | times | ratios, sorted(row)
        assert type(row["op"]) is str and type(row["backward"]) is bool and type(row["bytes"]) is int
        for name in sorted(times | ratios):
            assert_positive(row[name], f"{row['op']} {row['bytes']} B backward={row['backward']}: {name}")
    assert "forward, 1 KB: worst added latency" in output
    assert "forward, >= 1 MB: worst ours/floor" in output and "forward+backward, >= 1 MB: worst ours/floor" in output
    width, height = png_size(tmp_path / "collectives.png")
    assert width > height >= 400, (width, height)  # two rows of panels, one column per op


def test_strategy_benchmark_times_every_contender(tmp_path: Path) -> None:
    output = run_benchmark("strategy.py", tmp_path)
    payload = json.loads((tmp_path / "strategy.json").read_text())
    assert set(payload) == {
        "ranks",
        "threads_per_rank",
        "batch_per_rank",
        "steps",
        "warmup",
        "rounds",
        "median_ms_per_step",
        *STRATEGY_RATIOS,
        "mpi_ad_minus_lightning_local_ms",
        "targets",
    }
    assert (payload["ranks"], payload["steps"], payload["warmup"]) == (2, 20, 5)
    assert_count(payload["threads_per_rank"], "threads_per_rank")
    assert_count(payload["batch_per_rank"], "batch_per_rank")
    rounds = payload["rounds"]
    assert len(rounds) == 3 and all(set(r) == STRATEGY_CONTENDERS for r in rounds), rounds
    for number, times in enumerate(rounds):
        for name, milliseconds in times.items():
            assert_positive(milliseconds, f"round {number}: {name}")
    assert set(payload["median_ms_per_step"]) == STRATEGY_CONTENDERS
    for name, milliseconds in payload["median_ms_per_step"].items():
        median = statistics.median(r[name] for r in rounds)
        assert math.isclose(milliseconds, median, rel_tol=1e-12), (name, milliseconds, median)
    for key in STRATEGY_RATIOS:
        name, reference = key.split("_vs_")
        assert_positive(payload[key], key)
        paired = statistics.median(r[name] / r[reference] for r in rounds)  # the median of per-round ratios
        assert math.isclose(payload[key], paired, rel_tol=1e-12), (key, payload[key], paired)
    exposed = payload["mpi_ad_minus_lightning_local_ms"]
    assert_finite(exposed, "mpi_ad_minus_lightning_local_ms")
    difference = statistics.median(r["mpi_ad"] - r["lightning_local"] for r in rounds)
    assert math.isclose(exposed, difference, rel_tol=1e-12, abs_tol=1e-9), (exposed, difference)
    assert set(payload["targets"]) == {"vs_ddp", "vs_hand"}
    for name, target in payload["targets"].items():
        assert_positive(target, f"targets[{name}]")
    assert "mpi_ad / ddp" in output and "mpi_ad / hand" in output and "lightning_local / ddp" in output
    width, height = png_size(tmp_path / "strategy.png")
    assert width > height >= 300, (width, height)  # one wide box plot


def test_gpu_benchmark_on_the_cpu_times_every_contender_and_writes_finite_ratios(tmp_path: Path) -> None:
    """The GPU benchmark's code with the CPU standing in for the GPU, on the 14,058-parameter encoder that
    ``--quick --device cpu`` takes; a CPU run without a results directory is refused (it must never replace GPU
    figures)."""
    output = run_benchmark("gpu.py", tmp_path, "--device", "cpu")
    payload = json.loads((tmp_path / "gpu.json").read_text())
    assert payload["device"] == "cpu" and payload["model"]["parameters"] == 14_058 and set(payload["runs"]) == {"2"}
    run = payload["runs"]["2"]
    contenders = {"mpi_ad", "mpi_ad_host", "ddp", "hand", "local", "lightning_local"}
    assert run["ranks"] == 2 and run["ddp_backend"] == "gloo" and run["memory"] is None
    assert len(run["rounds"]) == 2 and all(set(r) == contenders for r in run["rounds"])
    assert set(run["median_ms_per_step"]) == contenders and all(v > 0 for v in run["median_ms_per_step"].values())
    assert set(run["ratios"]) == {
        "mpi_ad/hand",
        "mpi_ad_host/hand",
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
    assert payload["aggregation"] == run["aggregation"] == "mean" and "mpi_ad aggregation mean" in output
    width, height = png_size(tmp_path / "gpu.png")
    assert width >= 300 and height >= 300, (width, height)

    refused = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu.py"), "--device", "cpu"], capture_output=True, text=True, check=False
    )
    assert refused.returncode == 2 and "--device cpu: give --results DIR" in refused.stderr


def test_gpu_benchmark_with_a_compressor_writes_its_own_results_and_sets_no_verdict(tmp_path: Path) -> None:
    """``--aggregation powersgd``: mpi_ad trains with PowerSGD (the other contenders as they are); the results go
    to ``gpu_powersgd.json``, and the targets, set for the mean, give no verdict. A shape option given with
    ``--quick`` wins over the small encoder's."""
    output = run_benchmark("gpu.py", tmp_path, "--device", "cpu", "--d-model", "16", "--aggregation", "powersgd")
    assert not (tmp_path / "gpu.json").exists()
    payload = json.loads((tmp_path / "gpu_powersgd.json").read_text())
    run = payload["runs"]["2"]
    assert payload["aggregation"] == run["aggregation"] == "powersgd"
    assert (payload["model"]["d_model"], payload["model"]["layers"], payload["model"]["seq"]) == (16, 1, 8)
    assert all(math.isfinite(value) and value > 0 for value in run["median_ms_per_step"].values())
    assert "mpi_ad aggregation powersgd" in output and "(target <= 0.75 is set for the mean)" in output
    assert "target <= 0.75: " not in output
    assert png_size(tmp_path / "gpu_powersgd.png")[0] >= 300


def test_gpu_staging_benchmark_on_the_cpu_times_every_part_of_every_configuration(tmp_path: Path) -> None:
    """The staging breakdown's code with the CPU standing in for the GPU (no mirrors there: the parts are zero and
    nothing is hidden), two bucket caps, shared memory on and off."""
    output = run_benchmark("gpu_staging.py", tmp_path, "--device", "cpu", "--caps", "25", "0.01")
    payload = json.loads((tmp_path / "gpu_staging.json").read_text())
    assert payload["ranks"] == 2 and payload["model"]["parameters"] == 14_058 and payload["steps"] == 3
    configurations = payload["configurations"]
    assert [(c["bucket_cap_mb"], c["shared_memory"]) for c in configurations] == [
        (25.0, "auto"),
        (25.0, "off"),
        (0.01, "auto"),
        (0.01, "off"),
    ]
    for c in configurations:
        assert c["mirrored"] is False and c["hidden"] is None
        for name in ("alone", "step", "backward_returned", "wait_returned"):
            assert_positive(c["ms"][name], name)
        assert c["ms"]["backward_returned"] <= c["ms"]["wait_returned"] <= c["ms"]["step"]
        assert c["ms"]["device_to_host"] == c["ms"]["host_sums"] == c["ms"]["host_to_device"] == 0.0
    assert configurations[0]["buckets"] == 1 and configurations[2]["buckets"] > 1
    assert "staged gradient synchronisation on CPU" in output and "hidden" in output


def test_zero_benchmark_times_every_contender_and_measures_the_state(tmp_path: Path) -> None:
    output = run_benchmark("zero.py", tmp_path, "--models", "mlp")
    payload = json.loads((tmp_path / "zero.json").read_text())
    assert set(payload) == {"date", "steps", "warmup", "rounds", "jobs"} and payload["rounds"] == 1
    (job,) = payload["jobs"]
    assert job["ranks"] == 2 and set(job["models"]) == {"mlp"}
    result = job["models"]["mlp"]
    assert result["parameters"] == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    contenders = {"flat", "stage1", "stage2", "ddp", "ddp_zero"}
    assert set(result["median_ms_per_step"]) == contenders and set(result["rounds"][0]) == contenders
    for name, value in result["median_ms_per_step"].items():
        assert_positive(value, name)
        assert value == result["rounds"][0][name]  # one round: its median is the round's
    for label, ratio in result["ratios"].items():
        contender, reference = label.split("_vs_")
        assert ratio == result["rounds"][0][contender] / result["rounds"][0][reference], label
    state = result["optimizer_state_bytes_per_rank"]
    # AdamW keeps two float32 moments per element (and a step count per parameter): flat holds them all
    assert 2 * 4 * result["parameters"] <= state["flat"] == state["ddp"] <= 2 * 4 * result["parameters"] + 4 * 6
    for name in ("stage1", "stage2"):
        assert state[name] <= state["flat"] / 2 * 1.01, (name, state)
    assert "stage1_vs_flat" in output and "target <= 1/2 + 1% = 0.5050" in output
    width, height = png_size(tmp_path / "zero.png")
    assert width > height, (width, height)


BAD_ARGUMENTS = [
    ("strategy.py", ["--rounds", "0"], "argument --rounds: 0 is out of range; give 1 or more"),
    ("strategy.py", ["--steps", "3", "--warmup", "5"], "--steps 3 leaves no timed step after --warmup 5"),
    ("compression.py", ["--epochs", "0"], "argument --epochs: 0 is out of range; give 1 or more"),
    ("diagnosis.py", ["--calls", "0"], "argument --calls: 0 is out of range; give 1 or more"),
    ("zero.py", ["--ranks", "0"], "argument --ranks: 0 is out of range; give 1 or more"),
    ("zero.py", ["--steps", "1", "--warmup", "1"], "--steps 1 leaves no timed step after --warmup 1"),
    ("zero.py", ["--quick", "--steps=1", "--warmup", "1"], "--steps 1 leaves no timed step after --warmup 1"),
    ("collectives.py", ["--sizes", "0"], "argument --sizes: 0 is out of range; give 1 or more"),
    ("cluster_allreduce.py", ["--mb", "0"], "argument --mb: 0.0 is not a finite number above zero"),
    ("hierarchical.py", ["--rate", "fast"], "link rate 'fast': give bits per second in tc's units"),
    ("sync_convergence.py", ["--epochs", "0"], "argument --epochs: 0 is out of range; give 1 or more"),
    ("cost_model.py", ["--latency-us", "-5"], "argument --latency-us: -5.0 is not a finite number above zero"),
    ("cluster_allreduce.py", ["--results", "/proc/nope"], "argument --results: cannot make the directory '/proc/nope'"),
    ("gpu.py", ["--results", "/proc/nope"], "argument --results: cannot make the directory '/proc/nope'"),
]


def test_a_bad_argument_is_refused_before_any_work_naming_the_argument() -> None:
    for script, arguments, message in BAD_ARGUMENTS:
        refused = subprocess.run(
            [sys.executable, str(BENCHMARKS / script), *arguments], capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2 and message in refused.stderr, (script, arguments, refused.stderr[-2000:])


def test_a_quick_run_without_results_never_writes_over_the_published_figures() -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _launch import QUICK_RESULTS, RESULTS, results_of
    finally:
        sys.path.remove(str(BENCHMARKS))
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results", type=Path)
    assert results_of(parser.parse_args(["--quick"])) == QUICK_RESULTS == RESULTS / "quick"
    assert results_of(parser.parse_args([])) == RESULTS
    assert results_of(parser.parse_args(["--quick", "--results", "/tmp/x"])) == Path("/tmp/x")


def _processes_naming(text: str) -> list[int]:
    """The pids whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_killed_benchmark_takes_its_mpi_job_with_it(tmp_path: Path) -> None:
    """SIGKILL to the script that relaunched itself under mpiexec: mpiexec and its ranks end too."""
    results = str(tmp_path / "killed")
    launcher = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / "strategy.py"), "--rounds", "20", "--results", results],  # minutes long
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while len(_processes_naming(results)) < 4 and time.monotonic() < deadline:  # launcher, mpiexec, 2 ranks
        time.sleep(0.2)
    assert len(_processes_naming(results)) >= 4, "the MPI job did not start"
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while _processes_naming(results) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_naming(results)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "the MPI job outlived its launcher"
