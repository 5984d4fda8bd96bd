"""A stop signal mid-epoch: checkpoint, stop, and a rerun in the same run dir resumes to the same step count.

In one process, through ``recipes.train.train`` (what Hydra calls): with ``strategy=mpi_ad`` the strategy stops
and checkpoints and the preemption callback only decides about the requeue; with ``strategy=auto`` the callback
does it all. The SLURM requeue itself is tested in tests/slurm.
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
from hydra import compose, initialize_config_dir

import recipes.hydra_mpi  # noqa: F401
from recipes.config import register_configs
from recipes.train import CONFIG_DIR, train


class SignalAt(L.Callback):
    """Sends ``signal`` to this process once, at the end of training step ``step``."""

    def __init__(self, step: int, signal: str = "SIGUSR1") -> None:
        self.step, self.signum, self.fired = step, int(getattr(signal_module(), signal)), False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.fired and trainer.global_step == self.step:
            self.fired = True
            os.kill(os.getpid(), self.signum)


def signal_module():
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


@pytest.mark.parametrize("strategy", ["mpi_ad", "auto"])
def test_a_stop_signal_mid_epoch_checkpoints_and_the_rerun_resumes_to_the_same_step_count(
    strategy: str, tmp_path: Path
) -> None:
    kill = "+callbacks.kill={_target_: tests.recipes.test_preemption.SignalAt, step: 30}"
    assert train(_cfg(tmp_path, strategy, [kill])) is None  # stopped: no objective
    assert [p.name for p in tmp_path.glob("hpc_ckpt_*.ckpt")] == ["hpc_ckpt_1.ckpt"]
    assert not (tmp_path / "summary.json").exists()

    objective = train(_cfg(tmp_path, strategy, []))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"] == str(tmp_path / "hpc_ckpt_1.ckpt")
    steps_per_epoch = math.ceil(1437 / 32)
    assert summary["global_step"] == 3 * steps_per_epoch  # 30 steps before the stop + the rest after it
    assert objective == pytest.approx(summary["final"]["val/acc"])
    assert objective > 0.9
    # One metrics.csv across both parts (recipes.loggers.ResumableCSVLogger keeps the first part's rows).
    with (tmp_path / "csv" / "metrics.csv").open() as handle:
        steps = [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss_step")]
    assert min(steps) < 30 < max(steps), steps
    assert max(steps) >= 3 * steps_per_epoch - 5
