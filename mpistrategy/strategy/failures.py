"""Failure handling: an error on one rank ends every rank; a stop signal stops every rank at the same step.

Abort on exception. When one rank raises, the others are (or soon will be) blocked in a collective that can never
complete: without intervention the job hangs until the scheduler's time limit. :func:`abort` prints the exception
with its rank and traceback (once), flushes, gives the launcher half a second to forward it, and calls
``MPI.COMM_WORLD.Abort(1)``, which makes the launcher (``mpiexec``, ``srun``) kill every rank with a non-zero exit
code; the process ends there even if ``Abort`` returns before the launcher has killed it. The strategy calls it from
Lightning's ``on_exception`` hook (exceptions inside ``fit``/``validate``/``test``/``predict``), and
:func:`install_excepthook` covers uncaught exceptions anywhere else in the script. An exception that every rank
raises together, after agreeing on it (:func:`mark_raised_on_every_rank`: a coordinated stop, a corrupt checkpoint,
a configuration error), is not a reason to abort: every rank reports it and exits by itself; so is one that every
rank raises in step within :data:`RAISED_TOGETHER_SECONDS` (told by the stall watchdog), such as a collective's
``CommunicationError`` in a Fabric loop.

A rank that ends without an exception: killed outright (SIGKILL, out-of-memory), the launcher tears the job down
when it sees the process die and names its pid. A rank that calls ``os._exit`` (skipping ``atexit`` and every
Python handler) says so first: :func:`report_os_exit` makes ``os._exit`` print the rank, the exit code and where
it was called from, then exit.

Coordinated stop. SIGTERM (preemption, ``scancel``) and SIGUSR1 (SLURM's ``--signal``, forwarded by MPICH's
``mpiexec``) may reach the ranks at different times, or only one of them. :class:`StopSignals` only records the
signal; before each training batch that follows an optimizer step (never inside a gradient accumulation), every
rank contributes its flag to a max-allreduce, so all ranks decide together, at the same step, to save a checkpoint
and stop. The allreduce is non-blocking and completed at the next check, so it adds no synchronisation point to
the step (the stop comes one step after the signal). A stopped process exits with :data:`STOPPED_EXIT_CODE` (75,
``EX_TEMPFAIL`` of sysexits.h, "temporary failure, try again later"), so a batch script can tell "stopped after a
checkpoint, resume me" (75) from "finished" (0) and "failed" (anything else).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import NoReturn

import numpy as np
from mpi4py import MPI

from mpistrategy.comm import calls, flight, watchdog
from mpistrategy.comm.abort import abort_job
from mpistrategy.comm.communicator import world_ranks
from mpistrategy.comm.errors import CommunicationError

# The launcher forwards each rank's output through a pipe and stops forwarding when Abort tears the job down:
# without a pause the traceback just written could be lost (seen once in ~40 runs of the failure tests).
_OUTPUT_GRACE_SECONDS = 0.5

#: The exit code of a process stopped by a coordinated stop (after its checkpoint): EX_TEMPFAIL, "try again later".
STOPPED_EXIT_CODE = 75


class StopRequested(SystemExit):
    """Raised by the Fabric strategy on every rank after the same optimizer step, once the ranks decided together
    to stop on ``signal_name`` (the Trainer raises Lightning's ``SIGTERMException`` instead). Its exit code is
    :data:`STOPPED_EXIT_CODE`: a script that lets it propagate exits 75; one that catches it can save a checkpoint
    first (every rank is there, after a complete step)."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(STOPPED_EXIT_CODE)
        self.signal_name = signal_name


_excepthook_installed = False
_os_exit_reported = False
_training = False  # a fit is training (set by the strategy)
_abort_lock = threading.Lock()
_exit_process = os._exit


#: how long a rank that raised waits to hear that every rank raised too, before it aborts the job
RAISED_TOGETHER_SECONDS = 3.0


def _world() -> tuple[int, int]:
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def format_failure(
    error: BaseException, tb: TracebackType | None = None, consequence: str = "aborting all ranks"
) -> str:
    """The error's traceback, headed by the rank that raised it and ``consequence``."""
    rank, size = _world()
    lines = traceback.format_exception(type(error), error, tb if tb is not None else error.__traceback__)
    header = f"[mpistrategy] rank {rank} of {size} (pid {os.getpid()}) raised an exception; {consequence}.\n"
    return header + "".join(lines)


def abort(error: BaseException, tb: TracebackType | None = None, code: int = 1) -> None:
    """Print ``error`` with its rank and traceback to stderr, flush, and abort every rank of the job; never returns.

    Returns without aborting in a world of one process (nothing can hang; the exception propagates as usual).
    """
    _, size = _world()
    if size == 1:
        return
    with _abort_lock:
        _write_stderr(format_failure(error, tb))
        _write_stderr(flight.where(flight.dump(f"abort: {type(error).__name__}: {error}")))
        time.sleep(_OUTPUT_GRACE_SECONDS)
        abort_job(MPI.COMM_WORLD, code, _exit_process)


def _write_stderr(text: str) -> None:
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - a broken stdout must not prevent the report
        pass
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass


def install_excepthook() -> None:
    """Abort every rank on an uncaught exception (after printing it with its rank). Idempotent."""
    global _excepthook_installed
    if _excepthook_installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        if not raised_on_every_rank(error) and not watchdog.every_rank_raised(RAISED_TOGETHER_SECONDS):
            abort(error, tb)  # does not return with more than one rank
        record_desync(error)
        if previous is sys.__excepthook__ and _world()[1] > 1:
            # one write: the launcher forwards each rank's writes as they come, so the default hook's several
            # writes per line interleave with the other ranks' tracebacks of the same error
            _write_stderr(format_failure(error, tb, "every rank raised one and exits by itself"))
        else:
            previous(kind, error, tb)

    sys.excepthook = hook
    _excepthook_installed = True


def record_desync(error: BaseException) -> None:
    """Write this rank's flight record when ``error``, which ends the rank without an abort, is a
    ``CommunicationError`` (ranks that disagreed on a collective): their last calls show how they got there."""
    if isinstance(error, CommunicationError) and _world()[1] > 1 and not getattr(error, "_mpistrategy_recorded", False):
        error._mpistrategy_recorded = True  # type: ignore[attr-defined]
        flight.dump(f"{type(error).__name__}: {error}")


def report_os_exit() -> None:
    """Make ``os._exit`` in this process print, to stderr, which rank calls it with which code and from where,
    before the process ends (the launcher then ends every rank, knowing only a pid). Idempotent.

    Only the process that installed it reports (a forked child, such as a DataLoader worker, exits silently as
    before), and only while MPI is running with more than one rank.
    """
    global _os_exit_reported
    if _os_exit_reported:
        return
    installer = os.getpid()

    def reporting_exit(status: int) -> NoReturn:
        if os.getpid() == installer and MPI.Is_initialized() and not MPI.Is_finalized():
            rank, size = _world()
            if size > 1:
                where = "".join(traceback.format_stack()[:-1])
                ends = ""
                if status == 0 and _training:
                    status = 1
                    ends = " (code 0 while training: the job did not finish, so this rank exits with code 1)"
                _write_stderr(
                    f"[mpistrategy] rank {rank} of {size} (pid {installer}) exited with code {status} through "
                    f"os._exit before the job finished{ends}; the launcher ends the other ranks. Called from:\n"
                    f"{where}"
                )
        _exit_process(status)

    os._exit = reporting_exit
    _os_exit_reported = True


def set_training(active: bool) -> None:
    """Whether a fit is training now: ``os._exit(0)`` then leaves a job that did not finish, so it exits with
    code 1 instead (see :func:`report_os_exit`)."""
    global _training
    _training = active


def is_coordinated_stop(error: BaseException) -> bool:
    """Whether ``error`` was raised on every rank together by a coordinated stop (not a failure)."""
    return bool(getattr(error, "_mpistrategy_coordinated_stop", False))


def raised_on_every_rank(error: BaseException) -> bool:
    """Whether every rank raises ``error`` (or its counterpart) together, so that no rank is left waiting and the
    job need not be aborted: each rank ends with its own traceback."""
    return bool(getattr(error, "_mpistrategy_every_rank", False))


def mark_raised_on_every_rank(error: BaseException) -> BaseException:
    """Record that every rank raises ``error`` (or its counterpart) together (see :func:`raised_on_every_rank`)."""
    error._mpistrategy_every_rank = True  # type: ignore[attr-defined]
    return error


def raise_together(
    error: BaseException | None, comm: MPI.Comm, what: str, kind: type[Exception] = RuntimeError
) -> None:
    """Collective over ``comm``: return when no rank has an ``error``; otherwise raise on every rank together (see
    :func:`raised_on_every_rank`), this rank's own ``error`` where it has one and elsewhere a ``kind`` that names the
    failing ranks and the first one's error (``what``: the step that failed, e.g. "loading the optimizer shards")."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    problems = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    failing = [rank for rank, problem in enumerate(problems) if problem is not None]
    if not failing:
        return
    if error is not None:
        raise mark_raised_on_every_rank(error)
    raise mark_raised_on_every_rank(
        kind(f"{what} failed on rank(s) {failing} (rank {failing[0]}: {problems[failing[0]]})")
    )


def mark_coordinated_stop(error: BaseException) -> BaseException:
    """Mark ``error`` (a ``SIGTERMException(STOPPED_EXIT_CODE)``) as the coordinated stop every rank raises."""
    error._mpistrategy_coordinated_stop = True  # type: ignore[attr-defined]
    return mark_raised_on_every_rank(error)


def signal_numbers(signals: Iterable[int | str] | None) -> tuple[int, ...]:
    """The numbers of ``signals``, each given by number or by name, with or without ``SIG`` (``"SIGTERM"``,
    ``"usr1"``, ``15``)."""
    numbers = []
    for given in signals or ():
        if isinstance(given, int) and not isinstance(given, bool):
            number = given if given in signal.valid_signals() else None
        else:
            key = str(given).upper()
            known = signal.Signals.__members__.get(key if key.startswith("SIG") else f"SIG{key}")
            number = None if known is None else int(known)
        if number is None:
            raise ValueError(
                f"stop_signals: {given!r} is not a signal on this system; give names such as 'SIGTERM' or 'USR1', "
                "or signal numbers."
            )
        numbers.append(number)
    return tuple(numbers)


_ignored_at_exit: set[int] = set()


def ignore_at_exit(signals: Iterable[int]) -> None:
    """Ignore ``signals`` from the moment the script ends: a stop signal that reaches a job taking its seconds to
    exit after it finished (SLURM's ``--signal`` lead time running out then) or stopped after its checkpoint must
    not turn the exit code into 128 + the signal (SLURM would call the finished job FAILED). Python gives its
    handlers back to the default action while it shuts down, but leaves ignored signals ignored. Registered at the
    first call, after mpi4py's and the watchdog's exit hooks, so that it runs before them."""
    if not _ignored_at_exit:
        atexit.register(_ignore_stop_signals)
    _ignored_at_exit.update(signals)


def _ignore_stop_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for signum in _ignored_at_exit:
            signal.signal(signum, signal.SIG_IGN)


class StopSignals:
    """Records stop signals and turns them into one decision shared by all ranks.

    Args:
        signals: the signals that request a stop (default SIGTERM and SIGUSR1).
        comm: the communicator the decision is made on (every rank must call :meth:`decide` together).
    """

    def __init__(self, signals: Iterable[int], comm: MPI.Intracomm) -> None:
        self.signals = tuple(signals)
        self.comm = comm
        self.received: int = 0
        self._previous: dict[int, object] = {}  # while installed: the handlers to give back
        self._flag = np.zeros(1, dtype=np.int64)
        self._result = np.zeros(1, dtype=np.int64)
        self._request: MPI.Request | None = None
        self._posted = False
        self._channel = calls.register(world_ranks(comm))

    def install(self) -> None:
        """Take over the signals (replacing the handlers Lightning installed, which would stop one rank alone);
        idempotent. A signal received before stays recorded."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Give the signals still handled here back to their previous handlers (a signal that another handler
        took over since, a later strategy's, stays with it)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum
        flight.dump(signal.Signals(signum).name)

    def decide(self) -> int:
        """Collective: the signal number some rank had received at the previous call (the largest), or 0.

        The flags are combined by a non-blocking allreduce that each call posts and the next call completes, so
        deciding costs no synchronisation in the training step; the decision lags one call behind, the same lag
        on every rank. After a non-zero decision nothing is posted any more.
        """
        decision = 0
        if self._posted:
            self.finish()
            decision = int(self._result[0])
        if decision:
            return decision
        self._flag[0] = self.received
        if self.comm.Get_size() > 1:
            self._request = self.comm.Iallreduce(self._flag, self._result, op=MPI.MAX)
            calls.count(self._channel)  # ranks that raised after posting different numbers are not in step
        else:
            self._result[0] = self._flag[0]
        self._posted = True
        return 0

    def release(self) -> None:
        """Complete the decision in flight (:meth:`finish`) and give the signals back (:meth:`uninstall`)."""
        self.finish()
        self.uninstall()

    def finish(self) -> None:
        """Complete the allreduce in flight (collective: every rank has posted the same number of them)."""
        if self._request is not None:
            self._request.Wait()
            self._request = None
        self._posted = False
