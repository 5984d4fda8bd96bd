"""Ending the whole MPI job from one rank, also where ``MPI_Abort`` does not end this process.

``MPI_Abort`` makes the launcher (``mpiexec``, ``srun``) end every rank, but MPICH's can return before the launcher
has killed the caller, and what it does when called from one thread while another waits inside MPI is up to the
implementation. So :func:`abort_job` calls ``MPI_Abort`` without holding Python's global lock (through ``ctypes``;
mpi4py's ``Comm.Abort`` holds it) while a timer thread stands by: if the process still runs
:data:`ABORT_GRACE_SECONDS` later, it ends itself with the same exit code, and a launcher that sees a rank end
without ``MPI_Finalize`` ends the others.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import NoReturn

from mpi4py import MPI

#: seconds ``MPI_Abort`` is given to end the job before this process ends itself
ABORT_GRACE_SECONDS = 5.0


def abort_job(comm: MPI.Comm, code: int, exit_process: Callable[[int], object]) -> NoReturn:
    """``MPI_Abort(comm, code)``; this process ends with ``code`` (``exit_process(code)``) whatever it does."""
    timer = threading.Timer(ABORT_GRACE_SECONDS, exit_process, (code,))
    timer.daemon = True
    timer.start()
    mpi_abort = _c_abort()
    if mpi_abort is None:
        comm.Abort(code)
    else:
        handle = MPI._handleof(comm)
        mpi_abort(ctypes.c_void_p(handle) if MPI._sizeof(MPI.Comm) > 4 else ctypes.c_int(handle), ctypes.c_int(code))
    exit_process(code)
    raise SystemExit(code)  # not reached: ``exit_process`` ends the process


def _c_abort() -> Callable[..., int] | None:
    """``MPI_Abort`` of the MPI library mpi4py uses, called through ``ctypes`` (which releases the global lock);
    ``None`` where it cannot be found."""
    try:
        return ctypes.CDLL(MPI.__file__).MPI_Abort
    except (OSError, AttributeError):
        return None
