"""Where this process sits in the MPI job: ranks, nodes and the communicators built on them.

Everything here comes from MPI itself, never from launcher variables, so ``mpiexec``, ``srun --mpi=pmi2`` and a
plain ``python`` (a world of one) agree:

- a node is the set of processes that share memory, ``MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)``;
- *virtual nodes*: ``ranks_per_node=k`` (or ``MPISTRATEGY_RANKS_PER_NODE=k``) cuts every shared-memory node into
  groups of ``k`` consecutive local ranks that then act as nodes (the last group of a node may be smaller), so
  that ``mpiexec -n 4`` on one machine behaves as two nodes of two, for tests, demos and laptops;
- node rank: the index of a node's leader (its local rank 0) among all leaders, ordered by global rank;
- a wrong pairing of SLURM and MPI (SLURM started several tasks but each one is an MPI world of its own, because
  the MPI library cannot talk to srun's PMI) is detected and reported instead of training N separate models.

:func:`topology` builds the :class:`Topology` once per process and ``ranks_per_node``. Building it is collective
over ``MPI.COMM_WORLD`` (communicator splits and duplicates), so every rank must call it with the same
``ranks_per_node``, which is the case when every rank constructs the same ``Trainer``.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, replace

from mpi4py import MPI

from mpistrategy.comm.checks import is_integer
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.errors import by_rank

RANKS_PER_NODE_VARIABLE = "MPISTRATEGY_RANKS_PER_NODE"
_SLURM_TASK_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")


class LaunchMismatchError(RuntimeError):
    """SLURM started several tasks but MPI sees a world of one in each: the tasks cannot talk to each other."""


@dataclass(frozen=True)
class Topology:
    """Ranks, nodes and communicators of this process (see the module docstring).

    Attributes:
        rank, size: global rank and world size.
        local_rank, local_size: rank and number of processes on this node.
        node_rank, num_nodes: index of this node and number of nodes.
        node_sizes: the number of processes on every node, by node rank.
        virtual: nodes were cut from shared-memory nodes by ``ranks_per_node``.
        machine_rank, machine_size: the rank among, and the number of, the processes sharing this machine's memory
            (equal to ``local_rank`` and ``local_size`` unless nodes are virtual): what picks this process's GPU
            and its share of the cores.
        hostname: this node's host name; ``main_address`` is rank 0's.
        node_comm: the processes of this node.
        leader_comm: the local-rank-0 processes of every node, ordered by node rank (``MPI.COMM_NULL`` on the
            other ranks).
        cross_comm: the processes with this process's local rank on every node that has one, ordered by node
            rank (ranks of equal local rank across nodes).
        control: a private duplicate of the world for small blocking messages (barriers, object broadcasts, stop
            decisions, metric gathers), so they never interleave with user traffic.
        gradients: a private :class:`~mpistrategy.Communicator` over the world for gradient traffic.
        node_gradients: a private :class:`~mpistrategy.Communicator` over ``node_comm`` for node-local traffic.
        leader_gradients: a private :class:`~mpistrategy.Communicator` over ``leader_comm`` (``None`` off the
            leaders).
        cross_gradients: a private :class:`~mpistrategy.Communicator` over ``cross_comm``.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    node_sizes: tuple[int, ...]
    virtual: bool
    machine_rank: int
    machine_size: int
    hostname: str
    main_address: str
    node_comm: MPI.Intracomm
    leader_comm: MPI.Intracomm
    cross_comm: MPI.Intracomm
    control: MPI.Intracomm
    gradients: Communicator
    node_gradients: Communicator
    leader_gradients: Communicator | None
    cross_gradients: Communicator

    @property
    def is_leader(self) -> bool:
        """Whether this process is its node's leader (local rank 0)."""
        return self.local_rank == 0

    @property
    def even_nodes(self) -> bool:
        """Whether every node has the same number of processes."""
        return len(set(self.node_sizes)) == 1

    def with_own_gradient_channels(self) -> Topology:
        """This topology with new duplicates of its gradient communicators (collective over every rank): gradient
        traffic on the copy is never matched with traffic on this one, whatever order the two are posted in (a
        second model's gradient buckets, started in the same backward pass as the first model's)."""
        leader = self.leader_gradients
        return replace(
            self,
            gradients=Communicator(self.gradients.comm.Dup()),
            node_gradients=Communicator(self.node_gradients.comm.Dup()),
            leader_gradients=Communicator(leader.comm.Dup()) if leader is not None else None,
            cross_gradients=Communicator(self.cross_gradients.comm.Dup()),
        )

    def free_gradient_channels(self) -> None:
        """Free the gradient communicators (collective over every rank): of a copy made by
        :meth:`with_own_gradient_channels`, once its model's training is over."""
        for comm in (self.gradients, self.node_gradients, self.leader_gradients, self.cross_gradients):
            if comm is not None:
                comm.free()


_topologies: dict[int | None, Topology] = {}
_lock = threading.Lock()


def topology(ranks_per_node: int | None = None) -> Topology:
    """This process's :class:`Topology`, built on first use for each ``ranks_per_node`` (collective over
    ``MPI.COMM_WORLD`` then; later calls only look it up).

    ``ranks_per_node=None`` takes ``MPISTRATEGY_RANKS_PER_NODE`` when it is set, else the shared-memory nodes.
    Raises ``ValueError`` on every rank for a value that is not a positive integer or differs between ranks.
    """
    requested, problem = _requested_ranks_per_node(ranks_per_node)
    with _lock:
        found = _topologies.get(requested) if not problem else None
        if found is None:
            check_launch()
            _agree_on_ranks_per_node(requested, problem)
            found = _topologies[requested] = _build(MPI.COMM_WORLD, requested)
        return found


