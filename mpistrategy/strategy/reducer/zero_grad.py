"""An optimizer's ``zero_grad`` that zeroes the flat gradient buckets in place instead of dropping the gradients.

The ``.grad`` then stay views into the buckets from step to step, and backward accumulates into them in place: no
copy into the buckets, and no fresh gradient allocation per step. A ``.grad`` the user replaced by another tensor
is pointed at its zeroed view again (one set to ``None`` stays ``None``, as torch's ``zero_grad`` leaves it).
Gradients outside the flat buckets (own-gradient buckets, large gradients their hook copies into a bucket,
parameters outside the buckets) keep the optimizer's own behaviour. ``set_to_none`` is honoured all the same where
it is observable: the zeroed gradients are marked as stand-ins
(:class:`~mpistrategy.strategy.reducer.usage.GradientFlags`), and a parameter that no rank gives a gradient before
the reducer's next ``wait`` ends it with ``.grad`` ``None``, as in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from mpistrategy.strategy.reducer.memory import BucketMemory
from mpistrategy.strategy.reducer.usage import GradientFlags


@dataclass(frozen=True)
class ZeroPlan:
    """What one optimizer's ``zero_grad`` does.

    Attributes:
        buffers: whole accumulated prefixes of flat buckets whose parameters are all the optimizer's (zeroed).
        views: the optimizer's gradient views in flat buckets it shares with other parameters (zeroed).
        others: the optimizer's other parameters (reset as the optimizer would: ``None`` or zero).
        slots: the slots of the optimizer's bucketed parameters.
        bound: the optimizer's parameters whose ``.grad`` is a view of a zeroed bucket, each with its view.
    """

    buffers: list[torch.Tensor]
    views: list[torch.Tensor]
    others: list[nn.Parameter]
    slots: np.ndarray
    bound: list[tuple[nn.Parameter, torch.Tensor]]


def plan_zeroing(optimizer: torch.optim.Optimizer, memory: BucketMemory) -> ZeroPlan:
    """The :class:`ZeroPlan` of ``optimizer`` over the buckets of ``memory``."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    buffers, views, in_place, bound = [], [], set(), []
    for spec, bucket in zip(memory.layout.buckets, memory.buckets, strict=True):
        if spec.own_gradient:  # the optimizer's rule applies to the gradient it is
            continue
        accumulated = bucket.params[: len(spec.accumulated)]
        mine = [id(p) in owned for p in accumulated]
        in_place |= {id(p) for p in accumulated}
        bound += [(p, view) for p, view, m in zip(accumulated, bucket.views, mine, strict=False) if m]
        if all(mine):
            if accumulated:
                buffers.append(bucket.buffer[: spec.accumulated_numel])
        else:
            views += [view for view, m in zip(bucket.views, mine, strict=False) if m]
    others = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in in_place]
    slots = [place.slot for spec in memory.layout.buckets for place in spec.places]
    params = [p for bucket in memory.buckets for p in bucket.params]
    mine_slots = [slot for slot, p in zip(slots, params, strict=True) if id(p) in owned]
    return ZeroPlan(buffers, views, others, np.array(mine_slots, dtype=np.intp), bound)


class ZeroGradHook:
    """Replaces the ``zero_grad`` of the optimizers it is attached to (see the module docstring), for the buckets
    given by :meth:`use`."""

    def __init__(self, flags: GradientFlags) -> None:
        self._flags = flags
        self._memory: BucketMemory | None = None
        self._plans: dict[tuple[int, int], ZeroPlan] = {}
        self._patched: list[tuple[Any, bool]] = []

    def use(self, memory: BucketMemory) -> None:
        """Zero the buckets of ``memory`` from now on (the layout was built anew)."""
        self._memory = memory
        self._plans = {}

    def attach(self, optimizer: torch.optim.Optimizer, *aliases: Any) -> None:
        """Make ``optimizer.zero_grad()`` (and that of ``aliases``, wrappers that must behave the same) zero the
        flat buckets in place."""

        def zero_grad(set_to_none: bool = True) -> None:
            self.zero_grad(optimizer, set_to_none)

        for target in (optimizer, *aliases):
            had_attribute = "zero_grad" in vars(target)
            target.zero_grad = zero_grad
            self._patched.append((target, had_attribute))

    def detach(self) -> None:
        """Give the optimizers their own ``zero_grad`` back."""
        for target, had_attribute in reversed(self._patched):
            if not had_attribute and "zero_grad" in vars(target):
                del target.zero_grad
        self._patched = []
        self._plans = {}

    def zero_grad(self, optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """Zero ``optimizer``'s gradients in flat buckets in place (whole buffers where it owns a whole bucket);
        reset its other gradients as the optimizer would (``None`` or zero). With ``set_to_none`` the zeroed flat
        gradients count as absent."""
        plan = self._plan(optimizer)
        flags = self._flags
        if set_to_none:
            flags.stand_in[plan.slots] = 1
        else:  # a gradient that was absent stays absent, as torch's zero_grad leaves None alone
            flags.stand_in[plan.slots] &= flags.local_view[plan.slots] ^ 1
        flags.local_view[plan.slots] = 0
        for tensor in (*plan.buffers, *plan.views):
            tensor.zero_()
        for param, view in plan.bound:  # a .grad the user replaced after backward: backward accumulates into the view
            grad = param.grad  # read once: this loop runs every step
            if grad is not view and grad is not None:
                param.grad = view
        for param in plan.others:
            if param.grad is not None:
                _reset(param, set_to_none)

    def _plan(self, optimizer: torch.optim.Optimizer) -> ZeroPlan:
        key = (id(optimizer), sum(len(group["params"]) for group in optimizer.param_groups))
        plan = self._plans.get(key)
        if plan is None:
            assert self._memory is not None, "the reducer gives its buckets when it builds them"
            plan = self._plans[key] = plan_zeroing(optimizer, self._memory)
        return plan


def _reset(param: nn.Parameter, set_to_none: bool) -> None:
    """Reset ``param``'s gradient as torch's ``zero_grad`` does (a view, such as a bucket's, cannot be detached in
    place)."""
    grad = param.grad
    assert grad is not None
    if set_to_none:
        param.grad = None
        return
    if grad.grad_fn is not None:
        grad.detach_()
    else:
        grad.requires_grad_(False)
    grad.zero_()
