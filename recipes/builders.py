"""Targets for ``hydra.utils.instantiate`` that adapt a config node to a Lightning object.

``strategy_by_name`` covers the strategies Lightning knows by name; ``mpi_ad_strategy`` builds mpistrategy's
strategy with the aggregator of the aggregation group; ``build_run`` turns a composed config into everything
``Trainer.fit`` needs.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

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


def signal_numbers(names: Any) -> tuple[int, ...]:
    """``["SIGTERM", "USR1", 10]`` -> signal numbers."""
    import signal

    numbers = []
    for name in names or ():
        if isinstance(name, int):
            numbers.append(name)
            continue
        key = str(name).upper()
        key = key if key.startswith("SIG") else f"SIG{key}"
        if not hasattr(signal, key):
            raise ValueError(f"strategy.stop_signals: unknown signal {name!r}")
        numbers.append(int(getattr(signal, key)))
    return tuple(numbers)


def mpi_ad_strategy(
    aggregator: Any = None,
    stop_signals: Any = ("SIGTERM", "SIGUSR1"),
    model_parallel: bool = False,
    **options: Any,
) -> Any:
    """mpistrategy's ``mpi_ad`` strategy (``model_parallel``: :class:`recipes.model_parallel.ModelParallelMPIStrategy`).

    ``aggregator`` comes from the aggregation group; ``stop_signals`` are names; the other ``options``
    (``bucket_cap_mb``, ``checkpoint_on_stop`` ...) go to the constructor unchanged.
    """
    import mpistrategy  # noqa: F401  (registers "mpi_ad")

    if model_parallel:
        from recipes.model_parallel import ModelParallelMPIStrategy as cls
    else:
        from mpistrategy.strategy import MPIADStrategy as cls

    kwargs = {k: v for k, v in options.items() if v is not None}
    accepted = inspect.signature(cls.__init__).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(
            f"strategy.{unknown[0]}: {cls.__name__} does not accept {unknown}; it accepts "
            f"{sorted(k for k in accepted if k not in ('self', 'args', 'kwargs'))}"
        )
    return cls(aggregator=aggregator, stop_signals=signal_numbers(stop_signals), **kwargs)


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
    if OmegaConf.select(node, "_target_") == "recipes.builders.mpi_ad_strategy" and cfg.get("aggregation"):
        return instantiate(node, aggregator=instantiate(cfg.aggregation))
    return instantiate(node)


def build_run(cfg: DictConfig, *, trainer_overrides: dict[str, Any] | None = None) -> Run:
    """Instantiate data, model (with the optimizer and scheduler partials), strategy, loggers, callbacks, Trainer."""
    datamodule = instantiate(cfg.data)
    scheduler = instantiate(cfg.scheduler) if cfg.get("scheduler") else None
    model = instantiate(cfg.model, optimizer=instantiate(cfg.optimizer), scheduler=scheduler)
    strategy = build_strategy(cfg)
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
