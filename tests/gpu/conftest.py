"""The device the GPU tests run on: CUDA (each rank takes GPU ``local rank mod GPU count``), else skipped with the
reason before any MPI job starts.

``MPISTRATEGY_GPU_TEST_DEVICE=cpu`` runs the same checks with the CPU standing in for the GPU: that checks the tests
themselves, not the CUDA path (see docs/gpu.md for running them on a GPU machine).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

DEVICE_ENV = "MPISTRATEGY_GPU_TEST_DEVICE"
_HERE = Path(__file__).parent


def device_kind() -> str:
    return os.environ.get(DEVICE_ENV, "cuda")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every GPU test ``gpu``; skip them all, with the reason, where CUDA is asked for and absent."""
    skip = None
    if device_kind() == "cuda" and not torch.cuda.is_available():
        skip = pytest.mark.skip(
            reason="no CUDA device here: run on a machine with an NVIDIA GPU "
            "(pytest tests/gpu; MPISTRATEGY_GPU_TEST_DEVICE=cpu runs the same checks on the CPU)"
        )
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """This rank's device: ``cuda:<local rank mod GPU count>`` (ranks share GPUs when there are fewer), or the CPU."""
    if device_kind() != "cuda":
        return torch.device(device_kind())
    from mpistrategy.comm.topology import topology

    index = topology().local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


PATHS = {"peer device memory": "1", "host memory": "0"}


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which way ranks that share a GPU combine: through each other's device memory (``MPISTRATEGY_CUDA_IPC=1``,
    the default) or through host memory (``0``)."""
    from mpistrategy.comm.cuda_ipc import VARIABLE

    monkeypatch.setenv(VARIABLE, PATHS[request.param])
    return str(request.param)
