"""Targets for ``hydra.utils.instantiate`` that adapt a config node to a Lightning object.

``strategy_by_name`` covers the strategies Lightning knows by name; ``mpi_ad_strategy`` builds mpistrategy's
strategy with the aggregator of the aggregation group; ``build_run`` turns a composed config into everything
``Trainer.fit`` needs.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from enum import Enum
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from mpistrategy.recipes.config import check_values

log = logging.getLogger(__name__)


def strategy_by_name(name: str = "auto", **kwargs: Any) -> Any:
    """A strategy from Lightning's registry (``ddp``, ``mpi_ad`` ...), or the name itself (``auto``) for the
    Trainer to resolve."""
    from lightning.pytorch.strategies import StrategyRegistry

    if name in StrategyRegistry:
        return StrategyRegistry.get(name, **kwargs)
    if kwargs:
        raise ValueError(f"strategy '{name}' is not in Lightning's registry, so it takes no options: {kwargs}")
    return name


def mpi_ad_strategy(
    aggregator: Any = None,
    stop_signals: Any = ("SIGTERM", "SIGUSR1"),
    model_parallel: bool = False,
    sync: str = "flat",
    **options: Any,
) -> Any:
    """mpistrategy's ``mpi_ad`` strategy
    (``model_parallel``: :class:`mpistrategy.recipes.model_parallel.ModelParallelMPIStrategy`).

    ``aggregator`` comes from the aggregation group; ``stop_signals`` are names or numbers. ``options`` are split:
    the sync mode ``sync``'s own options (``period``, ``global_skip``, ``graph`` ...) build the mode with
    :func:`mpistrategy.sync.build_sync`, the others (``bucket_cap_mb``, ``ranks_per_node`` ...) go to the
    strategy's constructor. Gossip also takes ``neighbours``, its graph when ``graph=custom``.
    """
    import mpistrategy  # noqa: F401  (registers "mpi_ad")
    from mpistrategy.comm.topology import topology
    from mpistrategy.sync import SYNC_MODES, SyncConfigurationError, build_sync

    # The one collective of building (the strategy's cluster environment then finds it built): first, so that every
    # rank reaches it before a value that only some ranks got wrong raises below.
    topology(_plain(options.get("ranks_per_node")))

    if model_parallel:
        from mpistrategy.recipes.model_parallel import ModelParallelMPIStrategy as cls
    else:
        from mpistrategy.strategy import MPIADStrategy as cls

    if model_parallel and sync != "flat":
        raise ValueError(
            f"strategy.sync={sync!r}: model_parallel=true splits the model across the ranks, which have no "
            "replicas to average; use sync=flat (strategy=mpi_ad_model_parallel)."
        )
    if sync not in SYNC_MODES:
        valid = ", ".join(SYNC_MODES)
        raise SyncConfigurationError(f"strategy.sync={sync!r} is not a sync mode; valid modes: {valid}.")
    given = {key: _plain(value) for key, value in options.items()}
    accepted = _constructor_parameters(cls, exclude=("aggregator", "sync", "stop_signals"))
    mode_accepts = _parameters(SYNC_MODES[sync].__init__)
    if sync == "gossip":
        mode_accepts.add("neighbours")
    unknown = sorted(set(given) - accepted - mode_accepts)
    if unknown:
        mode = f"; sync mode {sync!r} accepts {sorted(mode_accepts)}" if mode_accepts else ""
        raise TypeError(
            f"strategy.{unknown[0]}: {cls.__name__} does not accept {unknown}; it accepts {sorted(accepted)}{mode}"
        )
    mode_options = {key: value for key, value in given.items() if key in mode_accepts}
    if sync == "gossip":
        mode_options["graph"] = _gossip_graph(mode_options.pop("graph", "ring"), mode_options.pop("neighbours", None))
    kwargs = {key: value for key, value in given.items() if key in accepted and value is not None}
    return cls(
        aggregator=aggregator,
        sync=build_sync(sync, **mode_options),
        stop_signals=stop_signals or (),
        **kwargs,
    )


def _parameters(function: Any, exclude: tuple[str, ...] = ()) -> set[str]:
    """The keyword parameters ``function`` takes (without ``self``, ``*args``, ``**kwargs`` and ``exclude``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if p.kind in kinds and p.name != "self" and p.name not in exclude}


