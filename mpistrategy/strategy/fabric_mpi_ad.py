"""The ``mpi_ad`` strategy for Lightning Fabric: ``Fabric(strategy="mpi_ad")``.

``import mpistrategy`` registers ``"mpi_ad"`` and the sync-mode names (``"mpi_hierarchical"``, ``"mpi_local_sgd"``,
``"mpi_daso"``, ...) in Fabric's strategy registry; ``Fabric(strategy=MPIADFabricStrategy(...))`` takes the options
of :class:`~mpistrategy.strategy.base.MPIStrategyBase`. Launch with ``mpiexec -n N python train.py``, ``srun
--mpi=pmi2 python train.py`` or plain ``python train.py``; ``fabric.launch()`` starts no processes (the launcher
did), it sets the torch threads per rank and the device. It is the Trainer strategy's machinery, driven by Fabric's
calls:

- ``fabric.setup(model, optimizer)``: rank 0's parameters and buffers are broadcast, then the model gets a
  :class:`~mpistrategy.strategy.engine.DataParallelEngine` (gradient buckets, aggregator, sync mode; set-up errors
  raise on every rank). Each further model set up gets its own engine, with copies of the configured sync mode and
  aggregator and its own gradient communicators (two models' buckets in one backward pass never mix).
- ``fabric.backward(loss)``: the buckets are combined during backward and finished before it returns, so clipping
  and the optimizer step see the average over the ranks. Inside ``fabric.no_backward_sync(model)`` backward only
  accumulates; the next synchronised backward averages the accumulated sum (gradient accumulation, one exchange
  per optimizer step).
- ``optimizer.step()``: then the sync mode's parameter work (model averaging under local SGD, DASO, gossip) and
  the coordinated stop check. Modes with an epoch schedule (DASO) need :meth:`MPIADFabricStrategy.begin_epoch` and
  :meth:`MPIADFabricStrategy.end_epoch` around each epoch; DASO's plateau detector gets every backward's loss.
- ``fabric.all_reduce``/``all_gather``/``broadcast``/``barrier``: over MPI; torchmetrics metrics inside a set-up
  model sync over MPI (others: :meth:`~mpistrategy.strategy.base.MPIStrategyBase.attach_metric_sync`).
- ``fabric.save``: rank 0 writes the file atomically, sealed with a SHA-256 (:mod:`~mpistrategy.strategy.
  checkpoints`), and every rank learns whether it worked (a failed write raises on every rank); the sync modes
  that keep state, or replicas that differ between ranks, add it under ``"mpistrategy"``. ``fabric.load``: every
  rank verifies and reads the file (a corrupt one raises ``CorruptCheckpointError`` on every rank) and restores the
  objects given, then each rank's own replica.
- Failures: an exception that escapes on one rank prints its traceback once and aborts every rank (non-zero exit,
  no rank left waiting); ``os._exit`` on a rank is reported.
- Stop signals: SIGTERM or SIGUSR1 reaching any rank during training makes every rank raise
  :class:`~mpistrategy.strategy.failures.StopRequested` (exit code 75) from the same ``optimizer.step()``, one step
  after the signal; catch it to save a checkpoint (``fabric.save``) before exiting.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import signal
from collections.abc import Callable, Generator
from typing import Any

import torch

try:
    from lightning.fabric.strategies import ParallelStrategy
    from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
    from lightning.fabric.utilities.types import _Stateful
except ImportError:  # the core install has no Lightning
    from mpistrategy.extras import require

    require("lightning", "mpistrategy's Fabric strategy (mpi_ad)")
    raise
from torch import Tensor, nn

from mpistrategy.strategy import checkpoints, failures
from mpistrategy.strategy.base import MPIStrategyBase
from mpistrategy.strategy.engine import DataParallelEngine

log = logging.getLogger(__name__)

Checkpoint = dict[str, Any]


class SkipGradientSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the model's backward passes inside the context only accumulate."""

    def __init__(self) -> None:
        self._skipped: set[int] = set()

    @contextlib.contextmanager
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> Generator[None, None, None]:
        key = id(module)
        if not enabled or key in self._skipped:
            yield
            return
        self._skipped.add(key)
        try:
            yield
        finally:
            self._skipped.discard(key)

    def skips(self, module: nn.Module) -> bool:
        """Whether ``module``'s gradients are not to be synchronised now."""
        return id(module) in self._skipped


