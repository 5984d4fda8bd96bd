"""mpistrategy: differentiable MPI collectives for PyTorch and an MPI data-parallel strategy for Lightning.

Every op is a torch autograd op. Convention: the global objective is the sum over ranks of each rank's own loss,
``L = sum_r L_r``; each op's backward is the exact adjoint of its forward under that convention (see the module
docstrings in :mod:`mpistrategy.collectives`), and an input an op does not read (a non-root's tensor in
``broadcast`` or ``scatter``) gets no gradient (``None``), as torch gives an input the output does not depend on.
Under ``torch.compile`` every op is a graph break and runs eagerly. Importing the package wraps
``MPI.COMM_WORLD`` and starts the stall watchdog (collective; see :mod:`mpistrategy.comm.watchdog`).
"""

__version__ = "0.1.0"

from mpi4py import MPI as _MPI

from mpistrategy.collectives.alltoall import alltoall, alltoall_v
from mpistrategy.collectives.broadcast import broadcast
from mpistrategy.collectives.gather import allgather, allgather_v, gather, gather_v, scatter, scatter_v
from mpistrategy.collectives.handles import Handle
from mpistrategy.collectives.p2p import irecv, isend, recv, send, sendrecv, wait_backward_sends
from mpistrategy.collectives.placeholder import Placeholder
from mpistrategy.collectives.reduction import (
    allreduce,
    iallreduce,
    reduce,
    reduce_scatter,
    reduce_scatter_v,
)
from mpistrategy.collectives.tensor_parallel import copy_to_parallel, reduce_from_parallel
from mpistrategy.comm import flight as _flight
from mpistrategy.comm import watchdog as _watchdog
from mpistrategy.comm.allocator import tune_malloc
from mpistrategy.comm.checks import set_validation, validation, validation_enabled
from mpistrategy.comm.communicator import Communicator, world
from mpistrategy.comm.errors import CommunicationError
from mpistrategy.comm.flight import set_flight_directory
from mpistrategy.comm.shm import set_shared_memory, shared_memory
from mpistrategy.comm.stall_report import STALL_EXIT_CODE
from mpistrategy.comm.stall_settings import set_stall_timeout, stall_timeout

tune_malloc()
world()
_watchdog.start(_MPI.COMM_WORLD)  # collective: the stall watchdog's own communicator
_flight.identify_job(_MPI.COMM_WORLD)  # collective: the job's name in the flight records
_flight.install_signal_handler()

# Registers the "mpi_ad" strategy with lightning.pytorch / pytorch_lightning (now or when they are imported)
# and sets Lightning's rank_zero_only from MPI; does not import Lightning itself.
from mpistrategy.strategy import registration as _registration  # noqa: E402

_registration.install()

__all__ = [
    "Communicator",
    "CommunicationError",
    "Handle",
    "Placeholder",
    "STALL_EXIT_CODE",
    "allgather",
    "allgather_v",
    "allreduce",
    "alltoall",
    "alltoall_v",
    "broadcast",
    "copy_to_parallel",
    "gather",
    "gather_v",
    "iallreduce",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_from_parallel",
    "reduce_scatter",
    "reduce_scatter_v",
    "scatter",
    "scatter_v",
    "send",
    "sendrecv",
    "set_flight_directory",
    "set_shared_memory",
    "set_stall_timeout",
    "set_validation",
    "shared_memory",
    "stall_timeout",
    "validation",
    "validation_enabled",
    "wait_backward_sends",
    "world",
]
