"""Typed schemas for the Hydra configs in ``conf/``, registered in Hydra's ConfigStore.

Every YAML option of a group names its schema first in its defaults list (``- /schema/model/mlp@_here_``), so
Hydra merges the YAML onto a dataclass: a misspelled key or a value of the wrong type fails at composition time,
before anything is built or trained, with the full key in the message. :func:`explain` adds the keys that *are*
allowed (and the closest match) to Hydra's message.

Rules that tie several values together, which a schema cannot state, are checked by :func:`check_values` on the
composed config (``build_run`` calls it before building the model).

Call :func:`register_configs` before composing (``mpistrategy.recipes.train`` does it at import; tests call it).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from mpistrategy.strategy.sharding.options import SHARD_MODES
from mpistrategy.sync.daso import DOWNCAST_TYPES
from mpistrategy.sync.gossip import GRAPHS as GOSSIP_GRAPHS
from mpistrategy.sync.transport import NODE_TRANSPORTS

# --- trainer ----------------------------------------------------------------------------------------------------------


@dataclass
class TrainerConf:
    """The ``lightning.pytorch.Trainer`` arguments a recipe may set; strategy, logger and callbacks come from their
    own groups."""

    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "cpu"
    devices: Any = "auto"
    num_nodes: int = 1
    precision: Any = "32-true"
    max_epochs: int | None = 10
    min_epochs: int | None = None
    max_steps: int = -1
    max_time: str | None = None
    limit_train_batches: float | None = None
    limit_val_batches: float | None = None
    limit_test_batches: float | None = None
    val_check_interval: float | None = None
    check_val_every_n_epoch: int | None = 1
    num_sanity_val_steps: int | None = 0
    log_every_n_steps: int | None = 5
    enable_checkpointing: bool | None = True
    enable_progress_bar: bool | None = True
    enable_model_summary: bool | None = True
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str | None = None
    deterministic: Any = False
    benchmark: bool | None = None
    fast_dev_run: Any = False
    use_distributed_sampler: bool = True
    sync_batchnorm: bool = False
    barebones: bool = False
    default_root_dir: str | None = "${paths.output_dir}"


# --- strategy and aggregation -----------------------------------------------------------------------------------------


@dataclass
class NamedStrategyConf:
    """A strategy Lightning knows by name (``auto``, ``ddp``, ``single_device`` ...), built by
    :func:`mpistrategy.recipes.builders.strategy_by_name`."""

    _target_: str = "mpistrategy.recipes.builders.strategy_by_name"
    name: str = "auto"


def _choices(name: str, values: Iterable[str], doc: str) -> type[Enum]:
    """An Enum whose members are ``values`` (so that Hydra checks a field against them and lists them)."""
    choices = Enum(name, [(value, value) for value in values], module=__name__)  # type: ignore[misc]
    choices.__doc__ = doc
    return choices


NodeTransport = _choices("NodeTransport", NODE_TRANSPORTS, "How node-local gradient averaging travels.")
ShardMode = _choices("ShardMode", SHARD_MODES, "Which training state is split over the ranks (ZeRO stage 1 or 2).")
GossipGraph = _choices("GossipGraph", (*GOSSIP_GRAPHS, "custom"), "Gossip's graph; custom: the neighbours field.")
SummaryMode = _choices("SummaryMode", ("max", "min"), "Whether the best value of the summary's metric is its largest.")
Downcast = _choices(
    "Downcast", (name for name in DOWNCAST_TYPES if name is not None), "DASO's precision of inter-node averages."
)


@dataclass
class MPIADStrategyConf:
    """mpistrategy's ``mpi_ad`` strategy (``mpistrategy.strategy.MPIADStrategy``); the aggregator comes from the
    aggregation group. ``model_parallel`` builds :class:`mpistrategy.recipes.model_parallel.ModelParallelMPIStrategy`.

    ``sync`` is the step-level sync mode (:mod:`mpistrategy.sync`); the schemas below add each mode's options as
    fields of the strategy (``strategy=daso strategy.global_skip=8``), which
    :func:`mpistrategy.recipes.builders.mpi_ad_strategy` passes to the mode."""

    _target_: str = "mpistrategy.recipes.builders.mpi_ad_strategy"
    sync: str = "flat"
    #: ranks per (virtual) node; null = the nodes MPI reports (or MPISTRATEGY_RANKS_PER_NODE)
    ranks_per_node: int | None = None
    node_transport: NodeTransport = NodeTransport.auto  # type: ignore[attr-defined]
    #: log comm/bytes_per_step, comm/node_bytes_per_step and comm/inter_node_bytes_per_step every optimizer step
    log_traffic: bool = True
    #: log memory/rank<r>/{param,grad,optimizer_state}_bytes (every rank's, measured from its tensors) likewise
    log_memory: bool = True
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    #: a gradient of at least this many MB is its own bucket, combined in place where autograd put it
    own_bucket_mb: float = 1.0
    #: split the training state over the ranks (ZeRO): optimizer (stage 1: optimizer state) or gradients (stage 2:
    #: also the averaged gradients); null = every rank keeps everything. Sync flat or hierarchical only.
    shard: ShardMode | None = None  # type: ignore[valid-type]
    abort_on_exception: bool = True
    #: signals that stop every rank together at the same step (after a checkpoint): SLURM's time-limit warning
    #: (--signal=USR1@<s>) and scancel/preemption (SIGTERM)
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    #: save hpc_ckpt_<n>.ckpt in the run dir before a coordinated stop (the run resumes from it)
    checkpoint_on_stop: bool = True
    #: each rank uses cores-per-node / ranks-per-node torch threads unless OMP_NUM_THREADS is set
    set_num_threads: bool = True
    #: seconds in one collective before the stall watchdog reports every rank and ends the job (0: off; null:
    #: MPISTRATEGY_STALL_TIMEOUT, default 300)
    stall_timeout: float | None = None
    #: abort (exit code 86) or warn after a stall report (null: MPISTRATEGY_STALL_ACTION, default abort)
    stall_action: str | None = None
    #: where each rank writes its flight record (null: MPISTRATEGY_FLIGHT_DIR, default
    #: ./mpistrategy_flight, in a SLURM job ./mpistrategy_flight/slurm-<job id>)
    flight_dir: str | None = None
    model_parallel: bool = False


@dataclass
class HierarchicalStrategyConf(MPIADStrategyConf):
    """``sync=hierarchical`` (:class:`mpistrategy.sync.HierarchicalSync`): no options of its own."""

    sync: str = "hierarchical"


@dataclass
class LocalSGDStrategyConf(MPIADStrategyConf):
    """``sync=local_sgd`` (:class:`mpistrategy.sync.LocalSGD`)."""

    sync: str = "local_sgd"
    #: H: local steps between two model averages (>= 1)
    period: int = 8
    #: optimizer steps of per-step gradient averaging before the local steps begin (>= 0)
    warmup_steps: int = 0


@dataclass
class HierarchicalLocalSGDStrategyConf(LocalSGDStrategyConf):
    """``sync=hierarchical_local_sgd`` (:class:`mpistrategy.sync.HierarchicalLocalSGD`)."""

    sync: str = "hierarchical_local_sgd"


@dataclass
class DASOStrategyConf(MPIADStrategyConf):
    """``sync=daso`` (:class:`mpistrategy.sync.DASO`), heat's defaults."""

    sync: str = "daso"
    warmup_epochs: int = 4
    cooldown_epochs: int = 4
    global_skip: int = 4
    batches_to_wait: int = 1
    local_skip: int = 1
    max_global_skips: int = 8
    stability_level: float = 0.05
    skip_reduction_factor: int = 2
    local_skip_factor: int = 4
    sending_chunk_size: int = 10_000_000
    downcast: Downcast | None = Downcast.bfloat16  # type: ignore[attr-defined,valid-type]
    downcast_all_phases: bool = False
    check_finite: bool = True


