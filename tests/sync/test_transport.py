"""Node transports: what `auto` picks; the torch.distributed transport meets through a file only this user can open,
which goes away with the group."""

from __future__ import annotations

import gc
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from mpistrategy.comm.topology import topology
from mpistrategy.sync.transport import MPINodeTransport, choose_node_transport, node_transport


@pytest.mark.mpi(ranks=(3,), timeout=120)
def test_the_gloo_group_meets_through_a_private_file_that_goes_away_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's file is the user's, mode 0600; once every rank has freed its group, the last rank's store has
    removed it (each rank frees its group at a different time: no rank may find the file gone while its own store
    still uses it)."""
    world = MPI.COMM_WORLD
    shared = Path(world.bcast(str(tmp_path), root=0))
    monkeypatch.setattr(tempfile, "tempdir", str(shared))  # where the leader makes its file
    here = topology(ranks_per_node=3)
    transport = node_transport(here, "gloo")
    (store,) = [path for path in shared.iterdir() if path.name.startswith("mpistrategy-rendezvous-")]
    status = store.stat()
    assert status.st_uid == os.getuid() and stat.S_IMODE(status.st_mode) == 0o600
    tensor = torch.full((5,), float(here.local_rank + 1), dtype=torch.float64)
    transport.start_sum(tensor).wait()
    assert torch.equal(tensor, torch.full((5,), float(sum(range(1, here.local_size + 1))), dtype=torch.float64))
    time.sleep(0.2 * here.local_rank)  # the ranks free their groups one after another
    del transport
    gc.collect()
    world.Barrier()
    assert list(shared.iterdir()) == [], "the rendezvous file outlived the group"


@pytest.mark.parametrize(
    ("gpus", "nccl", "chosen"),
    [
        (["GPU-a", "GPU-b", "GPU-c", "GPU-d"], True, "nccl"),  # a GPU per rank
        (["GPU-a", "GPU-a"], True, "mpi"),  # two ranks share one GPU: NCCL refuses that
        (["GPU-a", "GPU-b", "GPU-a"], True, "mpi"),
        (["GPU-a"], True, "mpi"),  # one rank on the node: nothing to move inside it
        (["GPU-a", "GPU-b"], False, "mpi"),  # no NCCL in this torch build
        ([None, None], True, "mpi"),  # the model is on the CPU
        (["GPU-a", None], True, "mpi"),
    ],
)
def test_auto_picks_nccl_only_for_a_node_whose_ranks_each_have_a_gpu(
    gpus: list[str | None], nccl: bool, chosen: str
) -> None:
    assert choose_node_transport(gpus, nccl) == chosen


@pytest.mark.mpi(ranks=(3,), timeout=120)
def test_auto_on_the_cpu_is_the_node_mpi_communicator() -> None:
    here = topology(ranks_per_node=3)
    transport = node_transport(here, "auto", torch.device("cpu"))
    assert isinstance(transport, MPINodeTransport) and transport.size == 3
    tensor = torch.full((4,), float(here.local_rank), dtype=torch.float64)
    transport.start_sum(tensor).wait()
    assert torch.equal(tensor, torch.full((4,), 3.0, dtype=torch.float64))
