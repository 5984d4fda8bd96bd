"""``LightningCLI`` over Lightning's demo ``BoringModel``, the strategy chosen on the command line as a user of the CLI
does: by class path with its init arguments (ZeRO stage 1, stop signals by name, a sync mode by name, a compressor by
class path), the composed config printed with every default representable, and an unknown stop signal ending every
rank. Each test runs its own ``mpiexec`` job of ``tests/strategy/scripts/lightning_cli.py``; the same signal given
to one rank only goes through ``one_rank_option_job.py``, without the CLI."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.external_job import OUTER_RUN_ONLY, ROOT, run_mpi_job
from tests.mpi_harness import clean_environ
from tests.strategy.helpers import ONE_RANK_OPTION_JOB

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse (the test extra installs it)")
yaml = pytest.importorskip("yaml", reason="jsonargparse reads and prints YAML with PyYAML")

SCRIPT = Path(__file__).parent / "scripts" / "lightning_cli.py"
TIMEOUT = 240.0  # generous: every rank imports torch, Lightning and jsonargparse on a loaded 2-core machine
STRATEGY = "--trainer.strategy=mpistrategy.strategy.MPIADStrategy"
SHORT_FIT = (
    "--trainer.accelerator=cpu", "--trainer.max_epochs=1", "--trainer.limit_train_batches=6",
    "--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
)  # fmt: skip
ADAMW_STATE_BYTES = 66 * 2 * 4  # BoringModel's 66 float32 parameters: exp_avg and exp_avg_sq

pytestmark = OUTER_RUN_ONLY


def _fit(tmp_path: Path, ranks: int, *options: str) -> list[dict]:
    code, output, _ = run_mpi_job(
        SCRIPT, ranks, "fit", *options, *SHORT_FIT, f"--trainer.default_root_dir={tmp_path}",
        timeout=TIMEOUT, CLI_REPORT_DIR=str(tmp_path),
    )  # fmt: skip
    assert code == 0, output[-6000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def test_zero_stage_1_and_stop_signals_by_name_from_the_command_line(tmp_path: Path) -> None:
    ranks = _fit(tmp_path, 2, STRATEGY, "--trainer.strategy.shard=optimizer", "--trainer.strategy.stop_signals=[USR1]",
                 "--optimizer=AdamW", "--optimizer.lr=0.01")  # fmt: skip
    for report in ranks:
        assert report["strategy"] == "MPIADStrategy" and report["shard"] == "optimizer"
        assert report["stop_signals"] == [int(signal.SIGUSR1)]
    assert ranks[0]["parameters"] == ranks[1]["parameters"]
    metrics = ranks[0]["metrics"]
    memory = {name: value for name, value in metrics.items() if name.startswith("memory/")}
    assert {name: value for name, value in ranks[1]["metrics"].items() if name.startswith("memory/")} == memory
    held = [metrics[f"memory/rank{rank}/optimizer_state_bytes"] for rank in (0, 1)]  # every rank's, on every rank
    assert sum(held) >= ADAMW_STATE_BYTES, held  # the whole state, once
    assert all(bytes_ <= ADAMW_STATE_BYTES / 2 + 16 for bytes_ in held), held  # half each (and a step counter)


def test_a_sync_mode_by_name_and_a_compressor_by_class_path_at_three_ranks(tmp_path: Path) -> None:
    options = ("--trainer.strategy.sync=local_sgd", "--trainer.strategy.aggregator=mpistrategy.aggregation.TopK",
               "--trainer.strategy.aggregator.density=0.5")  # fmt: skip
    ranks = _fit(tmp_path, 3, STRATEGY, *options)
    for report in ranks:
        assert report["sync"] == "LocalSGD"
        assert report["aggregator"].startswith("TopK(") and "density=0.5" in report["aggregator"]
        assert report["stop_signals"] == [int(signal.SIGTERM), int(signal.SIGUSR1)]
        assert len(report["parameters"]) == 66 and all(abs(value) < 1e3 for value in report["parameters"])


def test_the_printed_config_holds_the_strategy_and_its_defaults_and_runs_as_given(tmp_path: Path) -> None:
    """Each strategy argument once (the precision plugin under Lightning's name only), and the printed file is a
    config the CLI takes back."""
    printed = subprocess.run(
        [sys.executable, str(SCRIPT), "fit", STRATEGY, "--trainer.strategy.shard=gradients", "--print_config"],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT, env=clean_environ(),
    )  # fmt: skip
    assert printed.returncode == 0, printed.stderr[-4000:]
    config = printed.stdout
    assert "class_path: mpistrategy.strategy" in config and "MPIADStrategy" in config
    assert "shard: gradients" in config and "- SIGTERM" in config and "- SIGUSR1" in config
    arguments = yaml.safe_load(config)["trainer"]["strategy"]["init_args"]
    assert "precision_plugin" in arguments and "precision" not in arguments, sorted(arguments)
    (tmp_path / "config.yaml").write_text(config)
    ranks = _fit(tmp_path, 2, f"--config={tmp_path / 'config.yaml'}")
    assert ranks[0]["shard"] == "gradients" and ranks[0]["parameters"] == ranks[1]["parameters"]


def test_an_unknown_stop_signal_ends_every_rank_with_the_reason(tmp_path: Path) -> None:
    code, output, _ = run_mpi_job(
        SCRIPT, 2, "fit", STRATEGY, "--trainer.strategy.stop_signals=[SIGFOO]", *SHORT_FIT,
        timeout=TIMEOUT, CLI_REPORT_DIR=str(tmp_path),
    )  # fmt: skip
    assert code != 0
    assert "stop_signals: 'SIGFOO' is not a signal on this system" in output, output[-4000:]
    assert not list(tmp_path.glob("rank*.json"))


def test_an_unknown_stop_signal_on_one_rank_only_ends_the_job() -> None:
    code, output, _ = run_mpi_job(ONE_RANK_OPTION_JOB, 3, "stop_signals", '["USR1"]', '["USR99"]', timeout=TIMEOUT)
    assert code != 0
    assert "stop_signals: 'USR99' is not a signal on this system" in output, output[-4000:]
    assert "[mpistrategy] rank 1 of 3" in output, output[-4000:]
