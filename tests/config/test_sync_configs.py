"""Hydra options of the sync modes (``strategy=hierarchical | local_sgd | hierarchical_local_sgd | daso | gossip``):
every constructor option is a typed field at the strategy level, overrides reach the mode, and bad keys or values
fail at composition or while building, naming the field and what is valid; under mpiexec every rank exits
non-zero without a hang, also when only one rank got a bad value."""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException
from omegaconf import OmegaConf

import mpistrategy.recipes.hydra_mpi  # noqa: F401  (registers the resolvers)
from mpistrategy.launch import mpiexec_command
from mpistrategy.recipes.builders import build_strategy
from mpistrategy.recipes.config import explain, register_configs
from mpistrategy.recipes.train import CONFIG_DIR
from mpistrategy.sync import SYNC_MODES
from tests.recipes._cli import clean_env, train_command

MODES = ["hierarchical", "local_sgd", "hierarchical_local_sgd", "daso", "gossip"]
SHARED = {"sync", "ranks_per_node", "node_transport", "log_traffic", "bucket_cap_mb", "stop_signals"}


@pytest.fixture(scope="module", autouse=True)
def _schemas() -> None:
    register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[*overrides, "paths.output_dir=unused"])


def _options(cfg) -> dict:
    return OmegaConf.to_container(cfg.strategy, enum_to_str=True)


def test_every_sync_mode_has_a_strategy_option() -> None:
    assert sorted(MODES) == sorted(mode for mode in SYNC_MODES if mode != "flat")
    assert {p.stem for p in (CONFIG_DIR / "strategy").glob("*.yaml")} >= set(MODES)


@pytest.mark.parametrize("mode", MODES)
def test_every_option_of_the_mode_is_a_field_at_its_default_and_builds_the_mode(mode: str) -> None:
    cfg = _compose(f"strategy={mode}")
    options = _options(cfg)
    parameters = inspect.signature(SYNC_MODES[mode]).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD}
    assert bool(defaults) == (mode != "hierarchical"), defaults
    assert {name: options[name] for name in defaults} == defaults
    assert SHARED <= set(options) and options["sync"] == mode
    assert options["ranks_per_node"] is None and options["node_transport"] == "auto"
    strategy = build_strategy(cfg)
    assert type(strategy.sync) is SYNC_MODES[mode]
    assert strategy.node_transport == "auto" and strategy.log_traffic is True


def test_overrides_reach_the_mode_and_the_strategy() -> None:
    cfg = _compose(
        "strategy=daso",
        "strategy.global_skip=8",
        "strategy.batches_to_wait=2",
        "strategy.warmup_epochs=1",
        "strategy.cooldown_epochs=0",
        "strategy.stability_level=0.1",
        "strategy.sending_chunk_size=1000",
        "strategy.downcast=null",
        "strategy.downcast_all_phases=true",
        "strategy.node_transport=gloo",
        "strategy.ranks_per_node=2",
        "strategy.bucket_cap_mb=5",
    )
    strategy = build_strategy(cfg)
    daso = strategy.sync
    assert (daso.global_skip, daso.batches_to_wait, daso.warmup_epochs, daso.cooldown_epochs) == (8, 2, 1, 0)
    assert (daso.stability_level, daso.sending_chunk_size, daso.downcast, daso.downcast_all_phases) == (
        0.1, 1000, None, True,
    )  # fmt: skip
    assert strategy.node_transport == "gloo" and strategy.bucket_cap_mb == 5.0
    assert strategy.topology.virtual  # ranks_per_node reached the cluster environment

    local = build_strategy(_compose("strategy=hierarchical_local_sgd", "strategy.period=4", "strategy.warmup_steps=3"))
    assert type(local.sync).__name__ == "HierarchicalLocalSGD"
    assert (local.sync.period, local.sync.warmup_steps) == (4, 3)
    gossip = build_strategy(_compose("strategy=gossip", "strategy.graph=exponential", "strategy.period=2"))
    assert (gossip.sync.graph, gossip.sync.period) == ("exponential", 2)
    custom = build_strategy(_compose("strategy=gossip", "strategy.graph=custom", "strategy.neighbours=[[]]"))
    assert custom.sync.graph == [[]]  # a world of one: rank 0 has no neighbours
    flat = build_strategy(_compose("strategy=mpi_ad", "strategy.sync=hierarchical"))
    assert type(flat.sync).__name__ == "HierarchicalSync"


@pytest.mark.parametrize(
    "option, override, hint",
    [
        ("daso", "strategy.global_skp=4", "Did you mean 'strategy.global_skip'?"),
        ("gossip", "strategy.neighbors=[[0]]", "Did you mean 'strategy.neighbours'?"),
        ("local_sgd", "strategy.global_skip=4", "Keys allowed in 'strategy':"),
        ("mpi_ad", "strategy.period=4", "Keys allowed in 'strategy':"),
    ],
)
def test_an_unknown_key_names_the_key_and_the_allowed_ones(option: str, override: str, hint: str) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose(f"strategy={option}", override)
    message = explain(info.value)
    assert override.split("=")[0] in message and hint in message, message


