"""Configuration: schemes by name, bad options named at construction, options that differ between ranks and
buckets a scheme cannot combine refused at setup on every rank, and the Hydra options of every scheme."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

import mpistrategy.recipes.hydra_mpi  # noqa: F401  (registers the resolvers)
from mpistrategy import aggregation
from mpistrategy.aggregation import (
    SCHEMES,
    LowPrecision,
    MajorityVote,
    MeanAggregator,
    PowerSGD,
    RandomK,
    ScaledSign,
    TopK,
    build_aggregator,
)
from mpistrategy.recipes.config import explain, register_configs
from mpistrategy.recipes.train import CONFIG_DIR
from tests.aggregation.helpers import RANK, SIZE, bucket, combine, everyone, setup
from tests.recipes._cli import clean_env, train_command

ALL = ["mean", "fp16", "bf16", "topk", "randomk", "qsgd", "minmax", "sign", "majority_vote", "powersgd"]


# ------------------------------------------------------------------------------------------------------- by name


def test_every_scheme_is_built_by_name() -> None:
    assert list(SCHEMES) == ALL
    assert isinstance(build_aggregator("mean"), MeanAggregator)
    assert build_aggregator("bf16").dtype == "bfloat16"
    built = build_aggregator("powersgd", rank=4, start_iter=0)
    assert isinstance(built, PowerSGD) and built.rank == 4 and built.start_iter == 0
    assert repr(build_aggregator("topk", density=0.05)) == "TopK(density=0.05, error_feedback=True)"


def test_an_unknown_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown aggregation scheme 'top_k'; valid names: mean, fp16, bf16, topk"):
        build_aggregator("top_k")


def test_an_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(TypeError, match="'randomk'.*'densty'.*accepts density, seed, error_feedback"):
        build_aggregator("randomk", densty=0.1)
    with pytest.raises(TypeError, match="'fp16'.*accepts no options"):
        build_aggregator("fp16", scale=2)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("topk", {"density": 0.0}, r"topk: density=0.0 is outside \(0, 1\]"),
        ("topk", {"density": 1.5}, r"topk: density=1.5 is outside \(0, 1\]"),
        ("randomk", {"density": -0.1}, r"randomk: density=-0.1 is outside \(0, 1\]"),
        ("powersgd", {"rank": 0}, r"powersgd: rank=0 is invalid; rank must be an integer >= 1"),
        ("powersgd", {"start_iter": -1}, r"powersgd: start_iter=-1 is invalid; start_iter must be an integer >= 0"),
        ("powersgd", {"min_compression_rate": -1}, r"min_compression_rate must be a number >= 0"),
        ("qsgd", {"levels": 0}, r"qsgd: levels=0 is invalid; levels must be an integer from 1 to 127"),
        ("qsgd", {"levels": 128}, r"levels must be an integer from 1 to 127"),
        ("qsgd", {"block_size": 0}, r"block_size must be an integer >= 1"),
        ("minmax", {"bits": 9}, r"minmax: bits=9 is invalid; bits must be an integer from 1 to 8"),
        ("fp16", {}, None),
        ("sign", {"error_feedback": "yes"}, r"sign: error_feedback must be True or False, got 'yes'"),
    ],
)
def test_bad_options_fail_at_construction_naming_the_field_and_the_valid_values(name, options, message) -> None:
    if message is None:
        with pytest.raises(ValueError, match=r"low_precision: dtype='float8' is not valid; choose one of 'float16'"):
            LowPrecision("float8")
        return
    with pytest.raises((ValueError, TypeError), match=message):
        build_aggregator(name, **options)
    with pytest.raises(TypeError, match=r"topk: density must be a number in \(0, 1\], got '0.1' \(str\)"):
        TopK(density="0.1")
    with pytest.raises(TypeError, match="powersgd: rank must be an integer >= 1.*got 1.5"):
        PowerSGD(rank=1.5)


# ------------------------------------------------------------------------------------------------------- setup


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_options_that_differ_between_ranks_fail_at_setup_on_every_rank() -> None:
    density = 0.25 if RANK == SIZE - 1 else 0.1  # only the last rank got another value
    with pytest.raises(ValueError) as info:
        setup(TopK(density=density), [bucket([(8, 8)])])
    message = str(info.value)
    assert "topk: the ranks were given different options" in message
    others = "rank 0" if SIZE == 2 else f"ranks 0-{SIZE - 2}"  # ranks with one value are listed together
    assert f"rank {SIZE - 1}: {{'density': 0.25" in message and f"{others}: {{'density': 0.1" in message


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=60)
@pytest.mark.parametrize("make", [TopK, RandomK, ScaledSign, MajorityVote, PowerSGD, LowPrecision])
def test_complex_gradients_are_refused_at_setup_on_every_rank(make) -> None:
    buckets = [bucket([(4,)], 0), bucket([(3, 3)], 1, torch.complex64)]
    with pytest.raises(ValueError) as info:
        setup(make(), buckets)
    assert f"{make.scheme} cannot combine these gradients: bucket 1 (b1.p0) holds torch.complex64 gradients" in str(
        info.value
    )
    assert "(use MeanAggregator for others)" in str(info.value)


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=60)
def test_powersgd_averages_a_one_dimensional_own_gradient_bucket_exactly() -> None:
    buckets = [bucket([(300,)], 0, own=True), bucket([(40, 30), (30,)], 1)]
    aggregator = PowerSGD(rank=1, start_iter=0)
    traffic = setup(aggregator, buckets)
    inputs = [everyone(300), everyone(1230, seed=1)]
    combine(aggregator, buckets, [inputs[0][RANK], inputs[1][RANK]])
    torch.testing.assert_close(buckets[0].buffer, torch.stack(inputs[0]).mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buckets[1].buffer[1200:], torch.stack(inputs[1]).mean(0)[1200:], rtol=1e-6, atol=1e-6)
    assert torch.linalg.matrix_rank(buckets[1].buffer[:1200].view(40, 30)) == 1
    assert traffic.take()[0] == 4 * (300 + 30 + 40 + 30)  # the vector exactly; the matrix as P and Q


# ------------------------------------------------------------------------------------------------------- Hydra


@pytest.fixture(scope="module")
def _schemas() -> None:
    register_configs()


def _compose(overrides: list[str], tmp_path: Path):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"paths.output_dir={tmp_path}"])


@pytest.mark.parametrize("name", ALL)
def test_every_scheme_has_a_hydra_option(name: str, tmp_path: Path, _schemas) -> None:
    cfg = _compose([f"aggregation={name}"], tmp_path)
    built = instantiate(cfg.aggregation)
    reference = build_aggregator(name)
    assert type(built) is type(reference)
    assert repr(built) == repr(reference), "the YAML's values differ from the scheme's defaults"
    from mpistrategy.recipes.builders import build_strategy

    assert build_strategy(cfg).aggregator.__class__ is type(reference)


def test_scheme_fields_are_typed_and_validated(tmp_path: Path, _schemas) -> None:
    cfg = _compose(["aggregation=powersgd", "aggregation.rank=2"], tmp_path)
    assert instantiate(cfg.aggregation).rank == 2
    with pytest.raises(ConfigCompositionException) as info:
        _compose(["aggregation=topk", "aggregation.densty=0.1"], tmp_path)
    assert "Did you mean 'aggregation.density'?" in explain(info.value)
    with pytest.raises(ConfigCompositionException) as info:
        _compose(["aggregation=powersgd", "aggregation.rank=two"], tmp_path)
    assert "aggregation.rank" in explain(info.value)
    with pytest.raises(ConfigCompositionException) as info:
        _compose(["aggregation=top_k"], tmp_path)
    assert all(name in explain(info.value) for name in ALL)
    cfg = _compose(["aggregation=topk", "aggregation.density=2"], tmp_path)
    with pytest.raises(Exception, match=r"topk: density=2.0 is outside \(0, 1\]"):
        instantiate(cfg.aggregation)


def test_a_bad_value_stops_every_rank_before_training(tmp_path: Path) -> None:
    from mpistrategy.launch import mpiexec_command

    command = [*mpiexec_command(), "-n", "2", *train_command(), "aggregation=qsgd", "aggregation.levels=0"]
    env = clean_env(MPISTRATEGY_LOG_DIR=str(tmp_path / "logs"))
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode != 0
    assert "qsgd: levels=0 is invalid; levels must be an integer from 1 to 127" in result.stderr, result.stderr[-3000:]
    assert not list((tmp_path / "logs").rglob("*.ckpt")), "training started"


def test_the_package_exports_every_scheme() -> None:
    for name in ["LowPrecision", "TopK", "RandomK", "QSGD", "MinMaxQuantization", "ScaledSign", "MajorityVote"]:
        assert name in aggregation.__all__
    assert "PowerSGD" in aggregation.__all__ and "build_aggregator" in aggregation.__all__
