"""One space's parameters in one flat buffer, this rank's pieces of it, and the allgather of the updated shards.

The parameters of a space (one optimizer's parameters of one dtype and device, see
:mod:`~mpistrategy.strategy.sharding.layout`) are copied into one flat buffer and become views of it
(``param.data``), so that the allgather writes every updated shard in place, with no copy into or out of the
parameters. Each piece of this rank's shard is a parameter of its own (an ``nn.Parameter`` over its elements of the
buffer): the optimizer steps the pieces, which updates the model's parameters where they lie. A parameter keeps
its shape, dtype and device; its memory becomes contiguous.

Where every rank of the group shares one GPU, each rank copies the others' shards from their buffers on the device
(:class:`~mpistrategy.comm.cuda_ipc.PeerDeviceGroup`); elsewhere MPI gathers them, through host memory where it
cannot address the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.collectives._layout import offsets
from mpistrategy.comm.buffers import mpi_buffer, needs_staging
from mpistrategy.comm.cuda_ipc import PeerDeviceGroup, share_one_gpu
from mpistrategy.strategy.sharding.layout import Piece, shard_bounds, shard_pieces


class FlatParameters:
    """The flat buffer of one space over a shard group (see the module docstring).

    Args:
        params: the space's parameters, in the flat order.
        comm: the shard group's communicator (shard ``r`` is rank ``r`` of it).
    """

    def __init__(self, params: Sequence[nn.Parameter], comm: MPI.Intracomm) -> None:
        self.params = list(params)
        self.comm = comm
        self.sizes = [p.numel() for p in self.params]
        self.offsets = offsets(self.sizes)
        self.bounds = shard_bounds(sum(self.sizes), comm.Get_size())
        first = self.params[0]
        self.flat = torch.empty(sum(self.sizes), dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for param, offset, size in zip(self.params, self.offsets, self.sizes, strict=True):
                view = self.flat[offset : offset + size]
                view.copy_(param.detach().reshape(-1))
                param.data = view.view_as(param)
        self.pieces: list[Piece] = shard_pieces(self.sizes, comm.Get_size(), comm.Get_rank())
        self.tensors = [nn.Parameter(self.flat[p.offset : p.offset + p.numel]) for p in self.pieces]
        self._host: torch.Tensor | None = None
        on_one_gpu = comm.Get_size() > 1 and share_one_gpu(comm, first.device)
        self._peers = PeerDeviceGroup(comm, [self.flat]) if on_one_gpu else None

    @property
    def shard(self) -> torch.Tensor:
        """This rank's elements of the buffer."""
        rank = self.comm.Get_rank()
        return self.flat[self.bounds[rank] : self.bounds[rank + 1]]

    def allgather(self) -> None:
        """Every rank's shard into every rank's buffer, in place (collective over the group): after each rank
        updated its pieces, all parameters hold the updated values."""
        if self.comm.Get_size() == 1:
            return
        if self._peers is not None:
            self._peers.gather(0, self.bounds)
            return
        counts = [high - low for low, high in zip(self.bounds, self.bounds[1:], strict=False)]
        target = self._staged() if needs_staging(self.flat) else self.flat
        memory, _, datatype = mpi_buffer(target)
        self.comm.Allgatherv(MPI.IN_PLACE, [memory, counts, self.bounds[:-1], datatype])
        if target is not self.flat:
            self.flat.copy_(target)

    def _staged(self) -> torch.Tensor:
        """A host copy of the buffer holding this rank's shard (for an MPI that cannot address the device)."""
        if self._host is None:
            self._host = torch.empty(self.flat.shape, dtype=self.flat.dtype, pin_memory=torch.cuda.is_available())
        rank = self.comm.Get_rank()
        low, high = self.bounds[rank], self.bounds[rank + 1]
        self._host[low:high].copy_(self.flat[low:high])
        return self._host

    def release(self) -> None:
        """Unmap the peers' buffers (collective over the group); later allgathers go through MPI."""
        if self._peers is not None:
            self._peers.close()
            self._peers = None
