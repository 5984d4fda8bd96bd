"""Lightning's conventions under MPI: what a DDP user is told, an ``mpi_ad`` user is told too.

- Launch flags. Under DDP, ``devices=`` and ``num_nodes=`` decide how many processes train; under MPI the
  launcher already decided. :func:`follow_launch_flags` wraps the Trainer's and Fabric's connector: once it has
  configured an mpistrategy strategy, the strategy's ``follow_launch`` makes the devices Lightning reports
  (``trainer.num_devices``) follow the MPI world and warns once, on rank 0, about flags that disagree with it
  (:func:`launch_mismatch` words it).
- "Seed set to N". ``seed_everything`` logs it in every process, with a ``[rank: r]`` prefix only when a launcher
  variable (``RANK``, ``LOCAL_RANK``, ...) names the rank, which ``mpiexec`` does not set: N identical lines.
  :func:`log_seed_on_rank_zero_only` keeps rank 0's.
- The ``sync_dist=True`` hint. Lightning warns "It is recommended to use ``self.log(..., sync_dist=True)`` when
  logging on epoch level in distributed setting" only when ``torch.distributed`` is initialised, which mpi_ad never
  needs. :func:`hint_sync_dist` makes that check also true while an mpistrategy strategy with more than one rank
  is set up (:data:`running`).
- torchmetrics' sync. Under DDP every torchmetrics ``Metric`` gathers its state across ranks when it computes,
  wherever it lives (the LightningModule, a callback, a metric created in an epoch hook), because its default
  ``distributed_available_fn`` sees torch.distributed initialised, and it goes on gathering after ``fit`` returns
  (the process group outlives the Trainer). :func:`sync_torchmetrics` makes such a metric gather over the MPI world
  of the last strategy set up with more than one rank instead, while torch.distributed is not initialised.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

from mpistrategy.comm.topology import Topology

#: the strategies with more than one rank between their ``setup_environment`` and ``teardown``
running: weakref.WeakSet[Any] = weakref.WeakSet()
#: torchmetrics' ``dist_sync_fn`` over the MPI world (see :func:`sync_torchmetrics`)
_metric_gather: Callable[..., list[Any]] | None = None

SEED_MESSAGE = "Seed set to"
_INTERNAL_PACKAGES = ("mpistrategy", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")
_SEED_LOGGERS = ("lightning.fabric.utilities.seed", "lightning_fabric.utilities.seed")


def launch_mismatch(devices: Any, num_nodes: int, topology: Topology, owner: str, strategy: str) -> str | None:
    """The warning for ``owner(devices=..., num_nodes=...)`` flags that disagree with the MPI world, else ``None``.

    ``devices`` asks for that many processes on every node (a list or ``"0,1"`` for as many as it names);
    ``"auto"``, ``-1`` and the default ``num_nodes=1`` accept whatever MPI launched.
    """
    t = topology
    requested = _requested_devices(devices)
    wrong_devices = requested is not None and any(size != requested for size in t.node_sizes)
    wrong_nodes = num_nodes != 1 and num_nodes != t.num_nodes
    if not (wrong_devices or wrong_nodes):
        return None
    layout = (
        f"{t.node_sizes[0]} on each of {t.num_nodes} node(s)"
        if t.even_nodes
        else f"{', '.join(map(str, t.node_sizes))} on its {t.num_nodes} nodes"
    )
    if t.virtual:
        layout += " (virtual nodes: ranks_per_node / MPISTRATEGY_RANKS_PER_NODE)"
    wanted = (cast(int, requested) if wrong_devices else t.local_size) * (num_nodes if wrong_nodes else t.num_nodes)
    return (
        f"{owner}(devices={devices!r}, num_nodes={num_nodes}) does not match the MPI world: MPI launched {t.size} "
        f"rank(s), {layout}. The {strategy} strategy trains on the ranks MPI launched and ignores devices= and "
        f"num_nodes= (num_devices={t.local_size}, num_nodes={t.num_nodes}, world_size={t.size}). To train on "
        f"{wanted} processes, start them: mpiexec -n {wanted} python <script> (or srun -n {wanted}); to silence "
        "this warning, leave devices= and num_nodes= at their defaults."
    )


def _requested_devices(devices: Any) -> int | None:
    """The number of processes per node that ``devices=`` asks for; ``None`` for "whatever was launched"."""
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return len([part for part in text.split(",") if part.strip()])
        return int(text) if text.isdigit() and int(text) > 0 else None
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        return devices
    return None


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at the first frame outside
    Lightning and mpistrategy: the user's line that built the Trainer or Fabric."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in _INTERNAL_PACKAGES:
        frame = frame.f_back
        level += 1
    return level


def follow_launch_flags(connector: type, owner: str) -> None:
    """Wrap ``connector.__init__`` (Lightning's Trainer or Fabric connector) so that a strategy with a
    ``follow_launch(devices, num_nodes, owner)`` method gets the flags it was configured with (idempotent)."""
    original = connector.__init__  # type: ignore[misc]  # Lightning's connector class, patched below
    if getattr(original, "_mpistrategy", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        follow = getattr(self.strategy, "follow_launch", None)
        if follow is not None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            follow(bound.arguments["devices"], bound.arguments["num_nodes"], owner)

    init._mpistrategy = True  # type: ignore[attr-defined]
    connector.__init__ = init  # type: ignore[misc]


class _DropSeedMessage(logging.Filter):
    """Drops Lightning's "Seed set to N" record (installed on the ranks other than 0)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(SEED_MESSAGE)


def log_seed_on_rank_zero_only(rank: int) -> None:
    """Keep ``seed_everything``'s "Seed set to N" on rank 0 (idempotent; Lightning need not be imported yet)."""
    if rank == 0:
        return
    for name in _SEED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropSeedMessage) for f in logger.filters):
            logger.addFilter(_DropSeedMessage())


