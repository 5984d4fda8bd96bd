"""A cost model of a training step under each sync mode: fitted on the emulated cluster, checked against
benchmarks/hierarchical.py's measured step times, projected to 2-1024 nodes and 10/100/200 Gbit/s links.

    python benchmarks/cost_model.py --measure      # the sweeps on a 2x2 emulated cluster (root), then the model
    python benchmarks/cost_model.py                # the model from the saved sweeps and hierarchical.json

Inputs (all measured here):

1. Sweeps (``--measure``; one MPI job of 2 nodes x 2 ranks over the benchmark's link rate, float32 messages of
   1 KB to 64 MB, the median of several repetitions each; ranks not taking part wait in an ``Ibarrier`` polled with
   sleeps, so that they take no CPU): MPI ping-pong between the nodes (one pair, and both pairs at once through the
   same links), over gloo between the nodes, and inside a node; a plain TCP stream between the nodes (the floor
   under every transport); and for checking the formulas, allreduce over all 4 ranks, over the 2 node leaders and
   inside both nodes at once, and broadcast inside both nodes.
2. From the sweeps: the latency from the messages up to 64 KB (the median of ``t - n / beta``), the bandwidth by
   least squares on the messages from 1 MB up:

   - link: ``t(n) = alpha + n / beta`` one way (half a round trip) between nodes over MPI; ``beta_shared`` the
     same with both pairs crossing the links at once (what each of a node's ranks gets when all send);
     ``alpha_gloo, beta_gloo`` over gloo's TCP (Lightning DDP's transport);
   - node (shared memory): ``t(n) = alpha_s + n / beta_s``;
   - reduction: ``gamma`` seconds per byte summed, fitted so that the allreduce formula below matches the measured
     node allreduce from 1 MB up (least squares on relative error).

3. From the benchmark (hierarchical.json): per contender the bytes each rank sent per step by scope (the strategy's
   traffic counters: payload bytes, see mpistrategy/comm/traffic.py), the gradient buckets (messages per step),
   DASO's counts of blocking averages and sends, and the compute time per step: the median step of ``local_sgd``,
   whose steps between two averages communicate nothing.

The collectives' costs, for ``n`` bytes, ``N`` nodes of ``L`` ranks, ``P = N L`` (Thakur, Rabenseifner and Gropp,
"Optimization of collective communication operations in MPICH", 2005), with ``lg = ceil(log2)``:

- allreduce over ``p`` processes: the cheapest of recursive doubling ``lg p (alpha + n/beta + n gamma)``, ring
  ``2 (p-1) alpha + (p-1)/p n (2/beta + gamma)`` and Rabenseifner (reduce-scatter by recursive halving, allgather
  by doubling) ``2 lg p alpha + (p-1)/p n (2/beta + gamma)``: among the ``N`` node leaders with the link's
  ``alpha, beta``, inside a node with ``alpha_s, beta_s``;
- node broadcast (binomial tree): ``lg L (alpha_s + n / beta_s)``;
- flat allreduce over ``P`` ranks (MPICH, node-major ranks, Rabenseifner): its first ``lg L`` steps stay inside
  the node (a node allreduce) and its last ``lg N`` steps cross the links with the ``L`` ranks of a node sending
  ``n / L`` each, as many bytes per link as the leaders' allreduce of ``n``: node allreduce + leaders' allreduce;
- flat ring over ``P`` ranks (gloo's, Lightning DDP): ``2 (P-1)`` steps of ``n/P`` bytes, each as slow as its hop
  between nodes: ``2 (P-1) (alpha_gloo + n / (P beta_gloo)) + (P-1)/P n gamma``;
- hierarchical average (the modes' ``nodes`` route): node allreduce + leaders' allreduce + node broadcast;
- gossip on the ring (node-major ranks): each rank swaps its model ``m`` with both neighbours at once; per node
  the two boundary ranks share the link, the others swap in shared memory: ``max(alpha + m / beta_shared,
  alpha_s + m / beta_s)``, whatever ``N``.

Per contender, ms/step = compute + the cost of what it sends, taken from its counters (bytes per step) and its
schedule (how many operations): ``flat`` one flat allreduce per bucket; ``hierarchical`` one hierarchical average
per bucket; ``local_sgd`` a flat allreduce of the model every ``period`` steps; ``hierarchical_local_sgd`` a node
allreduce of every bucket per step and a hierarchical average of the model every ``period`` steps; ``daso`` the
node allreduce per step and its blocking averages (bfloat16) and sends (float32) as counted; ``gossip`` one
exchange per step; ``ddp`` one flat ring per bucket (DDP's 25 MB buckets). Nothing overlaps in the model (the
gradients of the 86 MB layer are ready only at the end of backward; DASO's and gossip's non-blocking transfers
progress only inside MPI calls).

Projection: the link's ``beta`` becomes the nominal rate (10, 100, 200 Gbit/s; concurrent streams keep the share
measured here), ``alpha`` stays as fitted (or ``--latency-us``), everything inside a node stays as fitted here,
and so does the compute time (per-rank batch fixed: weak scaling). Written as
cost_model.md (tables), cost_model.json and cost_model.png in ``--results``.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import RESULTS, positive_float, save, writable_directory  # noqa: E402

SWEEP_SIZES = [2**10, 2**13, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26]  # bytes
SWEEP_PREFIX = "COST_MODEL_SWEEP "
NODES, RANKS_PER_NODE = 2, 2
PROJECTED_NODES = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
PROJECTED_RATES_GBIT = [10, 100, 200]
CHECK_TOLERANCE = 0.25
SMALL = 2**16  # bytes: messages up to this size fit the latency
LARGE = 2**20  # bytes: messages from this size on fit the bandwidth


def _repetitions(nbytes: int) -> int:
    return 9 if nbytes <= 2**20 else 5 if nbytes <= 2**24 else 3


# ------------------------------------------------------------------------------------------------ the sweep job


def _sweep_worker() -> None:
    """In every rank of a 2x2 job: time each pattern at each size; rank 0 prints the medians (seconds)."""
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() != NODES * RANKS_PER_NODE:
        raise SystemExit(f"the sweep runs at {NODES * RANKS_PER_NODE} ranks")
    import torch.distributed as dist
    from hierarchical import rendezvous

    address, port = rendezvous(world)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=world.rank, world_size=world.size)
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    leaders = world.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, key=world.rank)
    stream = _tcp_stream(world)
    results: dict[str, dict[int, float]] = {}
    for nbytes in SWEEP_SIZES:
        send = np.ones(nbytes // 4, dtype=np.float32)
        for name, (takes_part, run) in _patterns(world, node, leaders, stream, send, np.empty_like(send)).items():
            samples = []
            for repetition in range(_repetitions(nbytes) + 1):
                _idle_wait(world)
                seconds = run() if takes_part else 0.0
                _idle_wait(world)
                slowest = world.allreduce(seconds, op=MPI.MAX)
                if repetition:  # the first is a warm-up
                    samples.append(slowest)
            results.setdefault(name, {})[nbytes] = statistics.median(samples)
    dist.destroy_process_group()
    if stream is not None:
        stream.close()
    if world.rank == 0:
        print(SWEEP_PREFIX + json.dumps(results), flush=True)


def _tcp_stream(world) -> socket.socket | None:
    """A plain TCP connection between rank 0 (node 0) and rank 2 (node 1) through the link: the floor under MPI's
    and gloo's transports (``None`` on the other ranks)."""
    listener = port = None
    if world.rank == 2:
        listener = socket.create_server(("", 0))
        port = listener.getsockname()[1]
    port = world.bcast(port, root=2)
    host = world.bcast(socket.gethostname() if world.rank == 2 else None, root=2)
    connection = None
    if world.rank == 0:
        connection = socket.create_connection((host, port))
    world.Barrier()
    if listener is not None:
        connection, _ = listener.accept()
        listener.close()
    if connection is not None:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return connection


