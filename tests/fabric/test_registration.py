"""`import mpistrategy` registers "mpi_ad" and every sync mode's name with Fabric (lazily: it does not import
Lightning), whatever is imported first, and Fabric then builds the mode with the MPI environment, also under SLURM
variables. Each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.mpi_harness import clean_environ

pytestmark = pytest.mark.skipif(
    os.environ.get("MPISTRATEGY_TEST_NRANKS") is not None or "PMI_RANK" in os.environ,
    reason="starts fresh single-process interpreters; run from the plain (outer) pytest",
)

ROOT = Path(__file__).parents[2]
SRUN_WITHOUT_TASKS_PER_NODE = dict(
    SLURM_NTASKS="1",
    SLURM_PROCID="0",
    SLURM_LOCALID="0",
    SLURM_NODEID="0",
    SLURM_JOB_NAME="train",
    SLURM_JOB_ID="4242",
    SLURM_NODELIST="localhost",
)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**clean_environ(), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environ, timeout=300
    )


def test_every_name_builds_its_mode_with_the_mpi_environment() -> None:
    result = _python(
        """
        import sys
        import mpistrategy
        assert "lightning.fabric" not in sys.modules
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from mpistrategy.strategy import MPIADFabricStrategy
        from mpistrategy.strategy.environment import MPIEnvironment
        from mpistrategy.strategy.registration import STRATEGIES
        from mpistrategy.sync import SYNC_MODES

        for name, entry in STRATEGIES.items():
            assert STRATEGY_REGISTRY[name]["strategy"] is MPIADFabricStrategy
            assert STRATEGY_REGISTRY[name]["description"] == entry.description
            fabric = Fabric(strategy=name, accelerator="cpu")
            assert type(fabric.strategy.sync) is SYNC_MODES[entry.sync], (name, fabric.strategy.sync)
            assert type(fabric.strategy.cluster_environment) is MPIEnvironment
        print("OK")
        """,
        **SRUN_WITHOUT_TASKS_PER_NODE,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize(
    "first_import",
    [
        "from mpistrategy.strategy.fabric_mpi_ad import MPIADFabricStrategy",
        "from mpistrategy.strategy.base import MPIStrategyBase",
        "import lightning.fabric",
    ],
)
def test_registered_whatever_is_imported_first(first_import: str) -> None:
    result = _python(
        f"""
        {first_import}
        import mpistrategy
        import warnings
        warnings.simplefilter("error")
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry
        assert "mpi_ad" in STRATEGY_REGISTRY and "mpi_daso" in STRATEGY_REGISTRY and "mpi_ad" in StrategyRegistry
        print("OK")
        """
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    assert "could not register" not in result.stderr
