"""Averaging a model's state over ranks: the parameters that train and the floating-point buffers.

The averaged state ``x`` is every parameter that requires a gradient (of every parameter group) and every
floating-point buffer (BatchNorm running statistics), packed into flat host buffers, one per dtype (a state on a
GPU is concatenated there and crosses the bus in one transfer each way, through page-locked memory where the flats
are private). The result is
the mean over all ``P`` ranks, ``x_bar = (1/P) sum_r x_r``, by one of two routes:

- ``"world"``: one allreduce (sum) over all ranks, then ``/ P``;
- ``"nodes"``: a sum inside each node (shared memory), an allreduce among the node leaders (the only traffic
  between nodes: one copy of the state per node), then ``/ P`` on the leader, which the other ranks of its node
  read.

On the ``"nodes"`` route with several ranks per node (and shared memory not switched off, see
:mod:`mpistrategy.comm.shm`), the flat buffers live in the node's shared memory
(:class:`~mpistrategy.comm.shared_flats.SharedFlats`, two sets used in turn): the node sum is the shared-memory
allreduce, in place, and the other ranks read the leader's mean where it is instead of receiving a broadcast. A
mean returned by :meth:`Averaging.result` off the leader is therefore the leader's memory: valid until the
average after the next one starts (a third average in flight at once is refused). Otherwise the node steps are
MPI's allreduce and broadcast on private buffers.

The inter-node part can be non-blocking (:meth:`ModelAverager.start` returns an :class:`Averaging` whose
:meth:`Averaging.result` completes it later; meanwhile a background thread drives MPI's progress on it, see
:mod:`mpistrategy.comm.progress`, so that it travels while the training loop computes), split into chunks of
``chunk_elements`` (so that MPI can pipeline them) and sent in a ``wire_dtype`` (bfloat16 or float16: two bytes
per element, summed pairwise in float32, see :mod:`mpistrategy.comm.low_precision`). What a mode does with the
mean (replace, or merge with the current state) is the mode's business: :meth:`ModelAverager.assign` and
:meth:`ModelAverager.merge`.

On the ``"nodes"`` route an average may also take one rank per node (``source``, a rank of the node): the mean
over the ``N`` nodes of that rank's state, ``(1/N) sum_n x_{n, source}`` (heat's DASO sends one rank's model per
node); the other ranks of each node contribute zeros to the node sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.comm.buffers import mpi_buffer, mpi_op
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.low_precision import HALF_DTYPES, half_buffer, half_sum
from mpistrategy.comm.progress import Progress, drive
from mpistrategy.comm.shared_flats import SharedFlats
from mpistrategy.comm.shm import group_for, shared_memory_mode
from mpistrategy.comm.topology import Topology
from mpistrategy.comm.traffic import INTER_NODE, NODE, TrafficCounter

ROUTES = ("world", "nodes")


def averaged_tensors(module: nn.Module) -> list[torch.Tensor]:
    """What model averaging averages: parameters that require a gradient, then floating-point buffers."""
    params = [p for p in module.parameters() if p.requires_grad]
    buffers = [b for b in module.buffers() if b.dtype.is_floating_point]
    return params + buffers


def _cuda_device(tensors: list[torch.Tensor]) -> torch.device | None:
    """The CUDA device holding every tensor of ``tensors``, if there is one (``None``: on the host, or spread)."""
    device = tensors[0].device
    return device if device.type == "cuda" and all(t.device == device for t in tensors) else None


def _pack_group(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``flat`` (host) <- ``tensors`` flattened and concatenated. Tensors on one GPU are concatenated there and
    copied to the host in one transfer (page-locked ``flat``: at the bus's speed), not one per tensor."""
    pieces = [t.detach().reshape(-1) for t in tensors]
    if _cuda_device(tensors) is None:
        torch.cat([piece.to("cpu") for piece in pieces], out=flat)
    else:
        flat.copy_(torch.cat(pieces))


def _to_wire(flat: torch.Tensor, wire: torch.Tensor, scale: float) -> None:
    """``wire`` <- ``scale * flat`` in ``wire``'s dtype (in place where ``wire`` is ``flat``)."""
    if scale != 1.0:
        torch.mul(flat, scale, out=wire)
    elif wire.data_ptr() != flat.data_ptr():
        wire.copy_(flat)