def _constructor_parameters(cls: type, exclude: tuple[str, ...] = ()) -> set[str]:
    """The keyword parameters ``cls(...)`` takes: its ``__init__``'s and, for as long as an ``__init__`` passes
    ``**options`` on, those of the next ``__init__`` up its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        names |= _parameters(init, exclude)
        if all(p.kind != inspect.Parameter.VAR_KEYWORD for p in inspect.signature(init).parameters.values()):
            break
    return names


def _plain(value: Any) -> Any:
    """A config value as the constructors take it: an Enum member's value, a list or dict instead of their
    OmegaConf containers."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _gossip_graph(graph: str, neighbours: list[list[int]] | None) -> Any:
    """Gossip's ``graph``: the named graph, or with ``graph=custom`` the ``neighbours`` list, checked against the
    world size here already (an error while building is reported without a traceback)."""
    from mpi4py import MPI

    from mpistrategy.sync import SyncConfigurationError
    from mpistrategy.sync.gossip import neighbours_of

    if graph == "custom":
        if neighbours is None:
            raise SyncConfigurationError(
                "gossip: strategy.graph=custom needs strategy.neighbours, one list of neighbour ranks per rank "
                "(for 4 ranks on a ring: [[1,3],[0,2],[1,3],[0,2]])."
            )
        neighbours_of(neighbours, MPI.COMM_WORLD.Get_size())
        return neighbours
    if neighbours is not None:
        raise SyncConfigurationError(
            f"gossip: strategy.neighbours is a custom graph but strategy.graph={graph!r}; set strategy.graph=custom "
            "to use the neighbour list (or drop strategy.neighbours)."
        )
    return graph


@dataclass
class Run:
    """Everything built from a config: ``trainer.fit(model, datamodule=datamodule, ckpt_path=...)``."""

    trainer: L.Trainer
    model: L.LightningModule
    datamodule: L.LightningDataModule
    callbacks: dict[str, Any]
    loggers: dict[str, Any]


def build_callbacks(cfg: DictConfig) -> dict[str, Any]:
    return {name: instantiate(node) for name, node in (cfg.get("callbacks") or {}).items() if node is not None}


def build_loggers(cfg: DictConfig) -> dict[str, Any]:
    return {name: instantiate(node) for name, node in (cfg.get("logger") or {}).items() if node is not None}


def build_strategy(cfg: DictConfig) -> Any:
    """The strategy; mpi_ad gets its aggregator from the aggregation group."""
    node = cfg.strategy
    if OmegaConf.select(node, "_target_") == "mpistrategy.recipes.builders.mpi_ad_strategy" and cfg.get("aggregation"):
        return instantiate(node, aggregator=instantiate(cfg.aggregation))
    return instantiate(node)


def build_run(cfg: DictConfig, *, trainer_overrides: dict[str, Any] | None = None) -> Run:
    """Instantiate strategy (first: building it is collective), check the values that must fit together
    (:func:`~mpistrategy.recipes.config.check_values`), then data, model (with the optimizer and scheduler partials),
    loggers, callbacks, Trainer."""
    strategy = build_strategy(cfg)
    check_values(cfg)  # after the strategy: every rank has reached building's one collective
    datamodule = instantiate(cfg.data)
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    model = instantiate(cfg.model, optimizer=instantiate(cfg.optimizer), scheduler=scheduler)
    loggers = build_loggers(cfg)
    callbacks = build_callbacks(cfg)
    if OmegaConf.select(cfg, "trainer.enable_progress_bar") is False:
        # Lightning refuses a progress-bar callback with the bar switched off: the switch wins.
        from lightning.pytorch.callbacks import ProgressBar

        callbacks = {k: v for k, v in callbacks.items() if not isinstance(v, ProgressBar)}
    trainer = instantiate(
        cfg.trainer,
        strategy=strategy,
        logger=list(loggers.values()) or False,
        callbacks=list(callbacks.values()),
        **(trainer_overrides or {}),
    )
    return Run(trainer, model, datamodule, callbacks, loggers)
