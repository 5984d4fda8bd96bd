"""A real one-node SLURM cluster for the tests in this folder (slurm/local-cluster.sh: munge, slurmctld, slurmd).

The session fixture installs (apt-get, as root) and starts the daemons, or reuses the running ones. When that is
impossible the tests FAIL with the reason: CI must not pass by skipping them. Outside CI a developer may set
MPISTRATEGY_SKIP_SLURM=1 to skip them on purpose.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = ROOT / "slurm" / "local-cluster.sh"


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    if os.environ.get("MPISTRATEGY_SKIP_SLURM") == "1" and os.environ.get("CI", "").lower() not in ("1", "true"):
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
