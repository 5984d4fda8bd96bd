"""benchmarks/hierarchical.py in quick mode on the emulated cluster, and benchmarks/cost_model.py on its output.

The benchmark needs root, iproute2 and MPICH's mpiexec (skipped with the missing parts as the reason otherwise).
No timing is asserted: what is checked is that every contender trained, that the bytes it sent were counted where
they must cross the link, and that the files a reader looks at were written. The cost model's fit is checked
against sweeps made from known parameters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import cost_model
from benchmarks.cluster import missing_requirements
from tests.mpi_harness import clean_environ

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = ROOT / "benchmarks" / "hierarchical.py"
COST_MODEL = ROOT / "benchmarks" / "cost_model.py"

MISSING = missing_requirements()
needs_cluster = pytest.mark.skipif(bool(MISSING), reason="emulated cluster unavailable, needs " + "; ".join(MISSING))


@needs_cluster
def test_every_contender_trains_and_the_results_are_written(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"  # the benchmark's TMPDIR: its records folder must be gone at the end
    scratch.mkdir()
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--results", str(tmp_path)],
        env={**clean_environ(), "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    payload = json.loads((tmp_path / "hierarchical.json").read_text())
    rows = payload["contenders"]
    expected = {"ddp", "flat", "hierarchical", "local_sgd", "hierarchical_local_sgd", "daso", "gossip"}
    assert expected <= set(rows), sorted(rows)
    for name, row in rows.items():
        assert row["steps"] == 4 and len(row["rounds_ms"]) == 1 and row["ms_per_step"] > 0, (name, row)
        # accuracy before training and after the (only) epoch, in percent of the 360 validation images
        assert [len(curve) for curve in row["curves"]] == [2] and 0 <= row["final_accuracy"] <= 100, (name, row)
    # gradients cross the link every step under DDP, flat and hierarchical: at least the 0.1 M parameters' bytes
    gradient_mb = payload["parameters"] * 4 / 1e6
    for name in ("ddp", "flat", "hierarchical", "gossip"):
        assert rows[name]["link_mb_per_step"] >= gradient_mb, (name, rows[name]["link_mb_per_step"], gradient_mb)
    assert rows["flat"]["counted_inter_node_mb_per_step"] == pytest.approx(4 * gradient_mb, rel=0.01)
    assert rows["hierarchical"]["counted_inter_node_mb_per_step"] == pytest.approx(2 * gradient_mb, rel=0.01)
    assert rows["ddp"]["counted_inter_node_mb_per_step"] is None  # Lightning's DDP has no traffic counter
    assert set(payload["targets"]) == {
        "daso_speedup",
        "hierarchical_local_sgd_speedup",
        "flat_vs_ddp",
        "daso_reaches_flat_accuracy_sooner",
    }
    assert all(len(r["load_before"]) == 3 for r in payload["rounds"])
    for png in ("hierarchical_step_time.png", "hierarchical_accuracy.png"):
        assert (tmp_path / png).stat().st_size > 10_000, png
    assert "x flat" in done.stdout and "load average" in done.stdout
    assert list(scratch.glob("hierarchical-*")) == []


def test_the_cost_model_recovers_known_links_and_writes_its_tables(tmp_path: Path) -> None:
    truth = cost_model.Network(
        alpha=80e-6,
        beta=40e6,
        beta_shared=25e6,
        alpha_s=5e-6,
        beta_s=2e9,
        gamma=0.4e-9,
        alpha_gloo=60e-6,
        beta_gloo=60e6,
    )
    layout = cost_model.Layout(2, 2)
    formulas = {
        "p2p_link": lambda n: truth.alpha + n / truth.beta,
        "p2p_link_shared": lambda n: truth.alpha + n / truth.beta_shared,
        "p2p_link_gloo": lambda n: truth.alpha_gloo + n / truth.beta_gloo,
        "tcp_stream_link": lambda n: 50e-6 + n / 100e6,
        "p2p_node": lambda n: truth.alpha_s + n / truth.beta_s,
        "allreduce_node": lambda n: cost_model.node_allreduce(truth, n, layout),
        "bcast_node": lambda n: cost_model.node_broadcast(truth, n, layout),
        "allreduce_leaders": lambda n: cost_model.leaders_allreduce(truth, n, layout),
        "allreduce_world": lambda n: cost_model.flat_allreduce(truth, n, layout),
    }
    seconds = {name: {n: f(n) for n in cost_model.SWEEP_SIZES} for name, f in formulas.items()}
    fitted = cost_model.Network.fit(seconds)
    for field in ("alpha", "beta", "beta_shared", "alpha_s", "beta_s", "gamma", "alpha_gloo", "beta_gloo"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    # a benchmark whose measured steps are the model's own: every contender within tolerance, and the projection
    benchmark = _benchmark_from(truth, compute=0.5)
    (tmp_path / "hierarchical.json").write_text(json.dumps(benchmark))
    (tmp_path / "cost_model_sweeps.json").write_text(
        json.dumps({"rate": "1gbit", "load": [1.0, 1.0], "seconds": seconds})
    )
    done = subprocess.run(
        [
            sys.executable,
            str(COST_MODEL),
            "--results",
            str(tmp_path),
            "--benchmark",
            str(tmp_path / "hierarchical.json"),
        ],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    payload = json.loads((tmp_path / "cost_model.json").read_text())
    assert all(abs(row["error"]) < 1e-6 for row in payload["check"].values()), payload["check"]
    assert payload["tcp_stream_gbit_per_s"] == pytest.approx(0.8)
    projection = payload["projection"]
    assert set(projection) == {"10 Gbit/s", "100 Gbit/s", "200 Gbit/s"}
    for table in projection.values():
        assert set(table) == set(benchmark["contenders"])
        assert all(set(row) == {str(n) for n in cost_model.PROJECTED_NODES} for row in table.values())
        # a ring's latency grows with the ranks, the leaders' Rabenseifner's with their logarithm
        assert table["ddp"]["1024"] > table["flat"]["1024"]
    assert "| flat |" in (tmp_path / "cost_model.md").read_text()
    assert (tmp_path / "cost_model.png").stat().st_size > 10_000


def _benchmark_from(net: cost_model.Network, compute: float) -> dict:
    """A hierarchical.json whose step times are exactly the model's, for 21.5 M parameters at 2x2."""
    parameters = 21_541_898
    model = parameters * 4
    buckets = [model - 1.2e6, 1.2e6]
    gossip = {"node": model, "inter": model}
    counted = {  # per step, all ranks: (node bytes, inter-node bytes)
        "ddp": (None, None),
        "flat": (0, 4 * model),
        "hierarchical": (4 * model, 2 * model),
        "local_sgd": (0, 4 * model / 8),
        "hierarchical_local_sgd": (4 * model + 4 * model / 8, 2 * model / 8),
        "daso": (4 * model, 2 * model / 4),
        "gossip": (4 * gossip["node"], 4 * gossip["inter"]),
    }
    layout = cost_model.Layout(2, 2)
    contenders = {}
    for name, (node, inter) in counted.items():
        row = {
            "buckets_mb": None if name == "ddp" else [b / 1e6 for b in buckets],
            "counted_node_mb_per_step": None if node is None else node / 1e6,
            "counted_inter_node_mb_per_step": None if inter is None else inter / 1e6,
            "steps": 48,
            "syncs": {"blocking": 12, "sent": 6, "merged": 6} if name == "daso" else None,
            "median_step_ms": compute * 1e3,
        }
        contenders[name] = row
    benchmark = {
        "nodes": 2,
        "ranks_per_node": 2,
        "parameters": parameters,
        "model": "MLP 64-4608-4608-10",
        "rounds": [{"load_before": [1.0, 1.0, 1.0], "load_after": [1.0, 1.0, 1.0]}],
        "contenders": contenders,
    }
    for name, work in cost_model.workloads(benchmark).items():
        seconds = compute + cost_model.comm_seconds(name, work, net, layout)
        contenders[name]["ms_per_step"] = seconds * 1e3
    return benchmark
