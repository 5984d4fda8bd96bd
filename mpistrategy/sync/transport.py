"""Node-local transports: how tensors move between the ranks of one node.

Two kinds, chosen with ``node_transport``:

- ``"auto"`` (default): ``"nccl"`` when the model is on CUDA, the node has more than one rank and every rank of the
  node has a GPU of its own (NCCL refuses two ranks on one GPU); ``"mpi"`` otherwise. The ranks of a node agree
  (:func:`choose_node_transport`), so every rank of a node picks the same kind.
- ``"mpi"``: the node's MPI communicator (``Split_type(COMM_TYPE_SHARED)``), whose messages MPI moves
  through shared memory. CUDA tensors are staged through host memory unless MPI is CUDA-aware.
- ``"gloo"`` / ``"nccl"``: a ``torch.distributed`` process group per node (NCCL for GPUs; gloo on the CPU). Its
  rendezvous is done over MPI: the node leader makes a private file in the temporary directory
  (``tempfile.mkstemp``: a new file of mode 0600, ``$TMPDIR`` else ``/tmp``) and tells the node's ranks its path
  through the node communicator; the group meets through a ``FileStore`` on it (which keeps the file's mode). So
  users set no ``MASTER_ADDR``, port or torchrun, and no store listens on a port that another user of the node
  could connect to (to read the peers' addresses, or to write false ones). The file goes away with the group: the
  ``FileStore`` of the last rank to free it removes it (nothing else removes it, so no rank's store can find it
  gone while it still uses it). The group is a standalone object: it does not initialise torch.distributed's
  default group.

Both offer the two operations the sync modes need, non-blocking: a sum over the node's ranks in place, and a
broadcast from one local rank in place. Each returns a :class:`~mpistrategy.aggregation.Work`.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from abc import ABC, abstractmethod
from typing import Any

import torch

from mpistrategy.aggregation.base import Work
from mpistrategy.collectives.handles import Pending
from mpistrategy.collectives.reduction import iallreduce
from mpistrategy.comm.buffers import mpi_buffer, needs_staging
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.cuda_ipc import gpu_uuid
from mpistrategy.comm.topology import Topology

NODE_TRANSPORTS = ("auto", "mpi", "gloo", "nccl")


class NodeTransport(ABC):
    """Non-blocking in-place operations over the ranks of one node."""

    rank: int
    size: int
    #: the operations on CUDA tensors are queued on the device's streams, the host never waits for them (NCCL)
    on_streams: bool = False

    @abstractmethod
    def start_sum(self, tensor: torch.Tensor) -> Work:
        """Start replacing ``tensor`` (contiguous) by the sum of every local rank's ``tensor``."""

    @abstractmethod
    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> Work:
        """Start replacing ``tensor`` (contiguous) on every local rank by local rank ``root``'s."""


class MPINodeTransport(NodeTransport):
    """The node's MPI communicator (see the module docstring)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size

    def start_sum(self, tensor: torch.Tensor) -> Work:
        with torch.no_grad():
            return iallreduce(tensor, "sum", self.comm, out=tensor)

    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> Work:
        if self.size == 1:
            return Pending([], _none)
        if not needs_staging(tensor):
            request = self.comm.forward.Ibcast(mpi_buffer(tensor), root=root)
            return Pending([request], _none, keepalive=(tensor,))
        host = tensor.detach().cpu()
        request = self.comm.forward.Ibcast(mpi_buffer(host), root=root)
        return Pending([request], lambda: tensor.copy_(host), keepalive=(host,))


class TorchNodeTransport(NodeTransport):
    """A ``torch.distributed`` process group over the node's ranks (rendezvous over MPI)."""

    def __init__(self, topology: Topology, backend: str, timeout_seconds: float = 1800.0) -> None:
        self.rank, self.size = topology.local_rank, topology.local_size
        self.backend = backend
        self.on_streams = backend == "nccl"
        # the store must live as long as the group (NCCL meets through it at the first collective)
        self.group, self._store = _node_process_group(topology, backend, timeout_seconds)

    def start_sum(self, tensor: torch.Tensor) -> Work:
        import torch.distributed as dist

        return _TorchWork(self.group.allreduce([tensor], dist.AllreduceOptions()))

    def start_broadcast(self, tensor: torch.Tensor, root: int = 0) -> Work:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = root
        return _TorchWork(self.group.broadcast([tensor], options))


