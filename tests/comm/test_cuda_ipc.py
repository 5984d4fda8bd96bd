"""The choice of the device-memory path (``mpistrategy.comm.cuda_ipc``) where no GPU is at hand: the setting, a rank
that got it wrong, ranks off CUDA, the chunks each rank reduces. The sums themselves are checked on a GPU
(``tests/gpu/test_peer_sums.py``)."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from mpistrategy.comm.cuda_ipc import CHUNK_ALIGN, VARIABLE, chunk_bounds, enabled, share_one_gpu

COMM = MPI.COMM_WORLD


@pytest.mark.parametrize(("text", "on"), [("", True), ("1", True), ("on", True), ("0", False), ("off", False)])
def test_the_setting_turns_the_path_on_and_off(monkeypatch: pytest.MonkeyPatch, text: str, on: bool) -> None:
    monkeypatch.setenv(VARIABLE, text)
    assert enabled() is on


@pytest.mark.mpi(ranks=(1, 2, 3))
def test_ranks_off_cuda_do_not_share_a_gpu() -> None:
    assert share_one_gpu(COMM, torch.device("cpu")) is False
    assert share_one_gpu(COMM, None) is False


@pytest.mark.mpi(ranks=(2, 3))
def test_a_setting_one_rank_got_wrong_is_named_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last rank sets ``MPISTRATEGY_CUDA_IPC=maybe``: every rank raises (none waits in the collective), and the
    message names that rank and the values that work."""
    last = COMM.Get_size() - 1
    if COMM.Get_rank() == last:
        monkeypatch.setenv(VARIABLE, "maybe")
    with pytest.raises(ValueError, match=rf"rank {last}: {VARIABLE}='maybe' is not a setting; set it to 1"):
        share_one_gpu(COMM, torch.device("cpu"))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [1, CHUNK_ALIGN - 1, CHUNK_ALIGN * 3 + 1, 1_000_003])
def test_the_chunks_cover_the_buffer_once_on_aligned_bounds(size: int, numel: int) -> None:
    chunks = chunk_bounds(numel, size)
    assert len(chunks) == size and chunks[0][0] == 0 and chunks[-1][1] == numel
    assert all(stop == start for (_, stop), (start, _) in zip(chunks, chunks[1:], strict=False))
    assert all(start % CHUNK_ALIGN == 0 or start == numel for start, _ in chunks)
    largest = max(stop - start for start, stop in chunks)
    assert largest <= -(-numel // (size * CHUNK_ALIGN)) * CHUNK_ALIGN