@dataclass
class GossipStrategyConf(MPIADStrategyConf):
    """``sync=gossip`` (:class:`mpistrategy.sync.Gossip`)."""

    sync: str = "gossip"
    graph: GossipGraph = GossipGraph.ring  # type: ignore[attr-defined,valid-type]
    #: with graph=custom: one list of neighbour ranks per rank (symmetric), e.g. [[1,3],[0,2],[1,3],[0,2]]
    neighbours: list[list[int]] | None = None
    #: mix with the neighbours every period optimizer steps (>= 1)
    period: int = 1


@dataclass
class MeanAggregationConf:
    """Average gradient buckets over all ranks (non-blocking, in place): plain data parallelism."""

    _target_: str = "mpistrategy.aggregation.MeanAggregator"


@dataclass
class LowPrecisionAggregationConf:
    """Average in a narrower float type on the wire (``mpistrategy.aggregation.LowPrecision``)."""

    _target_: str = "mpistrategy.aggregation.LowPrecision"
    #: float16, bfloat16, or float32 (compresses float64 gradients; the plain mean for float32 ones)
    dtype: str = "float16"


@dataclass
class TopKAggregationConf:
    """The largest entries as (index, value) pairs, with error feedback (``mpistrategy.aggregation.TopK``)."""

    _target_: str = "mpistrategy.aggregation.TopK"
    #: share of each bucket's elements sent, in (0, 1]
    density: float = 0.01
    error_feedback: bool = True