@dataclass
class Averaging:
    """A mean of the state in flight; :meth:`result` completes it and returns the flat means (one per dtype)."""

    averager: ModelAverager
    flats: list[torch.Tensor]
    wires: list[torch.Tensor]
    requests: list[MPI.Request] = field(default_factory=list)
    progress: Progress | None = None  # the thread driving the requests while they are in flight
    shared_set: int | None = None  # the set of the node's shared flats it uses (None: private flats)
    contributors: int = 1  # how many ranks' states the sum holds (the mean divides by it)
    done: bool = False

    def test(self) -> bool:
        """Whether the inter-node part completed (never blocks; drives MPI progress)."""
        if self.done or not self.requests:
            return True
        if self.progress is not None:
            return self.progress.completed
        return MPI.Request.Testall(self.requests)

    def result(self) -> list[torch.Tensor]:
        """Complete the average (waits for the inter-node part; broadcasts inside the node) and return the means."""
        if not self.done:
            if self.progress is not None:
                self.progress.stop()
            self.averager._complete(self)
            self.done = True
        return self.flats


class ModelAverager:
    """Averages a module's trainable parameters and floating-point buffers over all ranks (module docstring).

    Args:
        module: the model.
        topology: this process's ranks, nodes and communicators.
        traffic: counts the bytes sent.
        route: ``"world"`` or ``"nodes"``.
        chunk_elements: the most elements per inter-node message.

    Building it is collective (it duplicates the communicators it uses, so its traffic in flight never matches
    anybody else's).
    """

    def __init__(
        self,
        module: nn.Module,
        topology: Topology,
        traffic: TrafficCounter,
        route: str = "world",
        chunk_elements: int = 10_000_000,
    ) -> None:
        if route not in ROUTES:
            raise ValueError(f"ModelAverager: route={route!r} is not one of {ROUTES}.")
        if chunk_elements < 1:
            raise ValueError(f"ModelAverager: chunk_elements={chunk_elements} must be at least 1.")
        self.topology = topology
        self.traffic = traffic
        self.route = route
        self.chunk_elements = int(chunk_elements)
        self.tensors = averaged_tensors(module)
        self._groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for tensor in self.tensors:
            self._groups.setdefault(tensor.dtype, []).append(tensor)
        if route == "world":
            self.world: Communicator | None = Communicator(topology.gradients.comm.Dup())
            self.node = self.leaders = None
        else:
            self.world = None
            self.node = Communicator(topology.node_comm.Dup())
            self.leaders = Communicator(topology.leader_comm.Dup()) if topology.is_leader else None
        self._shared: SharedFlats | None = None  # built by the first average that uses it
        self._started = 0  # averages started
        self._in_flight: list[Averaging | None] = [None, None]  # the last two (at most two in flight at once)
        self._wires: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}  # a shared set's low-precision copies

    @property
    def numel(self) -> int:
        """The number of averaged elements."""
        return sum(t.numel() for t in self.tensors)

    def _zeros(self) -> list[torch.Tensor]:
        """Flat buffers laid out as :meth:`pack` lays them out, holding zeros."""
        return [torch.zeros(sum(t.numel() for t in tensors), dtype=dtype) for dtype, tensors in self._groups.items()]

    def pack(self) -> list[torch.Tensor]:
        """The current state as flat host buffers, one per dtype (copies; page-locked for a state on a GPU)."""
        flats = [
            torch.empty(sum(t.numel() for t in tensors), dtype=dtype, pin_memory=_cuda_device(tensors) is not None)
            for dtype, tensors in self._groups.items()
        ]
        self._pack_into(flats)
        return flats

    def _pack_into(self, flats: list[torch.Tensor]) -> None:
        for tensors, flat in zip(self._groups.values(), flats, strict=True):
            _pack_group(tensors, flat)

    @property
    def _shares_node_memory(self) -> bool:
        return self.route == "nodes" and self.node is not None and self.node.size > 1 and shared_memory_mode() != "off"

    def _shared_flats(self, index: int) -> list[torch.Tensor]:
        """This rank's shared flats of set ``index`` for the next average (collective over the node): once every
        rank of the node got here, none still reads the leader's mean of the last average that used the set."""
        assert self.node is not None  # the "nodes" route
        if self._shared is None:
            layout = [(tensors[0].dtype, sum(t.numel() for t in tensors)) for tensors in self._groups.values()]
            self._shared = SharedFlats(self.node.forward, layout)
        self.node.forward.Barrier()
        return self._shared.own(index)

    def _node_sum(self, flat: torch.Tensor) -> None:
        """``flat`` <- its sum over the node's ranks (the shared-memory allreduce where it applies, else MPI's)."""
        assert self.node is not None  # the "nodes" route
        self.traffic.add(NODE, flat.nbytes)
        group = group_for(self.node.forward, flat, "sum")
        if group is not None:
            group.allreduce(flat, "sum", flat)
        else:
            self.node.forward.Allreduce(MPI.IN_PLACE, mpi_buffer(flat), MPI.SUM)

    def start(self, wire_dtype: torch.dtype | None = None, source: int | None = None) -> Averaging:
        """Start averaging the current state: the node sum completes now, the inter-node part is left in flight.

        ``wire_dtype`` (``torch.bfloat16`` or ``torch.float16``) halves the inter-node bytes; ``None`` sends the
        state's own dtype. ``source`` (``"nodes"`` route only): average only the state of this rank of each node.
        On the ``"nodes"`` route in a ``wire_dtype``, each node sends its sum scaled to ``N / P`` (its mean, with
        nodes of equal size) and the nodes' sum is divided by ``N``: the value on the wire is a rank's state, not
        ``P / N`` times it, so it overflows float16 no sooner than one rank's state and rounds as one rank's does.
        """
        if wire_dtype is not None and wire_dtype not in HALF_DTYPES:
            raise ValueError(f"ModelAverager: wire_dtype={wire_dtype} must be None, torch.bfloat16 or torch.float16.")
        contributors = self.topology.size
        node_scale = 1.0
        if source is not None:
            if self.node is None or not 0 <= source < self.node.size:
                raise ValueError(f"ModelAverager: source={source} must be a rank of the node on the 'nodes' route.")
            contributors = self.topology.num_nodes
        elif wire_dtype is not None and self.route == "nodes":
            node_scale = self.topology.num_nodes / self.topology.size
            contributors = self.topology.num_nodes
        index = self._started % 2
        previous = self._in_flight[index]
        if previous is not None and not previous.done:
            raise RuntimeError(
                "ModelAverager: two averages are still in flight; complete one (Averaging.result()) before "
                "starting a third."
            )
        shared_set = index if self._shares_node_memory else None
        contributes = source is None or self.node is None or self.node.rank == source
        if shared_set is None:
            flats = self.pack() if contributes else self._zeros()
        else:
            flats = self._shared_flats(shared_set)
            if contributes:
                self._pack_into(flats)
            else:
                for flat in flats:
                    flat.zero_()
        spans_nodes = self.topology.num_nodes > 1
        if self.route == "nodes":
            assert self.node is not None
            if self.node.size > 1:
                for flat in flats:
                    self._node_sum(flat)
            comm = self.leaders
        else:
            comm = self.world
        wires: list[torch.Tensor] = []
        requests: list[MPI.Request] = []
        if comm is not None:
            for position, flat in enumerate(flats):
                wire = flat
                if shared_set is not None or (wire_dtype is not None and flat.dtype != wire_dtype):
                    wire = self._wire_buffer(position, flat.numel(), wire_dtype or flat.dtype, shared_set)
                wires.append(wire)
                if comm.size > 1:
                    self.traffic.add(INTER_NODE if spans_nodes else NODE, wire.nbytes)
                    requests += self._post(comm, flat, wire, node_scale)
                else:
                    _to_wire(flat, wire, node_scale)
        averaging = Averaging(self, flats, wires, requests, drive(requests), shared_set, contributors)
        self._in_flight[index] = averaging
        self._started += 1
        return averaging

    def _wire_buffer(self, position: int, numel: int, dtype: torch.dtype, shared_set: int | None) -> torch.Tensor:
        """Where flat ``position`` travels in ``dtype``: private memory (over TCP, MPI sends and receives the
        same bytes 10-17 % slower from a shared window, measured on the emulated cluster), kept for the next
        average on the same shared set (its pages are touched once), else new."""
        if shared_set is None:
            return torch.empty(numel, dtype=dtype)
        key = (shared_set, position, dtype)
        wire = self._wires.get(key)
        if wire is None or wire.numel() != numel:
            wire = self._wires[key] = torch.empty(numel, dtype=dtype)
        return wire

    def _post(self, comm: Communicator, flat: torch.Tensor, wire: torch.Tensor, scale: float) -> list[MPI.Request]:
        """Start the sum of ``wire`` over ``comm`` in chunks; each chunk is converted from ``flat`` (when ``wire``
        is a lower-precision copy) and scaled just before it is sent, so that the first travels while the next
        converts."""
        requests = []
        for begin in range(0, wire.numel(), self.chunk_elements):
            chunk = wire[begin : begin + self.chunk_elements]
            _to_wire(flat[begin : begin + self.chunk_elements], chunk, scale)
            if wire.dtype in HALF_DTYPES:
                requests.append(comm.forward.Iallreduce(MPI.IN_PLACE, half_buffer(chunk), half_sum(wire.dtype)))
            else:
                requests.append(comm.forward.Iallreduce(MPI.IN_PLACE, mpi_buffer(chunk), mpi_op(wire.dtype, "sum")))
        return requests

    def _complete(self, averaging: Averaging) -> None:
        if averaging.requests:
            MPI.Request.Waitall(averaging.requests)
        scale = 1.0 / averaging.contributors
        if averaging.shared_set is not None:  # the leader scales; the others read its mean in place
            assert self.node is not None and self._shared is not None  # set up by the start that chose shared memory
            if self.node.rank == 0:
                for flat, wire in zip(averaging.flats, averaging.wires, strict=False):
                    # a 1-element tensor, not a scalar: a bfloat16/float16 wire is multiplied in the flat's dtype
                    torch.mul(wire, torch.tensor([scale], dtype=flat.dtype), out=flat)
            self.node.forward.Barrier()
            averaging.flats = self._shared.of(0, averaging.shared_set)
            return
        for flat, wire in zip(averaging.flats, averaging.wires, strict=False):  # no wires off the node leaders
            if wire is not flat:
                flat.copy_(wire)
        if self.route == "nodes" and self.node is not None and self.node.size > 1:
            for flat in averaging.flats:
                self.node.forward.Bcast(mpi_buffer(flat), root=0)
        for flat in averaging.flats:
            flat.mul_(scale)

    def average(self, wire_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The mean state over all ranks, blocking."""
        return self.start(wire_dtype).result()

    def broadcast_in_node(self, root: int) -> None:
        """Replace the state of every rank of this node by that of its rank ``root`` (blocking)."""
        if self.node is None or self.node.size == 1:
            return
        flats = self.pack()
        for flat in flats:
            self.traffic.add(NODE, flat.nbytes)
            self.node.forward.Bcast(mpi_buffer(flat), root=root)
        self.assign(flats)

    def close(self) -> None:
        """Free the node's shared memory and the averager's communicators (collective; end of training: no
        average follows). Averages in flight must be complete; a mean still referenced keeps its memory until MPI
        ends."""
        self._in_flight = [None, None]
        self._wires = {}
        if self._shared is not None:
            self._shared.free()
            self._shared = None
        for comm in (self.world, self.node, self.leaders):
            if comm is not None:
                comm.free()  # its shared-memory groups go with it

    def assign(self, flats: list[torch.Tensor]) -> None:
        """Set the state to ``flats`` (as :meth:`pack` lays it out)."""
        self._apply(flats, lambda current, mean: current.copy_(mean))

    def merge(self, flats: list[torch.Tensor], own: float, other: float) -> None:
        """Set the state to ``own * current + other * flats``."""
        self._apply(flats, lambda current, mean: current.mul_(own).add_(mean, alpha=other))

    def _apply(self, flats: list[torch.Tensor], update: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
        with torch.no_grad():
            for tensors, flat in zip(self._groups.values(), flats, strict=True):
                device = _cuda_device(tensors)
                # a state on one GPU: one transfer there, then the updates on the device
                source = flat if device is None else flat.to(device, non_blocking=flat.is_pinned())
                offset = 0
                for tensor in tensors:
                    count = tensor.numel()
                    mean = source[offset : offset + count].view_as(tensor).to(tensor.device, non_blocking=True)
                    update(tensor.data, mean)
                    offset += count

    def __repr__(self) -> str:
        return f"ModelAverager(route={self.route!r}, {self.numel} elements)"
