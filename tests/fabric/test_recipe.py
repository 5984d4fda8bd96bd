"""recipes/fabric_digits.py, as the README runs it: ``mpiexec -n 2 python recipes/fabric_digits.py`` (3 epochs here)
learns the digits and leaves a checkpoint that holds the epoch reached."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from tests.external_job import OUTER_RUN_ONLY, ROOT, run_mpi_job

pytestmark = OUTER_RUN_ONLY


def test_fabric_digits_learns_and_checkpoints(tmp_path: Path) -> None:
    checkpoint = os.path.join(tmp_path, "digits.ckpt")
    script = ROOT / "recipes" / "fabric_digits.py"
    code, output, _ = run_mpi_job(script, 2, "--epochs", "3", "--checkpoint", checkpoint, timeout=300)
    assert code == 0, output[-4000:]
    epochs = re.findall(r"epoch (\d)/3 .* val acc ([0-9.]+)  \(2 ranks\)", output)
    assert [int(e) for e, _ in epochs] == [1, 2, 3], output[-4000:]  # printed by rank 0 only
    assert float(epochs[-1][1]) > 0.9
    assert torch.load(checkpoint, weights_only=True)["epoch"] == 3
