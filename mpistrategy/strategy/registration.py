"""Registering ``"mpi_ad"`` (and one name per sync mode) with Lightning, without making ``import mpistrategy``
import Lightning.

Lightning has no entry points for strategies: a name must be put in a strategy registry by code that runs in the
user's process. The Trainer of ``lightning.pytorch``, that of ``pytorch_lightning`` and ``lightning.fabric``'s
Fabric keep separate registries, and importing Lightning takes seconds, which users of the collectives alone should
not pay. So :func:`install` (run by
``import mpistrategy``) registers with each package that is already imported, and for each one that is not, adds
a tiny import hook that registers right after that package finishes importing. Either way, by the time a
``Trainer(strategy="mpi_ad")`` can be built, the name is registered.

What is registered is a factory, not the strategy class: a registry builds a strategy by calling the registered
callable with the name's options (``StrategyRegistry.get("mpi_daso")`` is ``factory(sync="daso")``), and each
factory imports its strategy class on its first call. Registering therefore imports none of the strategy modules
(which import Lightning themselves), and whichever is imported first, a registration never meets a strategy module
half-imported.

The names (:data:`STRATEGIES`): ``"mpi_ad"`` (flat data parallelism) and ``"mpi_<mode>"`` for every other sync
mode of :mod:`mpistrategy.sync` (``Trainer(strategy="mpi_daso")`` is ``MPIADStrategy(sync="daso")`` with the
mode's defaults; configure a mode by passing ``MPIADStrategy(sync=DASO(...))`` instead).

Registration also wraps the connectors (the Trainer's and Fabric's): their cluster-environment choice, because
for these names Lightning would otherwise build its ``SLURMEnvironment`` under ``srun`` (before the strategy
exists), which raises for ``--ntasks`` without ``--ntasks-per-node`` (for our strategy the MPI environment is
chosen instead); and their construction, so that the strategy sees the ``devices=``/``num_nodes=`` flags
(:mod:`~mpistrategy.strategy.conventions`, which also makes Lightning's ``sync_dist=True`` hint apply).

:func:`install` also sets ``rank_zero_only.rank`` from MPI when the world has several ranks: Lightning guesses the
rank from launcher variables only (RANK, LOCAL_RANK, SLURM_PROCID, JSM_NAMESPACE_RANK), so under ``mpiexec`` every
rank would otherwise believe it is rank 0 until a Trainer exists; and it keeps ``seed_everything``'s "Seed set to
N" message on rank 0.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mpistrategy.strategy import conventions

if TYPE_CHECKING:
    from mpistrategy.strategy.environment import MPIEnvironment
    from mpistrategy.strategy.fabric_mpi_ad import MPIADFabricStrategy
    from mpistrategy.strategy.mpi_ad import MPIADStrategy
    from mpistrategy.strategy.pytorch_lightning import MPIADStrategy as PLStrategy
    from mpistrategy.strategy.pytorch_lightning import MPIEnvironment as PLEnvironment

log = logging.getLogger(__name__)

NAME = "mpi_ad"


@dataclass(frozen=True)
class RegisteredStrategy:
    """A name in Lightning's strategy registry: ``MPIADStrategy(sync=sync)``."""

    sync: str
    description: str


#: every registered name; ``mpi_<mode>`` for each sync mode but ``flat`` (which is ``mpi_ad``)
STRATEGIES: dict[str, RegisteredStrategy] = {
    NAME: RegisteredStrategy("flat", "Data-parallel training over MPI with differentiable collectives (mpistrategy)"),
    "mpi_hierarchical": RegisteredStrategy(
        "hierarchical",
        "mpi_ad with hierarchical gradient averaging: node sum, node leaders across nodes, node broadcast "
        "(the result of flat averaging, one copy per node on the network)",
    ),
    "mpi_local_sgd": RegisteredStrategy(
        "local_sgd", "mpi_ad with post-local SGD: local steps, the model averaged over all ranks every few steps"
    ),
    "mpi_hierarchical_local_sgd": RegisteredStrategy(
        "hierarchical_local_sgd",
        "mpi_ad with node-local gradient averaging every step, the model averaged across nodes every few steps",
    ),
    "mpi_daso": RegisteredStrategy(
        "daso",
        "mpi_ad with DASO: node-local gradient averaging, non-blocking stale model averaging across nodes every "
        "few steps (heat's schedule and defaults)",
    ),
    "mpi_gossip": RegisteredStrategy(
        "gossip", "mpi_ad with gossip (D-PSGD): every rank mixes its model with its neighbours on a ring"
    ),
}

_lock = threading.Lock()
_registered: set[str] = set()


def _trainer_strategy(**options: Any) -> MPIADStrategy:
    """``MPIADStrategy(**options)`` of :mod:`~mpistrategy.strategy.mpi_ad`: the ``lightning.pytorch`` factory."""
    from mpistrategy.strategy.mpi_ad import MPIADStrategy

    return MPIADStrategy(**options)


def _pytorch_lightning_strategy(**options: Any) -> PLStrategy:
    """``MPIADStrategy(**options)`` of :mod:`~mpistrategy.strategy.pytorch_lightning`: the ``pytorch_lightning``
    factory."""
    from mpistrategy.strategy.pytorch_lightning import MPIADStrategy

    return MPIADStrategy(**options)


def _fabric_strategy(**options: Any) -> MPIADFabricStrategy:
    """``MPIADFabricStrategy(**options)``: the ``lightning.fabric`` factory."""
    from mpistrategy.strategy.fabric_mpi_ad import MPIADFabricStrategy

    return MPIADFabricStrategy(**options)