@dataclass
class RandomKAggregationConf:
    """A random subset shared by all ranks, with error feedback (``mpistrategy.aggregation.RandomK``)."""

    _target_: str = "mpistrategy.aggregation.RandomK"
    #: share of each bucket's elements sent, in (0, 1]
    density: float = 0.1
    seed: int = 0
    error_feedback: bool = True


@dataclass
class QSGDAggregationConf:
    """Unbiased stochastic quantisation (``mpistrategy.aggregation.QSGD``)."""

    _target_: str = "mpistrategy.aggregation.QSGD"
    #: levels per sign, 1 to 127
    levels: int = 127
    #: elements per norm
    block_size: int = 512
    seed: int = 0


@dataclass
class MinMaxAggregationConf:
    """``bits``-bit codes on each block's [min, max], with error feedback
    (``mpistrategy.aggregation.MinMaxQuantization``)."""

    _target_: str = "mpistrategy.aggregation.MinMaxQuantization"
    #: bits per element, 1 to 8
    bits: int = 8
    #: elements per (min, max) pair
    block_size: int = 1024
    error_feedback: bool = True


@dataclass
class SignAggregationConf:
    """Scaled sign with error feedback, EF-SignSGD (``mpistrategy.aggregation.ScaledSign``)."""

    _target_: str = "mpistrategy.aggregation.ScaledSign"
    error_feedback: bool = True


@dataclass
class MajorityVoteAggregationConf:
    """signSGD with majority vote (``mpistrategy.aggregation.MajorityVote``)."""

    _target_: str = "mpistrategy.aggregation.MajorityVote"
    #: multiply the vote by each parameter's mean magnitude over the ranks
    scaled: bool = True


@dataclass
class PowerSGDAggregationConf:
    """Rank-``rank`` approximation of every matrix gradient (``mpistrategy.aggregation.PowerSGD``)."""

    _target_: str = "mpistrategy.aggregation.PowerSGD"
    #: approximation rank, >= 1
    rank: int = 1
    #: rounds of plain averaging before compression starts
    start_iter: int = 10
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: bool = True
    seed: int = 0


# --- model and optimizer ----------------------------------------------------------------------------------------------


@dataclass
class MLPConf:
    _target_: str = "mpistrategy.recipes.models.MLPClassifier"
    in_features: int = 64
    hidden: int = 256
    depth: int = 1
    num_classes: int = 10
    dropout: float = 0.0


