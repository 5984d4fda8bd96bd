"""The ``mpi_ad`` Lightning strategy: data-parallel training over MPI with differentiable collectives.

``Trainer(strategy="mpi_ad")`` (or ``strategy=MPIADStrategy(...)``) under ``mpiexec -n N python train.py``,
``srun --mpi=pmi2 python train.py`` or a plain ``python train.py``: no MASTER_ADDR, ports or torch.distributed.
This class only overrides the Trainer's hooks and delegates; what it shares with the Fabric strategy (options,
ranks, devices, collectives, engine construction, failure handling) is :class:`~mpistrategy.strategy.base.
MPIStrategyBase`:

- ranks and nodes: :class:`~mpistrategy.strategy.environment.MPIEnvironment` (from MPI, also under srun);
- gradients and model averaging: :class:`~mpistrategy.strategy.engine.DataParallelEngine`, the Trainer-independent
  core: gradient buckets (:class:`~mpistrategy.strategy.reducer.GradientReducer`) whose non-blocking combination
  starts during backward and is finished as it returns, before ``on_after_backward`` (as under DDP; no sync
  inside ``block_backward_sync``, i.e. on the intermediate micro-batches of gradient accumulation), a pluggable
  :class:`~mpistrategy.aggregation.Aggregator` (default: :class:`~mpistrategy.aggregation.MeanAggregator`), and a
  step-level :class:`~mpistrategy.sync.SyncMode` (``sync=``: ``flat`` by default, ``hierarchical``,
  ``local_sgd``, ``hierarchical_local_sgd``, ``daso``, ``gossip``) that picks whose gradients each step averages
  and averages models after the optimizer step; bytes sent per step are logged as ``comm/*bytes_per_step``;
- ``reduce``, ``all_gather``, ``broadcast``, ``barrier``, torchmetrics sync, the initial broadcast of parameters and
  buffers from rank 0: :mod:`~mpistrategy.strategy.sync`;
- ``sync_batchnorm=True``: :class:`mpistrategy.nn.SyncBatchNorm`, built on the differentiable allreduce;
- failures and stop signals: :mod:`~mpistrategy.strategy.failures`.

Checkpoints (:mod:`~mpistrategy.strategy.checkpoints`): rank 0 writes them atomically, sealed with a SHA-256;
every rank verifies and reads them and the ranks agree on the outcome, so a corrupt file stops every rank with an
error naming it. They carry the sync mode's and aggregator's state and every rank's random state. The training
dataloader is made resumable (:mod:`~mpistrategy.strategy.resumable`): after a stop checkpoint, training continues
with the batch after the last one trained, with the random state of that moment, exactly as if it had not stopped.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import os
import signal
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

try:
    from lightning.pytorch.strategies import ParallelStrategy
except ImportError:  # the core install has no Lightning
    from mpistrategy.extras import require

    require("lightning", "mpistrategy's Trainer strategy (mpi_ad)")
    raise
from torch import Tensor

from mpistrategy.comm import watchdog
from mpistrategy.strategy import checkpoint_files, checkpoints, failures, passes, random_state
from mpistrategy.strategy.base import MPIStrategyBase
from mpistrategy.strategy.engine import DataParallelEngine
from mpistrategy.strategy.framework import LIGHTNING, framework
from mpistrategy.strategy.reducer import GradientReducer
from mpistrategy.strategy.resumable import CountedLoader, make_resumable, unwrapped
from mpistrategy.strategy.sharding import checkpoint as sharded_checkpoint
from mpistrategy.strategy.sharding import files as sharded_files
from mpistrategy.strategy.sharding import lightning_hooks
from mpistrategy.strategy.sharding.optimizer import ShardedOptimizer
from mpistrategy.strategy.sharding.training import ShardedTraining

log = logging.getLogger(__name__)

_RESUME_END = "_CheckpointConnector.resume_end"  # Lightning's barrier before it installs its signal handlers

CHECKPOINT_KEY = checkpoints.KEY


def _param_group_callback_problem(trainer: Any) -> ValueError | None:
    """The error to raise if a callback adds parameter groups while training, which a sharded optimizer cannot
    take (Lightning's BaseFinetuning and its subclasses), else ``None``."""
    for callback in trainer.callbacks:
        if any(base.__name__ == "BaseFinetuning" for base in type(callback).__mro__):
            return ValueError(
                f"shard (sharded optimizer state): the callback {type(callback).__name__} adds parameter groups to "
                "the optimizer while training (a BaseFinetuning callback), which a sharded optimizer does not "
                "support. Use shard=None with it, or freeze and unfreeze the backbone yourself (requires_grad) with "
                "every parameter in configure_optimizers' groups from the start."
            )
    return None


_fits = itertools.count()  # this process's fits, the same sequence on every rank (the watchdog's training passes)


class MPIADStrategyMixin(MPIStrategyBase):
    """The Trainer strategy's implementation, shared by the ``lightning.pytorch`` and ``pytorch_lightning`` classes.

    Takes the arguments of :class:`~mpistrategy.strategy.base.MPIStrategyBase` (Lightning's five, the last one
    called ``precision_plugin`` here as in the Trainer's strategies; ``aggregator``, ``sync``,
    ``ranks_per_node``, ``node_transport``, ``bucket_cap_mb``, ``first_bucket_cap_mb``, ``own_bucket_mb``,
    ``data_parallel``, ``abort_on_exception``, ``stop_signals``, ``set_num_threads``) and:

    Args:
        log_traffic: log the payload bytes this rank sent in each optimizer step (``comm/bytes_per_step``, split
            into ``comm/node_bytes_per_step`` and ``comm/inter_node_bytes_per_step``; rank 0's values) on the
            steps the Trainer's loggers record (every ``log_every_n_steps``; never without a logger).
        log_memory: on the same steps, log the bytes every rank holds for the model's parameters, gradients and
            optimizer state (``memory/rank<r>/param_bytes``, ``.../grad_bytes``, ``.../optimizer_state_bytes``,
            measured from the tensors: see :mod:`~mpistrategy.strategy.sharding.memory`), gathered to rank 0.
        checkpoint_on_stop: save a checkpoint (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, which
            ``fit(ckpt_path="hpc")`` resumes from, continuing exactly where it stopped) before a coordinated stop;
            ``fit`` then raises ``SIGTERMException`` with exit code
            :data:`~mpistrategy.strategy.failures.STOPPED_EXIT_CODE` (75).
    """

    _framework_name: str = LIGHTNING

    if TYPE_CHECKING:  # provided by the Trainer's ParallelStrategy this class is mixed into
        accelerator: Any
        model: Any
        precision_plugin: Any
        checkpoint_io: Any
        lightning_module: Any
        is_global_zero: bool
        optimizers: list[Any]
        _lightning_optimizers: list[Any]
        _layer_sync: Any

        def setup_optimizers(self, trainer: Any) -> None: ...

        def setup_precision_plugin(self) -> None: ...

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Any = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        log_traffic: bool = True,
        log_memory: bool = True,
        checkpoint_on_stop: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision_plugin,
            **options,
        )
        self.log_traffic = log_traffic
        self.log_memory = log_memory
        self.checkpoint_on_stop = checkpoint_on_stop
        self._checked_step = (-1, -1)  # (global step, the engine's optimizer steps) at the last stop check
        self._engine: DataParallelEngine | None = None
        #: the engine of the last fit, torn down: a checkpoint saved after ``fit`` still holds its state
        self._finished_engine: DataParallelEngine | None = None
        self._engine_state: dict[str, Any] | None = None
        self._epoch: int | None = None
        self._sync_gradients = True
        self._layer_sync_applied: Any = None
        self._random_state_to_restore: random_state.RandomState | None = None
        self._random_state_at_epoch_end = False
        self._unroute: Callable[[], None] | None = None  # gives Lightning's objects their own methods back
        self._checkpoint_path: str | None = None
        self._checkpoint_read = False  # by this run, before setup: the ranks without one check that none has
        self._sharding: ShardedTraining | None = None  # kept after fit: a checkpoint saved then needs it
        self._fit_index = -1
        self._training_pass = (-1, -1)  # (fit, epoch) of the training dataloader's current pass
        self._pass_offset = 0  # the batches of its epoch done before it began (a resumed epoch)
        self._one_loader = True  # whether fit has one training loader (whose data's end is the epoch's)

    @property
    def _fw(self):
        return framework(self._framework_name)

    # --------------------------------------------------------------------------------------------- setup

    def setup(self, trainer: Any) -> None:
        fw = self._fw
        assert self.accelerator is not None and self.model is not None
        checkpoints.check_none_read(self.topology.control, self._checkpoint_read)
        self._checkpoint_read = False
        self.accelerator.setup(trainer)
        self._fit_index = next(_fits)
        fitting = self._fitting()
        if fitting and self._layer_sync is not None:
            layer_sync = self._layer_sync
            if isinstance(layer_sync, fw.TorchSyncBatchNorm):
                layer_sync = fw.MPISyncBatchNorm()
            self.model = layer_sync.apply(self.model)
            self._layer_sync_applied = layer_sync
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.broadcast_module_state(self.model)
        if fitting:
            problem = _param_group_callback_problem(trainer) if self.shard is not None else None
            self.setup_optimizers(trainer)
            if self.world_size > 1 and self.data_parallel:  # the engine's option agreement raises it on every rank
                self._engine = self._build_engine(self.model, self.optimizers, problem=problem)
                self._finished_engine = None
                if self._engine_state is not None:
                    self._engine.load_state_dict(self._engine_state)
                    self._engine_state = None
            else:
                failures.raise_together(problem, self.topology.control, "setting up shard=", ValueError)
        self.setup_precision_plugin()
        if fitting:
            fw.optimizers_to_device(self.optimizers, self.root_device)
            self._sharding = None if self._engine is None else self._engine.sharding
            if self._engine is not None:
                for optimizer, wrapper in zip(self.optimizers, self._lightning_optimizers, strict=True):
                    self._engine.attach_optimizer(optimizer, wrapper)
            if self._sharding is not None:
                self._unroute = lightning_hooks.route(self._sharding, self.precision_plugin, self.lightning_module)
                if self._uses_grad_scaler():
                    self._sharding.watch_scaler(self.precision_plugin.scaler)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------------------------- gradient sync

    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._engine is not None:
            self._engine.pre_backward(self._sync_gradients, closure_loss)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's backward, with the gradient sync finished as the backward pass returns, as under DDP: every
        ``on_after_backward`` (also after ``manual_backward``) reads and edits the averaged gradients."""
        self.pre_backward(closure_loss)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        if self._engine is not None:
            self._engine.post_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)  # type: ignore[attr-defined]
        return closure_loss

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)  # type: ignore[misc]
        if self._engine is not None and self._engine.sync.uses_loss:
            self._engine.record_loss(output.get("loss") if isinstance(output, dict) else output)
        return output

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """The optimizer step, then the sync mode's model averaging; logs the step's bytes."""
        steps = self._engine.optimizer_steps if self._engine is not None else 0
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        if self._engine is not None:
            self._engine.complete_step(optimizer, steps)
            if (self.log_traffic or self.log_memory) and self._writes_logs_this_step():
                self._log_step_figures(self._engine)
        return output

    def _log_step_figures(self, engine: DataParallelEngine) -> None:
        """Log the step's bytes sent (this rank's) and every rank's memory (gathered to every rank, so that every
        rank holds the same metric names, which callbacks may monitor; collective)."""
        figures: dict[str, float] = {}
        if self.log_traffic:
            node, inter_node = engine.last_step_traffic
            figures["comm/bytes_per_step"] = float(node + inter_node)
            figures["comm/node_bytes_per_step"] = float(node)
            figures["comm/inter_node_bytes_per_step"] = float(inter_node)
        if self.log_memory:
            reports = self.topology.control.allgather(engine.memory().as_dict())
            for rank, report in enumerate(reports):
                figures.update({f"memory/rank{rank}/{name}": float(value) for name, value in report.items()})
        self.lightning_module.log_dict(figures, on_step=True, on_epoch=False, rank_zero_only=True)

    def _writes_logs_this_step(self) -> bool:
        """Whether a logger records this step's values: Lightning writes step values every ``log_every_n_steps``
        only, and handling a logged value costs about a millisecond here, a tenth of a small model's step."""
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None or not trainer.loggers:
            return False
        return bool(getattr(trainer._logger_connector, "should_update_logs", True))

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradients accumulate locally inside this context (no communication)."""
        previous = self._sync_gradients
        self._sync_gradients = False
        try:
            yield None
        finally:
            self._sync_gradients = previous

    @property
    def reducer(self) -> GradientReducer | None:
        """The gradient buckets while fitting with more than one rank, else ``None``."""
        return self._engine.reducer if self._engine is not None else None

    # -------------------------------------------------------------------------------------- collectives

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """The Trainer's name for :meth:`~mpistrategy.strategy.base.MPIStrategyBase.all_reduce`."""
        return self.all_reduce(tensor, group, reduce_op)

    # -------------------------------------------------------------------------------------- checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state: the first step of ``trainer.save_checkpoint``, which every rank must call (the stall
        watchdog tells the other ranks that this one entered it, and reports a rank that goes on without it)."""
        watchdog.entered_every_rank_call("trainer.save_checkpoint", checkpoints.SAVE_ON_EVERY_RANK)
        return super().lightning_module_state_dict()  # type: ignore[misc]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Collective: rank 0 writes ``checkpoint`` atomically, sealed with a SHA-256, with the sync mode's and the
        aggregator's state and every rank's random state added (see :mod:`~mpistrategy.strategy.checkpoints`);
        sharded optimizers' shards go to shard files beside it first (see :mod:`~mpistrategy.strategy.sharding.
        checkpoint`)."""
        engine = self._engine or self._finished_engine
        state = engine.state_dict() if engine is not None else {}
        checkpoints.add_state(checkpoint, state, self.topology.control)
        token = self._save_optimizer_shards(checkpoint, filepath)
        if not self.is_global_zero:
            return
        save = functools.partial(self.checkpoint_io.save_checkpoint, storage_options=storage_options)
        checkpoints.write(checkpoint, filepath, save, isinstance(self.checkpoint_io, self._fw.AsyncCheckpointIO))
        sharded_checkpoint.committed(os.fspath(filepath), token)

    def _save_optimizer_shards(self, checkpoint: dict[str, Any], filepath: Any) -> str | None:
        """Collective: write the sharded optimizers' shard files and put their manifests into ``checkpoint`` (on
        rank 0); returns the save's token (``None``: nothing sharded to save)."""
        sharding = self._sharding
        entries = checkpoint.get("optimizer_states")
        if sharding is None or not entries:
            return None
        control = self.topology.control
        token = sharded_checkpoint.new_token(control)
        sharded = [sharding.sharded(optimizer) for optimizer in self.optimizers]
        mine = [s for s in sharded if s is not None]
        manifests = iter(sharded_checkpoint.save(os.fspath(filepath), mine, sharding.group, control, token))
        if self.is_global_zero:
            checkpoint["optimizer_states"] = [
                next(manifests) if s else e for s, e in zip(sharded, entries, strict=True)
            ]
        return token

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """A sharded optimizer's state goes to shard files when the checkpoint is saved: a placeholder here."""
        if self._sharded_optimizer(optimizer) is not None:
            return sharded_checkpoint.placeholder()
        return super().optimizer_state(optimizer)  # type: ignore[misc]

    def _sharded_optimizer(self, optimizer: Any) -> ShardedOptimizer | None:
        return None if self._sharding is None else self._sharding.sharded(optimizer)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0 removes the checkpoint file and, unless ``filepath`` is a link, its shard files."""
        path = checkpoint_files.local_path(os.fspath(filepath))
        owns_shards = self.is_global_zero and not os.path.islink(path)
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        if owns_shards:
            sharded_files.remove(path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: every rank verifies and reads the checkpoint (the lowest rank that sees the file reads and
        broadcasts it if some rank cannot see it); a corrupt file raises :class:`~mpistrategy.strategy.
        checkpoint_files.CorruptCheckpointError`, a file no rank sees ``FileNotFoundError`` and different paths on
        different ranks ``ValueError``, on every rank (:func:`~mpistrategy.strategy.checkpoints.read`)."""
        load = functools.partial(self.checkpoint_io.load_checkpoint, weights_only=weights_only)
        self._checkpoint_read = True
        checkpoint = checkpoints.read(checkpoint_path, load, self.topology.control)
        self._checkpoint_path = checkpoint_files.local_path(os.fspath(checkpoint_path))
        if not self._fitting():  # validate, test, predict: the weights only (no sync state, replicas, random state)
            return checkpoint
        state = checkpoint.get(CHECKPOINT_KEY)
        if state:
            if self._engine is not None:
                self._engine.load_state_dict(state)
            else:
                self._engine_state = state  # for the engine fit builds next
        self._random_state_to_restore = checkpoints.random_state_of(checkpoint, self.global_rank, self.world_size)
        self._random_state_at_epoch_end = checkpoints.saved_at_epoch_end(checkpoint)
        return checkpoint

    def _fitting(self) -> bool:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer is not None and trainer.state.fn == self._fw.TrainerFn.FITTING

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The optimizer states (a sharded optimizer's pieces from the shard files, re-sharded if the checkpoint
        has another number of shards; a sharded checkpoint's state consolidated for an unsharded optimizer), then
        this rank's own replica where the sync mode keeps one (collective)."""
        entries = sharded_checkpoint.restore(
            self.optimizers,
            checkpoint["optimizer_states"],
            self._checkpoint_path,
            self._sharded_optimizer,
            self.topology.control,
        )
        for optimizer, entry in zip(self.optimizers, entries, strict=False):
            if entry is not None:
                optimizer.load_state_dict(entry)
        self._fw.optimizers_to_device(self.optimizers, self.root_device)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state and self._engine is not None:
            self._engine.restore_replica(state)

    # -------------------------------------------------------------------------------------- dataloaders

    def process_dataloader(self, dataloader: object) -> object:
        """The training dataloader of ``fit`` becomes a :class:`~mpistrategy.strategy.resumable.ResumableLoader`
        when its order can be resumed (Lightning's ``DistributedSampler``), else a
        :class:`~mpistrategy.strategy.resumable.CountedLoader`; other dataloaders are unchanged."""
        module = self.lightning_module
        if not self._fitting() or not module.trainer.training:
            return dataloader
        if "dataloader_iter" in inspect.signature(module.training_step).parameters:
            return dataloader  # the step pulls its batches itself: no place before each fetch
        restoring = lambda: self._random_state_to_restore is not None  # noqa: E731
        hooks = (self._before_training_pass, self._training_pass_ended, restoring)
        resumable = make_resumable(dataloader, self._before_training_batch, *hooks)
        return CountedLoader(unwrapped(dataloader), *hooks) if resumable is None else resumable

    # -------------------------------------------------------------------------------------- failures

    def on_exception(self, exception: BaseException) -> None:
        """Abort every rank (after printing the traceback) unless every rank raises an exception together: a
        coordinated stop, a corrupt checkpoint or a configuration error all ranks agreed on, or an error every rank
        raised in step within :data:`~mpistrategy.strategy.failures.RAISED_TOGETHER_SECONDS` (an invalid
        hyperparameter of a sweep's point: the ranks are free to run the next point)."""
        passes.leave_evaluation()
        if not self.abort_on_exception:
            return
        if failures.raised_on_every_rank(exception) or watchdog.every_rank_raised(failures.RAISED_TOGETHER_SECONDS):
            failures.mark_raised_on_every_rank(exception)
            failures.record_desync(exception)
            return
        failures.abort(exception)

    def setup_environment(self) -> None:
        """Before Lightning's setup: ``seed_everything``'s seed again, as DDP sets it (dropout draws DDP's masks); a
        stop signal from here on (data, setup hooks, checkpoint loading) stops every rank at the first steps."""
        super().setup_environment()
        self._fw.reset_seed()
        if self._fitting():
            self._install_stop_signals()

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        super().barrier(name, *args, **kwargs)
        if name == _RESUME_END:  # Lightning installs its handlers next, keeping the ones it finds for after fit:
            self._release_stop_signals()  # give the signals back (a received one stays recorded; retaken below)

    def on_train_start(self) -> None:
        self._install_stop_signals()
        self._checked_step = (-1, -1)  # (global step, the engine's optimizer steps) at the last stop check
        failures.set_training(True)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before each batch: rank 0's buffers (:meth:`_share_buffers`), the sync mode's epoch boundaries; then, for
        a training dataloader that is not resumable (its batch is fetched already), :meth:`_before_training_batch`;
        the watchdog learns where this rank is in the pass. The evaluation pass recorded last is over."""
        self._share_buffers()
        passes.leave_evaluation()
        if self._engine is not None and self.lightning_module is not None:
            self._track_epoch(self.lightning_module.trainer)
            self._engine.step_check.begin_batch()
        self._before_training_batch()
        watchdog.training_batch_started(self._training_pass, batch_idx + 1)

    def _before_training_pass(self) -> None:
        """At the first fetch of a pass over the training dataloader, before its iterator draws from the random
        generators: after a resume from a checkpoint saved at the end of an epoch (before the next epoch's iterator
        drew), restore this rank's random state here; one saved within an epoch is restored before the first batch
        (:meth:`_before_training_batch`). A new pass (fit, epoch) for the watchdog, which learns the number of
        batches the epoch will have where Lightning knows it (a sized loader, or ``limit_train_batches``); where
        every rank knows it exactly, the ranks compare it at once (:mod:`~mpistrategy.strategy.passes`)."""
        if self._random_state_at_epoch_end and self._random_state_to_restore is not None:
            random_state.restore(self._random_state_to_restore)
            self._random_state_to_restore = None
        trainer = self.lightning_module.trainer
        training_pass = (self._fit_index, trainer.current_epoch)
        if training_pass == self._training_pass:
            return  # another loader of the same epoch (several training loaders, one cycled)
        self._training_pass = training_pass
        self._pass_offset = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # > 0: an epoch resumed
        loaders = trainer.train_dataloader
        self._one_loader = len(passes.training_loaders(loaders)) == 1
        if trainer.num_training_batches != float("inf"):
            watchdog.training_batches(training_pass, int(trainer.num_training_batches), "planned")
        passes.check_even_batches(trainer, loaders, self.topology.control)

    def _training_pass_ended(self, batches: int) -> None:
        """The training data of this pass ended after ``batches`` batches: every rank's watchdog is told (a rank
        beyond it waiting for this one is reported at once). With several training loaders, the end of one is not
        the epoch's (Lightning may cycle it)."""
        if self._one_loader:
            watchdog.training_batches(self._training_pass, self._pass_offset + batches, "ended")

    def _before_training_batch(self) -> None:
        """Before a training batch is fetched (resumable dataloaders) or used (others), on every rank: the first
        time after a resume, restore this rank's random state; after an optimizer step, the coordinated stop
        check."""
        if self._random_state_to_restore is not None:
            random_state.restore(self._random_state_to_restore)
            self._random_state_to_restore = None
        if self._stop is not None and self.lightning_module is not None:
            trainer = self.lightning_module.trainer
            step = (trainer.global_step, self._engine.optimizer_steps if self._engine is not None else 0)
            if step != self._checked_step:
                self._checked_step = step
                self._check_stop(trainer)

    def _track_epoch(self, trainer: Any) -> None:
        """Tell the sync mode when an epoch ends and the next begins (its index, optimizer steps, total epochs)."""
        assert self._engine is not None
        epoch = trainer.current_epoch
        if epoch == self._epoch:
            return
        if self._epoch is not None:
            self._engine.end_epoch()
        batches = trainer.num_training_batches
        steps = None if batches == float("inf") else -(-int(batches) // max(1, trainer.accumulate_grad_batches))
        total = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        self._engine.begin_epoch(epoch, steps, total)
        self._epoch = epoch

    def on_train_end(self) -> None:
        passes.check_training_end(self.lightning_module.trainer)
        self._release_stop_signals()
        failures.set_training(False)

    def on_validation_start(self) -> None:
        """Validation in ``fit`` (the sanity check first) already turns stop signals into a coordinated stop, decided
        at the first training batch: a preemption there is not a failure of one rank."""
        self._start_evaluation("validation")
        if self._fitting():
            self._install_stop_signals()

    def on_test_start(self) -> None:
        self._start_evaluation("test")

    def on_predict_start(self) -> None:
        self._start_evaluation("predict")

    def _start_evaluation(self, stage: str) -> None:
        """Give every rank rank 0's buffers (see :meth:`_share_buffers`);
        record the pass and its batches per dataloader, so that a collective mismatch or a stall in it names ranks
        whose evaluation data differs."""
        self._share_buffers()
        passes.begin_evaluation(self.lightning_module.trainer, stage)

    def _share_buffers(self) -> None:
        """Collective, before each training batch and evaluation pass where the ranks hold one replica (``flat``,
        ``hierarchical``): every rank gets rank 0's buffers, as DDP broadcasts them before its forward passes (a
        training forward pass updates buffers with its rank's batch: BatchNorm's statistics, a running mean)."""
        engine, module = self._engine, self.lightning_module
        if engine is None or module is None or self.world_size == 1 or engine.sync.replicas != "world":
            return
        self.share_buffers(module)

    def on_validation_end(self) -> None:
        passes.end_evaluation()

    on_test_end = on_predict_end = on_validation_end

    def _check_stop(self, trainer: Any) -> None:
        """Between two optimizer steps, on every rank: stop together if any rank received a stop signal. Called
        before a batch when an optimizer stepped since the last check (the global step, or the engine's count, which
        has the steps of the torch optimizer itself too, moved): never in the middle of a gradient accumulation, and
        the same on every rank. The decision lags one check behind the signal. The checkpoint (with the random state
        of this moment) resumes with the batch about to be fetched."""
        signum = self._decide_stop()
        if not signum:
            return
        name = signal.Signals(signum).name
        path = None
        if self.checkpoint_on_stop:
            path = self.broadcast(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir), 0)
            trainer.save_checkpoint(path)
        if self.is_global_zero:
            saved = f", checkpoint saved to {path}" if path else ""
            log.warning(f"mpi_ad: {name} received; all ranks stop at global step {trainer.global_step}{saved}.")
        raise failures.mark_coordinated_stop(self._fw.SIGTERMException(failures.STOPPED_EXIT_CODE))

    # -------------------------------------------------------------------------------------- teardown

    def teardown(self) -> None:
        self._random_state_to_restore = self._engine_state = None
        if self._unroute is not None:
            self._unroute()
            self._unroute = None
        if self._engine is not None:
            self._engine.teardown()
            self._finished_engine, self._engine = self._engine, None
        self._epoch = None
        self._release_stop_signals()
        if self._layer_sync_applied is not None and self.model is not None:
            self.model = self._layer_sync_applied.revert(self.model)
            self._layer_sync_applied = None
        super().teardown()

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(world_size={self.world_size}, sync={self.sync!r}, aggregator={self.aggregator!r})"


class MPIADStrategy(MPIADStrategyMixin, ParallelStrategy):
    """Data-parallel training over MPI for ``lightning.pytorch`` (see :class:`MPIADStrategyMixin` for options)."""
