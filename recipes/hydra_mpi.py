"""Hydra under several MPI ranks: one run directory, one writer.

Every rank runs Hydra itself. Left alone, ranks that start in different seconds get different run dirs and every
rank writes ``.hydra/``, the log file and ``multirun.yaml``. What this module adds (registered at import):

- ``${mpi_run_id:}``: the run id rank 0 decided (its start time, or ``slurm-<job id>[_<array task>]`` inside a SLURM
  job), broadcast to every rank by :func:`agree_on_run_id` before Hydra composes; used in ``hydra.run.dir`` and
  ``hydra.sweep.dir``. Cached like Hydra's ``now`` so sweep jobs (also submitit's) see the master's value.
- ``${mpi_rank_zero:value}``: ``value`` on rank 0, ``null`` elsewhere (``hydra.output_subdir``: only rank 0 writes
  ``.hydra/``).
- ``${mpi_rank:}`` and ``${mpi_size:}``.
- :class:`RankStreamHandler` / :class:`RankFileHandler`: logging handlers that keep other ranks quiet and file-less
  (or write ``<name>.rank<r>.log`` when asked).
- :class:`OneSweepDir`: a Hydra callback that keeps every point of a sweep in the sweep's dir, also points that set
  their own ``task_name`` (``-m experiment=digits_mlp,digits_cnn``).
- :class:`LauncherInOneProcess`: a launcher that starts the points itself (``hydra/launcher=slurm`` submits each as
  a SLURM job with its own ranks) is refused under several MPI ranks, which would each submit every point.
- :func:`quiet_other_ranks`: Hydra's basic sweeper writes ``multirun.yaml`` on whichever rank runs it; on ranks
  other than 0 that write is skipped.

The rank is MPI's (``MPI.COMM_WORLD``), the same one mpistrategy uses.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from datetime import datetime
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

_run_id: str | None = None


def comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def rank() -> int:
    return comm().Get_rank()


def size() -> int:
    return comm().Get_size()


def local_run_id(now: datetime | None = None) -> str:
    """This process's idea of a run id: the SLURM job (stable across a requeue) or the current time."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job:
        task = os.environ.get("SLURM_ARRAY_TASK_ID")
        return f"slurm-{job}" + (f"_{task}" if task and os.environ.get("SLURM_ARRAY_JOB_ID") else "")
    return (now or datetime.now()).strftime("%Y-%m-%d_%H-%M-%S")


def agree_on_run_id() -> str:
    """Collective over ``MPI.COMM_WORLD``: rank 0 decides the run id, every rank receives it. Call on all ranks,
    before Hydra composes (``mpistrategy.recipes.train.main`` does)."""
    global _run_id
    decided = local_run_id() if rank() == 0 else None
    _run_id = comm().bcast(decided, root=0) if size() > 1 else decided
    return _run_id


def run_id() -> str:
    # Outside main() (a submitit job unpickling the task) the value normally comes from the master's resolver
    # cache; this fallback is only used when there is none.
    return _run_id if _run_id is not None else local_run_id()


