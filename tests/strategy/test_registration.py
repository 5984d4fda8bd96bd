"""`import mpistrategy` registers "mpi_ad" with the Trainers and Fabric (lazily: Lightning is not imported by it),
plain `python` runs a world of one, and a SLURM/MPI mismatch fails loudly. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpistrategy.comm.topology import LaunchMismatchError, check_launch
from mpistrategy.launch import mpiexec_command
from mpistrategy.strategy.registration import STRATEGIES
from tests.mpi_harness import clean_environ

pytestmark = pytest.mark.skipif(
    os.environ.get("MPISTRATEGY_TEST_NRANKS") is not None or "PMI_RANK" in os.environ,
    reason="starts fresh single-process interpreters; run from the plain (outer) pytest",
)

ROOT = Path(__file__).parents[2]


def _run_python(code: str, *, ranks: int | None = None, **env: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (``ranks``: under ``mpiexec -n ranks``) with this checkout on the path."""
    return _start_python(code, ranks=ranks, **env).result()


def _start_python(code: str, *, ranks: int | None = None, **env: str) -> _Started:
    """:func:`_run_python` started in the background: ``.result()`` waits for it."""
    environ = {**clean_environ(), "PYTHONPATH": str(ROOT), **env}
    launcher = [] if ranks is None else [*mpiexec_command(), "-n", str(ranks)]
    command = [*launcher, sys.executable, "-c", textwrap.dedent(code)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
    return _Started(command, process)


class _Started:
    """A fresh interpreter in flight."""

    def __init__(self, command: list[str], process: subprocess.Popen) -> None:
        self._command, self._process = command, process

    def result(self) -> subprocess.CompletedProcess:
        try:
            stdout, stderr = self._process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            self._process.kill()
            raise
        return subprocess.CompletedProcess(self._command, self._process.returncode, stdout, stderr)


# Builds a Trainer of each Lightning package and a Fabric by the name "mpi_ad" and checks the strategy classes.
BUILD_BY_NAME = """
    import lightning.pytorch as L
    import pytorch_lightning as PL
    from lightning.fabric import Fabric
    from mpistrategy.strategy.environment import MPIEnvironment
    from mpistrategy.strategy.fabric_mpi_ad import MPIADFabricStrategy
    from mpistrategy.strategy.mpi_ad import MPIADStrategy
    from mpistrategy.strategy.pytorch_lightning import MPIADStrategy as PLStrategy, MPIEnvironment as PLEnvironment

    built = []
    for package, strategy_class, environment in ((L, MPIADStrategy, MPIEnvironment), (PL, PLStrategy, PLEnvironment)):
        strategy = package.Trainer(strategy="mpi_ad", logger=False, enable_progress_bar=False).strategy
        assert type(strategy) is strategy_class, strategy
        assert type(strategy.cluster_environment) is environment, strategy.cluster_environment
        built.append(f"{package.__name__}:{type(strategy).__name__}")
    strategy = Fabric(strategy="mpi_ad", accelerator="cpu").strategy
    assert type(strategy) is MPIADFabricStrategy and type(strategy.cluster_environment) is MPIEnvironment
    built.append(f"fabric:{type(strategy).__name__}")
    print("BUILT", " ".join(built))
"""
BUILT = "BUILT lightning.pytorch:MPIADStrategy pytorch_lightning:MPIADStrategy fabric:MPIADFabricStrategy"
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric")
STRATEGY_MODULES = ("base", "environment", "mpi_ad", "pytorch_lightning", "fabric_mpi_ad")


def test_import_imports_no_lightning_and_registering_imports_no_strategy_module() -> None:
    """``import mpistrategy`` leaves Lightning unimported; importing Lightning then registers every name with a
    factory, without importing a strategy module; building a strategy by name imports its class."""
    result = _run_python(
        f"""
        import sys
        import mpistrategy
        lightning = sorted(m for m in sys.modules if m.split(".")[0] in {LIGHTNING_PACKAGES!r})
        print("LIGHTNING", lightning)
        import lightning.pytorch, pytorch_lightning, lightning.fabric
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry
        from mpistrategy.strategy.registration import STRATEGIES
        for registry in (StrategyRegistry, PLRegistry, STRATEGY_REGISTRY):
            for name, entry in STRATEGIES.items():
                assert registry[name]["description"] == entry.description, (name, registry[name])
                assert registry[name]["init_params"] == ({{}} if name == "mpi_ad" else {{"sync": entry.sync}})
        loaded = [m for m in {STRATEGY_MODULES!r} if f"mpistrategy.strategy.{{m}}" in sys.modules]
        print("LOADED", loaded)
        {textwrap.indent(textwrap.dedent(BUILD_BY_NAME), " " * 8).strip()}
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LIGHTNING []" in result.stdout and "LOADED []" in result.stdout, result.stdout
    assert BUILT in result.stdout, result.stdout


def test_import_under_mpiexec_imports_no_lightning_and_sets_the_rank() -> None:
    """With several ranks, ``import mpistrategy`` sets Lightning's ``rank_zero_only.rank`` from MPI (through
    lightning_utilities) and still imports no Lightning package."""
    result = _run_python(
        f"""
        import sys
        import mpistrategy
        from mpi4py import MPI
        from lightning_utilities.core.rank_zero import rank_zero_only
        lightning = sorted(m for m in sys.modules if m.split(".")[0] in {LIGHTNING_PACKAGES!r})
        print(f"rank {{MPI.COMM_WORLD.rank}}: rank_zero_only {{rank_zero_only.rank}}, Lightning {{lightning}}")
        """,
        ranks=2,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: rank_zero_only {rank}, Lightning []" in result.stdout, result.stdout


def test_lightning_alone_knows_no_mpistrategy_name() -> None:
    """Without ``import mpistrategy`` (and mpistrategy declares no entry points) Lightning's registries hold none of
    its names and the Trainer rejects them."""
    result = _run_python(
        """
        import json, sys
        import lightning.pytorch as L, pytorch_lightning, lightning.fabric
        from lightning.fabric.strategies import STRATEGY_REGISTRY
        from lightning.pytorch.strategies import StrategyRegistry
        from pytorch_lightning.strategies import StrategyRegistry as PLRegistry
        print("NAMES", json.dumps(sorted({*StrategyRegistry, *PLRegistry, *STRATEGY_REGISTRY})))
        print("MPISTRATEGY", sorted(m for m in sys.modules if m.split(".")[0] == "mpistrategy"))
        try:
            L.Trainer(strategy="mpi_ad")
        except ValueError as error:
            print("REFUSED", error)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    names = json.loads(result.stdout.split("NAMES ", 1)[1].splitlines()[0])
    assert "ddp" in names and not set(names) & set(STRATEGIES), names
    assert "MPISTRATEGY []" in result.stdout
    assert "REFUSED You selected an invalid strategy name: `strategy='mpi_ad'`" in result.stdout, result.stdout


FIRST_IMPORTS = (
    "import mpistrategy",
    "from mpistrategy.strategy.mpi_ad import MPIADStrategy",
    "from mpistrategy.strategy.pytorch_lightning import MPIADStrategy",
    "from mpistrategy.strategy.fabric_mpi_ad import MPIADFabricStrategy",
    "import lightning",
    "import pytorch_lightning",
)


@pytest.fixture(scope="module")
def built_by_name() -> dict[str, _Started]:
    """Per first import, the interpreter that imports it, then mpistrategy, and builds the strategies by name: all
    started at once (each spends seconds importing torch and Lightning)."""
    code = textwrap.dedent(BUILD_BY_NAME)
    return {first: _start_python(f"{first}\nimport mpistrategy\n{code}") for first in FIRST_IMPORTS}


@pytest.mark.parametrize("first_import", FIRST_IMPORTS)
def test_trainer_and_fabric_build_by_name_whatever_is_imported_first(
    first_import: str, built_by_name: dict[str, _Started]
) -> None:
    """A strategy module imported first imports mpistrategy, then Lightning, whose import hook registers while that
    module is half-done; Lightning imported first is registered with when mpistrategy is imported."""
    result = built_by_name[first_import].result()
    assert result.returncode == 0, result.stderr[-3000:]
    assert BUILT in result.stdout, result.stdout
    assert "could not register" not in result.stderr


def test_every_sync_mode_has_a_registered_name_that_builds_its_mode() -> None:
    """``Trainer(strategy="mpi_<mode>")`` in both Lightning packages and ``Fabric(strategy="mpi_<mode>")`` build the
    strategy with that mode, and under SLURM variables get the MPI environment (Lightning would pick its
    SLURMEnvironment for an unknown name)."""
    result = _run_python(
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
            assert FabricRegistry[name]["description"] == entry.description
            fabric = Fabric(strategy=name, accelerator="cpu")
            assert type(fabric.strategy) is MPIADFabricStrategy, fabric.strategy
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
    result = _run_python(
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
    result = _run_python(
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
