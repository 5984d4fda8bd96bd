"""The data-parallel core of the ``mpi_ad`` strategy, independent of Lightning's Trainer.

:class:`DataParallelEngine` owns the step-level :class:`~mpistrategy.sync.SyncMode`, the gradient buckets
(:class:`~mpistrategy.strategy.reducer.GradientReducer`) and the traffic counter, and exposes the calls a
training loop makes, in order: :meth:`~DataParallelEngine.setup` once; per optimizer step
:meth:`~DataParallelEngine.pre_backward` / :meth:`~DataParallelEngine.post_backward` around each backward pass,
then :meth:`~DataParallelEngine.after_optimizer_step`; :meth:`~DataParallelEngine.begin_epoch` /
:meth:`~DataParallelEngine.end_epoch` around epochs; :meth:`~DataParallelEngine.state_dict` /
:meth:`~DataParallelEngine.load_state_dict` / :meth:`~DataParallelEngine.restore_replica` for checkpoints. The
Trainer strategy calls them from its hooks; a Fabric strategy calls the same.

Replicas. Under ``flat`` and ``hierarchical`` every rank holds the same model and optimizer state, so a rank-0
checkpoint is the whole state. Modes whose replicas differ between steps (local SGD, DASO, gossip: see
:attr:`~mpistrategy.sync.SyncMode.replicas`) need each replica's model and optimizer state to resume the same
trajectory: :meth:`~DataParallelEngine.state_dict` gathers one copy per distinct replica (per node, or per rank)
to rank 0, and :meth:`~DataParallelEngine.restore_replica` gives every rank its own back after the checkpoint's
rank-0 state was loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import nn

from mpistrategy.aggregation.base import Aggregator
from mpistrategy.aggregation.mean import MeanAggregator
from mpistrategy.comm.errors import by_rank
from mpistrategy.comm.topology import Topology
from mpistrategy.comm.traffic import TrafficCounter
from mpistrategy.strategy.failures import raise_together
from mpistrategy.strategy.reducer import GradientReducer
from mpistrategy.strategy.sharding.memory import MemoryReport, measure
from mpistrategy.strategy.sharding.optimizer import unwrapped
from mpistrategy.strategy.sharding.options import configuration_problem
from mpistrategy.strategy.sharding.training import ShardedTraining
from mpistrategy.strategy.step_check import StepCheck
from mpistrategy.sync.base import SyncConfigurationError, SyncContext, SyncMode

log = logging.getLogger(__name__)
T = TypeVar("T")


class DataParallelEngine:
    """Gradient buckets plus a sync mode over one module (see the module docstring).

    Args:
        sync: the sync mode (not yet set up).
        aggregator: the gradient aggregator of the level that spans nodes.
        topology: ranks, nodes and communicators.
        bucket_cap_mb, first_bucket_cap_mb, own_bucket_mb: the bucket layout (see
            :class:`~mpistrategy.strategy.reducer.GradientReducer`).
        node_transport: ``"auto"``, ``"mpi"``, ``"gloo"`` or ``"nccl"`` for node-local gradient averaging.
        traffic: where the bytes sent are counted (a new counter by default).
    """

    def __init__(
        self,
        sync: SyncMode,
        aggregator: Aggregator,
        topology: Topology,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        own_bucket_mb: float = 1.0,
        node_transport: str = "auto",
        traffic: TrafficCounter | None = None,
        shard: str | None = None,
        agree_on_overflow: bool = False,
    ) -> None:
        self.sync = sync
        self.aggregator = aggregator
        self.topology = topology
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.own_bucket_mb = own_bucket_mb
        self.node_transport = node_transport
        self.traffic = traffic if traffic is not None else TrafficCounter()
        self.last_step_traffic: tuple[int, int] = (0, 0)
        self.reducer: GradientReducer | None = None
        self.module: nn.Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.step_check = StepCheck()
        self.shard = shard
        self.agree_on_overflow = agree_on_overflow
        self.sharding: ShardedTraining | None = None
        self._sync_pass = False
        self.optimizer_steps = 0  #: optimizer steps whose after-step work is done
        self._step_hooks: list[tuple[torch.optim.Optimizer, Any]] = []  # (optimizer, its step post-hook's handle)

    def setup(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], problem: Exception | None = None
    ) -> None:
        """Set the sync mode up and build the gradient buckets (collective). Configuration errors raise on every
        rank: each rank checks the same configuration, and a failure on some ranks only is agreed on; so does
        ``problem``, one the caller found on this rank (raised where no options problem is)."""
        self.module, self.optimizers = module, list(optimizers)
        self._agree_on(
            self._options_problem() or _sparse_gradient_problem(module) or problem,
            "checking the sync mode and shard options",
        )
        context = SyncContext(module, self.topology, self.aggregator, self.traffic, self.node_transport, optimizers)
        self._agreed(lambda: self.sync.setup(context), "setting up the sync mode")
        if (
            self.topology.rank == 0
            and not isinstance(self.aggregator, MeanAggregator)
            and not self.sync.uses_aggregator()
        ):
            log.warning(
                "mpi_ad: the aggregator %r is not used: %r averages no gradients across nodes (only models, or only "
                "inside nodes; this run has %d node(s)), so nothing is compressed. Compression applies under "
                "sync='flat', 'hierarchical' with several nodes, and in the warm-up steps of local SGD.",
                self.aggregator,
                self.sync,
                self.topology.num_nodes,
            )
        try:
            self._build_parts(module, optimizers)
        except BaseException:
            self.teardown()  # the sync mode's communicators and shared memory, and what was built of the rest
            raise

    def _build_parts(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        """The sharding, the gradient reducer and the optimizers' hooks, on a set-up sync mode (collective)."""
        if self.shard is not None:
            per_node = self.sync.name == "hierarchical"
            self.sharding = ShardedTraining(
                self.shard, module, self.topology, per_node, self.agree_on_overflow, self.bucket_cap_mb, self.traffic
            )
        if self.shard != "gradients":  # the reducer sets the aggregators up: they refuse options that differ by rank
            self.reducer = self._agreed(
                lambda: GradientReducer(
                    module, self.sync, self.topology, self.bucket_cap_mb, self.first_bucket_cap_mb, self.own_bucket_mb
                ),
                "setting up the gradient aggregation",
            )
        for optimizer in optimizers:
            self.add_optimizer(optimizer)

    def _options_problem(self) -> SyncConfigurationError | None:
        """What stops this rank's options (before anything is set up, so that no rank waits in a collective of
        another mode): ranks given different sync modes, sync options, shard options or optimizers (type, groups and
        hyperparameters: replicas stepped differently drift apart), or a shard option the configuration cannot
        run."""
        mine = {
            "sync mode": f"{self.sync.name} {self.sync.options()}",
            "shard": repr(self.shard),
            "optimizer": "; ".join(_described(optimizer) for optimizer in self.optimizers),
        }
        control = self.topology.control
        everyone = control.allgather(mine) if control.Get_size() > 1 else [mine]
        for what in mine:
            if len({theirs[what] for theirs in everyone}) > 1:
                listing = by_rank(theirs[what] for theirs in everyone)
                return SyncConfigurationError(
                    f"the ranks were given different {what} options ({listing}); give every rank the same."
                )
        problem = configuration_problem(self.shard, self.sync.name, self.aggregator, self.topology.node_sizes)
        return None if problem is None else SyncConfigurationError(problem)

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the engine's steps drive ``optimizer`` too (collective: the ranks agree the sync mode can drive one
        more optimizer; where the state is sharded, it is split)."""
        if optimizer not in self.optimizers:
            count = len(self.optimizers) + 1
            self._agreed(lambda: self.sync.check_optimizers(count), "adding an optimizer")
            self.optimizers.append(optimizer)
        if self.sharding is not None:
            sharding = self.sharding
            self._agreed(lambda: sharding.check_optimizer(optimizer), "sharding the optimizer")
            sharding.add_optimizer(optimizer)
        self._hook_steps(unwrapped(optimizer))

    def _hook_steps(self, optimizer: torch.optim.Optimizer) -> None:
        """Do the after-step work (:meth:`after_optimizer_step`) after every step of ``optimizer``: also after one
        made on the torch optimizer itself, past the strategy (``self.optimizers(use_pl_optimizer=False)`` under
        the Trainer, the optimizer object kept from before ``fabric.setup``)."""
        register = getattr(optimizer, "register_step_post_hook", None)
        if register is None or any(optimizer is hooked for hooked, _ in self._step_hooks):
            return
        handle = register(lambda stepped, args, kwargs: self.after_optimizer_step(stepped))
        self._step_hooks.append((optimizer, handle))

    def complete_step(self, optimizer: Any, steps_before: int) -> None:
        """After the strategy's step of ``optimizer``, begun when :attr:`optimizer_steps` was ``steps_before``: the
        after-step work, unless the step's hook did it. The optimizer did not step where a ``GradScaler`` skipped a
        step of non-finite gradients: the ranks count the step all the same (a sync mode's period, the allgather of
        the shards)."""
        if self.optimizer_steps == steps_before:
            self.after_optimizer_step(optimizer)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *aliases: Any) -> None:
        """Make ``optimizer.zero_grad()`` (and its wrappers' ``aliases``) zero the gradients where the engine keeps
        them (see :meth:`~mpistrategy.strategy.reducer.GradientReducer.attach_optimizer`)."""
        if self.sharding is not None:
            self.sharding.attach_optimizer(optimizer, self.reducer, *aliases)
        elif self.reducer is not None:
            self.reducer.attach_optimizer(optimizer, *aliases)

    def _agree_on(self, problem: BaseException | None, what: str) -> None:
        """Raise ``problem`` on its rank and a :class:`SyncConfigurationError` on the others, if any rank has one."""
        raise_together(problem, self.topology.control, what, SyncConfigurationError)

    def _agreed(self, step: Callable[[], T], what: str, errors: tuple[type[Exception], ...] = ()) -> T:
        """``step()``, its configuration errors (and ``errors``) agreed on by the ranks (see :meth:`_agree_on`)."""
        problem: BaseException | None = None
        result: T | None = None
        caught: tuple[type[Exception], ...] = (SyncConfigurationError, ValueError, TypeError, *errors)
        try:
            result = step()
        except caught as error:
            problem = error
        self._agree_on(problem, what)
        return cast(T, result)  # no rank failed: the step returned

    # ---------------------------------------------------------------------------------------------- steps

    def pre_backward(self, sync_gradients: bool, loss: torch.Tensor | None = None) -> None:
        """Before each backward pass (of ``loss``): ``sync_gradients`` is False inside gradient accumulation. Posts
        the check that every rank is at the same batch (:mod:`~mpistrategy.strategy.step_check`)."""
        self._sync_pass = sync_gradients
        if self.reducer is not None:
            self.reducer.prepare(sync=sync_gradients)
            aggregator = self.reducer.aggregator
            span = None if aggregator is None or aggregator.context is None else aggregator.context.span
            self.step_check.begin_sync(None if span is None else span.comm)
        elif self.sharding is not None and self.sharding.gradients is not None:
            self.sharding.gradients.prepare(sync_gradients, loss)
            self.step_check.begin_sync(self.sharding.group.span if sync_gradients else None)

    def post_backward(self) -> None:
        """After each backward pass, before clipping and the optimizer step: finish the gradient buckets, and check
        that every rank was at the same batch (:mod:`~mpistrategy.strategy.step_check`)."""
        gradients = self.sharding.gradients if self.sharding is not None else None
        if self.reducer is not None or gradients is not None:
            self.step_check.waiting()
            if self.reducer is not None:
                self.reducer.wait()
            elif gradients is not None:
                gradients.wait()
            self.step_check.end_sync()
        if self.sharding is not None and self._sync_pass:
            self.sharding.after_backward()

    def after_optimizer_step(self, optimizer: Any = None) -> None:
        """After ``optimizer``'s step (``None``: any): the allgather of its updated shards when sharded, the sync
        mode's parameter work; the step's bytes go to :attr:`last_step_traffic` (``(node, inter_node)`` bytes this
        rank sent in the step)."""
        if self.sharding is not None:
            self.sharding.after_step(optimizer)
        self.sync.after_optimizer_step()
        self.last_step_traffic = self.traffic.take()
        self.optimizer_steps += 1

    def memory(self) -> MemoryReport:
        """The bytes this rank holds for the model's parameters, gradients (the ``.grad`` and the gradient buckets
        or shards) and optimizer state, measured from the tensors (see :mod:`~mpistrategy.strategy.sharding.memory`)."""
        assert self.module is not None, "memory() is measured after setup"
        buffers = [bucket.buffer for bucket in self.reducer.buckets] if self.reducer is not None else []
        if self.sharding is not None:
            buffers += self.sharding.gradient_buffers()
        return measure(self.module, self.optimizers, buffers)

    def begin_epoch(self, epoch: int, steps: int | None, total_epochs: int | None) -> None:
        self.sync.begin_epoch(epoch, steps, total_epochs)

    def end_epoch(self) -> None:
        self.sync.end_epoch()

    def record_loss(self, loss: Any) -> None:
        """Give the sync mode a training step's loss when it asks for it (DASO's plateau detector)."""
        if self.sync.uses_loss and loss is not None:
            self.sync.record_loss(float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss))

    # ----------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The sync mode's and the aggregator's state and, for diverging replicas, every replica's model and
        optimizer state (collective; the result is complete on rank 0)."""
        state: dict[str, Any] = {"sync": {"name": self.sync.name, "state": self.sync.state_dict()}}
        if self.aggregator.context is not None or self.topology.rank == 0:
            aggregator = self.aggregator.state_dict()
            if aggregator:
                state["aggregator"] = aggregator
        replicas = self._gather_replicas()
        if replicas is not None:
            state["replicas"] = replicas
        return state

    def _replica_index(self) -> int | None:
        scope = self.sync.replicas
        if scope == "node":
            return self.topology.node_rank
        if scope == "rank":
            return self.topology.rank
        return None

    def _gather_replicas(self) -> dict[str, Any] | None:
        index = self._replica_index()
        if index is None or self.module is None:
            return None
        representative = self.sync.replicas == "rank" or self.topology.is_leader
        mine = None
        if representative:
            mine = {
                "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
                "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            }
        control = self.topology.control
        everyone = control.gather((index, mine), root=0) if control.Get_size() > 1 else [(index, mine)]
        if everyone is None:
            return {"scope": self.sync.replicas}
        copies = {i: copy for i, copy in everyone if copy is not None}
        return {"scope": self.sync.replicas, "copies": [copies[i] for i in sorted(copies)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the sync mode's and the aggregator's state (before the model's weights are loaded; collective:
        a state this run cannot take, such as per-rank state of another number of ranks, raises on every rank)."""
        what = "restoring the sync mode's and the aggregator's state"
        self._agreed(lambda: self._load_state(state), what, (KeyError,))

    def _load_state(self, state: dict[str, Any]) -> None:
        sync_state = state.get("sync")
        if sync_state is not None:
            if sync_state["name"] != self.sync.name:
                raise SyncConfigurationError(
                    f"the checkpoint was written with sync mode {sync_state['name']!r}, but this run uses "
                    f"{self.sync.name!r}; resume with the same mode, or load only the weights."
                )
            self.sync.load_state_dict(sync_state["state"])
        aggregator = state.get("aggregator")
        if aggregator and (self.aggregator.context is not None or self.topology.rank == 0):
            self.aggregator.load_state_dict(aggregator)

    def restore_replica(self, state: dict[str, Any]) -> None:
        """After the checkpoint's (rank-0) model and optimizer state were loaded: load this rank's own replica
        (collective: a replica this run needs and the checkpoint lacks raises on every rank; replicas of ranks or
        nodes this run does not have are dropped with a warning on rank 0)."""
        replicas = state.get("replicas")
        if not replicas or self._replica_index() is None or self.module is None:
            return
        self._agreed(lambda: self._load_replica(replicas), "restoring the replicas", (KeyError,))

    def _load_replica(self, replicas: dict[str, Any]) -> None:
        index, scope, copies = self._replica_index(), self.sync.replicas, replicas["copies"]
        assert index is not None and self.module is not None
        if replicas["scope"] != scope or index >= len(copies):
            raise SyncConfigurationError(
                f"the checkpoint holds {len(copies)} {replicas['scope']} replicas, but this run needs replica "
                f"{index} of scope {scope!r}; resume {self.sync.name} with the layout it was saved with."
            )
        here = self.topology.size if scope == "rank" else len(self.topology.node_sizes)
        if len(copies) > here and self.topology.rank == 0:
            log.warning(
                "mpi_ad: the checkpoint holds %d %s replicas and this run has %d %ss: the replicas of %s(s) %s are "
                "dropped (what they trained since their last average is lost); the run continues from those of "
                "%s(s) 0-%d.",
                len(copies),
                scope,
                here,
                scope,
                scope,
                ", ".join(str(i) for i in range(here, len(copies))),
                scope,
                here - 1,
            )
        copy = copies[index]
        self.module.load_state_dict(copy["model"])
        for optimizer, optimizer_state in zip(self.optimizers, copy["optimizers"], strict=True):
            optimizer.load_state_dict(optimizer_state)

    def teardown(self) -> None:
        """Complete the sync mode's work in flight and remove the sharding's and the reducer's hooks (in this
        order: the reducer frees the gradient buckets, which the sharded optimizer's pieces may view) and the
        optimizers' step hooks."""
        self.sync.finish()
        for _, handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        if self.sharding is not None:
            self.sharding.remove()
            self.sharding = None
        if self.reducer is not None:
            self.reducer.remove()
            self.reducer = None


def _described(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's type, and each parameter group's size and hyperparameters (what every rank must share)."""
    groups = [
        f"{len(group['params'])} params, "
        + ", ".join(f"{key}={value!r}" for key, value in sorted(group.items()) if key != "params")
        for group in optimizer.param_groups
    ]
    return f"{type(optimizer).__name__}({' | '.join(groups)})"


def _sparse_gradient_problem(module: nn.Module) -> ValueError | None:
    """Embeddings of ``module`` that would give trainable parameters sparse gradients, which the gradient buckets
    (dense, flat) cannot hold."""
    sparse = [
        f"{name}.weight"
        for name, child in module.named_modules()
        if isinstance(child, nn.Embedding | nn.EmbeddingBag) and child.sparse and child.weight.requires_grad
    ]
    if not sparse:
        return None
    return ValueError(
        f"mpi_ad averages dense gradients only, and {', '.join(repr(name) for name in sparse)} would get sparse "
        "ones; build the embedding with sparse=False (and use a dense optimizer, e.g. Adam instead of SparseAdam)."
    )