class MPIADFabricStrategy(MPIStrategyBase, ParallelStrategy):
    """Data-parallel training over MPI for Lightning Fabric (see the module docstring; options:
    :class:`~mpistrategy.strategy.base.MPIStrategyBase`)."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self._backward_sync_control: SkipGradientSync = SkipGradientSync()
        # copies taken before any setup, for the engines of the models after the first
        self._sync_template = copy.deepcopy(self.sync)
        self._aggregator_template = copy.deepcopy(self.aggregator)
        self._engines: list[tuple[nn.Module, DataParallelEngine]] = []
        self._pending_states: list[dict[str, Any]] = []

    @property
    def engines(self) -> list[DataParallelEngine]:
        """The data-parallel engines, one per model set up, in setup order (none with one rank)."""
        return [engine for _, engine in self._engines]

    # --------------------------------------------------------------------------------------------- setup

    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Rank 0's parameters and buffers on every rank, metric sync, and the model's engine (collective)."""
        self._setup(module, [])
        return module

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], Any]:
        self._setup(module, optimizers)
        return module, optimizers, scheduler

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """An optimizer set up after its model (``fabric.setup_optimizers``) joins the engine of the model whose
        parameters it steps (its steps then drive that model's sync mode)."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module, engine in self._engines:
            if optimizer not in engine.optimizers and any(id(p) in params for p in module.parameters()):
                engine.add_optimizer(optimizer)
                engine.attach_optimizer(optimizer)
        return optimizer

    def _setup(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        self.broadcast_module_state(module)
        self.attach_metric_sync(module)
        if self.world_size == 1 or not self.data_parallel:
            return
        if not self._engines:
            engine = self._build_engine(module, optimizers)
        else:
            engine = self._build_engine(
                module,
                optimizers,
                copy.deepcopy(self._sync_template),
                copy.deepcopy(self._aggregator_template),
                self.topology.with_own_gradient_channels(),
            )
        for optimizer in optimizers:
            engine.attach_optimizer(optimizer)
        index = len(self._engines)
        self._engines.append((module, engine))
        if index < len(self._pending_states):
            engine.load_state_dict(self._pending_states[index])
            engine.restore_replica(self._pending_states[index])

    # ------------------------------------------------------------------------------------------ training

    def _engines_of(self, module: nn.Module | None) -> list[tuple[nn.Module, DataParallelEngine]]:
        """The engines a backward pass drives: ``module``'s, or every model's when Fabric names none."""
        if module is None:
            return self._engines
        return [(m, engine) for m, engine in self._engines if m is module]

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward with the gradient buckets armed (unless inside ``no_backward_sync``) and finished: on return,
        ``.grad`` holds the average over the ranks."""
        engines = self._engines_of(module)
        for owner, engine in engines:
            if engine.sync.uses_loss and tensor.numel() == 1:
                engine.record_loss(tensor)
            engine.pre_backward(not self._backward_sync_control.skips(owner), tensor)
        super().backward(tensor, module, *args, **kwargs)
        for _, engine in engines:
            engine.post_backward()

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer step, the sync mode's parameter work for the model it stepped, then the coordinated stop
        check (every rank raises :class:`~mpistrategy.strategy.failures.StopRequested` together after a stop
        signal)."""
        output = super().optimizer_step(optimizer, **kwargs)
        for _, engine in self._engines:
            if any(optimizer is mine for mine in engine.optimizers):
                engine.after_optimizer_step(optimizer)
        self._install_stop_signals()
        signum = self._decide_stop()
        if signum:
            name = signal.Signals(signum).name
            if self.is_global_zero:
                log.warning("mpi_ad: %s received; every rank stops after this optimizer step.", name)
            raise failures.mark_coordinated_stop(failures.StopRequested(name))
        return output

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Fabric's clipping by norm; a sharded optimizer's gradients are clipped by the norm of the whole gradient
        (collective over the ranks that share its state)."""
        for _, engine in self._engines:
            sharded = engine.sharding.sharded(optimizer) if engine.sharding is not None else None
            if sharded is not None:
                self.precision.unscale_gradients(optimizer)
                return sharded.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    def begin_epoch(self, epoch: int, steps: int | None = None, total_epochs: int | None = None) -> None:
        """Before epoch ``epoch`` (0-based) of ``steps`` optimizer steps, of ``total_epochs``: for sync modes with an
        epoch schedule (DASO); every rank calls it."""
        for _, engine in self._engines:
            engine.begin_epoch(epoch, steps, total_epochs)

    def end_epoch(self) -> None:
        """After an epoch's last optimizer step (collective)."""
        for _, engine in self._engines:
            engine.end_epoch()

    # --------------------------------------------------------------------------------------- checkpoints

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Collective: rank 0 writes the state atomically, sealed with a SHA-256; every rank learns the outcome.
        The engines' state goes under ``"mpistrategy"`` when a sync mode or aggregator keeps some or the replicas
        differ between ranks."""
        checkpoint = self._convert_stateful_objects_in_state(state, filter=filter or {})
        engine_states = [engine.state_dict() for _, engine in self._engines]
        if any(_carries_state(engine_state) for engine_state in engine_states):
            checkpoint[checkpoints.KEY] = {"engines": engine_states}
        save = functools.partial(self.checkpoint_io.save_checkpoint, storage_options=storage_options)
        checkpoints.write_on_rank_zero(checkpoint, path, save, self.topology.control)

    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> Checkpoint:
        """Collective: every rank verifies and reads the checkpoint (a corrupt one raises
        ``CorruptCheckpointError`` on every rank) and restores ``state`` from it as Fabric does; then the engines'
        state and this rank's replica (for models not set up yet: when they are)."""
        load = functools.partial(self.checkpoint_io.load_checkpoint, weights_only=weights_only)
        checkpoint = checkpoints.read(path, load, self.topology.control)
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):  # a raw state dict (``fabric.load_raw``)
            return self._restore(checkpoint, state, strict)
        ours = checkpoint.pop(checkpoints.KEY, None)
        engine_states = list(ours.get("engines", [])) if ours else []
        for (_, engine), engine_state in zip(self._engines, engine_states, strict=False):
            engine.load_state_dict(engine_state)
        remainder = self._restore(checkpoint, state, strict)
        for (_, engine), engine_state in zip(self._engines, engine_states, strict=False):
            engine.restore_replica(engine_state)
        self._pending_states = engine_states
        return remainder

    def _restore(
        self, checkpoint: Checkpoint, state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None, strict: bool
    ) -> Checkpoint:
        """Restore ``state`` from ``checkpoint`` with Fabric's rules; returns what was not restored."""
        if not state:
            return checkpoint
        if isinstance(state, nn.Module):
            self.load_module_state_dict(module=state, state_dict=checkpoint, strict=strict)
            return {}
        if isinstance(state, torch.optim.Optimizer):
            state.load_state_dict(checkpoint)
            return {}
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
        for name, obj in list(state.items()):
            if name not in checkpoint:
                continue
            value = checkpoint.pop(name)
            if isinstance(obj, nn.Module):
                self.load_module_state_dict(module=obj, state_dict=value, strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return checkpoint

    # ------------------------------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        for _, engine in self._engines:
            engine.teardown()
        self._engines = []
        self._release_stop_signals()
        super().teardown()

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(world_size={self.world_size}, sync={self.sync!r}, aggregator={self.aggregator!r})"


def _carries_state(engine_state: dict[str, Any]) -> bool:
    """Whether an engine's :meth:`~DataParallelEngine.state_dict` holds anything a resume needs."""
    return bool(
        engine_state.get("sync", {}).get("state") or engine_state.get("aggregator") or "replicas" in engine_state
    )
