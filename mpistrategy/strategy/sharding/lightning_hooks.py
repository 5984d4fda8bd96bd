"""What the Trainer strategy routes through the sharded optimizers while the optimizer state is sharded.

A sharded optimizer's parameter groups list the pieces of this rank's shard (see
:mod:`~mpistrategy.strategy.sharding.optimizer`), so Lightning code that walks them would act on the pieces:

- the precision plugin's clipping by norm would see this rank's shard only: it clips by the norm of the whole
  gradient (:meth:`~mpistrategy.strategy.sharding.optimizer.ShardedOptimizer.clip_grad_norm_`) instead; clipping
  by value first points the pieces at the parameters' current ``.grad`` (a hook may have replaced one), and clips
  nothing on a rank whose pieces hold no gradient;
- ``LightningModule.toggle_optimizer`` / ``untoggle_optimizer`` (manual optimization with several optimizers, as in
  a GAN) would set ``requires_grad`` on the pieces and freeze nothing: they act on the model's parameters each
  optimizer steps instead, exactly as Lightning's own do on an optimizer that is not sharded.

:func:`route` installs them (instance attributes over the classes' methods); the callable it returns removes them.
Under ``shard="gradients"`` the parameters hold no ``.grad`` after backward (the gradients live in the shards), so
an override of ``configure_gradient_clipping`` that clips ``.grad`` itself would clip nothing: it is warned of.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from mpistrategy.strategy.sharding.optimizer import unwrapped
from mpistrategy.strategy.sharding.training import ShardedTraining

log = logging.getLogger(__name__)


def route(sharding: ShardedTraining, plugin: Any, module: Any) -> Callable[[], None]:
    """Route ``plugin``'s clipping by norm and ``module``'s optimizer toggles through ``sharding``; returns the
    undo."""
    own_clip, own_clip_by_value = plugin.clip_grad_by_norm, plugin.clip_grad_by_value

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        sharded = sharding.sharded(optimizer)
        if sharded is None:
            own_clip(optimizer, clip_val)
        else:
            sharded.clip_grad_norm_(clip_val)

    def clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
        sharded = sharding.sharded(optimizer)
        if sharded is None or sharded.gradients():  # torch refuses to clip an empty list: a rank's pieces may have none
            own_clip_by_value(optimizer, clip_val)

    def stepped(optimizer: Any) -> list[nn.Parameter]:
        """The model's parameters ``optimizer`` steps (a wrapper's optimizer's)."""
        sharded = sharding.sharded(optimizer)
        if sharded is not None:
            return sharded.params
        return [p for group in unwrapped(optimizer).param_groups for p in group["params"]]

    def toggle_optimizer(optimizer: Any) -> None:
        every = {p: p.requires_grad for opt in module.trainer.optimizers for p in stepped(opt)}
        for param in every:
            param.requires_grad = False
        for param in stepped(optimizer):
            param.requires_grad = every[param]
        module._param_requires_grad_state = every

    def untoggle_optimizer(optimizer: Any) -> None:
        toggled = unwrapped(optimizer)
        saved = module._param_requires_grad_state
        for opt in module.trainer.optimizers:
            if opt is not toggled:
                for param in stepped(opt):
                    if param in saved:
                        param.requires_grad = saved[param]
        module._param_requires_grad_state = {}

    if sharding.gradients is not None and _overrides_clipping(module) and getattr(module, "global_rank", 0) == 0:
        log.warning(
            "mpi_ad: shard='gradients' keeps the gradients in shards, so parameters hold no .grad after backward: "
            "%s.configure_gradient_clipping must clip through self.clip_gradients(optimizer, ...) (which sees the "
            "whole gradient); torch.nn.utils.clip_grad_norm_(self.parameters(), ...) there would clip nothing.",
            type(module).__name__,
        )
    plugin.clip_grad_by_norm = clip_grad_by_norm
    plugin.clip_grad_by_value = clip_grad_by_value
    module.toggle_optimizer = toggle_optimizer
    module.untoggle_optimizer = untoggle_optimizer

    def undo() -> None:
        vars(plugin).pop("clip_grad_by_norm", None)
        vars(plugin).pop("clip_grad_by_value", None)
        vars(module).pop("toggle_optimizer", None)
        vars(module).pop("untoggle_optimizer", None)

    return undo


def _overrides_clipping(module: Any) -> bool:
    """Whether ``module``'s class overrides ``LightningModule.configure_gradient_clipping``."""
    own = getattr(type(module), "configure_gradient_clipping", None)
    return any(
        getattr(base, "configure_gradient_clipping", None) is not own
        for base in type(module).__mro__
        if base.__name__ == "LightningModule"
    )
