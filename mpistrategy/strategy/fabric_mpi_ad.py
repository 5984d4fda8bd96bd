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
  and the optimizer step see the average over the ranks; under ``flat`` and ``hierarchical`` every rank then holds
  rank 0's buffers (BatchNorm statistics), as under DDP. Inside ``fabric.no_backward_sync(model)`` backward only
  accumulates; the next synchronised backward averages the accumulated sum (gradient accumulation, one exchange
  per optimizer step).
- ``optimizer.step()``: then the sync mode's parameter work (model averaging under local SGD, DASO, gossip) and
  the coordinated stop check. Modes with an epoch schedule (DASO) need :meth:`MPIADFabricStrategy.begin_epoch` and
  :meth:`MPIADFabricStrategy.end_epoch` around each epoch; DASO's plateau detector gets every backward's loss.
- ``fabric.all_reduce``/``all_gather``/``broadcast``/``barrier``: over MPI; torchmetrics metrics sync over MPI
  after ``fabric.launch()``, as under DDP (see :func:`~mpistrategy.strategy.conventions.sync_torchmetrics`).
- ``fabric.save``: rank 0 writes the file atomically, sealed with a SHA-256 (:mod:`~mpistrategy.strategy.
  checkpoints`), and every rank learns whether it worked (a failed write raises on every rank); the sync modes
  that keep state, or replicas that differ between ranks, add it under ``"mpistrategy"``. ``fabric.load``: every
  rank verifies and reads the file (a corrupt one raises ``CorruptCheckpointError`` on every rank) and restores the
  objects given, then each rank's own replica.
- Failures: an exception that escapes on one rank prints its traceback once and aborts every rank (non-zero exit,
  no rank left waiting); ``os._exit`` on a rank is reported.