def _patterns(world, node, leaders, stream, send, receive) -> dict[str, tuple[bool, Any]]:
    """Per pattern: whether this rank takes part, and the call that returns its seconds."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    rank, local = world.rank, node.Get_rank()
    tensors = torch.from_numpy(send), torch.from_numpy(receive)

    def pingpong(peer: int, first: bool) -> float:
        """One way: half a round trip."""
        start = time.perf_counter()
        if first:
            world.Send(send, dest=peer)
            world.Recv(receive, source=peer)
        else:
            world.Recv(receive, source=peer)
            world.Send(send, dest=peer)
        return (time.perf_counter() - start) / 2

    def pingpong_gloo(peer: int, first: bool) -> float:
        start = time.perf_counter()
        if first:
            dist.send(tensors[0], dst=peer)
            dist.recv(tensors[1], src=peer)
        else:
            dist.recv(tensors[1], src=peer)
            dist.send(tensors[0], dst=peer)
        return (time.perf_counter() - start) / 2

    def stream_once() -> float:
        """Rank 0 streams the message, rank 2 answers one byte when all of it arrived."""
        start = time.perf_counter()
        if rank == 0:
            stream.sendall(memoryview(send).cast("B"))
            stream.recv(1)
        else:
            view, got = memoryview(receive).cast("B"), 0
            while got < len(view):
                got += stream.recv_into(view[got:])
            stream.sendall(b"k")
        return time.perf_counter() - start

    def timed(call) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    return {
        "p2p_link": (rank in (0, 2), lambda: pingpong(2 - rank, rank == 0)),  # one pair across the link
        "p2p_link_shared": (True, lambda: pingpong(rank ^ 2, rank < RANKS_PER_NODE)),  # 0 <-> 2 and 1 <-> 3 at once
        "p2p_node": (rank in (0, 1), lambda: pingpong(1 - rank, rank == 0)),  # inside node 0
        "p2p_link_gloo": (rank in (0, 2), lambda: pingpong_gloo(2 - rank, rank == 0)),  # torch.distributed's TCP
        "tcp_stream_link": (rank in (0, 2), stream_once),  # a plain socket
        "allreduce_world": (True, lambda: timed(lambda: world.Allreduce(send, receive))),
        "allreduce_leaders": (leaders != MPI.COMM_NULL, lambda: timed(lambda: leaders.Allreduce(send, receive))),
        "allreduce_node": (True, lambda: timed(lambda: node.Allreduce(send, receive))),  # both nodes at once
        "bcast_node": (True, lambda: timed(lambda: node.Bcast(send if local == 0 else receive, root=0))),
    }


def _idle_wait(world) -> None:
    """A barrier that does not spin: an Ibarrier polled with sleeps (ranks not taking part leave the CPU)."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def measure_sweeps(rate: str) -> dict[str, Any]:
    """Run the sweep job on a fresh 2x2 emulated cluster at ``rate``; the medians per pattern and size (seconds)."""
    import os

    from cluster import EmulatedCluster

    load_before = os.getloadavg()
    with EmulatedCluster(nodes=NODES, rate=rate) as cluster:
        print(cluster.describe(), file=sys.stderr, flush=True)
        done = cluster.run(
            [sys.executable, __file__, "--sweep-worker"],
            RANKS_PER_NODE,
            env={"OMP_NUM_THREADS": "1"},
            timeout=3600,
            capture_output=True,
        )
    if done.returncode != 0:
        sys.exit(f"the sweep job failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    line = [line for line in done.stdout.splitlines() if line.startswith(SWEEP_PREFIX)][-1]
    sweeps = {
        name: {int(n): t for n, t in points.items()} for name, points in json.loads(line[len(SWEEP_PREFIX) :]).items()
    }
    return {"rate": rate, "load": [load_before[0], os.getloadavg()[0]], "seconds": sweeps}


# ------------------------------------------------------------------------------------------------ fitting


def fit_affine(points: dict[int, float]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b n`` (``a, b >= 0``): the per-byte cost ``b`` by least squares on the messages of
    :data:`LARGE` bytes and more (where bandwidth rules), the latency ``a`` as the median of ``t - b n`` over the
    messages up to :data:`SMALL` bytes (where it rules; a single fit over all sizes would let either end's noise
    set the other's parameter)."""
    large = [(n, t) for n, t in points.items() if n >= LARGE]
    mean_n = sum(n for n, _ in large) / len(large)
    mean_t = sum(t for _, t in large) / len(large)
    b = sum((n - mean_n) * (t - mean_t) for n, t in large) / sum((n - mean_n) ** 2 for n, _ in large)
    b = max(b, 1e-15)
    a = max(statistics.median(t - b * n for n, t in points.items() if n <= SMALL), 0.0)
    b = max(sum(n * (t - a) for n, t in large) / sum(n * n for n, _ in large), 1e-15)  # refit through the latency
    return a, b


def fit_gamma(points: dict[int, float], alpha_s: float, beta_s: float) -> float:
    """The seconds per byte of a sum that make :func:`allreduce` over a node's ranks fit the measured node
    allreduce of :data:`LARGE` bytes and more best (relative error; a bounded search, as the formula is piecewise
    linear in ``gamma``)."""
    from scipy.optimize import minimize_scalar

    largest = max(points)
    unit = points[largest] / largest  # search gamma in units of the largest message's seconds per byte

    def error(units: float) -> float:
        gamma = units * unit
        return sum(
            (allreduce(n, RANKS_PER_NODE, alpha_s, beta_s, gamma) / t - 1) ** 2 for n, t in points.items() if n >= LARGE
        )

    found = minimize_scalar(error, bounds=(0.0, 4.0), method="bounded", options={"xatol": 1e-10})
    return float(found.x) * unit


@dataclass
class Network:
    """The fitted parameters: seconds and bytes per second.

    Attributes:
        alpha, beta: one message between nodes: latency and bandwidth of one stream over a link.
        beta_shared: the bandwidth each of the ``L`` ranks of a node gets when all send over the link at once.
        alpha_s, beta_s: one message inside a node (shared memory).
        alpha_gloo, beta_gloo: one message between nodes over gloo's TCP (torch.distributed, Lightning's DDP).
        gamma: seconds per byte of a float32 sum.
    """

    alpha: float
    beta: float
    beta_shared: float
    alpha_s: float
    beta_s: float
    gamma: float
    alpha_gloo: float
    beta_gloo: float

    @classmethod
    def fit(cls, seconds: dict[str, dict[int, float]]) -> Network:
        alpha, per_byte = fit_affine(seconds["p2p_link"])
        _, per_byte_shared = fit_affine(seconds["p2p_link_shared"])
        alpha_s, per_byte_s = fit_affine(seconds["p2p_node"])
        gamma = fit_gamma(seconds["allreduce_node"], alpha_s, 1 / per_byte_s)
        alpha_gloo, per_byte_gloo = fit_affine(seconds["p2p_link_gloo"])
        return cls(
            alpha, 1 / per_byte, 1 / per_byte_shared, alpha_s, 1 / per_byte_s, gamma, alpha_gloo, 1 / per_byte_gloo
        )

    def at_rate(self, bits_per_second: float, latency: float | None = None) -> Network:
        """The same network with links of the nominal rate ``bits_per_second`` (one stream gets it, concurrent
        streams the share measured here) and, if given, ``latency`` seconds per message between nodes; shared memory
        and sums unchanged."""
        beta = bits_per_second / 8
        alpha = self.alpha if latency is None else latency
        alpha_gloo = self.alpha_gloo if latency is None else latency
        shared = beta * self.beta_shared / self.beta
        return Network(alpha, beta, shared, self.alpha_s, self.beta_s, self.gamma, alpha_gloo, beta)


def _lg(count: int) -> int:
    return math.ceil(math.log2(count)) if count > 1 else 0


def allreduce(n: float, count: int, alpha: float, beta: float, gamma: float) -> float:
    """The cheapest of recursive doubling, ring and Rabenseifner for ``n`` bytes over ``count`` processes."""
    if count <= 1:
        return 0.0
    share = (count - 1) / count * n
    doubling = _lg(count) * (alpha + n / beta + n * gamma)
    ring = 2 * (count - 1) * alpha + share * (2 / beta + gamma)
    rabenseifner = 2 * _lg(count) * alpha + share * (2 / beta + gamma)
    return min(doubling, ring, rabenseifner)


@dataclass(frozen=True)
class Layout:
    """``nodes`` nodes of ``ranks_per_node`` ranks."""

    nodes: int
    ranks_per_node: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node


def node_allreduce(net: Network, n: float, layout: Layout) -> float:
    return allreduce(n, layout.ranks_per_node, net.alpha_s, net.beta_s, net.gamma)


def node_broadcast(net: Network, n: float, layout: Layout) -> float:
    return _lg(layout.ranks_per_node) * (net.alpha_s + n / net.beta_s)


def leaders_allreduce(net: Network, n: float, layout: Layout) -> float:
    return allreduce(n, layout.nodes, net.alpha, net.beta, net.gamma)


def flat_allreduce(net: Network, n: float, layout: Layout) -> float:
    """MPICH's allreduce over all ranks (node-major Rabenseifner): its node steps, then its inter-node steps."""
    return node_allreduce(net, n, layout) + leaders_allreduce(net, n, layout)


def hierarchical_average(net: Network, n: float, layout: Layout) -> float:
    """Node sum, leaders' allreduce, node broadcast (the hierarchical modes' ``nodes`` route)."""
    return node_allreduce(net, n, layout) + leaders_allreduce(net, n, layout) + node_broadcast(net, n, layout)


def ring_allreduce(net: Network, n: float, layout: Layout) -> float:
    """A ring over all ranks (gloo, TCP also inside a node): ``2 (P-1)`` steps of ``n/P`` bytes, each as slow as its
    inter-node hop."""
    ranks = layout.ranks
    if ranks <= 1:
        return 0.0
    hop = net.alpha_gloo + n / ranks / net.beta_gloo
    return 2 * (ranks - 1) * hop + (ranks - 1) / ranks * n * net.gamma


def gossip_exchange(net: Network, n: float, layout: Layout) -> float:
    """Ring gossip with node-major ranks: a node's two boundary ranks each swap ``n`` bytes with a rank of the
    neighbouring node (both directions at once) while the others swap inside the node."""
    if layout.ranks <= 1:
        return 0.0
    link = net.alpha + n / net.beta_shared if layout.nodes > 1 else 0.0
    node = net.alpha_s + n / net.beta_s if layout.ranks_per_node > 1 else 0.0
    return max(link, node)


# ------------------------------------------------------------------------------------------------ step times


@dataclass
class Workload:
    """What one contender sends, per step, from the benchmark's counters and schedule.

    Attributes:
        gradient_bytes: the gradient buckets' sizes (one allreduce each per step, where gradients are averaged).
        model_bytes: the averaged model state (float32).
        inter_node_bytes: payload bytes per rank per step that crossed nodes (the traffic counters' totals over
            all ranks and steps, divided by both; Lightning's DDP has no counter: its gradients).
        steps: steps of the run; blocking, sends: DASO's blocking averages (bfloat16) and non-blocking sends
            (float32) in the run.
    """

    gradient_bytes: list[float]
    model_bytes: float
    inter_node_bytes: float
    steps: int
    blocking: int = 0
    sends: int = 0


def comm_seconds(contender: str, work: Workload, net: Network, layout: Layout) -> float:
    """Seconds of communication per step of ``contender`` (see the module docstring), at ``layout``.

    Bytes per step come from the counters: a period ``H`` is read as ``model_bytes / inter-node bytes per rank``
    (local SGD: every rank sends the model every ``H`` steps; the hierarchical modes: the leaders, ``1/L`` of the
    ranks, do), so a measured schedule carries over to any number of nodes.
    """
    grads, model = work.gradient_bytes, work.model_bytes
    per_leader = work.inter_node_bytes * RANKS_PER_NODE  # inter-node bytes per leader per step (measured at L=2)
    if contender == "ddp":
        return sum(ring_allreduce(net, n, layout) for n in grads)
    if contender == "flat":
        return sum(flat_allreduce(net, n, layout) for n in grads)
    if contender == "hierarchical" or contender.startswith("hierarchical+"):
        fraction = per_leader / sum(grads)  # a compressor sends less than the gradients across nodes
        return sum(
            node_allreduce(net, n, layout)
            + leaders_allreduce(net, n * fraction, layout)
            + node_broadcast(net, n, layout)
            for n in grads
        )
    if contender == "local_sgd":
        return flat_allreduce(net, model, layout) * work.inter_node_bytes / model
    if contender == "hierarchical_local_sgd":
        periodic = hierarchical_average(net, model, layout) * per_leader / model
        return sum(node_allreduce(net, n, layout) for n in grads) + periodic
    if contender == "daso":
        half = model / 2
        averages = work.blocking * hierarchical_average(net, half, layout) + work.sends * (
            hierarchical_average(net, model, layout)
        )
        return sum(node_allreduce(net, n, layout) for n in grads) + averages / work.steps
    if contender == "gossip":  # every rank sends its model to its neighbour on the other node each step
        return gossip_exchange(net, work.inter_node_bytes, layout)
    raise ValueError(f"no cost formula for contender {contender!r}")


def workloads(benchmark: dict[str, Any]) -> dict[str, Workload]:
    """Every contender's :class:`Workload` from hierarchical.json."""
    ranks = benchmark["nodes"] * benchmark["ranks_per_node"]
    model = benchmark["parameters"] * 4.0
    found = {}
    for name, row in benchmark["contenders"].items():
        buckets = [mb * 1e6 for mb in row["buckets_mb"]] if row.get("buckets_mb") else _ddp_buckets(model)
        syncs = row.get("syncs") or {}
        inter = row["counted_inter_node_mb_per_step"]
        found[name] = Workload(
            gradient_bytes=buckets,
            model_bytes=model,
            inter_node_bytes=(inter if inter is not None else model / 1e6) * 1e6 / ranks,
            steps=row["steps"],
            blocking=syncs.get("blocking", 0),
            sends=syncs.get("sent", 0),
        )
    return found


def _ddp_buckets(model_bytes: float, cap: float = 25e6) -> list[float]:
    """DDP's buckets: ``cap`` bytes each (its default 25 MB; a larger parameter gets one of its own, which for the
    one 85 MB layer gives the same total)."""
    full, rest = divmod(model_bytes, cap)
    return [cap] * int(full) + ([rest] if rest else [])


def check(benchmark: dict[str, Any], net: Network, compute: float) -> dict[str, dict[str, float]]:
    """Predicted against measured ms/step for every contender at the benchmark's layout."""
    layout = Layout(benchmark["nodes"], benchmark["ranks_per_node"])
    rows = {}
    for name, work in workloads(benchmark).items():
        predicted = compute + comm_seconds(name, work, net, layout)
        measured = benchmark["contenders"][name]["ms_per_step"] / 1e3
        rows[name] = {
            "measured_ms": measured * 1e3,
            "predicted_ms": predicted * 1e3,
            "error": predicted / measured - 1,
            "within_tolerance": abs(predicted / measured - 1) <= CHECK_TOLERANCE,
        }
    return rows


def project(
    benchmark: dict[str, Any], net: Network, compute: float, latency: float | None = None
) -> dict[str, dict[str, dict[int, float]]]:
    """ms/step per link rate, contender and node count (``L`` as measured; ``latency``: seconds per message between
    nodes instead of the fitted ones)."""
    table: dict[str, dict[str, dict[int, float]]] = {}
    works = workloads(benchmark)
    for rate in PROJECTED_RATES_GBIT:
        scaled = net.at_rate(rate * 1e9, latency)
        table[f"{rate} Gbit/s"] = {
            name: {
                nodes: 1e3 * (compute + comm_seconds(name, work, scaled, Layout(nodes, benchmark["ranks_per_node"])))
                for nodes in PROJECTED_NODES
            }
            for name, work in works.items()
        }
    return table


def tcp_floor_gbit(seconds: dict[str, dict[int, float]]) -> float | None:
    """The bandwidth of a plain TCP stream between the nodes (Gbit/s): what no transport over the link can beat."""
    if "tcp_stream_link" not in seconds:
        return None
    return 8 / fit_affine(seconds["tcp_stream_link"])[1] / 1e9


def sweep_check(seconds: dict[str, dict[int, float]], net: Network) -> dict[str, dict[int, dict[str, float]]]:
    """The fitted formulas against every measured sweep point (ms)."""
    layout = Layout(NODES, RANKS_PER_NODE)
    formulas = {
        "p2p_link": lambda n: net.alpha + n / net.beta,
        "p2p_link_shared": lambda n: net.alpha + n / net.beta_shared,
        "p2p_link_gloo": lambda n: net.alpha_gloo + n / net.beta_gloo,
        "p2p_node": lambda n: net.alpha_s + n / net.beta_s,
        "allreduce_node": lambda n: node_allreduce(net, n, layout),
        "bcast_node": lambda n: node_broadcast(net, n, layout),
        "allreduce_leaders": lambda n: leaders_allreduce(net, n, layout),
        "allreduce_world": lambda n: flat_allreduce(net, n, layout),
    }
    if "tcp_stream_link" in seconds:  # the floor: a plain TCP stream, fitted on its own
        latency, per_byte = fit_affine(seconds["tcp_stream_link"])
        formulas["tcp_stream_link"] = lambda n: latency + n * per_byte
    return {
        name: {n: {"measured_ms": t * 1e3, "model_ms": formulas[name](n) * 1e3} for n, t in points.items()}
        for name, points in seconds.items()
    }


# ------------------------------------------------------------------------------------------------ output


def markdown(payload: dict[str, Any]) -> str:
    """The fit, the check against the benchmark and the projection as markdown tables."""
    net, sweeps = payload["network"], payload["sweeps"]
    lines = [
        "# Cost model of a training step (benchmarks/cost_model.py)",
        "",
        f"Fitted on a 2x2 emulated cluster over {sweeps['rate']} links (load average {sweeps['load'][0]:.1f} before "
        f"the sweeps, {sweeps['load'][1]:.1f} after), checked against benchmarks/hierarchical.py "
        f"({payload['benchmark_model']}, load average {payload['benchmark_load']}).",
        "",
        "| parameter | fitted |",
        "| --- | --- |",
        f"| link latency alpha | {net['alpha'] * 1e6:.0f} us |",
        f"| link bandwidth beta (one stream) | {net['beta'] * 8 / 1e9:.3f} Gbit/s |",
        f"| link bandwidth per stream, both ranks of a node sending | {net['beta_shared'] * 8 / 1e9:.3f} Gbit/s |",
        f"| shared-memory latency alpha_s | {net['alpha_s'] * 1e6:.0f} us |",
        f"| shared-memory bandwidth beta_s | {net['beta_s'] / 1e9:.2f} GB/s |",
        f"| float32 sum gamma | {net['gamma'] * 1e9:.2f} ns/byte |",
        f"| a plain TCP stream between the nodes (the floor) | {_gbit(payload['tcp_stream_gbit_per_s'])} |",
        f"| link latency over gloo's TCP (DDP) | {net['alpha_gloo'] * 1e6:.0f} us |",
        f"| link bandwidth over gloo's TCP (DDP) | {net['beta_gloo'] * 8 / 1e9:.3f} Gbit/s |",
        f"| compute per step (local_sgd's median step) | {payload['compute_ms']:.0f} ms |",
        "",
        "Sweep points against the fitted formulas (ms):",
        "",
        "| pattern | " + " | ".join(_size(n) for n in SWEEP_SIZES) + " |",
        "| --- |" + " --- |" * len(SWEEP_SIZES),
    ]
    for name, points in payload["sweep_check"].items():
        cells = [f"{p['measured_ms']:.2f} / {p['model_ms']:.2f}" for p in (points[str(n)] for n in SWEEP_SIZES)]
        lines.append(f"| {name} (measured / model) | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Step time at 2 nodes x 2 ranks, measured by benchmarks/hierarchical.py against the model (within "
        f"{CHECK_TOLERANCE:.0%}?):",
        "",
        "| contender | measured ms/step | model ms/step | error | within |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, row in payload["check"].items():
        lines.append(
            f"| {name} | {row['measured_ms']:.0f} | {row['predicted_ms']:.0f} | {row['error']:+.0%} | "
            f"{'yes' if row['within_tolerance'] else 'no'} |"
        )
    for rate, table in payload["projection"].items():
        latency = payload["projected_latency_us"]
        between = "fitted" if latency is None else f"{latency:g} us"
        lines += [
            "",
            f"Projected ms/step, links of {rate}, latency between nodes {between} (shared memory and compute as "
            "fitted here):",
            "",
        ]
        lines.append("| contender | " + " | ".join(f"{n} nodes" for n in PROJECTED_NODES) + " |")
        lines.append("| --- |" + " --- |" * len(PROJECTED_NODES))
        for name, row in table.items():
            lines.append(f"| {name} | " + " | ".join(f"{row[str(n)]:.0f}" for n in PROJECTED_NODES) + " |")
    return "\n".join(lines) + "\n"


def _gbit(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.3f} Gbit/s"


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 2**20 else f"{nbytes >> 10} KB"


def plot(payload: dict[str, Any], path: Path) -> None:
    """Left: the model against the measured step times; right: the projection, one panel per link rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(payload["projection"])
    fig, axes = plt.subplots(1, 1 + len(rates), figsize=(5 + 4.5 * len(rates), 4.5))
    names = list(payload["check"])
    check_rows = payload["check"]
    axes[0].bar([i - 0.2 for i in range(len(names))], [check_rows[n]["measured_ms"] for n in names], 0.4,
                label="measured")  # fmt: skip
    axes[0].bar([i + 0.2 for i in range(len(names))], [check_rows[n]["predicted_ms"] for n in names], 0.4,
                label="model")  # fmt: skip
    axes[0].set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("ms per step")
    axes[0].set_title(f"2x2 emulated, {payload['sweeps']['rate']}", fontsize=9)
    axes[0].legend(fontsize=8)
    for ax, rate in zip(axes[1:], rates, strict=True):
        for index, (name, row) in enumerate(payload["projection"][rate].items()):
            ax.plot(PROJECTED_NODES, [row[str(n)] for n in PROJECTED_NODES], "-o", markersize=3, color=f"C{index}",
                    label=name)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel("ms per step (log)")
        ax.set_xlabel("nodes (2 ranks each)")
        ax.set_title(f"projected, {rate} links", fontsize=9)
        ax.grid(True, alpha=0.3)
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="run the sweeps on the emulated cluster (root)")
    parser.add_argument("--rate", default="1gbit", help="the sweeps' link rate (the benchmark's)")
    parser.add_argument("--benchmark", type=Path, default=RESULTS / "hierarchical.json", help="the measured steps")
    parser.add_argument("--results", type=writable_directory, default=RESULTS, help="where to write cost_model.*")
    parser.add_argument(
        "--latency-us", type=positive_float, help="project with this latency between nodes (default: the fitted ones)"
    )
    parser.add_argument("--sweep-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sweep_worker:
        _sweep_worker()
        return
    sweep_path = args.results / "cost_model_sweeps.json"
    if args.measure:
        save("cost_model_sweeps", measure_sweeps(args.rate), args.results)
    if not sweep_path.exists():
        parser.error(f"no sweeps in {sweep_path}: run with --measure first (as root)")
    sweeps = json.loads(sweep_path.read_text())
    seconds = {name: {int(n): t for n, t in points.items()} for name, points in sweeps["seconds"].items()}
    benchmark = json.loads(args.benchmark.read_text())
    if "local_sgd" not in benchmark["contenders"]:
        parser.error(f"{args.benchmark} has no local_sgd contender, whose local steps give the compute time")
    net = Network.fit(seconds)
    compute = benchmark["contenders"]["local_sgd"]["median_step_ms"] / 1e3
    loads = sorted(round(load, 1) for r in benchmark["rounds"] for load in (r["load_before"][0], r["load_after"][0]))
    payload = json.loads(json.dumps({  # str keys throughout, as the JSON file has them
        "network": asdict(net),
        "tcp_stream_gbit_per_s": tcp_floor_gbit(seconds),
        "compute_ms": compute * 1e3,
        "sweeps": sweeps,
        "sweep_check": sweep_check(seconds, net),
        "benchmark_model": benchmark["model"],
        "benchmark_load": f"{loads[0]}-{loads[-1]}",
        "check": check(benchmark, net, compute),
        "projected_latency_us": args.latency_us,
        "projection": project(benchmark, net, compute, None if args.latency_us is None else args.latency_us * 1e-6),
    }))  # fmt: skip
    save("cost_model", payload, args.results)
    (args.results / "cost_model.md").write_text(markdown(payload))
    plot(payload, args.results / "cost_model.png")
    print(markdown(payload))
    print(f"wrote cost_model.json, cost_model.md and cost_model.png in {args.results}")


if __name__ == "__main__":
    main()
