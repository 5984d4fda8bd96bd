"""Real SLURM clusters for the tests in this folder: one node (slurm/local-cluster.sh: munge, slurmctld, slurmd) and
several emulated nodes (benchmarks/slurm_cluster.py: network namespaces, a slurmd in each).

The one-node session fixture installs (apt-get, as root) and starts the daemons, or reuses the running ones. When
that is impossible the tests FAIL with the reason: CI must not pass by skipping them. Outside CI a developer may set
MPISTRATEGY_SKIP_SLURM=1 to skip them on purpose. The multi-node fixture needs network namespaces too; outside CI
it skips, with the reason, where root, the namespaces or the packages are missing.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.slurm_cluster import SlurmCluster, missing_slurm

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = ROOT / "slurm" / "local-cluster.sh"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true")


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    if os.environ.get("MPISTRATEGY_SKIP_SLURM") == "1" and not _in_ci():
        pytest.skip("MPISTRATEGY_SKIP_SLURM=1: SLURM tests skipped on purpose (never in CI)")
    if os.geteuid() != 0:
        pytest.fail(
            "the SLURM tests install and start a local SLURM cluster with slurm/local-cluster.sh, which needs root "
            "(apt-get, daemons, /etc/slurm); run them as root, or set MPISTRATEGY_SKIP_SLURM=1 outside CI"
        )
    try:
        result = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start"], capture_output=True, text=True, timeout=1200)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"slurm/local-cluster.sh start did not finish in {exc.timeout:.0f} s")
    if result.returncode != 0:
        pytest.fail(
            f"could not install/start SLURM with slurm/local-cluster.sh (exit {result.returncode}):\n"
            f"{result.stderr[-4000:]}{result.stdout[-2000:]}"
        )


def _unavailable(reason: str) -> None:
    """Skip with ``reason``, or fail in CI, which must run the test."""
    if _in_ci():
        pytest.fail(f"{reason} (in CI the two-node SLURM tests must run)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_nodes() -> Iterator[SlurmCluster]:
    """A SLURM cluster of two emulated nodes (benchmarks/slurm_cluster.py), up for the tests of one module."""
    if os.environ.get("MPISTRATEGY_SKIP_SLURM") == "1" and not _in_ci():
        pytest.skip("MPISTRATEGY_SKIP_SLURM=1: SLURM tests skipped on purpose (never in CI)")
    if os.geteuid() != 0:
        _unavailable("the two-node SLURM cluster needs root (network namespaces, apt-get, SLURM daemons)")
    installed = subprocess.run(["bash", str(CLUSTER_SCRIPT), "install"], capture_output=True, text=True, timeout=1200)
    if installed.returncode != 0:
        _unavailable(f"slurm-wlm and munge could not be installed: {installed.stderr.strip()[-2000:]}")
    missing = missing_slurm()
    if missing:
        _unavailable("the two-node SLURM cluster needs " + "; ".join(missing))
    with SlurmCluster(nodes=2) as cluster:
        yield cluster
