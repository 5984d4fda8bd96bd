"""Where this process sits in the MPI job: ranks, nodes and the communicators the strategy uses.

Everything here comes from MPI itself, never from launcher variables, so ``mpiexec``, ``srun --mpi=pmi2`` and a
plain ``python`` (a world of one) agree:

- local rank and local size: the rank in ``MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)`` (the processes
  that share memory, i.e. one node);
- node rank: the index of this node's leader (its local rank 0) among all leaders, ordered by global rank;
- a wrong pairing of SLURM and MPI (SLURM started several tasks but each one is an MPI world of its own, because
  the MPI library cannot talk to srun's PMI) is detected and reported instead of training N separate models.

:func:`topology` builds the :class:`Topology` once per process. Building it is collective over
``MPI.COMM_WORLD`` (communicator splits and duplicates), so every rank must call it, which is the case when
every rank constructs the ``Trainer``.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

from mpi4py import MPI

from mpistrategy.comm.communicator import Communicator

_SLURM_TASK_VARIABLES = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")


class LaunchMismatchError(RuntimeError):
    """SLURM started several tasks but MPI sees a world of one in each: the tasks cannot talk to each other."""


@dataclass(frozen=True)
class Topology:
    """Ranks and communicators of this process (see the module docstring).

    Attributes:
        rank, size: global rank and world size.
        local_rank, local_size: rank and number of processes on this node.
        node_rank, num_nodes: index of this node and number of nodes.
        hostname: this node's host name; ``main_address`` is rank 0's.
        node_comm: the processes of this node (``COMM_TYPE_SHARED``).
        leader_comm: the local-rank-0 processes of every node (``MPI.COMM_NULL`` elsewhere).
        control: a private duplicate of the world for the strategy's small blocking messages (barriers, object
            broadcasts, stop decisions, metric gathers), so they never interleave with user traffic.
        gradients: a private :class:`~mpistrategy.Communicator` over the world that carries only gradient
            reductions.
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    hostname: str
    main_address: str
    node_comm: MPI.Intracomm
    leader_comm: MPI.Intracomm
    control: MPI.Intracomm
    gradients: Communicator


_topology: Topology | None = None
_lock = threading.Lock()


def topology() -> Topology:
    """This process's :class:`Topology`, built on first use (collective over ``MPI.COMM_WORLD``)."""
    global _topology
    with _lock:
        if _topology is None:
            check_launch()
            _topology = _build(MPI.COMM_WORLD)
        return _topology


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


def _build(world: MPI.Intracomm) -> Topology:
    rank, size = world.Get_rank(), world.Get_size()
    node_comm = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    # Every rank learns the global rank of its node's leader; the sorted distinct leaders number the nodes.
    leader = node_comm.bcast(rank, root=0)
    leaders = sorted(set(world.allgather(leader)))
    node_rank = leaders.index(leader)
    leader_comm = world.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=rank)
    hostname = socket.gethostname()
    main_address = world.bcast(hostname, root=0)
    control = world.Dup()
    gradients = Communicator(world.Dup())
    return Topology(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        node_rank=node_rank,
        num_nodes=len(leaders),
        hostname=hostname,
        main_address=main_address,
        node_comm=node_comm,
        leader_comm=leader_comm,
        control=control,
        gradients=gradients,
    )
