"""The compiled rank-order sum: the same bits as torch's chain of additions, outputs that are inputs, the build
cache shared by processes that build at once, and the fallback when no compiler works (one process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpistrategy.comm import rank_sum

NUMELS = [1, 7, 511, 512, 513, 100_003]


def _torch_chain(inputs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """What the shared-memory allreduce computes with torch: ((x_0 + x_1) + ...) * scale."""
    total = inputs[0].clone()
    for part in inputs[1:]:
        total.add_(part)
    return total.mul_(scale) if scale != 1.0 else total


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def _inputs_for(count: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=generator, dtype=dtype) * 10.0 ** (k % 4 - 1) for k in range(count)]


@pytest.fixture(autouse=True)
def built() -> None:
    assert rank_sum.available(torch.float32), "the kernel did not build on this machine (a C compiler is needed)"


@pytest.mark.parametrize("dtype", rank_sum.SUPPORTED_DTYPES)
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5])
def test_the_sum_and_the_average_are_the_bits_of_torchs_chain(dtype: torch.dtype, count: int) -> None:
    for numel in NUMELS:
        inputs = _inputs_for(count, numel, dtype, seed=numel + count)
        for scale in (1.0, 1.0 / count):
            expected = _torch_chain(inputs, scale)
            outputs = [torch.full((numel,), float("nan"), dtype=dtype) for _ in range(3)]
            rank_sum.sum_to(outputs, inputs, scale)
            for output in outputs:
                assert torch.equal(_bits(output), _bits(expected)), f"{numel} elements, scale {scale}"


@pytest.mark.parametrize("dtype", rank_sum.SUPPORTED_DTYPES)
def test_an_output_may_be_any_of_the_inputs(dtype: torch.dtype) -> None:
    count, numel = 4, 4099
    for written in range(count):
        inputs = _inputs_for(count, numel, dtype, seed=written)
        expected = _torch_chain(inputs, 0.25)
        elsewhere = torch.empty(numel, dtype=dtype)
        rank_sum.sum_to([inputs[written], elsewhere], inputs, 0.25)
        assert torch.equal(_bits(inputs[written]), _bits(expected)) and torch.equal(_bits(elsewhere), _bits(expected))


def test_only_float32_and_float64_are_compiled_and_the_switch_turns_it_off() -> None:
    assert rank_sum.available(torch.float64)
    assert not any(rank_sum.available(d) for d in (torch.float16, torch.bfloat16, torch.int64, torch.complex64))
    with rank_sum.compiled(False):
        assert not rank_sum.available(torch.float32)
    assert rank_sum.available(torch.float32)


def _run_python(code: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **environment}, capture_output=True, text=True, timeout=120
    )


PROBE = "import torch; from mpistrategy.comm import rank_sum; print(rank_sum.available(torch.float32))"


def test_processes_that_build_at_once_share_one_cached_library(tmp_path: Path) -> None:
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE],
            env={**os.environ, rank_sum.CACHE_VARIABLE: str(tmp_path)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    assert [process.communicate(timeout=120)[0].strip() for process in starts] == ["True"] * 4
    library = rank_sum.cached_library(tmp_path)
    assert library is not None and [path.name for path in tmp_path.iterdir()] == [library.parent.name], (
        "a temporary build was left behind"
    )
    assert sorted(path.name for path in library.parent.iterdir()) == ["library.so", "library.so.sha256"]
    modified = library.stat().st_mtime_ns
    assert _run_python(PROBE, **{rank_sum.CACHE_VARIABLE: str(tmp_path)}).stdout.strip() == "True"
    assert library.stat().st_mtime_ns == modified, "a cached build was built again"


def test_without_a_working_compiler_torch_sums_and_a_warning_says_why(tmp_path: Path) -> None:
    failed = _run_python(PROBE, CC="/bin/false", **{rank_sum.CACHE_VARIABLE: str(tmp_path)})
    assert failed.stdout.strip() == "False"
    assert "could not be built with '/bin/false'" in failed.stderr and "summing with torch" in failed.stderr
    assert list(tmp_path.iterdir()) == [], "a failed build left files behind"
    with_flags = _run_python(PROBE, CC="cc -w", **{rank_sum.CACHE_VARIABLE: str(tmp_path)})
    assert with_flags.stdout.strip() == "True", with_flags.stderr  # $CC may carry flags, as make's does
    switched_off = _run_python(PROBE, CC="/bin/false", **{rank_sum.NATIVE_VARIABLE: "0"})
    assert switched_off.stdout.strip() == "False" and "could not be built" not in switched_off.stderr