- Stop signals: SIGTERM or SIGUSR1 reaching any rank during training makes every rank raise
  :class:`~mpistrategy.strategy.failures.StopRequested` (exit code 75) from the same ``optimizer.step()``, one step
  after the signal (also a step of the torch optimizer itself, past Fabric's wrapper); catch it to save a checkpoint
  (``fabric.save``) before exiting.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import signal
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

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

from mpistrategy.comm import watchdog
from mpistrategy.strategy import checkpoints, fabric_release, failures
from mpistrategy.strategy.base import MPIStrategyBase
from mpistrategy.strategy.engine import DataParallelEngine
from mpistrategy.strategy.sharding import checkpoint as sharded_checkpoint
from mpistrategy.strategy.sharding.optimizer import ShardedOptimizer, unwrapped
from mpistrategy.strategy.sharding.training import ShardedTraining

log = logging.getLogger(__name__)
V = TypeVar("V")

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
        # what teardown frees, or fabric_release once this strategy is gone: Fabric never calls teardown
        self._held = fabric_release.Held()
        self._engines = self._held.engines
        # engine states of the last load for models not set up yet: (the model it names, or None for setup order)
        self._pending_states: list[tuple[nn.Module | None, dict[str, Any]]] = []
        self._routed = self._held.routed  # optimizers given a routed class, their own
        self._own_channels = self._held.own_channels  # the gradient channels made for the second and later models
        self._registered = False
        self._stepping = False  # inside optimizer_step: its own stop check follows the step
        self._torn_down: list[ShardedTraining | None] = []  # by model, kept after teardown: a save still needs them

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
                self._route_zero_grad(optimizer)
                self._hook_stop_check(optimizer)
        return optimizer

    def _setup(self, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
        if self.world_size > 1 and not self._registered:  # the first model: free what dropped strategies held
            fabric_release.release_dropped(self.topology.control)
            fabric_release.register(self, self._held, self.topology.control)
            self._registered = True
        self.broadcast_module_state(module)
        if self.world_size == 1 or not self.data_parallel:
            return
        if not self._engines:
            self._torn_down = []
            engine = self._build_engine(module, optimizers)
        else:
            own_channels = self.topology.with_own_gradient_channels()
            try:
                engine = self._build_engine(
                    module,
                    optimizers,
                    copy.deepcopy(self._sync_template),
                    copy.deepcopy(self._aggregator_template),
                    own_channels,
                )
            except BaseException:
                own_channels.free_gradient_channels()  # a refused model keeps no communicator
                raise
            self._own_channels.append(own_channels)
        for optimizer in optimizers:
            engine.attach_optimizer(optimizer)
            self._route_zero_grad(optimizer)
            self._hook_stop_check(optimizer)
        if engine.sharding is not None and self._uses_grad_scaler():
            engine.sharding.watch_scaler(getattr(self.precision, "scaler", None))
        self._engines.append((module, engine))
        pending = _paired(self._pending_states, module, len(self._engines) - 1)
        if pending is not None:
            engine.load_state_dict(pending)
            engine.restore_replica(pending)

    def _route_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``zero_grad`` of the wrapper Fabric puts around ``optimizer`` the engine's.

        Fabric's wrapper is an instance of a subclass of the optimizer's class, so its ``zero_grad`` is the class's
        and would miss the engine's, set on the optimizer object: it would reset the pieces a sharded optimizer
        steps instead of the model's gradients. The optimizer gets a subclass of its class (same name, restored at
        teardown) whose ``zero_grad`` calls the optimizer object's own.
        """
        original = type(optimizer)
        if not issubclass(original, _RoutedZeroGrad):
            optimizer.__class__ = _routed_class(original)
            self._routed.append((optimizer, original))

    def _hook_stop_check(self, optimizer: torch.optim.Optimizer) -> None:
        """Make a step of ``optimizer`` itself, past Fabric's wrapper, end with the coordinated stop check as the
        wrapper's step does (after the engine's after-step work: its hook was registered first). The hook holds
        the strategy weakly, so that a dropped Fabric object is still freed (:mod:`~mpistrategy.strategy.
        fabric_release`)."""
        strategy = weakref.ref(self)

        def check_after_step(*_: Any) -> None:
            owner = strategy()
            if owner is not None and not owner._stepping:
                owner._install_stop_signals()
                owner._stop_if_requested()

        self._held.step_hooks.append(unwrapped(optimizer).register_step_post_hook(check_after_step))

    # ------------------------------------------------------------------------------------------ training

    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward with the gradient buckets armed (unless inside ``no_backward_sync``) and finished: on return,
        ``.grad`` holds the average over the ranks. After a synchronised backward under a mode that keeps one replica
        (``flat``, ``hierarchical``) every rank holds rank 0's buffers, as under DDP: BatchNorm's running statistics
        would otherwise follow each rank's own batches, and the ranks would evaluate different models.

        Every set-up model's buckets take part, whichever model ``fabric.backward(loss, model=...)`` names (a hint
        for plugins): as under DDP, the gradients of every model the loss reaches are averaged, and a model it
        reaches on no rank costs one small exchange."""
        engines = [(owner, engine, not self._backward_sync_control.skips(owner)) for owner, engine in self._engines]
        for _, engine, synchronised in engines:
            if engine.sync.uses_loss and tensor.numel() == 1:
                engine.record_loss(tensor)
            engine.pre_backward(synchronised, tensor)
        super().backward(tensor, module, *args, **kwargs)
        for owner, engine, synchronised in engines:
            engine.post_backward()
            if synchronised and engine.sync.replicas == "world":
                self.share_buffers(owner)

    def _install_stop_signals(self) -> None:
        super()._install_stop_signals()
        self._held.stop = self._stop

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """The optimizer step, the sync mode's parameter work for the model it stepped, then the coordinated stop
        check (every rank raises :class:`~mpistrategy.strategy.failures.StopRequested` together after a stop
        signal)."""
        owners = [engine for _, engine in self._engines if any(optimizer is mine for mine in engine.optimizers)]
        steps = [engine.optimizer_steps for engine in owners]
        self._stepping = True
        try:
            output = super().optimizer_step(optimizer, **kwargs)
        finally:
            self._stepping = False
        for engine, before in zip(owners, steps, strict=True):
            engine.complete_step(optimizer, before)
        self._install_stop_signals()
        self._stop_if_requested()
        return output

    def _stop_if_requested(self) -> None:
        """The coordinated stop check after an optimizer step (collective): raise ``StopRequested`` on every rank if
        a rank received a stop signal."""
        signum = self._decide_stop()
        if signum:
            name = signal.Signals(signum).name
            if self.is_global_zero:
                log.warning("mpi_ad: %s received; every rank stops after this optimizer step.", name)
            raise failures.mark_coordinated_stop(failures.StopRequested(name))

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
        sharded = self._sharded_optimizer(optimizer)
        if sharded is not None:
            self.precision.unscale_gradients(optimizer)
            return sharded.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: torch.optim.Optimizer, clip_val: float | int) -> None:
        """Fabric's clipping by value; a sharded optimizer's pieces first take the parameters' current ``.grad``
        (none on this rank: nothing to clip)."""
        sharded = self._sharded_optimizer(optimizer)
        if sharded is None or sharded.gradients():
            super().clip_gradients_value(module, optimizer, clip_val)

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
        differ between ranks. A sharded optimizer's entry is a manifest; the ranks of one copy of its state write
        their shard files beside ``path`` first (see :mod:`~mpistrategy.strategy.sharding.checkpoint`). The stall
        watchdog reports a rank that goes on without saving while another saves."""
        watchdog.entered_every_rank_call("fabric.save", checkpoints.FABRIC_SAVE_ON_EVERY_RANK)
        unsharded = {
            key: sharded_checkpoint.placeholder() if self._sharded_optimizer(obj) else obj for key, obj in state.items()
        }
        checkpoint = self._convert_stateful_objects_in_state(unsharded, filter=filter or {})
        engine_states = [engine.state_dict() for _, engine in self._engines]
        if any(_carries_state(engine_state) for engine_state in engine_states):
            names = [next((k for k, obj in state.items() if obj is module), None) for module, _ in self._engines]
            checkpoint[checkpoints.KEY] = {"engines": engine_states, "models": names}
        token = self._save_optimizer_shards(state, checkpoint, os.fspath(path))
        save = functools.partial(self.checkpoint_io.save_checkpoint, storage_options=storage_options)
        checkpoints.write_on_rank_zero(checkpoint, path, save, self.topology.control)
        if self.is_global_zero:
            sharded_checkpoint.committed(os.fspath(path), token)

    def _sharded_optimizer(self, optimizer: Any) -> ShardedOptimizer | None:
        """The sharded form of ``optimizer``, if it is an optimizer some model's engine shards (its
        ``state_dict()`` is then the state of this rank's pieces)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            return None
        for sharding in self._shardings():
            sharded = sharding.sharded(optimizer) if sharding is not None else None
            if sharded is not None:
                return sharded
        return None

    def _shardings(self) -> list[ShardedTraining | None]:
        """Each model's sharding (``None``: unsharded), in the order the models were set up; after teardown, those
        of the models torn down (their optimizers keep their pieces)."""
        return [engine.sharding for _, engine in self._engines] if self._engines else self._torn_down

    def _save_optimizer_shards(self, state: dict[str, Any], checkpoint: Checkpoint, path: str) -> str | None:
        """Collective: each model's sharded optimizers in ``state`` write their shard files (part: the model's
        number) and rank 0 puts their manifests into ``checkpoint``; returns the save's token (``None``: nothing
        sharded to save)."""
        optimizers = [(name, obj) for name, obj in state.items() if isinstance(obj, torch.optim.Optimizer)]
        parts = []
        for part, sharding in enumerate(self._shardings()):
            found = [(name, sharding.sharded(obj)) for name, obj in optimizers] if sharding is not None else []
            named = [(name, sharded) for name, sharded in found if sharded is not None]
            if named:
                parts.append((part, sharding, named))
        if not parts:
            return None
        control = self.topology.control
        token = sharded_checkpoint.new_token(control)
        for part, sharding, named in parts:
            assert sharding is not None
            mine = [sharded for _, sharded in named]
            manifests = sharded_checkpoint.save(path, mine, sharding.group, control, token, part)
            for (name, _), manifest in zip(named, manifests, strict=True):
                if self.is_global_zero and name in checkpoint:
                    checkpoint[name] = manifest
        return token

    def load_checkpoint(
        self,
        path: Any,
        state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> Checkpoint:
        """Collective: every rank verifies and reads the checkpoint (a corrupt one raises
        ``CorruptCheckpointError`` on every rank) and restores ``state`` from it as Fabric does; then the engines'
        state and this rank's replica (for models not set up yet: when they are). A sharded optimizer loads the
        pieces of its shard from the shard files, re-sharded if the checkpoint has another number of shards; an
        unsharded one loads a sharded checkpoint's state consolidated, and so does the optimizer state in what is
        returned (the checkpoint's entries not in ``state``; all of them without ``state``)."""
        load = functools.partial(self.checkpoint_io.load_checkpoint, weights_only=weights_only)
        checkpoint = checkpoints.read(path, load, self.topology.control)
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):  # a raw state dict (``fabric.load_raw``)
            if isinstance(state, torch.optim.Optimizer):
                (entry,) = self._restore_optimizers([state], [checkpoint], path)
                return {} if entry is None else self._restore(entry, state, strict)
            return self._restore(checkpoint, state, strict)
        ours = checkpoint.pop(checkpoints.KEY, None)
        assigned = _assign_engine_states(ours or {}, state if isinstance(state, dict) else {})
        engines = [_paired(self._engines, target, index) for index, (target, _) in enumerate(assigned)]
        for engine, (_, engine_state) in zip(engines, assigned, strict=True):
            if engine is not None:
                engine.load_state_dict(engine_state)
        restored: set[str] = set()
        if state:
            names = [n for n, obj in state.items() if isinstance(obj, torch.optim.Optimizer) and n in checkpoint]
            entries = self._restore_optimizers([state[n] for n in names], [checkpoint[n] for n in names], path)
            for name, entry in zip(names, entries, strict=True):
                if entry is None:
                    restored.add(name)
                else:
                    checkpoint[name] = entry
        remainder = self._restore(checkpoint, state, strict, restored)
        sharded_checkpoint.consolidate_entries(remainder, os.fspath(path))
        for engine, (_, engine_state) in zip(engines, assigned, strict=True):
            if engine is not None:
                engine.restore_replica(engine_state)
        self._pending_states = assigned
        return remainder

    def _restore_optimizers(self, optimizers: list[Any], entries: list[Any], path: Any) -> list[Any]:
        """Collective: load the sharded ones of ``optimizers`` from their ``entries``; returns what the others
        load (``None`` for the sharded ones; see :func:`~mpistrategy.strategy.sharding.checkpoint.restore`)."""
        return sharded_checkpoint.restore(
            optimizers, entries, os.fspath(path), self._sharded_optimizer, self.topology.control
        )

    def _restore(
        self,
        checkpoint: Checkpoint,
        state: nn.Module | torch.optim.Optimizer | dict[str, Any] | None,
        strict: bool,
        restored: set[str] | frozenset[str] = frozenset(),
    ) -> Checkpoint:
        """Restore ``state`` from ``checkpoint`` with Fabric's rules, but for the names in ``restored`` (loaded
        already); returns what was not restored."""
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
            if name in restored:
                continue
            if isinstance(obj, nn.Module):
                self.load_module_state_dict(module=obj, state_dict=value, strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(value)
            else:
                state[name] = value
        return checkpoint

    # ------------------------------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        self._torn_down = self._shardings()
        self._held.release()
        super().teardown()

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(world_size={self.world_size}, sync={self.sync!r}, aggregator={self.aggregator!r})"


class _RoutedZeroGrad:
    """Mixed into an optimizer's class by :meth:`MPIADFabricStrategy._route_zero_grad`."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        optimizer = vars(self).get("_optimizer", self)  # Fabric's wrapper holds the optimizer as ``_optimizer``
        own = vars(optimizer).get("zero_grad")
        if own is not None:
            own(set_to_none)
        else:
            super().zero_grad(set_to_none)  # type: ignore[misc]


_ROUTED_CLASSES: dict[type, type] = {}


def _routed_class(original: type) -> type:
    """``original`` with :class:`_RoutedZeroGrad`'s ``zero_grad``, under the same name (one class per original)."""
    if original not in _ROUTED_CLASSES:
        namespace = {"__module__": original.__module__, "__qualname__": original.__qualname__}
        _ROUTED_CLASSES[original] = type(original.__name__, (_RoutedZeroGrad, original), namespace)
    return _ROUTED_CLASSES[original]


def _assign_engine_states(
    saved: dict[str, Any], state: dict[str, Any]
) -> list[tuple[nn.Module | None, dict[str, Any]]]:
    """Each engine state of a checkpoint (``saved``, the strategy's entry) with the model it belongs to in the
    ``state`` being loaded: the model under the name it was saved with (so that models set up in another order, or
    a new model loaded in place of the trained one, get their own sync state and replica), or ``None`` (by setup
    order) where the checkpoint names none or ``state`` has no model under that name."""
    engine_states = list(saved.get("engines", []))
    names = list(saved.get("models", [])) + [None] * len(engine_states)
    targets = [state.get(name) if name is not None else None for name in names]
    return [
        (target if isinstance(target, nn.Module) else None, engine_state)
        for target, engine_state in zip(targets, engine_states, strict=False)
    ]


def _paired(pairs: Sequence[tuple[nn.Module | None, V]], module: nn.Module | None, index: int) -> V | None:
    """What ``pairs`` (``(model or None, value)``, in setup order) holds for ``module``, set up ``index``-th: the
    value of the pair whose model is ``module``; else the ``index``-th pair's where either names no model (the
    engines of set-up models for a saved state that names none, the saved states that name none for a model)."""
    if module is not None:
        for model, value in pairs:
            if model is module:
                return value
    if index < len(pairs) and (module is None or pairs[index][0] is None):
        return pairs[index][1]
    return None


def _carries_state(engine_state: dict[str, Any]) -> bool:
    """Whether an engine's :meth:`~DataParallelEngine.state_dict` holds anything a resume needs."""
    return bool(
        engine_state.get("sync", {}).get("state") or engine_state.get("aggregator") or "replicas" in engine_state
    )
