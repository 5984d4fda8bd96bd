"""What the data-parallel engine drives when the optimizer state is sharded (ZeRO stages 1 and 2).

:class:`ShardedTraining` holds the shard group, one :class:`~mpistrategy.strategy.sharding.optimizer.
ShardedOptimizer` per optimizer and, under ``shard="gradients"``, the gradient shards
(:class:`~mpistrategy.strategy.sharding.gradients.GradientShards`), and is called by the engine at the points of a
training step:

- after each synchronised backward pass (:meth:`ShardedTraining.after_backward`): the pieces get their averaged
  gradients (under ``shard="optimizer"`` the gradient reducer averaged every ``.grad`` as without sharding; under
  ``shard="gradients"`` the parameters no optimizer steps keep their ``.grad``, averaged over the ranks as flat
  mpi_ad averages it), and, where an overflow check follows (a ``GradScaler``), the ranks agree on whether some
  gradient is not finite;
- after each optimizer step (:meth:`ShardedTraining.after_step`): the updated shards are allgathered.

``optimizer.zero_grad()`` keeps zeroing the gradient buckets in place under ``shard="optimizer"``: the reducer
treats a sharded optimizer as one over the model's parameters (:meth:`ShardedTraining.attach_optimizer`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from mpistrategy.collectives.reduction import allreduce
from mpistrategy.comm.communicator import world as world_communicator
from mpistrategy.comm.topology import Topology
from mpistrategy.comm.traffic import INTER_NODE, TrafficCounter, scope_of
from mpistrategy.strategy.reducer import GradientReducer
from mpistrategy.strategy.sharding.gradients import GradientShards
from mpistrategy.strategy.sharding.group import ShardGroup, shard_group
from mpistrategy.strategy.sharding.optimizer import ShardedOptimizer, check_shardable, unwrapped


class ModelParameters:
    """A sharded optimizer as the gradient reducer sees it: one group of the model's parameters it steps."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.param_groups = [{"params": params}]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Replaced by the reducer's in-place zeroing when attached."""


class ShardedTraining:
    """The sharded state of one model's optimizers (see the module docstring).

    Args:
        mode: ``"optimizer"`` or ``"gradients"``.
        module: the model.
        topology: ranks, nodes and communicators.
        per_node: one copy of the state per node (hierarchical sync), else one over all ranks.
        agree_on_overflow: make an overflow anywhere visible on every rank (for a ``GradScaler``).
        bucket_cap_mb: under ``shard="gradients"``, the memory its gradient buckets may take together.
        traffic: where the bytes sent are counted.
    """

    def __init__(
        self,
        mode: str,
        module: nn.Module,
        topology: Topology,
        per_node: bool,
        agree_on_overflow: bool = False,
        bucket_cap_mb: float = 25.0,
        traffic: TrafficCounter | None = None,
    ) -> None:
        self.mode = mode
        self.module = module
        self.topology = topology
        self.agree_on_overflow = agree_on_overflow
        self.traffic = traffic if traffic is not None else TrafficCounter()
        self.group: ShardGroup = shard_group(topology, per_node)
        self.scope = scope_of(not per_node and topology.num_nodes > 1)
        self.optimizers: list[ShardedOptimizer] = []
        self._stepped: set[int] = set()  # the ids of the parameters the optimizers step
        self.gradients: GradientShards | None = None
        if mode == "gradients":
            self.gradients = GradientShards(self.group, bucket_cap_mb, self.traffic, self.scope == INTER_NODE)
        self._launch_order = list(reversed(list(module.parameters())))

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise unless ``optimizer`` can be sharded (see :func:`~mpistrategy.strategy.sharding.optimizer.
        check_shardable`; under ``shard="optimizer"`` it steps the model's parameters only)."""
        if self.sharded(optimizer) is None:
            check_shardable(optimizer, self._launch_order if self.gradients is None else None)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """Shard ``optimizer`` (collective over the shard group; once per optimizer)."""
        found = self.sharded(optimizer)
        if found is not None:
            return found
        _check_not_shared(optimizer, self.optimizers)
        sharded = ShardedOptimizer(optimizer, self.group.comm, self._launch_order)
        self.optimizers.append(sharded)
        self._stepped.update(id(p) for p in sharded.params)
        if self.gradients is not None:
            self.gradients.add(sharded)
        else:
            sharded.follow_parameter_gradients()
        return sharded

    def sharded(self, optimizer: Any) -> ShardedOptimizer | None:
        """The :class:`ShardedOptimizer` of ``optimizer`` (or of the optimizer a wrapper holds), if any."""
        optimizer = unwrapped(optimizer)
        return next((s for s in self.optimizers if s.optimizer is optimizer), None)

    def attach_optimizer(
        self, optimizer: torch.optim.Optimizer, reducer: GradientReducer | None, *aliases: Any
    ) -> None:
        """Make ``optimizer.zero_grad()`` (and its ``aliases``') zero the gradients of the parameters it steps."""
        sharded = self.add_optimizer(optimizer)
        if self.gradients is not None:
            self.gradients.attach_optimizer(sharded, *aliases)
        elif reducer is not None:
            # duck-typed: the reducer reads ``param_groups`` and replaces ``zero_grad``
            reducer.attach_optimizer(cast(torch.optim.Optimizer, ModelParameters(sharded.params)), optimizer, *aliases)

    def after_backward(self) -> None:
        """After a synchronised backward pass: the pieces' gradients (see the module docstring)."""
        for sharded in self.optimizers:
            problem = sharded.groups_problem()
            if problem is not None:  # no collective: a group added on some ranks only ends the job (see failures)
                raise problem
        if self.gradients is not None:
            self._average_unstepped()
        for sharded in self.optimizers:
            if self.gradients is None:
                sharded.use_parameter_gradients()
            if self.agree_on_overflow:
                sharded.agree_on_nonfinite()

    def _average_unstepped(self) -> None:
        """The ``.grad`` of each parameter that requires a gradient and that no optimizer steps (a temperature the
        user updates, a weight read from ``.grad``) averaged over every rank, as flat mpi_ad does: one allreduce per
        dtype and device of the gradients and a used flag each; a parameter some ranks gave no gradient gets the
        average with zeros from those ranks, one no rank gave a gradient keeps ``None``."""
        unstepped = [p for p in self.module.parameters() if p.requires_grad and id(p) not in self._stepped]
        groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for param in unstepped:
            groups.setdefault((param.dtype, param.device), []).append(param)
        world = world_communicator()
        for params in groups.values():
            pieces = [torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1) for p in params]
            used = torch.tensor([p.grad is not None for p in params], dtype=params[0].dtype, device=params[0].device)
            total = allreduce(torch.cat([*pieces, used]), "sum", world)
            sums, counts = total[: -len(params)].split([p.numel() for p in params]), total[-len(params) :]
            for param, summed, count in zip(params, sums, counts.tolist(), strict=True):
                if count:
                    param.grad = (summed / world.size).view_as(param)

    def watch_scaler(self, scaler: Any) -> None:
        """Make ``scaler`` (a ``GradScaler``) take the ranks' agreed overflow for a sharded optimizer whose pieces
        hold no gradient on this rank (see :meth:`~mpistrategy.strategy.sharding.optimizer.ShardedOptimizer.
        report_to_scaler`). The scaler's own ``unscale_`` is wrapped, so a later fit's sharding replaces this one."""

        def unscale_(optimizer: Any) -> None:
            type(scaler).unscale_(scaler, optimizer)
            sharded = self.sharded(optimizer)
            if sharded is not None:
                sharded.report_to_scaler(scaler)

        scaler.unscale_ = unscale_

    def after_step(self, optimizer: Any = None) -> None:
        """After ``optimizer``'s step (``None``: every optimizer's): allgather its updated shards."""
        for sharded in self.optimizers if optimizer is None else _listed(self.sharded(optimizer)):
            sent = sharded.after_step()
            if self.group.size > 1:
                self.traffic.add(self.scope, sent)

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The gradient memory held beside the parameters' ``.grad`` (the gradient shards and buckets)."""
        return self.gradients.buffers() if self.gradients is not None else []

    def remove(self) -> None:
        """Remove the gradient hooks, give the optimizers their ``zero_grad`` back, drop the pieces' gradients
        (views of the parameters' gradients, which may live in the reducer's shared memory: freed next) and unmap
        the peers' parameter buffers (collective). The optimizers keep their pieces and state (and can still be
        saved: see :mod:`~mpistrategy.strategy.sharding.checkpoint`)."""
        if self.gradients is not None:
            self.gradients.remove()
        for sharded in self.optimizers:
            sharded.stop_following()
            for piece in sharded.pieces:
                piece.grad = None
            for space in sharded.spaces:
                space.release()


def _listed(sharded: ShardedOptimizer | None) -> Iterable[ShardedOptimizer]:
    return () if sharded is None else (sharded,)


def _check_not_shared(optimizer: torch.optim.Optimizer, others: list[ShardedOptimizer]) -> None:
    mine = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for other in others:
        if any(id(p) in mine for p in other.params):
            raise ValueError(
                "a parameter is stepped by two optimizers; with shard= each parameter must belong to one optimizer."
            )