def _rank_zero(value: Any = None) -> Any:
    return value if rank() == 0 else None


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("mpi_run_id", run_id, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("mpi_rank_zero", _rank_zero, replace=True)
    OmegaConf.register_new_resolver("mpi_rank", rank, replace=True)
    OmegaConf.register_new_resolver("mpi_size", size, replace=True)


# --- logging handlers -------------------------------------------------------------------------------------------------


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


class RankStreamHandler(logging.StreamHandler):
    """A console handler: rank 0 at the configured level, the other ranks at ``other_ranks_level`` (WARNING)."""

    def __init__(self, stream=None, other_ranks_level: str | int = "WARNING") -> None:
        super().__init__(stream)
        self._other_level = (
            logging.getLevelName(other_ranks_level) if isinstance(other_ranks_level, str) else (other_ranks_level)
        )

    def emit(self, record: logging.LogRecord) -> None:
        if rank() != 0 and record.levelno < self._other_level:
            return
        super().emit(record)


class RankFileHandler(logging.Handler):
    """A file handler on rank 0; on other ranks nothing, or ``<stem>.rank<r><suffix>`` if ``per_rank``."""

    def __init__(self, filename: str, mode: str = "a", encoding: str | None = None, per_rank: Any = False) -> None:
        super().__init__()
        r = rank()
        self.path: str | None = filename
        if r != 0:
            if _as_bool(per_rank):
                stem, dot, suffix = filename.rpartition(".")
                self.path = f"{stem}.rank{r}.{suffix}" if dot else f"{filename}.rank{r}"
            else:
                self.path = None
        self._inner: logging.FileHandler | None = None
        if self.path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._inner = logging.FileHandler(self.path, mode=mode, encoding=encoding)

    def setFormatter(self, fmt) -> None:  # noqa: N802
        super().setFormatter(fmt)
        if self._inner is not None:
            self._inner.setFormatter(fmt)

    def emit(self, record: logging.LogRecord) -> None:
        if self._inner is not None:
            self._inner.emit(record)

    def flush(self) -> None:
        if self._inner is not None:
            self._inner.flush()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        super().close()


# --- the sweep dir ----------------------------------------------------------------------------------------------------


class OneSweepDir(Callback):
    """Hydra callback, every rank: pin ``hydra.sweep.dir`` to the sweep's value for every point.

    Hydra composes each point's config anew and resolves ``hydra.sweep.dir`` in it, so a point whose overrides change
    what the dir names (``${task_name}``, set by each ``experiment=``) would land in a dir of its own, where the
    comparison of the sweep never looks. The value resolved in the sweep's config becomes a Hydra override of every
    point's (as if given as ``hydra.sweep.dir=...``; recorded in ``multirun.yaml``).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        with read_write(config.hydra.overrides):
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir={_quoted(str(config.hydra.sweep.dir))}")


#: Hydra's own launcher, which runs the points in this process (on every rank, under mpiexec)
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


class LauncherInOneProcess(Callback):
    """Hydra callback, every rank: under several MPI ranks, refuse a launcher other than Hydra's basic one.

    Such a launcher starts each point itself (submitit: a SLURM job with its own ranks), so every rank would
    submit every point, into the same sweep dir. Rank 0 names the fix; every rank exits 1 before anything is
    submitted (Hydra turns a callback's exception into a warning, hence ``SystemExit``).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        target = str(config.hydra.launcher.get("_target_", BASIC_LAUNCHER))
        if size() == 1 or target == BASIC_LAUNCHER:
            return
        if rank() == 0:
            name = config.hydra.runtime.choices.get("hydra/launcher", target)
            sys.stderr.write(
                f"Error: hydra/launcher={name} starts every point of the sweep itself (each with its own ranks), "
                f"but this sweep runs on {size()} MPI ranks, each of which would start every point. Run it from one "
                f"process, without mpiexec or srun: mpistrategy-train -m hydra/launcher={name} ...\n"
            )
        raise SystemExit(1)


def _quoted(value: str) -> str:
    """``value`` as a quoted string of Hydra's override grammar: quotes escaped, and the backslashes before them or
    at the end; ``${`` escaped so that OmegaConf does not read an interpolation."""
    body = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), value)
    return "'" + body.replace("${", "\\${") + "'"


# --- multirun.yaml ----------------------------------------------------------------------------------------------------


def quiet_other_ranks() -> None:
    """On ranks other than 0, make Hydra's basic sweeper skip writing ``<sweep dir>/multirun.yaml``, and a failed
    job's result skip its "Error executing job with overrides" line (rank 0 prints it once).

    The sweeper calls ``OmegaConf.save`` through its module's ``OmegaConf`` name; only that name is replaced, by a
    subclass whose ``save`` does nothing. A job's result raises its error as before, without the line. Every rank
    still runs the same jobs in the same order.
    """
    if rank() == 0:
        return
    from hydra._internal.core_plugins import basic_sweeper
    from hydra.core.utils import JobReturn, JobStatus

    def quiet_return_value(job: JobReturn) -> Any:
        if job.status == JobStatus.COMPLETED:
            return job._return_value
        raise job._return_value

    JobReturn.return_value = property(quiet_return_value, JobReturn.return_value.fset)  # type: ignore[method-assign,assignment]

    class _NoSave(OmegaConf):
        @staticmethod
        def save(*args: Any, **kwargs: Any) -> None:
            return None

    basic_sweeper.OmegaConf = _NoSave  # type: ignore[misc]


register_resolvers()