@pytest.mark.parametrize(
    "option, override, valid",
    [
        ("gossip", "strategy.graph=rings", ["ring", "torus", "exponential", "complete", "custom"]),
        ("daso", "strategy.downcast=fp8", ["bfloat16", "float16", "float32"]),
        ("hierarchical", "strategy.node_transport=ucx", ["auto", "mpi", "gloo", "nccl"]),
        ("daso", "strategy.global_skip=x", ["Integer"]),
        ("local_sgd", "strategy.period=1.5", ["Integer"]),
        ("daso", "strategy.stability_level=high", ["Float"]),
        ("hierarchical_local_sgd", "strategy.ranks_per_node=two", ["Integer"]),
        ("gossip", "strategy.neighbours=[[a]]", ["int"]),
    ],
)
def test_a_value_of_the_wrong_kind_fails_at_composition_naming_the_field(
    option: str, override: str, valid: list[str]
) -> None:
    with pytest.raises(ConfigCompositionException) as info:
        _compose(f"strategy={option}", override)
    message = explain(info.value)
    assert override.split("=")[0] in message, message
    for choice in valid:
        assert choice in message, message


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["strategy=local_sgd", "strategy.period=0"], "local_sgd: period=0 must be an integer >= 1"),
        (["strategy=hierarchical_local_sgd", "strategy.warmup_steps=-1"], "warmup_steps=-1 must be an integer >= 0"),
        (["strategy=daso", "strategy.global_skip=0"], "daso: global_skip=0 must be an integer >= 1"),
        (["strategy=daso", "strategy.skip_reduction_factor=1"], "skip_reduction_factor=1 must be an integer >= 2"),
        (["strategy=daso", "strategy.stability_level=-0.5"], "stability_level=-0.5 must be a number >= 0"),
        (["strategy=gossip", "strategy.period=0"], "gossip: period=0 must be an integer >= 1"),
        (["strategy=gossip", "strategy.graph=custom"], "strategy.graph=custom needs strategy.neighbours"),
        (["strategy=gossip", "strategy.neighbours=[[]]"], "set strategy.graph=custom"),
        (
            ["strategy=gossip", "strategy.graph=custom", "strategy.neighbours=[[1,3],[0,2],[1,3],[0,2]]"],
            "the neighbour list has 4 entries but there are 1 ranks",
        ),
        (["strategy=mpi_ad", "strategy.sync=dasso"], "valid modes: flat, hierarchical, local_sgd"),
        (["strategy=mpi_ad_model_parallel", "strategy.sync=daso"], "use sync=flat"),
        (["strategy=hierarchical", "strategy.ranks_per_node=0"], "ranks_per_node=0 is not a positive integer"),
    ],
)
def test_a_value_out_of_range_fails_while_building_naming_the_field(overrides: list[str], named: str) -> None:
    cfg = _compose(*overrides)
    with pytest.raises(InstantiationException) as info:
        build_strategy(cfg)
    assert named in str(info.value), info.value


# --- the command line under mpiexec ------------------------------------------------------------------------------

BAD = ["strategy=local_sgd", "strategy.period=0"]


def _launch(tmp_path: Path, *groups: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``mpiexec -n 1 <rank 0's command> : -n 1 <rank 1's> ...``; each rank reports its exit code on stderr."""
    command = [*mpiexec_command()]
    for index, overrides in enumerate(groups):
        report = '"$@"; code=$?; echo "rank exit code $code" >&2; exit $code'
        command += [*([":"] if index else []), "-n", "1", "sh", "-c", report, "sh", *train_command(), *overrides]
    result = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(MPISTRATEGY_LOG_DIR=str(tmp_path / "logs")),
    )
    codes = [line.rsplit(" ", 1)[1] for line in result.stderr.splitlines() if line.startswith("rank exit code")]
    return result, codes


def test_a_bad_value_on_every_rank_exits_every_rank_with_the_message(tmp_path: Path) -> None:
    result, codes = _launch(tmp_path, BAD, BAD)
    assert result.returncode != 0 and codes == ["1", "1"], result.stderr
    assert result.stderr.count("local_sgd: period=0 must be an integer >= 1") == 1, result.stderr  # rank 0 reports
    assert "Traceback" not in result.stderr


def test_a_value_on_one_rank_only_is_named_with_every_ranks_value_and_every_rank_exits(tmp_path: Path) -> None:
    """The ranks compare their composed configs before building (a build is collective): rank 0 names the key and
    each rank's value, once, and every rank exits 1."""
    result, codes = _launch(tmp_path, ["strategy=local_sgd"], BAD)
    assert result.returncode != 0 and codes == ["1", "1"], result.stderr
    message = r"\[rank (\d)\] the ranks composed different configs: strategy.period \(rank 0: \d+; rank 1: 0\)"
    reported = re.findall(message, result.stderr)
    assert reported == ["0"], result.stderr
    assert "Traceback" not in result.stderr


def test_a_mode_that_cannot_run_on_the_layout_fails_at_setup_on_every_rank_without_a_hang(tmp_path: Path) -> None:
    """DASO needs nodes of equal size: 3 ranks as nodes of 2 (2 + 1) stop together when the Trainer sets up (no
    abort: every rank raises the error)."""
    command = [*mpiexec_command(), "-n", "3", *train_command(), "experiment=debug", "strategy=daso"]
    result = subprocess.run(
        [*command, "strategy.ranks_per_node=2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(MPISTRATEGY_LOG_DIR=str(tmp_path / "logs")),
    )
    assert result.returncode == 1, result.stderr
    assert "daso: needs nodes of equal size" in result.stderr and "[2, 1] ranks" in result.stderr, result.stderr
    assert "aborting" not in result.stderr and "MPI_Abort" not in result.stderr, result.stderr
