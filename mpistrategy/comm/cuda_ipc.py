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

:meth:`PeerDeviceGroup.gather` is steps 3-5 alone, on ranges the caller chooses: the allgather of a sharded
optimizer's updated shards (:mod:`mpistrategy.strategy.sharding.flat`).

Buffers are registered when the group is built and must live as long as it. The group is closed collectively
(:meth:`PeerDeviceGroup.close`). ``MPISTRATEGY_CUDA_IPC=0`` turns the path off (the buckets then go through host
memory, see :mod:`mpistrategy.strategy.reducer.staging`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

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


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of ``device``'s GPU (``None`` off CUDA): ranks on one GPU have the same, whatever index they see it
    under."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(_index(device)).uuid)


def gpu_identity(device: torch.device) -> tuple[str, int] | None:
    """The UUID and index of ``device``'s GPU (``None`` off CUDA): ranks that see one GPU under one index have the
    same."""
    uuid = gpu_uuid(device)
    return None if uuid is None else (uuid, _index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def chunk_bounds(numel: int, ranks: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` element ranges of a buffer of ``numel`` elements that ``ranks`` ranks reduce, one per
    rank, starting on multiples of :data:`CHUNK_ALIGN` (the last ones empty where the buffer is short)."""
    step = -(-numel // (ranks * CHUNK_ALIGN)) * CHUNK_ALIGN
    return [(min(rank * step, numel), min((rank + 1) * step, numel)) for rank in range(ranks)]


def _check_alike(everyone: list, buffers: Sequence[torch.Tensor]) -> None:
    """Every rank registered buffers of the same shapes and dtypes (each rank sees every rank's: all raise alike)."""
    for rank, (_, _, described) in enumerate(everyone):
        if described != everyone[0][2]:
            raise ValueError(
                f"rank {rank} registered buffers {described}, rank 0 {everyone[0][2]}: every rank must register the "
                f"same buffers (shapes and dtypes, in the same order); this rank registered {len(buffers)}."
            )


def share_one_gpu(comm: MPI.Intracomm, device: torch.device | None) -> bool:
    """Whether every rank of ``comm`` (collective) holds its buffers on the same GPU under the same index, and the
    path is enabled everywhere: then :class:`PeerDeviceGroup` can serve them."""
    try:
        mine, problem = (gpu_identity(device) if device is not None and enabled() else None), ""
    except ValueError as error:  # a setting one rank got wrong: said on every rank
        mine, problem = None, str(error)
    everyone = comm.allgather((mine, problem))
    problems = "; ".join(f"rank {rank}: {problem}" for rank, (_, problem) in enumerate(everyone) if problem)
    if problems:
        raise ValueError(problems)
    return mine is not None and all(other == mine for other, _ in everyone)


class PeerDeviceGroup:
    """In-place sums and allgathers of registered CUDA buffers over the ranks of ``comm`` (one node, one GPU; see the
    module docstring). Building it is collective; every rank registers buffers of the same sizes and dtypes, in the same
    order."""

    def __init__(self, comm: MPI.Intracomm, buffers: Sequence[torch.Tensor]) -> None:
        self._comm = comm.Dup()
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        self.buffers: list[list[torch.Tensor]] = []
        self._events: list[Event] = []
        self._peer_events: list[list[Event]] = []
        device = buffers[0].device if buffers else torch.device("cuda", torch.cuda.current_device())
        try:
            with torch.cuda.device(device):
                everyone = self._agree(lambda: self._export(buffers))
                _check_alike(everyone, buffers)
                self._agree(lambda: self._open(everyone, buffers, device))
        except BaseException:
            self._comm.Free()
            raise

    def _agree(self, work: Callable[[], Any]) -> list[Any]:
        """``work()`` on every rank, its results gathered in rank order (collective); where it fails on some rank,
        every rank raises, naming each rank's failure."""
        try:
            outcome, problem = work(), ""
        except Exception as error:  # reported on every rank below
            outcome, problem = None, f"{type(error).__name__}: {error}"
        gathered = self._comm.allgather((outcome, problem))
        failed = "; ".join(f"rank {rank}: {problem}" for rank, (_, problem) in enumerate(gathered) if problem)
        if failed:
            raise RuntimeError(
                f"sharing device memory between the ranks on this GPU failed ({failed}); set {VARIABLE}=0 to "
                "combine through host memory instead."
            )
        return [value for value, _ in gathered]

    def _export(self, buffers: Sequence[torch.Tensor]) -> tuple[list, list, list]:
        """This rank's fence events, and what the peers need to open them and the buffers: the buffers' IPC
        arguments, the events' handles, the buffers' shapes and dtypes."""
        from torch.multiprocessing.reductions import reduce_tensor

        self._events = [Event(interprocess=True) for _ in range(_FENCES)]
        shared = [reduce_tensor(buffer)[1] for buffer in buffers]
        described = [(tuple(buffer.shape), str(buffer.dtype)) for buffer in buffers]
        return shared, [event.ipc_handle() for event in self._events], described

    def _open(self, everyone: list, buffers: Sequence[torch.Tensor], device: torch.device) -> None:
        """Map every peer's buffers and events (this rank's own at its place, in rank order)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        self.buffers = [
            [mine if rank == self.rank else rebuild_cuda_tensor(*peer[0][index]) for rank, peer in enumerate(everyone)]
            for index, mine in enumerate(buffers)
        ]
        self._peer_events = [
            [
                mine if rank == self.rank else Event.from_ipc_handle(device, peer[1][fence])
                for rank, peer in enumerate(everyone)
            ]
            for fence, mine in enumerate(self._events)
        ]

    def sum(self, index: int, average: bool = False) -> None:
        """Queue, on the current stream, the sum (``average``: the mean) of buffer ``index`` over the ranks, in
        place on every rank. Returns when the work is queued; later work on the stream sees the result."""
        stream = torch.cuda.current_stream(self.buffers[index][0].device)
        parts = self.buffers[index]
        if self.size == 1:
            return
        bounds = chunk_bounds(parts[0].numel(), self.size)
        start, stop = bounds[self.rank]
        self._fence(0, stream)
        if stop > start:
            self._reduce([part[start:stop] for part in parts], average)
        self._fence(1, stream)
        self._copy_others(parts, bounds, stream)

    def gather(self, index: int, bounds: Sequence[int]) -> None:
        """Queue, on the current stream, an allgather in place: rank ``r``'s elements ``[bounds[r], bounds[r+1])`` of
        buffer ``index`` (written by rank ``r`` before the call, on its current stream) are copied from its buffer
        into every other rank's. Returns when the work is queued."""
        stream = torch.cuda.current_stream(self.buffers[index][0].device)
        parts = self.buffers[index]
        if self.size == 1:
            return
        self._fence(0, stream)
        self._copy_others(parts, list(zip(bounds, bounds[1:], strict=False)), stream)

    def _copy_others(
        self, parts: list[torch.Tensor], ranges: Sequence[tuple[int, int]], stream: torch.cuda.Stream
    ) -> None:
        """Rank ``r``'s range ``ranges[r]`` from its buffer into this rank's, for every other rank; then the fence
        after which no rank reads another's buffer."""
        own = parts[self.rank]
        for rank, (begin, end) in enumerate(ranges):
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
