"""Sums of CUDA buffers over the ranks of one node, read from each other's device memory (CUDA IPC).

Where the ranks of a node share a GPU, NCCL refuses them ("duplicate GPU") and MPI without CUDA support moves every
byte through host memory twice. A :class:`PeerDeviceGroup` maps, once, every rank's registered buffers into every
other rank (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``, through torch's CUDA tensor sharing), so each rank's
kernels read the peers' buffers directly. The sum of buffer ``b`` over the ``L`` ranks, in place on every rank, is a
reduce-scatter then an allgather on the device:

1. fence: every rank's writes to ``b`` are complete;
2. rank ``r`` computes chunk ``r`` (``L`` near-equal chunks, 256-element aligned) as
   ``((x_0 + x_1) + x_2) + ... + x_{L-1}`` (rank order, the order MPI's reference sum takes), divided by ``L`` for the
   mean, into its own buffer;
3. fence: every chunk is reduced;
4. rank ``r`` copies chunk ``s`` from rank ``s``'s buffer, for every ``s != r``;
5. fence: no rank reads ``b`` of another any more, so each may write its own again.

Each rank moves ``(L - 1) / L`` of the buffer in twice; the device does the arithmetic. A fence is an event recorded on
the current stream, a barrier on the host (so that every rank's record precedes every wait) and a wait of the
current stream on every peer's event: neither the host nor the device waits for the kernels themselves. An
interprocess event can be waited on for its latest record only, so every fence has its own event, reused: a rank
records it again only after the next fence's barrier, which the others enter after their waits.

Buffers are registered when the group is built and must live as long as it. The group is closed collectively
(:meth:`PeerDeviceGroup.close`). ``MPISTRATEGY_CUDA_IPC=0`` turns the path off (the buckets then go through host
memory, see :mod:`mpistrategy.strategy.reducer.staging`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from mpi4py import MPI
from torch.cuda import Event

VARIABLE = "MPISTRATEGY_CUDA_IPC"
#: elements: chunk boundaries fall on multiples of this many, so that each rank's kernels read aligned memory
CHUNK_ALIGN = 256
_FENCES = 3


def enabled() -> bool:
    """Whether ``MPISTRATEGY_CUDA_IPC`` allows the path (default: on; ``0``/``off`` turns it off)."""
    value = os.environ.get(VARIABLE, "").strip().lower()
    if value in ("", "1", "on", "true", "yes", "auto"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{VARIABLE}={value!r} is not a setting; set it to 1 (the default) or 0 (off).")


def gpu_identity(device: torch.device) -> tuple[str, int] | None:
    """The UUID and index of ``device``'s GPU (``None`` off CUDA): ranks on one GPU have the same."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid), index


def share_one_gpu(comm: MPI.Intracomm, device: torch.device | None) -> bool:
    """Whether every rank of ``comm`` (collective) holds its buffers on the same GPU under the same index, and the
    path is enabled everywhere: then :class:`PeerDeviceGroup` can serve them."""
    mine = gpu_identity(device) if device is not None and enabled() else None
    everyone = comm.allgather(mine)
    return mine is not None and all(other == mine for other in everyone)


class PeerDeviceGroup:
    """In-place sums of registered CUDA buffers over the ranks of ``comm`` (one node, one GPU; see the module
    docstring). Building it is collective; every rank registers buffers of the same sizes and dtypes, in the same
    order."""

    def __init__(self, comm: MPI.Intracomm, buffers: Sequence[torch.Tensor]) -> None:
        self._comm = comm.Dup()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self._events = [Event(interprocess=True) for _ in range(_FENCES)]
        device = buffers[0].device if buffers else torch.device("cuda", torch.cuda.current_device())
        try:
            self._map(buffers, device)
        except BaseException:
            self._comm.Free()
            raise

    def _map(self, buffers: Sequence[torch.Tensor], device: torch.device) -> None:
        """Exchange the buffers' and the fences' handles and open the peers' (collective)."""
        from torch.multiprocessing.reductions import reduce_tensor

        with torch.cuda.device(device):
            handles = [event.ipc_handle() for event in self._events]
            shared = [reduce_tensor(buffer)[1] for buffer in buffers]
            everyone = self._comm.allgather((shared, handles))
            self.buffers = [self._open(everyone, index, buffer) for index, buffer in enumerate(buffers)]
            opened = Event.from_ipc_handle
            self._peer_events = [
                [mine if rank == self.rank else opened(device, peer[1][fence]) for rank, peer in enumerate(everyone)]
                for fence, mine in enumerate(self._events)
            ]

    def _open(self, everyone: list, index: int, mine: torch.Tensor) -> list[torch.Tensor]:
        """Buffer ``index`` of every rank, in rank order (this rank's own tensor at its place)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        opened = []
        for rank, (shared, _) in enumerate(everyone):
            peer = mine if rank == self.rank else rebuild_cuda_tensor(*shared[index])
            if peer.shape != mine.shape or peer.dtype != mine.dtype:
                raise ValueError(
                    f"rank {rank} registered buffer {index} as {peer.dtype} {tuple(peer.shape)}, this rank as "
                    f"{mine.dtype} {tuple(mine.shape)}: every rank must register the same buffers."
                )
            opened.append(peer)
        return opened

    def chunks(self, numel: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` element ranges that the ranks reduce, one per rank."""
        step = -(-numel // (self.size * CHUNK_ALIGN)) * CHUNK_ALIGN
        return [(min(rank * step, numel), min((rank + 1) * step, numel)) for rank in range(self.size)]

    def sum(self, index: int, average: bool = False) -> None:
        """Queue, on the current stream, the sum (``average``: the mean) of buffer ``index`` over the ranks, in
        place on every rank. Returns when the work is queued; later work on the stream sees the result."""
        stream = torch.cuda.current_stream(self.buffers[index][0].device)
        parts = self.buffers[index]
        if self.size == 1:
            return
        bounds = self.chunks(parts[0].numel())
        start, stop = bounds[self.rank]
        self._fence(0, stream)
        if stop > start:
            self._reduce([part[start:stop] for part in parts], average)
        self._fence(1, stream)
        own = parts[self.rank]
        for rank, (begin, end) in enumerate(bounds):
            if rank != self.rank and end > begin:
                own[begin:end].copy_(parts[rank][begin:end])
        self._fence(2, stream)

    def _reduce(self, chunks: list[torch.Tensor], average: bool) -> None:
        """This rank's chunk of the sum, in rank order, into its own buffer."""
        own = chunks[self.rank]
        total = torch.add(chunks[0], chunks[1], out=own if self.rank < 2 else None)
        for chunk in chunks[2:]:
            total.add_(chunk)
        if average:
            total.div_(self.size)
        if total is not own:
            own.copy_(total)

    def _fence(self, fence: int, stream: torch.cuda.Stream) -> None:
        self._events[fence].record(stream)
        self._comm.Barrier()
        for rank, event in enumerate(self._peer_events[fence]):
            if rank != self.rank:
                stream.wait_event(event)

    def close(self) -> None:
        """Wait for the queued sums, unmap the peers' buffers and free the communicator (collective)."""
        if self._comm == MPI.COMM_NULL:
            return
        torch.cuda.synchronize(self.buffers[0][0].device if self.buffers else None)
        self._comm.Barrier()
        self.buffers, self._peer_events = [], []
        self._comm.Free()