@dataclass
class CNNConf:
    _target_: str = "mpistrategy.recipes.models.CNNClassifier"
    image_size: int = 8
    channels: int = 32
    hidden: int = 128
    num_classes: int = 10
    dropout: float = 0.0


@dataclass
class TensorParallelMLPConf:
    _target_: str = "mpistrategy.recipes.tensor_parallel.TensorParallelMLPClassifier"
    in_features: int = 64
    hidden: int = 128
    depth: int = 1
    num_classes: int = 10


@dataclass
class PipelineMLPConf:
    _target_: str = "mpistrategy.recipes.pipeline.PipelineMLPClassifier"
    in_features: int = 64
    hidden: int = 128
    layers_per_stage: int = 1
    num_classes: int = 10
    micro_batches: int = 2


@dataclass
class SGDConf:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0005


@dataclass
class AdamConf:
    _target_: str = "torch.optim.Adam"
    _partial_: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass
class AdamWConf:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.01


@dataclass
class CosineSchedulerConf:
    _target_: str = "torch.optim.lr_scheduler.CosineAnnealingLR"
    _partial_: bool = True
    T_max: int = "${trainer.max_epochs}"  # type: ignore[assignment]
    eta_min: float = 0.0


@dataclass
class StepSchedulerConf:
    _target_: str = "torch.optim.lr_scheduler.StepLR"
    _partial_: bool = True
    step_size: int = 5
    gamma: float = 0.5


# --- data -------------------------------------------------------------------------------------------------------------


@dataclass
class DigitsDataConf:
    _target_: str = "mpistrategy.recipes.data.DigitsDataModule"
    batch_size: int = 32
    val_fraction: float = 0.2
    split_seed: int = 0
    standardize: bool = True
    num_workers: int = 0
    same_batches_on_all_ranks: bool = False


@dataclass
class SyntheticDataConf:
    _target_: str = "mpistrategy.recipes.data.SyntheticDataModule"
    num_samples: int = 8192
    num_val_samples: int = 1024
    in_features: int = 512
    num_classes: int = 16
    batch_size: int = 128
    seed: int = 0
    num_workers: int = 0
    same_batches_on_all_ranks: bool = False


# --- logger and callbacks ---------------------------------------------------------------------------------------------


@dataclass
class CSVLoggerConf:
    _target_: str = "mpistrategy.recipes.loggers.ResumableCSVLogger"
    save_dir: str = "${paths.output_dir}"
    name: str = "csv"
    version: str = ""
    flush_logs_every_n_steps: int = 50


@dataclass
class ModelCheckpointConf:
    _target_: str = "lightning.pytorch.callbacks.ModelCheckpoint"
    dirpath: str = "${paths.output_dir}/checkpoints"
    filename: str = "epoch{epoch:03d}"
    monitor: str | None = "val/acc"
    mode: str = "max"
    save_last: bool | None = True
    save_top_k: int = 1
    every_n_epochs: int | None = 1
    auto_insert_metric_name: bool = False
    save_on_train_epoch_end: bool | None = None
    enable_version_counter: bool = True


@dataclass
class ProgressBarConf:
    _target_: str = "lightning.pytorch.callbacks.TQDMProgressBar"
    refresh_rate: int = 5
    leave: bool = False


@dataclass
class FitTimerConf:
    _target_: str = "mpistrategy.recipes.callbacks.FitTimer"


@dataclass
class PreemptionConf:
    """SIGUSR1 (SLURM's ``--signal=USR1@<seconds>``) -> all ranks agree -> checkpoint -> ``scontrol requeue``."""

    _target_: str = "mpistrategy.recipes.callbacks.Preemption"
    signal: str = "SIGUSR1"
    requeue: bool = True
    check_every_n_steps: int = 1


