"""The torch.distributed node transport meets in a directory only this user can open, and removes it afterwards."""

from __future__ import annotations

import gc
import os
import stat
import tempfile
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from mpistrategy.comm.topology import topology
from mpistrategy.sync.transport import node_transport


@pytest.mark.mpi(ranks=(3,), timeout=120)
def test_the_gloo_group_meets_in_a_private_directory_that_goes_away_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    world = MPI.COMM_WORLD
    shared = Path(world.bcast(str(tmp_path), root=0))
    monkeypatch.setattr(tempfile, "tempdir", str(shared))  # where the leader makes its directory
    here = topology(ranks_per_node=3)
    transport = node_transport(here, "gloo")
    (directory,) = [path for path in shared.iterdir() if path.name.startswith("mpistrategy-rendezvous-")]
    status = directory.stat()
    assert status.st_uid == os.getuid() and stat.S_IMODE(status.st_mode) == 0o700
    tensor = torch.full((5,), float(here.local_rank + 1), dtype=torch.float64)
    transport.start_sum(tensor).wait()
    assert torch.equal(tensor, torch.full((5,), float(sum(range(1, here.local_size + 1))), dtype=torch.float64))
    del transport
    gc.collect()
    world.Barrier()
    assert not directory.exists(), "the rendezvous directory outlived the group"
