"""The MPI cluster environment: Lightning's view of ranks and nodes, taken from MPI (see :mod:`.topology`).

Lightning picks its cluster environment by probing launcher variables (TorchElastic, then SLURM, LSF, MPI). Under
``srun`` it would choose ``SLURMEnvironment``, which reads ranks from SLURM variables and refuses ``--ntasks``
without ``--ntasks-per-node``. The ``mpi_ad`` strategy brings this environment instead, so the ranks are always
MPI's, whatever started the processes. The processes are created externally (``mpiexec``, ``srun`` or a plain
``python``), and nothing needs a main address or port: all communication goes through MPI.
"""

from __future__ import annotations

import logging

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
except ImportError:  # the core install has no Lightning
    from mpistrategy.extras import require

    require("lightning", "mpistrategy's Lightning cluster environment")
    raise

from mpistrategy.comm.topology import Topology, topology

log = logging.getLogger(__name__)


class MPIEnvironmentMixin:
    """The implementation, shared with the ``pytorch_lightning`` twin (which needs its own base class).

    ``ranks_per_node`` makes groups of that many ranks act as nodes (see :mod:`mpistrategy.comm.topology`).
    Constructing it builds the process :class:`~mpistrategy.comm.topology.Topology` on first use, which is
    collective: every rank must construct it (every rank constructs the ``Trainer``).
    """

    def __init__(self, ranks_per_node: int | None = None) -> None:
        super().__init__()
        self._topology: Topology = topology(ranks_per_node)

    @property
    def topology(self) -> Topology:
        """Ranks, nodes and the communicators of this process."""
        return self._topology

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        """Rank 0's host name (informative only: nothing connects to it)."""
        return self._topology.main_address

    @property
    def main_port(self) -> int:
        """Unused: MPI needs no port. Returns 0."""
        return 0

    @staticmethod
    def detect() -> bool:
        """True when MPI runs more than one process (mpi4py is always importable here)."""
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_size() > 1

    def world_size(self) -> int:
        return self._topology.size

    def set_world_size(self, size: int) -> None:
        if size != self._topology.size:
            log.debug("MPIEnvironment: ignoring set_world_size(%s); MPI's world has %s ranks.", size, self.world_size())

    def global_rank(self) -> int:
        return self._topology.rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self._topology.rank:
            log.debug("MPIEnvironment: ignoring set_global_rank(%s); the MPI rank is %s.", rank, self.global_rank())

    def local_rank(self) -> int:
        return self._topology.local_rank

    def local_world_size(self) -> int:
        """The number of ranks on this node."""
        return self._topology.local_size

    def node_rank(self) -> int:
        return self._topology.node_rank

    def num_nodes(self) -> int:
        """The number of nodes (distinct shared-memory domains) in the job."""
        return self._topology.num_nodes

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Nothing to validate: MPI decides the ranks, ``devices`` and ``num_nodes`` of the Trainer are ignored."""

    def __repr__(self) -> str:
        t = self._topology
        return (
            f"{type(self).__name__}(rank={t.rank}, world_size={t.size}, local_rank={t.local_rank}, "
            f"node_rank={t.node_rank}, num_nodes={t.num_nodes})"
        )


class MPIEnvironment(MPIEnvironmentMixin, ClusterEnvironment):
    """Lightning cluster environment whose ranks, local ranks and node ranks come from MPI.

    Local rank: the rank among the processes sharing memory (``MPI.COMM_TYPE_SHARED``); node rank: the index of
    the node's leader among all leaders. Constructing it is collective over ``MPI.COMM_WORLD``. It raises
    :class:`~mpistrategy.comm.topology.LaunchMismatchError` when SLURM started several tasks but MPI sees a
    world of one.
    """
