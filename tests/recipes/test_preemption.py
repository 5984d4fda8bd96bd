"""A stop signal mid-epoch through ``mpistrategy.recipes.train.train`` (what ``mpistrategy-train`` runs on every rank):
checkpoint, exit code 75, and the rerun in the same run dir ends with exactly the parameters and optimizer state of an
uninterrupted run; rerunning a finished run trains nothing.

With ``strategy=mpi_ad`` the strategy stops and checkpoints and the preemption callback only decides about the
requeue; with ``strategy=auto`` (one process) the callback does it all, and Lightning's plain loader re-reads the
interrupted epoch, so only the recovery itself is checked there. The SLURM requeue is tested in tests/slurm.
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir

import mpistrategy.recipes.hydra_mpi  # noqa: F401
from mpistrategy.recipes.config import register_configs
from mpistrategy.recipes.train import CONFIG_DIR, resume_command, train
from mpistrategy.strategy.failures import STOPPED_EXIT_CODE
from tests.strategy.helpers import shared_tmpdir


class SignalAt(L.Callback):
    """Sends ``signal`` to this process once, at the end of training step ``step``, on rank ``rank`` only."""

    def __init__(self, step: int, signal: str = "SIGUSR1", rank: int = 0) -> None:
        self.step, self.signum, self.rank, self.fired = step, int(getattr(_signal_module(), signal)), rank, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.fired and trainer.global_step == self.step and trainer.global_rank == self.rank:
            self.fired = True
            os.kill(os.getpid(), self.signum)


def _signal_module():
    return signal


def _cfg(run_dir: Path, strategy: str, extra: list[str]):
    register_configs()
    overrides = [
        f"strategy={strategy}",
        f"paths.output_dir={run_dir}",
        "trainer.max_epochs=3",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "summary.table=false",
        "summary.plot=false",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def _stop_with(signal_name: str, rank: int, step: int = 30) -> str:
    """The override that adds a :class:`SignalAt` callback."""
    target = "tests.recipes.test_preemption.SignalAt"
    return f"+callbacks.kill={{_target_: {target}, step: {step}, signal: {signal_name}, rank: {rank}}}"


def _assert_same_training_state(path: Path, reference_path: Path) -> None:
    state, reference = torch.load(path, weights_only=True), torch.load(reference_path, weights_only=True)
    assert state["global_step"] == reference["global_step"]
    for name, value in reference["state_dict"].items():
        assert torch.equal(state["state_dict"][name], value), f"parameter {name} differs from the uninterrupted run"
    optimizer, reference_optimizer = state["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"]
    assert optimizer.keys() == reference_optimizer.keys()
    for index, values in reference_optimizer.items():
        for key, value in values.items():
            assert torch.equal(optimizer[index][key], value), f"optimizer state {key} of parameter {index} differs"
    assert state["lr_schedulers"] == reference["lr_schedulers"]


@pytest.mark.mpi(ranks=(2, 3), timeout=300)
@pytest.mark.parametrize("signal_name", ["SIGUSR1", "SIGTERM"])
def test_a_stop_mid_epoch_and_the_rerun_end_bit_identical_to_an_uninterrupted_run(signal_name: str) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    base = Path(shared_tmpdir())
    noisy = ["optimizer=adamw", "model.dropout=0.2"]  # dropout and a stateful optimizer
    reference_dir, run_dir = base / "uninterrupted", base / "stopped"
    train(_cfg(reference_dir, "mpi_ad", noisy))

    with pytest.raises(SystemExit) as stop:
        train(_cfg(run_dir, "mpi_ad", [*noisy, _stop_with(signal_name, rank=comm.size - 1)]))
    assert stop.value.code == STOPPED_EXIT_CODE
    assert [p.name for p in run_dir.glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"]
    assert torch.load(run_dir / "hpc_ckpt_1.ckpt", weights_only=True)["global_step"] == 31
    assert not (run_dir / "summary.json").exists()
    comm.Barrier()  # rank 0 wrote the status before it raised
    assert json.loads((run_dir / "status.json").read_text())["status"] == "stopped"

    objective = train(_cfg(run_dir, "mpi_ad", noisy))
    comm.Barrier()  # rank 0 writes the summary after the other ranks are done
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(run_dir / "hpc_ckpt_1.ckpt")
    assert objective == pytest.approx(summary["final"]["val/acc"])
    # The resumed run's time counts from the resume (the interrupted epoch has no epoch start of its own).
    assert 0 < summary["train_seconds"] <= summary["fit_seconds"], summary
    assert summary["samples_per_second"] >= summary["train_samples"] / summary["fit_seconds"], summary
    _assert_same_training_state(run_dir / "checkpoints" / "last.ckpt", reference_dir / "checkpoints" / "last.ckpt")

    # Rerunning the finished run resumes from its last.ckpt, the final state, trains nothing, and keeps the
    # finished run's summary and objective.
    last = reference_dir / "checkpoints" / "last.ckpt"
    written = last.stat().st_mtime_ns
    finished = (reference_dir / "summary.json").read_text()
    rerun_objective = train(_cfg(reference_dir, "mpi_ad", noisy))
    comm.Barrier()
    assert (reference_dir / "summary.json").read_text() == finished
    assert rerun_objective == pytest.approx(json.loads(finished)["final"]["val/acc"])
    assert last.stat().st_mtime_ns == written


def test_with_another_strategy_the_preemption_callback_stops_and_the_rerun_finishes(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as stop:
        train(_cfg(tmp_path, "auto", [_stop_with("SIGUSR1", rank=0)]))
    assert stop.value.code == STOPPED_EXIT_CODE
    assert [p.name for p in tmp_path.glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"]
    assert not (tmp_path / "summary.json").exists()
    assert json.loads((tmp_path / "status.json").read_text())["status"] == "stopped"

    objective = train(_cfg(tmp_path, "auto", []))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"] == str(tmp_path / "hpc_ckpt_1.ckpt")
    steps_per_epoch = math.ceil(1437 / 32)
    assert summary["global_step"] == 3 * steps_per_epoch  # 30 steps before the stop + the rest after it
    assert objective == pytest.approx(summary["final"]["val/acc"])
    assert objective > 0.9
    # One metrics.csv across both parts (mpistrategy.recipes.loggers.ResumableCSVLogger keeps the first part's rows).
    with (tmp_path / "csv" / "metrics.csv").open() as handle:
        steps = [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss_step")]
    assert min(steps) < 30 < max(steps), steps
    assert max(steps) >= 3 * steps_per_epoch - 5


def _as_hydra_run(run_dir: Path, sweep_dir: Path, mode: str) -> None:
    """Make a composed config with these directories the running Hydra job's (``mode`` ``RUN`` or ``MULTIRUN``)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra.mode={mode}"], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.sweep.dir = str(sweep_dir)
    HydraConfig.instance().set_config(cfg)


def test_the_resume_command_is_the_same_command_in_the_stopped_run_dir(tmp_path: Path) -> None:
    """What the log's last line gives after a stop: the command with the run dir (a sweep's dir under -m) named."""
    from hydra.core.hydra_config import HydraConfig

    run, sweep = tmp_path / "run", tmp_path / "sweep"
    try:
        _as_hydra_run(run, sweep, "RUN")
        command = resume_command(["/venv/bin/mpistrategy-train", "trainer.max_epochs=2", "hydra.run.dir=relative"])
        assert command == f"mpistrategy-train trainer.max_epochs=2 hydra.run.dir={run}"
        assert resume_command(["recipes/train.py", "model.hidden=32"]) == (
            f"python -m mpistrategy.recipes.train model.hidden=32 hydra.run.dir={run}"
        )
        _as_hydra_run(run, sweep, "MULTIRUN")
        assert resume_command(["mpistrategy-train", "-m", "model.hidden=32,64"]) == (
            f"mpistrategy-train -m model.hidden=32,64 hydra.sweep.dir={sweep}"
        )
    finally:
        HydraConfig.instance().cfg = None  # no Hydra job runs in the tests that follow
    assert not HydraConfig.initialized()