class _TorchWork:
    """A ``torch.distributed`` work handle as a :class:`~mpistrategy.aggregation.Work`."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self) -> None:
        self.work.wait()

    def test(self) -> bool:
        return self.work.is_completed()


def _none() -> None:
    return None


def _node_process_group(topology: Topology, backend: str, timeout_seconds: float) -> tuple[Any, Any]:
    """A process group over this node's ranks and its ``FileStore``, on a private file the leader made and sent by
    MPI (see the module doc)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_seconds)
    node = topology.node_comm
    path, problem = "", ""
    if topology.is_leader:
        try:
            descriptor, path = tempfile.mkstemp(prefix="mpistrategy-rendezvous-")
            os.close(descriptor)
        except OSError as error:
            problem = f"{type(error).__name__}: {error}"
    path, problem = node.bcast((path, problem), root=0)
    if problem:
        raise RuntimeError(
            f"node_transport={backend!r}: the node leader could not make its rendezvous file ({problem}); "
            "set TMPDIR to a writable node-local directory."
        )
    blind = [rank for rank, sees in enumerate(node.allgather(os.path.isfile(path))) if not sees]
    if blind:
        if topology.is_leader:
            os.unlink(path)
        raise RuntimeError(
            f"node_transport={backend!r}: local rank(s) {blind} cannot see the rendezvous file {path} that the "
            "node leader made; set TMPDIR to a node-local directory that every rank of the node sees, or use "
            "node_transport='mpi'."
        )
    store = dist.FileStore(path, topology.local_size)
    store.set_timeout(timeout)
    prefixed = dist.PrefixStore(f"mpistrategy/node{topology.node_rank}", store)
    group: Any
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = dist.ProcessGroupGloo(prefixed, topology.local_rank, topology.local_size, options)
    else:
        group = dist.ProcessGroupNCCL(prefixed, topology.local_rank, topology.local_size)  # type: ignore[call-arg]
    node.Barrier()
    return group, store


def choose_node_transport(gpus: list[str | None], nccl_available: bool) -> str:
    """What ``node_transport="auto"`` picks for a node whose ranks hold the GPUs ``gpus`` (one entry per local rank:
    the GPU's UUID, ``None`` for a model off CUDA): ``"nccl"`` when there are at least two ranks, every one on a GPU
    of its own, and NCCL is available; ``"mpi"`` otherwise."""
    own_gpus = all(gpu is not None for gpu in gpus) and len(set(gpus)) == len(gpus)
    return "nccl" if nccl_available and len(gpus) > 1 and own_gpus else "mpi"


def _nccl_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def node_transport(topology: Topology, kind: str, device: torch.device | None = None) -> NodeTransport:
    """The node-local transport ``kind`` (one of :data:`NODE_TRANSPORTS`) for this process's node (collective);
    ``device`` is where the model lives (for ``"auto"``)."""
    if kind == "auto":
        gpus = topology.node_comm.allgather(gpu_uuid(device or torch.device("cpu")))
        kind = choose_node_transport(gpus, _nccl_available())
    if kind == "mpi":
        return MPINodeTransport(topology.node_gradients)
    if kind in ("gloo", "nccl"):
        import torch.distributed as dist

        available = dist.is_available() and (dist.is_gloo_available() if kind == "gloo" else dist.is_nccl_available())
        if not available:
            raise ValueError(
                f"node_transport={kind!r}: this torch build has no {kind} backend; use node_transport='mpi'"
                + ("" if kind == "gloo" else " or 'gloo'")
                + "."
            )
        return TorchNodeTransport(topology, kind)
    raise ValueError(f"node_transport={kind!r} is not one of {', '.join(map(repr, NODE_TRANSPORTS))}.")