def hint_sync_dist(result_module: ModuleType) -> None:
    """Make the check before Lightning's ``sync_dist=True`` warning in ``result_module`` (its logger connector's
    ``result``) true while an mpistrategy strategy with more than one rank is set up (idempotent)."""
    original = getattr(result_module, "_distributed_is_initialized", None)
    if original is None or getattr(original, "_mpistrategy", False):
        return

    @functools.wraps(original)
    def distributed() -> bool:
        return bool(original()) or len(running) > 0

    distributed._mpistrategy = True  # type: ignore[attr-defined]
    result_module._distributed_is_initialized = distributed  # type: ignore[attr-defined]


def sync_torchmetrics(gather: Callable[..., list[Any]]) -> None:
    """Make ``torchmetrics.Metric.sync`` gather with ``gather`` (``dist_sync_fn``'s contract) for a metric that keeps
    torchmetrics' default ``distributed_available_fn`` while torch.distributed is not initialised; nothing without
    torchmetrics. A later call replaces ``gather``; it stays after the strategy's teardown, as a process group
    outlives a DDP Trainer. A metric given its own ``distributed_available_fn`` or ``dist_sync_fn`` keeps it."""
    global _metric_gather
    _metric_gather = gather
    try:
        from torchmetrics import metric as metric_module
    except ImportError:
        return
    original = metric_module.Metric.sync
    if getattr(original, "_mpistrategy", False):
        return
    default = metric_module.jit_distributed_available

    @functools.wraps(original)
    def sync(
        self: Any,
        dist_sync_fn: Any = None,
        process_group: Any = None,
        should_sync: bool = True,
        distributed_available: Any = None,
    ) -> None:
        if (
            _metric_gather is not None
            and distributed_available is None
            and self.distributed_available_fn is default
            and not default()
        ):
            distributed_available = metrics_distributed
            dist_sync_fn = dist_sync_fn or _metric_gather
        original(self, dist_sync_fn, process_group, should_sync, distributed_available)

    sync._mpistrategy = True  # type: ignore[attr-defined]
    metric_module.Metric.sync = sync  # type: ignore[method-assign]


def metrics_distributed() -> bool:
    """torchmetrics' ``distributed_available_fn`` for a metric that syncs over MPI: always true."""
    return True
