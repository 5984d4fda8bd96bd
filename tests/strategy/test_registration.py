"""`import mpistrategy` registers "mpi_ad" with the Trainers and Fabric (lazily: Lightning is not imported by it),
plain `python` runs a world of one, and a SLURM/MPI mismatch fails loudly. Each check runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpistrategy.comm.topology import LaunchMismatchError, check_launch
from tests.mpi_harness import clean_environ

pytestmark = pytest.mark.skipif(
    os.environ.get("MPISTRATEGY_TEST_NRANKS") is not None or "PMI_RANK" in os.environ,
    reason="starts fresh single-process interpreters; run from the plain (outer) pytest",
)

ROOT = Path(__file__).parents[2]


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**clean_environ(), "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=environ, timeout=300
    )


def test_import_registers_without_importing_lightning() -> None:
    result = _python(
        """
        import sys
        import mpistrategy
        assert "lightning.pytorch" not in sys.modules and "pytorch_lightning" not in sys.modules
        assert "lightning.fabric" not in sys.modules
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from mpistrategy.strategy import MPIADFabricStrategy
        assert STRATEGY_REGISTRY["mpi_ad"]["strategy"] is MPIADFabricStrategy, "not registered with Fabric"
        from lightning.pytorch.strategies import StrategyRegistry
        assert "mpi_ad" in StrategyRegistry, "not registered with lightning.pytorch"
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry
        assert "mpi_ad" in PLRegistry, "not registered with pytorch_lightning"
        from mpistrategy.strategy.pytorch_lightning import MPIADStrategy
        assert PLRegistry["mpi_ad"]["strategy"] is MPIADStrategy
        print("OK")
        """
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_import_after_lightning_registers_too() -> None:
    result = _python(
        """
        import lightning.pytorch as L
        import mpistrategy
        from lightning.pytorch.strategies import StrategyRegistry
        from mpistrategy.strategy.mpi_ad import MPIADStrategy
        assert StrategyRegistry["mpi_ad"]["strategy"] is MPIADStrategy
        print("OK")
        """
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize(
    "first_import",
    [
        "from mpistrategy.strategy.mpi_ad import MPIADStrategy",
        "from mpistrategy.strategy.environment import MPIEnvironment",
        "from mpistrategy.strategy.pytorch_lightning import MPIADStrategy",
        "from mpistrategy.strategy import MPIADStrategy",
        "import lightning",
        "import pytorch_lightning",
        "import pytorch_lightning, lightning.pytorch",
        "from mpistrategy.strategy.fabric_mpi_ad import MPIADFabricStrategy",
        "from mpistrategy.strategy.base import MPIStrategyBase",
        "import lightning.fabric",
    ],
)
def test_registered_whatever_is_imported_first(first_import: str) -> None:
    """Importing a strategy module imports Lightning, whose import hook fires while that module is half-done."""
    result = _python(
        f"""
        {first_import}
        import mpistrategy
        import warnings
        warnings.simplefilter("error")
        from lightning.pytorch.strategies import StrategyRegistry
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        assert "mpi_ad" in StrategyRegistry and "mpi_ad" in PLRegistry and "mpi_daso" in STRATEGY_REGISTRY
        print("OK")
        """
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    assert "could not register" not in result.stderr


def test_every_sync_mode_has_a_registered_name_that_builds_its_mode() -> None:
    """``Trainer(strategy="mpi_<mode>")`` in both Lightning packages and ``Fabric(strategy="mpi_<mode>")`` build the
    strategy with that mode, and under SLURM variables get the MPI environment (Lightning would pick its
    SLURMEnvironment for an unknown name)."""
    result = _python(
        """
        import lightning.pytorch as L
        import pytorch_lightning as PL
        import mpistrategy
        from lightning.pytorch.strategies import StrategyRegistry
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry
        from mpistrategy.strategy.environment import MPIEnvironment
        from mpistrategy.strategy.pytorch_lightning import MPIEnvironment as PLEnvironment
        from mpistrategy.strategy.registration import STRATEGIES
        from mpistrategy.sync import SYNC_MODES
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import STRATEGY_REGISTRY as FabricRegistry
        from mpistrategy.strategy import MPIADFabricStrategy

        assert sorted(STRATEGIES) == sorted(["mpi_ad"] + [f"mpi_{m}" for m in SYNC_MODES if m != "flat"])
        built = []
        for name, entry in STRATEGIES.items():
            for package, registry, environment in (
                (L, StrategyRegistry, MPIEnvironment), (PL, PLRegistry, PLEnvironment)
            ):
                assert registry[name]["description"] == entry.description and entry.description
                trainer = package.Trainer(strategy=name, logger=False, enable_progress_bar=False)
                sync = trainer.strategy.sync
                assert type(sync) is SYNC_MODES[entry.sync], (name, sync)
                assert type(trainer.strategy.cluster_environment) is environment, trainer.strategy.cluster_environment
                built.append(f"{name}={sync.name}")
            assert FabricRegistry[name]["strategy"] is MPIADFabricStrategy
            fabric = Fabric(strategy=name, accelerator="cpu")
            assert type(fabric.strategy.sync) is SYNC_MODES[entry.sync], (name, fabric.strategy.sync)
            assert type(fabric.strategy.cluster_environment) is MPIEnvironment
        # every Trainer gets a new mode object (with the mode's defaults), never a shared one
        first, second = L.Trainer(strategy="mpi_daso"), L.Trainer(strategy="mpi_daso")
        assert first.strategy.sync is not second.strategy.sync and second.strategy.sync.global_skip == 4
        print("OK", " ".join(built))
        """,
        SLURM_NTASKS="1",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_JOB_NAME="train",
        SLURM_JOB_ID="4242",
        SLURM_NODELIST="localhost",
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    for name, mode in [
        ("mpi_ad", "flat"),
        ("mpi_hierarchical", "hierarchical"),
        ("mpi_local_sgd", "local_sgd"),
        ("mpi_hierarchical_local_sgd", "hierarchical_local_sgd"),
        ("mpi_daso", "daso"),
        ("mpi_gossip", "gossip"),
    ]:
        assert result.stdout.count(f"{name}={mode}") == 2, result.stdout


def test_plain_python_is_a_world_of_one() -> None:
    result = _python(
        """
        import torch, lightning.pytorch as L
        import mpistrategy
        from torch.utils.data import DataLoader, TensorDataset

        class M(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(3, 1)
            def training_step(self, batch, i):
                loss = self.layer(batch[0]).pow(2).mean()
                self.log("loss", loss, sync_dist=True)
                return loss
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        trainer = L.Trainer(strategy="mpi_ad", max_steps=3, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(M(), DataLoader(TensorDataset(torch.randn(12, 3)), batch_size=4))
        assert trainer.world_size == 1 and trainer.global_step == 3
        print("OK", type(trainer.strategy).__name__)
        """
    )
    assert result.returncode == 0 and "OK MPIADStrategy" in result.stdout, result.stderr[-3000:]


def test_slurm_tasks_with_a_world_of_one_fail_loudly() -> None:
    result = _python(
        """
        import lightning.pytorch as L
        import mpistrategy
        L.Trainer(strategy="mpi_ad")
        """,
        SLURM_NTASKS="4",
        SLURM_PROCID="0",
        SLURM_JOB_NAME="train",
    )
    assert result.returncode != 0
    assert "LaunchMismatchError" in result.stderr and "srun --mpi=pmi2" in result.stderr


def test_check_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", "MPISTRATEGY_IGNORE_SLURM"):
        monkeypatch.delenv(name, raising=False)
    check_launch(world_size=1)  # not under SLURM
    monkeypatch.setenv("SLURM_NTASKS", "3")
    check_launch(world_size=3)  # MPI sees all tasks
    with pytest.raises(LaunchMismatchError, match="3 tasks"):
        check_launch(world_size=1)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # a one-task step inside a larger allocation
    check_launch(world_size=1)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("MPISTRATEGY_IGNORE_SLURM", "1")
    check_launch(world_size=1)
