"""recipes/fabric_digits.py, as the README runs it: ``mpiexec -n 2 python recipes/fabric_digits.py`` (3 epochs here)
learns the digits and leaves a checkpoint that holds the epoch reached."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mpistrategy.launch import mpiexec_command
from tests.mpi_harness import clean_environ

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("MPISTRATEGY_TEST_NRANKS") is not None or "PMI_RANK" in os.environ,
    reason="launches its own mpiexec; run from the plain (outer) pytest",
)


def test_fabric_digits_learns_and_checkpoints() -> None:
    checkpoint = os.path.join(tempfile.mkdtemp(), "digits.ckpt")
    env = {**clean_environ(), "PYTHONPATH": str(ROOT)}
    command = [*mpiexec_command(), "-n", "2", sys.executable, str(ROOT / "recipes" / "fabric_digits.py")]
    result = subprocess.run(
        [*command, "--epochs", "3", "--checkpoint", checkpoint], capture_output=True, text=True, env=env, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    epochs = re.findall(r"epoch (\d)/3 .* val acc ([0-9.]+)  \(2 ranks\)", output)
    assert [int(e) for e, _ in epochs] == [1, 2, 3], output[-4000:]  # printed by rank 0 only
    assert float(epochs[-1][1]) > 0.9
    assert torch.load(checkpoint, weights_only=True)["epoch"] == 3
