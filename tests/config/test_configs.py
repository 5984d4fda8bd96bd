"""Every experiment preset composes and instantiates; bad overrides fail at composition, naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import mpistrategy.recipes.hydra_mpi  # noqa: F401  (registers the resolvers)
from mpistrategy.recipes.config import explain, register_configs
from mpistrategy.recipes.train import CONFIG_DIR

EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _schemas() -> None:
    register_configs()


def _compose(overrides: list[str], tmp_path: Path | None = None, hydra: bool = False):
    extra = [f"paths.output_dir={tmp_path}"] if tmp_path is not None else []
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[*overrides, *extra], return_hydra_config=hydra)


def _assert_holds(composed: object, written: object, where: str) -> None:
    """Assert that every value written in an option file (interpolations aside) is in the composed config."""
    if isinstance(written, dict):
        assert isinstance(composed, dict), where
        for key, value in written.items():
            _assert_holds(composed[key], value, f"{where}.{key}")
    elif not (isinstance(written, str) and "${" in written):
        assert composed == written, where


def test_the_presets_are_all_found() -> None:
    assert {"digits_mlp", "digits_cnn", "synthetic_mlp", "tp_mlp", "pipeline_mlp", "debug"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(experiment: str, tmp_path: Path) -> None:
    import lightning as L

    from mpistrategy.recipes.builders import build_run

    cfg = _compose([f"experiment={experiment}"], tmp_path)
    assert cfg.task_name == experiment
    OmegaConf.resolve(cfg)  # every interpolation resolves
    run = build_run(cfg)
    assert isinstance(run.trainer, L.Trainer)
    assert isinstance(run.model, L.LightningModule)
    assert isinstance(run.datamodule, L.LightningDataModule)
    run.datamodule.setup("fit")
    x, y = next(iter(run.datamodule.train_dataloader()))
    assert x.shape[0] == y.shape[0] == cfg.data.batch_size


@pytest.mark.parametrize(
    "group, option",
    [
        ("model", "cnn"),
        ("model", "big_mlp"),
        ("optimizer", "adam"),
        ("optimizer", "adamw"),
        ("scheduler", "step"),
        ("strategy", "auto"),
        ("strategy", "mpi_ad_one_bucket"),
        ("data", "synthetic"),
        ("callbacks", "early_stopping"),
        ("callbacks", "none"),
        ("logger", "none"),
        ("trainer", "debug"),
        ("trainer", "gpu"),
    ],
)
def test_every_group_option_composes(group: str, option: str, tmp_path: Path) -> None:
    cfg = _compose([f"{group}={option}"], tmp_path, hydra=True)
    assert cfg.hydra.runtime.choices[group] == option
    OmegaConf.set_struct(cfg, False)
    cfg.pop("hydra")
    OmegaConf.resolve(cfg)
    own = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / group / f"{option}.yaml"))
    assert isinstance(own, dict)
    own.pop("defaults", None)
    _assert_holds(OmegaConf.to_container(cfg[group]), own, f"{group}={option}")
    if group in ("model", "optimizer", "data", "scheduler"):
        assert instantiate(cfg[group]) is not None


def test_the_default_job_is_the_digits_mlp_on_mpi_ad(tmp_path: Path) -> None:
    cfg = _compose([], tmp_path, hydra=True)
    assert cfg.model._target_ == "mpistrategy.recipes.models.MLPClassifier"
    assert cfg.data._target_ == "mpistrategy.recipes.data.DigitsDataModule"
    assert cfg.strategy._target_ == "mpistrategy.recipes.builders.mpi_ad_strategy"
    hydra = OmegaConf.to_container(cfg.hydra, resolve=False)
    assert hydra["output_subdir"] == "${mpi_rank_zero:.hydra}"
    assert "${mpi_run_id:}" in hydra["run"]["dir"] and "${mpi_run_id:}" in hydra["sweep"]["dir"]
    assert cfg.hydra.output_subdir == ".hydra"  # rank 0 of a world of one


def test_configs_are_typed(tmp_path: Path) -> None:
    cfg = _compose(["trainer.max_epochs=3", "optimizer.lr=0.5", "data.batch_size=16"], tmp_path)
    assert cfg.trainer.max_epochs == 3 and isinstance(cfg.trainer.max_epochs, int)
    assert cfg.optimizer.lr == 0.5 and cfg.data.batch_size == 16


@pytest.mark.parametrize(
    "override, named, hint",
    [
        ("trainer.max_epoch=3", "trainer.max_epoch", "Did you mean 'trainer.max_epochs'?"),
        ("model.hiden=64", "model.hiden", "Did you mean 'model.hidden'?"),
        ("optimizer.learning_rate=0.1", "optimizer.learning_rate", "Keys allowed in 'optimizer':"),
        ("data.batchsize=8", "data.batchsize", "Did you mean 'data.batch_size'?"),
        ("strategy.bucket_cap=5", "strategy.bucket_cap", "Did you mean 'strategy.bucket_cap_mb'?"),
        ("sead=3", "sead", "Did you mean 'seed'?"),
    ],
)
def test_a_misspelled_key_fails_naming_the_key_and_the_choices(override: str, named: str, hint: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose([override])
    message = explain(info.value)
    assert named in message and hint in message, message


@pytest.mark.parametrize(
    "override, named",
    [
        ("trainer.max_epochs=ten", "trainer.max_epochs"),
        ("data.batch_size=1.5", "data.batch_size"),
        ("optimizer.lr=fast", "optimizer.lr"),
        ("strategy.abort_on_exception=maybe", "strategy.abort_on_exception"),
        ("model.depth=[1,2]", "model.depth"),
    ],
)
def test_a_wrong_type_fails_naming_the_key(override: str, named: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose([override])
    assert named in explain(info.value)


@pytest.mark.parametrize(
    "override, choices",
    [
        ("model=mlpp", ["mlp", "cnn", "tp_mlp", "pipeline_mlp"]),
        ("experiment=digits", ["digits_mlp", "digits_cnn"]),
        ("strategy=mpi", ["mpi_ad", "mpi_ad_model_parallel", "auto"]),
    ],
)
def test_an_unknown_option_lists_the_choices(override: str, choices: list[str]) -> None:
    with pytest.raises(Exception) as info:
        _compose([override])
    message = explain(info.value)
    assert override.split("=")[0] in message
    for choice in choices:
        assert choice in message, message


def test_the_command_line_fails_before_training_with_the_named_key(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mpistrategy.recipes.train", "trainer.max_epoch=3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "MPISTRATEGY_LOG_DIR": str(tmp_path / "logs")},
    )
    assert result.returncode == 1, result.stderr
    assert "trainer.max_epoch" in result.stderr and "Did you mean 'trainer.max_epochs'?" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "logs").exists()  # nothing was built, no run directory


def test_a_bad_strategy_option_names_the_accepted_ones(tmp_path: Path) -> None:
    from mpistrategy.recipes.builders import mpi_ad_strategy

    with pytest.raises(TypeError, match=r"strategy\.bucket_size: MPIADStrategy does not accept.*bucket_cap_mb"):
        mpi_ad_strategy(bucket_size=3)
    with pytest.raises(ValueError, match="stop_signals: 'SIGFOO' is not a signal on this system"):
        mpi_ad_strategy(stop_signals=["SIGFOO"])


def test_a_cosine_scheduler_without_a_length_fails_naming_t_max_and_the_fix(tmp_path: Path) -> None:
    from omegaconf.errors import ValidationError

    from mpistrategy.recipes.builders import build_run
    from mpistrategy.recipes.config import check_values
    from mpistrategy.recipes.train import _is_config_error

    for overrides, t_max in ((["trainer.max_epochs=-1"], -1), (["scheduler.T_max=0"], 0)):
        with pytest.raises(ValidationError) as info:
            build_run(_compose(overrides, tmp_path))
        message = explain(info.value)
        assert message.startswith(f"scheduler.T_max={t_max} (trainer.max_epochs="), message
        assert "Set scheduler.T_max" in message and "a finite trainer.max_epochs" in message
        assert _is_config_error(info.value)  # printed once by rank 0, without a traceback
    for fine in (["trainer.max_epochs=-1", "scheduler.T_max=5"], ["trainer.max_epochs=-1", "scheduler=step"]):
        check_values(_compose(fine, tmp_path))


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPISTRATEGY_TEST_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("launcher, partition", [("slurm", None), ("slurm_local", "debug")])
def test_the_slurm_launchers_compose_for_submitit(launcher: str, partition: str | None) -> None:
    cfg = _compose([f"hydra/launcher={launcher}"], hydra=True)
    node = cfg.hydra.launcher
    assert node._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert node.partition == partition and node.tasks_per_node == 2
    assert "export SLURM_MPI_TYPE=pmi2" in node.setup  # srun gives the ranks an MPI world (MPICH)


def test_the_stall_watchdog_and_flight_recorder_are_strategy_options(tmp_path: Path) -> None:
    from mpistrategy.comm import flight, stall_settings
    from mpistrategy.recipes.builders import build_run

    before = (stall_settings.stall_timeout(), stall_settings.stall_action(), flight.flight_directory())
    overrides = ["strategy.stall_timeout=42", "strategy.stall_action=warn", f"strategy.flight_dir={tmp_path}/flight"]
    try:
        build_run(_compose(overrides, tmp_path))
        assert (stall_settings.stall_timeout(), stall_settings.stall_action()) == (42.0, "warn")
        assert flight.flight_directory() == tmp_path / "flight"
    finally:
        stall_settings.set_stall_timeout(before[0], before[1])
        flight.set_flight_directory(before[2])


@pytest.mark.parametrize("strategy, shard", [("mpi_ad", "gradients"), ("hierarchical", "optimizer")])
def test_shard_is_a_strategy_option(strategy: str, shard: str, tmp_path: Path) -> None:
    from mpistrategy.recipes.builders import build_strategy

    built = build_strategy(_compose([f"strategy={strategy}", f"strategy.shard={shard}"], tmp_path))
    assert built.shard == shard
    assert build_strategy(_compose([f"strategy={strategy}"], tmp_path)).shard is None
    with pytest.raises(ConfigCompositionException) as info:
        _compose(["strategy.shard=parameters"])
    assert "strategy.shard" in explain(info.value) and "gradients" in explain(info.value)