@dataclass
class EarlyStoppingConf:
    _target_: str = "lightning.pytorch.callbacks.EarlyStopping"
    monitor: str = "val/acc"
    mode: str = "max"
    patience: int = 5
    min_delta: float = 0.0
    stopping_threshold: float | None = None


@dataclass
class LearningRateMonitorConf:
    _target_: str = "lightning.pytorch.callbacks.LearningRateMonitor"
    logging_interval: str | None = "epoch"


# --- paths and the primary config -------------------------------------------------------------------------------------


@dataclass
class PathsConf:
    root_dir: str = "${oc.env:MPISTRATEGY_ROOT,.}"
    log_dir: str = "${oc.env:MPISTRATEGY_LOG_DIR,outputs}"
    output_dir: str = "${hydra:runtime.output_dir}"


@dataclass
class SummaryConf:
    enabled: bool = True
    plot: bool = True
    table: bool = True
    metric: str = "val/acc"
    mode: SummaryMode = SummaryMode.max  # type: ignore[valid-type, attr-defined]


@dataclass
class TrainConfig:
    """The primary config (``conf/config.yaml``). Groups left open (``Any``) get their type from the schema each
    option names."""

    trainer: TrainerConf = MISSING
    strategy: Any = MISSING
    aggregation: Any = None
    model: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = None
    data: Any = MISSING
    logger: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)
    paths: PathsConf = field(default_factory=PathsConf)
    summary: SummaryConf = field(default_factory=SummaryConf)
    task_name: str = "train"
    seed: int = 1234
    #: a checkpoint to start from; ``null`` = resume automatically when this run dir holds one (``resume: true``)
    ckpt_path: str | None = None
    resume: bool = True
    #: also run ``trainer.test`` on the validation split after fitting (off: digits has no separate test split)
    test: bool = False
    #: the objective a sweeper optimises: the final value of this logged metric
    objective: str = "val/acc"
    tags: list[str] = field(default_factory=list)
    #: torch intra-op threads per rank; null = leave it to the strategy (mpi_ad: the node's cores / its ranks)
    torch_threads: int | None = None


_SCHEMAS: dict[str, dict[str, type]] = {
    "trainer": {"default": TrainerConf},
    "strategy": {
        "named": NamedStrategyConf,
        "mpi_ad": MPIADStrategyConf,
        "hierarchical": HierarchicalStrategyConf,
        "local_sgd": LocalSGDStrategyConf,
        "hierarchical_local_sgd": HierarchicalLocalSGDStrategyConf,
        "daso": DASOStrategyConf,
        "gossip": GossipStrategyConf,
    },
    "aggregation": {
        "mean": MeanAggregationConf,
        "low_precision": LowPrecisionAggregationConf,
        "topk": TopKAggregationConf,
        "randomk": RandomKAggregationConf,
        "qsgd": QSGDAggregationConf,
        "minmax": MinMaxAggregationConf,
        "sign": SignAggregationConf,
        "majority_vote": MajorityVoteAggregationConf,
        "powersgd": PowerSGDAggregationConf,
    },
    "model": {"mlp": MLPConf, "cnn": CNNConf, "tp_mlp": TensorParallelMLPConf, "pipeline_mlp": PipelineMLPConf},
    "optimizer": {"sgd": SGDConf, "adam": AdamConf, "adamw": AdamWConf},
    "scheduler": {"cosine": CosineSchedulerConf, "step": StepSchedulerConf},
    "data": {"digits": DigitsDataConf, "synthetic": SyntheticDataConf},
    "logger": {"csv": CSVLoggerConf},
    "callbacks": {
        "model_checkpoint": ModelCheckpointConf,
        "progress_bar": ProgressBarConf,
        "fit_timer": FitTimerConf,
        "preemption": PreemptionConf,
        "early_stopping": EarlyStoppingConf,
        "lr_monitor": LearningRateMonitorConf,
    },
    "paths": {"default": PathsConf},
}

_registered = False


