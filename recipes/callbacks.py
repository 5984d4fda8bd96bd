"""Lightning callbacks for the recipes: a fit timer for the summary, and SLURM preemption (checkpoint + requeue).

Preemption: SLURM sends a signal a set time before the time limit (``#SBATCH --signal=USR1@120``); handlers only
set a flag. At the next step boundary all ranks agree (a max-reduction of the flags, so a rank that got the signal
later still stops in the same step), save one checkpoint (rank 0 writes), stop (every rank exits with code 75,
:data:`mpistrategy.strategy.failures.STOPPED_EXIT_CODE`), and rank 0 asks for ``scontrol requeue $SLURM_JOB_ID``.
The requeued job gets the same job id, hence the same run dir (``slurm-<job id>``), and ``mpistrategy.recipes.train``
resumes from that checkpoint (with ``strategy=mpi_ad``: exactly where it stopped, see
:mod:`mpistrategy.strategy.resumable`).
"""

from __future__ import annotations

import logging
import os
import signal as signal_module
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from mpistrategy.strategy import failures

log = logging.getLogger(__name__)


class FitTimer(Callback):
    """Wall time of ``fit`` and of each training epoch, and the number of samples trained on (all ranks)."""

    def __init__(self) -> None:
        self.fit_seconds = 0.0
        self.train_seconds = 0.0
        self.samples = 0
        self.steps = 0
        self.epoch_seconds: list[float] = []
        self._fit_start = self._epoch_start = 0.0

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # An epoch resumed in its middle has no on_train_epoch_start: its time counts from here.
        self._epoch_start = time.perf_counter()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        first = batch[0] if isinstance(batch, list | tuple) else batch
        size = len(first) if hasattr(first, "__len__") else 0
        # Data parallel: every rank trains on its own batch of this size; model parallel: all on the same one.
        shared = getattr(trainer.datamodule, "same_batches_on_all_ranks", False)
        self.samples += size * (1 if shared else trainer.world_size)
        self.steps += 1

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds = time.perf_counter() - self._epoch_start
        self.epoch_seconds.append(seconds)
        self.train_seconds += seconds

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fit_seconds = time.perf_counter() - self._fit_start

    def stats(self) -> dict[str, float]:
        """This process's timing; the throughput only when it trained (a rerun of a finished run trains nothing)."""
        stats = {
            "fit_seconds": round(self.fit_seconds, 3),
            "train_seconds": round(self.train_seconds, 3),
            "train_samples": self.samples,
        }
        if self.samples and self.train_seconds:
            stats["samples_per_second"] = round(self.samples / self.train_seconds, 1)
        return stats


def _signal_number(name: str | int) -> int:
    if isinstance(name, int):
        return name
    name = name.upper()
    return int(getattr(signal_module, name if name.startswith("SIG") else f"SIG{name}"))