def _mpi_environment() -> MPIEnvironment:
    """The MPI cluster environment of ``lightning.pytorch`` and ``lightning.fabric``."""
    from mpistrategy.strategy.environment import MPIEnvironment

    return MPIEnvironment()


def _pytorch_lightning_environment() -> PLEnvironment:
    """The MPI cluster environment of ``pytorch_lightning``."""
    from mpistrategy.strategy.pytorch_lightning import MPIEnvironment

    return MPIEnvironment()


def register_lightning() -> None:
    """Register :data:`STRATEGIES` in ``lightning.pytorch``'s strategy registry (idempotent)."""
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    from lightning.pytorch.trainer.connectors.logger_connector import result

    _register(StrategyRegistry, _trainer_strategy, "lightning.pytorch")
    _wrap_connector(_AcceleratorConnector, ClusterEnvironment, _mpi_environment, "Trainer")
    conventions.hint_sync_dist(result)


def register_pytorch_lightning() -> None:
    """Register :data:`STRATEGIES` in ``pytorch_lightning``'s strategy registry (idempotent)."""
    from lightning_fabric.plugins.environments import ClusterEnvironment
    from pytorch_lightning.strategies import StrategyRegistry
    from pytorch_lightning.trainer.connectors.accelerator_connector import _AcceleratorConnector
    from pytorch_lightning.trainer.connectors.logger_connector import result

    _register(StrategyRegistry, _pytorch_lightning_strategy, "pytorch_lightning")
    _wrap_connector(_AcceleratorConnector, ClusterEnvironment, _pytorch_lightning_environment, "Trainer")
    conventions.hint_sync_dist(result)


def register_fabric() -> None:
    """Register :data:`STRATEGIES` in ``lightning.fabric``'s strategy registry (idempotent)."""
    from lightning.fabric.connector import _Connector
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    _register(STRATEGY_REGISTRY, _fabric_strategy, "lightning.fabric")
    _wrap_connector(_Connector, ClusterEnvironment, _mpi_environment, "Fabric")


def _register(registry: Any, factory: Callable[..., Any], package: str) -> None:
    with _lock:
        if package in _registered:
            return
        for name, entry in STRATEGIES.items():
            if name not in registry:
                init_params = {} if name == NAME else {"sync": entry.sync}
                registry.register(name, factory, description=entry.description, **init_params)
        _registered.add(package)


def _wrap_connector(connector: type, base: type, environment: Callable[[], Any], owner: str) -> None:
    """The MPI environment for our names, and the launch flags passed on to our strategy (see the module doc)."""
    _prefer_mpi_environment(connector, base, environment)
    conventions.follow_launch_flags(connector, owner)


def _prefer_mpi_environment(connector: Any, base: type, environment: Callable[[], Any]) -> None:
    """For our strategy names, choose the MPI environment instead of probing launchers (SLURM would raise)."""
    original = connector._choose_and_init_cluster_environment
    if getattr(original, "_mpistrategy", False):
        return

    def choose(self: Any) -> Any:
        flag = self._strategy_flag
        if isinstance(flag, str) and flag in STRATEGIES and not isinstance(self._cluster_environment_flag, base):
            return environment()
        return original(self)

    choose._mpistrategy = True  # type: ignore[attr-defined]
    choose.__doc__ = original.__doc__
    connector._choose_and_init_cluster_environment = choose


_REGISTRARS: dict[str, Callable[[], None]] = {
    "lightning.fabric": register_fabric,
    "lightning.pytorch": register_lightning,
    "pytorch_lightning": register_pytorch_lightning,
}


def install() -> None:
    """Set ``rank_zero_only`` from MPI and register :data:`STRATEGIES` with every Lightning package, now (those
    already imported) or right after it is imported (an import hook)."""
    _set_rank_zero_only()
    waiting = {package: registrar for package, registrar in _REGISTRARS.items() if package not in sys.modules}
    # The hook goes in first: registering with one package may import the other.
    if waiting and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport(waiting))
    for package, registrar in _REGISTRARS.items():
        if package not in waiting:
            _safely(registrar, package)


def _set_rank_zero_only() -> None:
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 1:
        return  # keep Lightning's own guess (another launcher may have set RANK)
    conventions.log_seed_on_rank_zero_only(MPI.COMM_WORLD.Get_rank())
    try:
        from lightning_utilities.core.rank_zero import rank_zero_only
    except ImportError:
        return
    rank_zero_only.rank = MPI.COMM_WORLD.Get_rank()  # type: ignore[attr-defined]  # set at run time


def _safely(registrar: Callable[[], None], package: str) -> None:
    try:
        registrar()
    except Exception as error:  # noqa: BLE001 - an incompatible Lightning must not break `import mpistrategy`
        warnings.warn(f"mpistrategy could not register its strategies with {package}: {error!r}", stacklevel=2)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Import hook: right after a Lightning package of ``registrars`` is imported, its registrar runs."""

    def __init__(self, registrars: dict[str, Callable[[], None]]) -> None:
        self._registrars = dict(registrars)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._registrars:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        registrar = self._registrars.pop(fullname)
        if not self._registrars:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec.loader = _LoaderThenRegister(spec.loader, registrar, fullname)
        return spec


class _LoaderThenRegister(importlib.abc.Loader):
    """Delegates to the real loader, then registers (every other attribute comes from the real loader)."""

    def __init__(self, loader: Any, registrar: Callable[[], None], package: str) -> None:
        self._loader = loader
        self._registrar = registrar
        self._package = package

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _safely(self._registrar, self._package)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