def register_configs() -> None:
    """Store every schema under ``schema/<group>/<name>`` and the primary schema as ``schema/config`` (idempotent)."""
    global _registered
    if _registered:
        return
    cs = ConfigStore.instance()
    cs.store(group="schema", name="config", node=TrainConfig)
    for group, schemas in _SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
    _registered = True


# --- rules across values ---------------------------------------------------------------------------------------------

COSINE_SCHEDULER = "torch.optim.lr_scheduler.CosineAnnealingLR"


def check_values(cfg: DictConfig) -> None:
    """Raise :class:`omegaconf.errors.ValidationError` (a configuration error: printed once, without a traceback) for
    values that are each valid but do not work together: a cosine scheduler needs ``T_max >= 1`` epochs (its default
    is ``trainer.max_epochs``, which is -1 for "no limit"); with less, the learning rate jumps between its initial
    value and ``eta_min`` every epoch."""
    scheduler = cfg.get("scheduler")
    if not scheduler or OmegaConf.select(scheduler, "_target_") != COSINE_SCHEDULER:
        return
    t_max = OmegaConf.select(scheduler, "T_max")
    if t_max is not None and t_max >= 1:
        return
    max_epochs = OmegaConf.select(cfg, "trainer.max_epochs")
    raise ValidationError(
        f"scheduler.T_max={t_max} (trainer.max_epochs={max_epochs}): the cosine scheduler decays the learning rate "
        "over T_max epochs and needs T_max >= 1; with less, the learning rate alternates between its initial value "
        "and eta_min every epoch. Set scheduler.T_max to the number of epochs to decay over, choose another "
        "scheduler (scheduler=step), or set a finite trainer.max_epochs."
    )


# --- friendlier errors ------------------------------------------------------------------------------------------------


def allowed_keys(schema_path: str) -> list[str]:
    """The keys a node of the primary config accepts (``"trainer"``, ``"model"`` ...), from its schema."""
    node: Any = OmegaConf.structured(TrainConfig)
    for part in [p for p in schema_path.split(".") if p]:
        if not isinstance(node, DictConfig) or part not in node:
            return []
        node = node._get_node(part)
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def explain(exc: BaseException, cfg: DictConfig | None = None) -> str:
    """Hydra's / OmegaConf's message for ``exc`` plus the keys allowed where a key was not found.

    ``cfg`` (the composed config, when there is one) gives the allowed keys of nodes whose schema depends on the
    option chosen (``model``, ``data`` ...); otherwise they come from :class:`TrainConfig`.
    """
    lines = [str(exc).strip()]
    cause = exc.__cause__ if exc.__cause__ is not None else exc
    full_key = getattr(cause, "full_key", None) or getattr(exc, "full_key", None)
    key = getattr(cause, "key", None)
    parent = getattr(cause, "parent_node", None)
    if cause is not exc and str(cause).strip() and str(cause).strip() not in lines[0]:
        lines.append(str(cause).strip())
    if full_key and "not in struct" in str(cause) or (full_key and "not in" in str(cause) and "Key" in str(cause)):
        parent_path, _, leaf = str(full_key).rpartition(".")
        keys: list[str] = []
        if isinstance(parent, DictConfig):
            keys = [str(k) for k in parent.keys()]
        elif cfg is not None:
            node = OmegaConf.select(cfg, parent_path) if parent_path else cfg
            keys = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        if not keys:
            keys = allowed_keys(parent_path)
        keys = [k for k in keys if not k.startswith("_")]
        if keys:
            where = f"'{parent_path}'" if parent_path else "the top level"
            leaf = str(key) if key is not None else leaf
            close = difflib.get_close_matches(leaf, keys, n=1)
            hint = f" Did you mean '{parent_path + '.' if parent_path else ''}{close[0]}'?" if close else ""
            lines.append(f"Unknown key '{full_key}'.{hint} Keys allowed in {where}: {', '.join(sorted(keys))}")
    return "\n".join(lines)
