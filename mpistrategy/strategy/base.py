"""What the Trainer's and Fabric's ``mpi_ad`` strategies share: options, ranks, devices, collectives, engines.

:class:`MPIStrategyBase` is a mixin placed before Lightning's ``ParallelStrategy`` (the Trainer's in
:mod:`~mpistrategy.strategy.mpi_ad`, Fabric's in :mod:`~mpistrategy.strategy.fabric_mpi_ad`). It only uses what
both ``ParallelStrategy`` classes have (cluster environment, parallel devices, ranks) and never imports the
Trainer:

- ranks and nodes come from MPI (:class:`~mpistrategy.strategy.environment.MPIEnvironment`, also under srun);
  ``devices=`` and ``num_nodes=`` that disagree with the MPI world are reported once and the devices Lightning
  reports follow the MPI world (:meth:`MPIStrategyBase.follow_launch`);
- ``all_reduce``/``all_gather``/``broadcast``/``barrier``/``reduce_boolean_decision`` over MPI
  (:mod:`~mpistrategy.strategy.sync`);
- the data-parallel engine of a module (:class:`~mpistrategy.strategy.engine.DataParallelEngine`: the initial
  broadcast of rank 0's parameters and buffers, gradient buckets, sync mode);
- failures: an exception on one rank aborts every rank, ``os._exit`` is reported
  (:mod:`~mpistrategy.strategy.failures`); the stop signals every rank acts on together.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mpistrategy.aggregation.base import Aggregator
from mpistrategy.aggregation.registry import aggregator_from
from mpistrategy.comm import flight, stall_settings
from mpistrategy.comm.communicator import world
from mpistrategy.comm.topology import Topology
from mpistrategy.comm.traffic import TrafficCounter
from mpistrategy.strategy import conventions, failures, sync
from mpistrategy.strategy.engine import DataParallelEngine
from mpistrategy.strategy.environment import MPIEnvironment
from mpistrategy.strategy.sharding.optimizer import ShardedOptimizer
from mpistrategy.strategy.sharding.options import check_shard
from mpistrategy.sync import SyncMode, build_sync
from mpistrategy.sync.transport import NODE_TRANSPORTS

DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class MPIStrategyBase:
    """The part of the ``mpi_ad`` strategy that the Trainer and Fabric share (see the module docstring).

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: as for any Lightning
            parallel strategy (the Trainer calls the last one ``precision_plugin``); the cluster environment
            defaults to :class:`~mpistrategy.strategy.environment.MPIEnvironment`.
        aggregator: how gradient buckets are combined, an :class:`~mpistrategy.aggregation.Aggregator` or its name
            with default options (``"topk"``, ``"powersgd"``; see :mod:`mpistrategy.aggregation.registry`; default:
            :class:`~mpistrategy.aggregation.MeanAggregator`); under hierarchical modes, the combination across
            nodes.
        sync: the step-level sync mode, a :class:`~mpistrategy.sync.SyncMode` or its name (``"flat"``, the
            default: every step over all ranks; see :mod:`mpistrategy.sync`).
        ranks_per_node: make groups of this many ranks act as nodes (default: nodes from MPI, or
            ``MPISTRATEGY_RANKS_PER_NODE``): one machine can then act as several nodes.
        node_transport: how node-local gradient averaging travels: ``"auto"`` (default: NCCL for a model on CUDA
            when every rank of the node has a GPU of its own, else MPI), ``"mpi"`` (the node's shared-memory
            communicator), ``"gloo"`` or ``"nccl"`` (a torch.distributed group per node, its rendezvous done over
            MPI). The step across nodes always goes over MPI.
        bucket_cap_mb: gradient bucket size cap in MB (DDP's default 25).
        first_bucket_cap_mb: cap of the first bucket, which is started first (default: ``bucket_cap_mb``). DDP
            uses 1 MB so that communication starts early; with MPI, whose non-blocking collectives progress only
            inside MPI calls, that early start bought no measurable overlap on CPU while the extra collective
            cost about 0.2 ms per step on the benchmark MLP (see benchmarks/strategy.py), so it is opt-in.
        own_bucket_mb: a parameter whose gradient has at least this many MB is its own bucket and is combined in
            place in the ``.grad`` autograd produced: no flat buffer, no zeroing and no accumulation pass per step
            (``math.inf`` puts every gradient into flat buckets).
        data_parallel: broadcast rank 0's parameters and buffers at setup and average the gradients (data
            parallelism). ``False`` for a model split across the ranks (tensor or pipeline parallel, where each
            rank's parameters and gradients are its own slice): no broadcast, no gradient reducer; checkpoints,
            metrics, failure handling and stop signals stay as they are.
        abort_on_exception: abort every rank when one raises (prints the traceback first), and report a rank that
            ends through ``os._exit``. Turn off only for a deliberate, identical exception on every rank that the
            script catches.
        stop_signals: signals that trigger a coordinated stop, by name (``"SIGUSR1"`` or ``"USR1"``) or number
            (default ``("SIGTERM", "SIGUSR1")``): every rank stops at the same step with exit code
            :data:`~mpistrategy.strategy.failures.STOPPED_EXIT_CODE` (75); ``()`` leaves the signals alone.
        set_num_threads: when ``OMP_NUM_THREADS`` is unset, give each rank ``cpu_count // ranks_per_node``
            torch threads (as Lightning does for the processes it launches).
        stall_timeout: seconds a rank may wait in a collective or the gradient sync before the stall watchdog
            reports every rank's position and stack (0: never; ``None``: ``MPISTRATEGY_STALL_TIMEOUT``, default
            300; see :mod:`mpistrategy.comm.watchdog`).
        stall_action: ``"abort"`` (end the job with exit code 86 after the report) or ``"warn"``; ``None``:
            ``MPISTRATEGY_STALL_ACTION``, default ``"abort"``.
        flight_dir: where each rank writes its flight record (its last collectives) on a stall, an abort or a
            signal; ``None``: ``MPISTRATEGY_FLIGHT_DIR``, default ``./mpistrategy_flight`` (in a SLURM job
            ``./mpistrategy_flight/slurm-<job id>``).
        shard: split the optimizer state over the ranks (ZeRO, see :mod:`mpistrategy.strategy.sharding`):
            ``"optimizer"`` (stage 1: each rank keeps and steps ``1/N`` of the optimizer state, the updated
            parameters are allgathered), ``"gradients"`` (stage 2: also the averaged gradients are kept only for
            the rank's shard: gradient buckets are reduce-scattered) or ``None`` (every rank keeps everything).
            Under ``sync="hierarchical"`` the ranks of each node split one copy.
    """

    if TYPE_CHECKING:  # provided by the Lightning strategy this class is mixed into
        world_size: int
        global_rank: int
        cluster_environment: Any
        parallel_devices: list[torch.device] | None

    strategy_name = "mpi_ad"
    _environment_class: type = MPIEnvironment

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        *,
        aggregator: Aggregator | str | None = None,
        sync: SyncMode | str | None = None,
        ranks_per_node: int | None = None,
        node_transport: str = "auto",
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        own_bucket_mb: float = 1.0,
        data_parallel: bool = True,
        abort_on_exception: bool = True,
        stop_signals: Iterable[int | str] = DEFAULT_STOP_SIGNALS,
        set_num_threads: bool = True,
        stall_timeout: float | None = None,
        stall_action: str | None = None,
        flight_dir: str | None = None,
        shard: str | None = None,
    ) -> None:
        if stall_timeout is not None or stall_action is not None:
            stall_settings.set_stall_timeout(
                stall_settings.stall_timeout() if stall_timeout is None else stall_timeout, stall_action
            )
        if flight_dir is not None:
            flight.set_flight_directory(flight_dir)
        if node_transport not in NODE_TRANSPORTS:
            valid = ", ".join(map(repr, NODE_TRANSPORTS))
            raise ValueError(f"node_transport={node_transport!r} is not one of {valid}.")
        if cluster_environment is None:
            cluster_environment = self._environment_class(ranks_per_node)
        # positional: the Trainer's ParallelStrategy calls the last one precision_plugin, Fabric's precision
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision)  # type: ignore[call-arg]
        self.node_transport = node_transport
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = first_bucket_cap_mb
        self.own_bucket_mb = own_bucket_mb
        self.data_parallel = data_parallel
        self.shard = shard
        self.abort_on_exception = abort_on_exception
        self.set_num_threads = set_num_threads
        self._stop: failures.StopSignals | None = None
        self._traffic = TrafficCounter()
        if self.abort_on_exception and self.world_size > 1:
            failures.install_excepthook()
            failures.report_os_exit()
        # after the hook: a value wrong on one rank only ends every rank
        self.aggregator: Aggregator = aggregator_from(aggregator)
        self.sync: SyncMode = build_sync(sync)
        self._stop_signal_numbers = failures.signal_numbers(stop_signals)
        check_shard(shard, data_parallel)

    # --------------------------------------------------------------------------------------------- ranks

    @property
    def topology(self) -> Topology:
        """Ranks, nodes and communicators of this process (from the cluster environment)."""
        env = self.cluster_environment
        if not hasattr(env, "topology"):
            from mpistrategy.comm.topology import topology

            return topology()
        return env.topology

    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to use distributed samplers and to honour ``self.log(..., sync_dist=True)``."""
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":
            return torch.device("cuda", self.topology.machine_rank % max(1, torch.cuda.device_count()))
        return devices[0]

    @property
    def num_nodes(self) -> int:
        return self.topology.num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        """Lightning sets its ``num_nodes`` flag here; MPI decides (see :meth:`follow_launch`)."""

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return self.topology.local_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Called by the Trainer (and, as ``_set_world_ranks``, by Fabric) at construction: make
        ``rank_zero_only`` follow the MPI rank."""
        from lightning_utilities.core.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    _set_world_ranks = set_world_ranks

    def follow_launch(self, devices: Any, num_nodes: int, owner: str) -> None:
        """Called once the Trainer or Fabric (``owner``) was configured with ``devices=`` and ``num_nodes=``: the
        devices Lightning reports follow the MPI world (``num_devices`` is this node's ranks), and flags that
        disagree with the MPI world are reported once, on rank 0 (see
        :func:`~mpistrategy.strategy.conventions.launch_mismatch`)."""
        t = self.topology
        kind = (self.parallel_devices or [torch.device("cpu")])[0].type
        if kind == "cuda":
            count, first = max(1, torch.cuda.device_count()), t.machine_rank - t.local_rank
            self.parallel_devices = [torch.device("cuda", (first + i) % count) for i in range(t.local_size)]
        else:
            self.parallel_devices = [torch.device(kind)] * t.local_size
        message = conventions.launch_mismatch(devices, num_nodes, t, owner, self.strategy_name)
        if message is not None and self.global_rank == 0:
            warnings.warn(message, UserWarning, stacklevel=conventions.user_stacklevel())

    # --------------------------------------------------------------------------------------------- setup

    def setup_environment(self) -> None:
        """Torch threads per rank (see ``set_num_threads``), then Lightning's device setup."""
        if self.set_num_threads and "OMP_NUM_THREADS" not in os.environ:
            threads = max(1, _cpus_available() // max(1, self.topology.machine_size))
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)
        if self.world_size > 1:
            conventions.running.add(self)
            conventions.sync_torchmetrics(sync.metric_gather(self.topology.control, world()))
        super().setup_environment()  # type: ignore[misc]

    def _build_engine(
        self,
        module: nn.Module,
        optimizers: list[torch.optim.Optimizer],
        sync_mode: SyncMode | None = None,
        aggregator: Aggregator | None = None,
        topology: Topology | None = None,
        problem: Exception | None = None,
    ) -> DataParallelEngine:
        """A set-up :class:`DataParallelEngine` over ``module`` (collective): gradient buckets combined by
        ``aggregator`` under ``sync_mode`` on ``topology``'s communicators (defaults: the strategy's);
        configuration errors, and ``problem`` (one the caller found on this rank), raise on every rank."""
        engine = DataParallelEngine(
            sync_mode if sync_mode is not None else self.sync,
            aggregator if aggregator is not None else self.aggregator,
            topology if topology is not None else self.topology,
            self.bucket_cap_mb,
            self.first_bucket_cap_mb,
            self.own_bucket_mb,
            self.node_transport,
            self._traffic,
            self.shard,
            self._uses_grad_scaler(),
        )
        engine.setup(module, optimizers, problem)
        return engine

    def _uses_grad_scaler(self) -> bool:
        """Whether the precision plugin checks gradients for overflow (a ``GradScaler``, float16 mixed precision)."""
        plugin = getattr(self, "precision_plugin", None) or getattr(self, "precision", None)
        return getattr(plugin, "scaler", None) is not None

    def broadcast_module_state(self, module: nn.Module) -> None:
        """Give ``module`` rank 0's parameters and buffers (collective; nothing without data parallelism)."""
        if self.data_parallel:
            sync.broadcast_module_state(module, self.topology.control)

    def share_buffers(self, module: nn.Module) -> None:
        """Give every rank rank 0's buffers of ``module`` (collective): BatchNorm's running statistics follow each
        rank's own batches in training. Done for you before evaluation (Trainer) and after each synchronised
        backward (Fabric) under ``flat`` and ``hierarchical``."""
        if self.world_size > 1:
            sync.share_buffers(module, self.topology.control, world())

    def attach_metric_sync(self, module: nn.Module) -> int:
        """Make every torchmetrics ``Metric`` in ``module`` (or ``module`` itself) sync its state over MPI when it
        computes, also while torch.distributed is initialised (without it, every metric that keeps torchmetrics'
        default ``distributed_available_fn`` already does); returns how many were found."""
        if self.world_size == 1:
            return 0
        return sync.attach_metric_sync(module, self.gather_metric_state, conventions.metrics_distributed)

    def gather_metric_state(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        """Collective: every rank's ``tensor`` (shapes may differ), in rank order; torchmetrics' ``dist_sync_fn``."""
        return sync.gather_tensors(tensor, self.topology.control, world())

    @property
    def traffic(self) -> TrafficCounter:
        """The payload bytes this rank sent for gradient and model averaging, per step and in total."""
        return self._traffic

    # -------------------------------------------------------------------------------------- collectives

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over all ranks: ``reduce_op`` is "mean"/"sum"/"max"/"min" or a ``ReduceOp``.
        Non-tensors are returned unchanged."""
        if not isinstance(tensor, Tensor):
            return tensor
        return sync.reduce_tensor(tensor, reduce_op, world())

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        """Every rank's tensor stacked: shape ``(world_size, *tensor.shape)``; differentiable with ``sync_grads``."""
        return sync.all_gather(tensor, world(), sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s object (anything picklable) on every rank."""
        return sync.broadcast_object(obj, src, self.topology.control, world())

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Wait until every rank has reached its barrier."""
        sync.barrier(self.topology.control, world())

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``decision`` combined over the ranks: true where every rank's is (``all``), else where any rank's is."""
        return sync.reduce_boolean(decision, all, self.topology.control, world())

    def consolidated_optimizer_state(self, optimizer: Any, to: int = 0) -> dict[str, Any] | None:
        """Collective: the whole ``state_dict()`` of ``optimizer`` (or of the optimizer a Lightning wrapper holds)
        on rank ``to``, ``None`` on the other ranks. Under ``shard=``, where ``optimizer.state_dict()`` is the state
        of this rank's pieces, the pieces of one copy of the state are gathered into the state the unsharded
        optimizer would have, its parameters numbered as its ``state_dict()`` numbers them (what torch's
        ``ZeroRedundancyOptimizer.consolidate_state_dict(to)`` and then ``state_dict()`` give). Unsharded: rank
        ``to``'s ``optimizer.state_dict()``."""
        sharded = self._sharded_optimizer(optimizer)
        return sync.optimizer_state_on(optimizer, sharded, to, self.topology.control, world())

    def _sharded_optimizer(self, optimizer: Any) -> ShardedOptimizer | None:
        """The sharded form of ``optimizer``, if the strategy shards it."""
        raise NotImplementedError

    # -------------------------------------------------------------------------------------- stop signals

    def _install_stop_signals(self) -> None:
        """Take over the stop signals (idempotent); :meth:`_decide_stop` then turns them into one decision. Once the
        script ends they are ignored (:func:`~mpistrategy.strategy.failures.ignore_at_exit`)."""
        if not self._stop_signal_numbers:
            return
        if self._stop is None:
            self._stop = failures.StopSignals(self._stop_signal_numbers, self.topology.control)
        self._stop.install()
        failures.ignore_at_exit(self._stop_signal_numbers)

    def _decide_stop(self) -> int:
        """Collective, at the same point on every rank: the stop signal some rank received (0: none)."""
        return self._stop.decide() if self._stop is not None else 0

    def _release_stop_signals(self) -> None:
        """Complete the decision in flight and give the signals back."""
        if self._stop is not None:
            self._stop.release()

    def teardown(self) -> None:
        conventions.running.discard(self)
        super().teardown()  # type: ignore[misc]


def _cpus_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
