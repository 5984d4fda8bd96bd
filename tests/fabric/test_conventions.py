"""Lightning's conventions under mpi_ad, as a DDP user knows them: launch flags that disagree with the MPI world
warn once (rank 0) and ``num_devices`` reports the MPI world, "Seed set to N" appears once, and the ``sync_dist=True``
hint for epoch-level logging appears. The multi-rank checks read one ``mpiexec -n 2`` job's output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mpistrategy.comm.topology import topology
from mpistrategy.strategy.conventions import launch_mismatch
from tests.external_job import OUTER_RUN_ONLY, run_mpi_job

SCRIPT = Path(__file__).parent / "scripts" / "conventions.py"
RANKS = 2

pytestmark = OUTER_RUN_ONLY


@pytest.fixture(scope="module")
def output() -> str:
    code, text, _ = run_mpi_job(SCRIPT, RANKS, timeout=300, PYTHONWARNINGS="default")
    assert code == 0, text[-4000:]
    return text


def test_seed_message_once(output: str) -> None:
    assert output.count("Seed set to 7") == 1, output[-4000:]


def test_devices_that_disagree_with_mpi_warn_once_and_num_devices_follows_mpi(output: str) -> None:
    trainer_warning = (
        f"Trainer(devices=4, num_nodes=1) does not match the MPI world: MPI launched {RANKS} rank(s), {RANKS} on "
        f"each of 1 node(s). The mpi_ad strategy trains on the ranks MPI launched and ignores devices= and num_nodes="
    )
    assert output.count(trainer_warning) == 1, output[-4000:]
    assert "To train on 4 processes, start them: mpiexec -n 4 python" in output
    assert "conventions.py:" in output.split(trainer_warning)[0].rsplit("\n", 1)[-1]  # points at the user's line
    for rank in range(RANKS):
        assert f"MISMATCHED rank={rank} num_devices={RANKS} world_size={RANKS} num_nodes=1" in output
        assert f"DEFAULT rank={rank} num_devices={RANKS}" in output  # devices="auto": no warning, MPI's count
    assert output.count("does not match the MPI world") == 2, output[-4000:]  # the Trainer's and Fabric's only
    assert output.count("Fabric(devices=2, num_nodes=3) does not match the MPI world") == 1
    assert f"To train on {RANKS * 3} processes" in output


def test_sync_dist_hint_for_unsynced_epoch_logging(output: str) -> None:
    assert output.count("It is recommended to use `self.log('unsynced_epoch_loss', ..., sync_dist=True)`") == 1
    assert "self.log('synced_epoch_loss'" not in output


@pytest.mark.parametrize(
    ("devices", "num_nodes", "wanted"),
    [
        ("auto", 1, None),
        (-1, 1, None),
        ("-1", 1, None),
        (1, 1, None),
        ([0], 1, None),
        (2, 1, 2),
        ("0,1,2", 1, 3),
        ([0, 1], 1, 2),
        ("3", 1, 3),
        (1, 4, 4),
        (2, 2, 4),
    ],
)
def test_launch_flags_against_a_world_of_one(devices: object, num_nodes: int, wanted: int | None) -> None:
    message = launch_mismatch(devices, num_nodes, topology(), "Trainer", "mpi_ad")
    if wanted is None:
        assert message is None
    else:
        assert message is not None and "MPI launched 1 rank(s), 1 on each of 1 node(s)" in message
        assert re.search(rf"To train on {wanted} processes, start them: mpiexec -n {wanted} ", message), message