class Preemption(Callback):
    """SLURM preemption: on ``signal`` (default SIGUSR1) all ranks checkpoint and stop; rank 0 requeues the job.

    With ``strategy=mpi_ad`` the strategy already turns SIGUSR1/SIGTERM into a coordinated stop (a checkpoint
    ``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``, then every rank raises the same stop exception); this callback
    then only decides, on every rank together, whether the signal was ``signal`` (not an ``scancel``'s SIGTERM) and
    has rank 0 request the requeue. With another strategy it does all of it itself: its own handler, a
    max-reduction of the flags at each step boundary, the same ``hpc_ckpt_<n>.ckpt``, then the same stop exception on
    every rank (``mpistrategy.recipes.train`` treats it as a clean stop). That checkpoint is written after the step, but
    the run only resumes exactly with mpi_ad's resumable dataloader; other strategies re-read the interrupted epoch from
    its start, as Lightning does.

    Args:
        signal: the signal SLURM sends before the limit (``#SBATCH --signal=USR1@<seconds>``).
        requeue: run ``scontrol requeue $SLURM_JOB_ID`` on rank 0 (only inside a SLURM job).
        check_every_n_steps: how often the ranks compare flags when this callback handles the signal itself.
    """

    def __init__(self, signal: str | int = "SIGUSR1", requeue: bool = True, check_every_n_steps: int = 1) -> None:
        self.signum = _signal_number(signal)
        self.requeue = requeue
        self.check_every_n_steps = max(1, int(check_every_n_steps))
        self.received = False
        self.preempted = False
        self.requeued = False
        self.checkpoint: str | None = None
        self.delegated = False
        self._previous: Any = None

    # -- who handles the signal -------------------------------------------------------------------------------
    def _handler(self, signum, frame) -> None:
        self.received = True

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        handled = getattr(trainer.strategy, "_stop_signal_numbers", ())
        self.delegated = self.signum in tuple(int(s) for s in handled)
        if not self.delegated and threading.current_thread() is threading.main_thread():
            self._previous = signal_module.signal(self.signum, self._handler)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal_module.signal(self.signum, self._previous)
            self._previous = None

    # -- the strategy stopped every rank (mpi_ad) ----------------------------------------------------------------
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not self.delegated or not failures.is_coordinated_stop(exception):
            return  # a real failure: the strategy aborts every rank; no collective here
        stop = getattr(trainer.strategy, "_stop", None)
        mine = int(getattr(stop, "received", 0) or 0) == self.signum
        # Every rank is here (the stop was decided together): agree whether it was this signal.
        flag = torch.tensor(1.0 if mine else 0.0)
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="max")
        if float(flag) <= 0:
            return
        self.preempted = True
        self.checkpoint = _latest_hpc_checkpoint(trainer.default_root_dir)
        if self.requeue and trainer.is_global_zero:
            self.requeued = requeue_slurm_job()

    # -- handling the signal here (other strategies) --------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch: Any, batch_idx: int) -> None:
        if self.delegated or self.preempted or trainer.global_step % self.check_every_n_steps:
            return
        flag = torch.tensor(1.0 if self.received else 0.0)
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="max")
        if float(flag) <= 0:
            return
        self.preempted = True
        self.checkpoint = trainer.strategy.broadcast(
            trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir), 0
        )
        log.warning(
            "%s: checkpointing at step %d to %s",
            signal_module.Signals(self.signum).name,
            trainer.global_step,
            self.checkpoint,
        )
        trainer.save_checkpoint(self.checkpoint)
        if self.requeue and trainer.is_global_zero:
            self.requeued = requeue_slurm_job()
        # Stop now, on every rank (they decided together), as mpi_ad does: no further validation or checkpoint
        # after this one, so the run resumes exactly here.
        raise failures.mark_coordinated_stop(SIGTERMException(failures.STOPPED_EXIT_CODE))


def _latest_hpc_checkpoint(folder: str | os.PathLike) -> str | None:
    found = list_hpc_checkpoints(folder)
    return str(found[-1]) if found else None


def list_hpc_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """``hpc_ckpt_<n>.ckpt`` files in ``folder``, by ``n``."""

    def number(path: Path) -> int:
        try:
            return int(path.stem.rsplit("_", 1)[1])
        except (IndexError, ValueError):
            return -1

    return sorted(Path(folder).glob("hpc_ckpt_*.ckpt"), key=number)


REQUEUE_FILE_ENV = "MPISTRATEGY_REQUEUE_FILE"


def slurm_job_id() -> str | None:
    """This job's id for ``scontrol`` (``<array job>_<task>`` for an array task), or None outside SLURM."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job() -> bool:
    """Requeue this SLURM job. False outside SLURM.

    With ``$MPISTRATEGY_REQUEUE_FILE`` set (slurm/preemptible.sbatch sets it), the job id is written there and the
    batch script runs ``scontrol requeue`` once the step has ended: every rank exits cleanly first. Otherwise
    ``scontrol requeue`` runs now, and SLURM ends the ranks while they are still shutting down (MPI state such as
    MPICH's shared-memory segments of a killed rank can then be left behind on the node).
    """
    job = slurm_job_id()
    if not job:
        log.warning("preempted outside a SLURM job: not requeued; the run resumes from its checkpoint in its run dir")
        return False
    marker = os.environ.get(REQUEUE_FILE_ENV)
    if marker:
        Path(marker).write_text(f"{job}\n")
        log.warning("requeue of SLURM job %s requested: the batch script requeues it when this step ends", job)
        return True
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, (result.stderr or result.stdout).strip())
        return False
    log.warning("requeued SLURM job %s", job)
    return True
