"""Progress for non-blocking MPI requests while the caller computes.

MPI advances a non-blocking operation only inside MPI calls (unless the library runs a progress thread of its own,
which busy-polls a core). A transfer over TCP that is left in flight while the training loop computes therefore
moves only the bytes its first call pushed into the socket, and the rest when it is waited for. :class:`Progress`
calls ``MPI_Testall`` on the requests from a background thread every ``interval`` seconds (asleep in between, and
outside the GIL inside MPI) until they complete or :meth:`Progress.stop` is called; at 1 Gbit/s one millisecond is
125 KB, which the socket buffers hold, so the link stays busy.

It needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default); with a lower thread level :func:`drive` returns ``None`` and
the requests progress only inside MPI calls. The caller must call :meth:`Progress.stop` before it tests or waits for the
requests itself (two threads must not complete the same request). Threads still running when the interpreter
exits are stopped before MPI is finalised.
"""

from __future__ import annotations

import atexit
import threading
import weakref

from mpi4py import MPI

#: seconds between two ``MPI_Testall`` calls of the background thread
INTERVAL = 1e-3

_running: weakref.WeakSet[Progress] = weakref.WeakSet()


class Progress:
    """A background thread testing ``requests`` until they complete or :meth:`stop` (see the module docstring)."""

    def __init__(self, requests: list[MPI.Request], interval: float = INTERVAL) -> None:
        self._requests = requests
        self._interval = interval
        self._stopping = threading.Event()
        self.completed = False
        self._thread = threading.Thread(target=self._run, name="mpistrategy-progress", daemon=True)
        _running.add(self)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(self._interval):
            if MPI.Request.Testall(self._requests):
                self.completed = True
                return

    def stop(self) -> None:
        """Stop the thread (returns once it has left MPI); the requests are the caller's again."""
        self._stopping.set()
        self._thread.join()
        _running.discard(self)


def drive(requests: list[MPI.Request], interval: float = INTERVAL) -> Progress | None:
    """A :class:`Progress` for ``requests``, or ``None`` when there are none or MPI does not allow threads."""
    if not requests or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return None
    return Progress(requests, interval)


@atexit.register
def _stop_all() -> None:
    """Registered after mpi4py's finaliser, so it runs first: no thread is inside MPI when MPI is finalised."""
    for progress in list(_running):
        progress.stop()