def _requested_ranks_per_node(ranks_per_node: int | None) -> tuple[int | None, str]:
    """The virtual node size asked for on this rank (``None``: real nodes) and what is wrong with it, if anything."""
    value: object = ranks_per_node
    if ranks_per_node is None:
        text = os.environ.get(RANKS_PER_NODE_VARIABLE, "").strip()
        if not text:
            return None, ""
        try:
            value = int(text)
        except ValueError:
            return None, f"{RANKS_PER_NODE_VARIABLE}={text!r} is not an integer"
    if not is_integer(value) or value < 1:
        return None, f"ranks_per_node={value!r} is not a positive integer"
    return int(value), ""


def _agree_on_ranks_per_node(requested: int | None, problem: str) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks asked for the same valid virtual node size."""
    world = MPI.COMM_WORLD
    everyone = world.allgather((problem, requested)) if world.Get_size() > 1 else [(problem, requested)]
    problems = [f"rank {rank}: {p}" for rank, (p, _) in enumerate(everyone) if p]
    if problems:
        raise ValueError(
            f"virtual nodes: {'; '.join(problems)}. Pass a positive number of ranks per node (for example "
            f"{RANKS_PER_NODE_VARIABLE}=2), or leave it unset to take the nodes from MPI."
        )
    if len({value for _, value in everyone}) > 1:
        listing = by_rank(value for _, value in everyone)
        raise ValueError(
            f"virtual nodes: ranks asked for different ranks_per_node ({listing}); set the same value on every rank."
        )


def slurm_task_count() -> int | None:
    """The number of tasks SLURM started for this job step, or ``None`` outside SLURM."""
    for name in _SLURM_TASK_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value.split("(")[0].split(",")[0])
            except ValueError:
                continue
    return None


def check_launch(world_size: int | None = None) -> None:
    """Raise :class:`LaunchMismatchError` when SLURM says several tasks but MPI sees a world of one.

    That happens when the MPI library does not understand the PMI that ``srun`` offers (for instance
    ``--mpi=pmix`` with MPICH's wheel, or no ``--mpi`` at all with some setups): every task then initialises MPI
    as a singleton and would silently train its own model. Set ``MPISTRATEGY_IGNORE_SLURM=1`` to skip the check
    (for a deliberately single-process run inside a multi-task allocation).
    """
    if os.environ.get("MPISTRATEGY_IGNORE_SLURM", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    size = MPI.COMM_WORLD.Get_size() if world_size is None else world_size
    tasks = slurm_task_count()
    if size == 1 and tasks is not None and tasks > 1:
        raise LaunchMismatchError(
            f"SLURM started {tasks} tasks for this step, but MPI sees a world of one process in this task: the MPI "
            "library and srun's process-management interface do not match, so every task would train on its own. "
            "Launch with `srun --mpi=pmi2 python train.py` (MPICH), use the `--mpi` type your MPI library was built "
            "for (see `srun --mpi=list`), or run `mpiexec -n $SLURM_NTASKS python train.py` inside the allocation. "
            "To run a single process on purpose inside a multi-task allocation, set MPISTRATEGY_IGNORE_SLURM=1."
        )


def ready_for_objects(comm: MPI.Intracomm) -> MPI.Intracomm:
    """``comm`` (``MPI.COMM_NULL`` passes), with mpi4py's context for object reductions made now: collective.

    mpi4py makes that context at a communicator's first ``comm.allreduce``, ``reduce``, ``scan`` or ``exscan`` of
    Python objects, by an ``MPI_Comm_dup`` during which it holds the GIL. A rank that reaches such a call while the
    others wait in another collective would block there with its stall watchdog unable to run, so the stall report
    could only say that it did not answer; made here, where every rank builds the communicator, the later calls
    wait without the GIL and the rank answers with its stack."""
    if comm != MPI.COMM_NULL:
        comm.allreduce(0)
    return comm


def _build(world: MPI.Intracomm, ranks_per_node: int | None) -> Topology:
    rank, size = world.Get_rank(), world.Get_size()
    shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    machine_rank, machine_size = shared.Get_rank(), shared.Get_size()
    if ranks_per_node is None:
        node_comm = shared
    else:
        node_comm = shared.Split(shared.Get_rank() // ranks_per_node, key=rank)
        shared.Free()
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    # Every rank learns the global rank of its node's leader; the sorted distinct leaders number the nodes.
    leader = node_comm.bcast(rank, root=0)
    leaders_of_ranks = world.allgather(leader)
    leaders = sorted(set(leaders_of_ranks))
    node_rank = leaders.index(leader)
    node_sizes = tuple(leaders_of_ranks.count(node_leader) for node_leader in leaders)
    leader_comm = world.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=node_rank)
    cross_comm = world.Split(local_rank, key=node_rank)
    hostname = socket.gethostname()
    main_address = world.bcast(hostname, root=0)
    return Topology(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        node_rank=node_rank,
        num_nodes=len(leaders),
        node_sizes=node_sizes,
        virtual=ranks_per_node is not None,
        machine_rank=machine_rank,
        machine_size=machine_size,
        hostname=hostname,
        main_address=main_address,
        node_comm=ready_for_objects(node_comm),  # type: ignore[arg-type]  # mpi4py types Split's result as Comm
        leader_comm=ready_for_objects(leader_comm),  # type: ignore[arg-type]
        cross_comm=ready_for_objects(cross_comm),  # type: ignore[arg-type]
        control=ready_for_objects(world.Dup()),
        gradients=Communicator(world.Dup()),
        node_gradients=Communicator(node_comm.Dup()),
        leader_gradients=Communicator(leader_comm.Dup()) if leader_comm != MPI.COMM_NULL else None,
        cross_gradients=Communicator(cross_comm.Dup()),
    )
