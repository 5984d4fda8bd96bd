"""The stall watchdog: when a rank has waited in a collective too long, every rank says where it is, then the job ends.

A thread on every rank (started when mpistrategy is imported, with more than one rank) looks once per poll
interval at the thread that entered the last collective (and the main thread): when its innermost Python frame
has been inside mpistrategy for longer than the stall timeout without entering another collective (blocked in an
MPI call, a shared-memory wait, a backward collective or the strategy's gradient sync), the rank is stalled. Its
watchdog then tells every other rank's watchdog, on a communicator of their own (a duplicate of the world, used
with non-blocking sends and probes only; it never waits in the stuck collective), and every rank that can still
speak sends its state to all others: the collective it is in or entered last (op, arguments, call site, how long
ago; :mod:`mpistrategy.comm.calls`), its collective counts and its Python stack, which shows a rank stuck in a C
call (``time.sleep``, a blocked read in a data loader) at the line that called it. Each rank prints the report
(which ranks have not arrived, each rank's last collective, its own stack), writes its flight record
(:mod:`mpistrategy.comm.flight`) and, unless the action is ``"warn"``, exits with :data:`STALL_EXIT_CODE`. When
some rank did not answer, the lowest rank that answered first waits for the others to end and then calls
``MPI_Abort`` with that code, which ends the ranks that could not answer (a launcher on a cluster does not end the
ranks on other nodes when one exits).

Uneven training data is found without waiting for the timeout: the strategy tells the watchdog which batch of
which training pass (fit, epoch) it has started and, when a pass's data ended, after how many batches; the watchdog
sends that end to every other rank's watchdog. Once a rank learns that a peer's data of a pass ended after fewer
batches than it has started, or after another number than its own, the ranks no longer run the same collectives
(the longer ones wait for peers that will not come, or pair their collectives with the peers' next epoch): it
raises the alarm at once, and the report names each rank's number of batches.

A rank that ends its script waits at exit (an ``atexit`` hook that runs before ``MPI_Finalize``) until every rank
has ended its own, its watchdog still answering: a rank that finished while another waits in a collective is named
in the report as ended, and every rank exits by itself, instead of one sitting silent in ``MPI_Finalize`` until
``MPI_Abort`` reaches it. The wait at exit never raises an alarm of its own (ranks end at different times).

Settings: ``MPISTRATEGY_STALL_TIMEOUT`` (seconds, default :data:`DEFAULT_TIMEOUT`; 0 turns the watchdog off) and
``MPISTRATEGY_STALL_ACTION`` (``"abort"``, the default, or ``"warn"``), or :func:`set_stall_timeout` in Python (on
every rank alike). A rank whose watchdog thread cannot run (a C extension holding the GIL, a dead process) does not
answer and is named as such.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import FrameType
from typing import Any

from mpi4py import MPI

from mpistrategy.comm import calls, flight
from mpistrategy.comm.abort import abort_job

#: the exit code of a rank ended by the watchdog (EX_PROTOCOL of sysexits.h is 76; 86 is mpistrategy's own)
STALL_EXIT_CODE = 86
#: the default stall timeout in seconds: longer than any healthy wait in a collective on a cluster
DEFAULT_TIMEOUT = 300.0
ACTIONS = ("abort", "warn")

# How long a rank waits for the others' states once a stall is reported (their watchdogs poll once a second).
_ANSWER_SECONDS = 3.0
_ALARM, _STATE, _WRITTEN, _DATA_END = 1, 2, 3, 4
# How many recent training passes a watchdog keeps the batch counts of.
_PASSES_KEPT = 8
# The launcher forwards a report's output before it tears the job down within this time.
_OUTPUT_SECONDS = 0.5
_PACKAGE_ROOT = calls.package_root()
_exit_process = os._exit


def _timeout_from_environment() -> float:
    text = os.environ.get("MPISTRATEGY_STALL_TIMEOUT", "").strip()
    try:
        seconds = float(text) if text else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(
            f"MPISTRATEGY_STALL_TIMEOUT={text!r} is not a number of seconds; set it to e.g. 300, or 0 to turn the "
            "stall watchdog off."
        ) from None
    return _checked_timeout(seconds)


def _checked_timeout(seconds: float) -> float:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
        raise ValueError(f"stall timeout: {seconds!r} is not a number of seconds >= 0 (0 turns the watchdog off).")
    return float(seconds)


def _checked_action(action: str) -> str:
    if action not in ACTIONS:
        raise ValueError(f"stall action: {action!r} is not one of {ACTIONS}.")
    return action


_timeout = _timeout_from_environment()
_action = _checked_action(os.environ.get("MPISTRATEGY_STALL_ACTION", "abort").strip().lower() or "abort")


def set_stall_timeout(seconds: float, action: str | None = None) -> None:
    """Report a rank that waited more than ``seconds`` in a collective (0: never); ``action`` ``"abort"`` ends the
    job with exit code :data:`STALL_EXIT_CODE` after the report, ``"warn"`` only reports. Call it on every rank."""
    global _timeout, _action
    _timeout = _checked_timeout(seconds)
    if action is not None:
        _action = _checked_action(action)


def stall_timeout() -> float:
    """The stall timeout in seconds (0: the watchdog is off)."""
    return _timeout


def stall_action() -> str:
    """``"abort"`` or ``"warn"``: what the watchdog does after its report."""
    return _action


def _inside_package(frame: FrameType | None) -> bool:
    return frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_ROOT)


class Watchdog:
    """The watchdog thread of this rank (see the module docstring); creating it is collective over ``comm``."""

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._stopping = threading.Event()
        self._polled_key = -1  # the call log's entry count at the previous poll
        self._watched_key = -1  # the call log's entry count when the current wait was first seen
        self._since = 0.0
        self._reported_key = -1
        self._sends: list[MPI.Request] = []
        self._pid = os.getpid()
        self._ended: float | None = None  # when this rank's script ended (time.time())
        self._sends_lock = threading.Lock()
        # per training pass (fit, epoch): this rank's batches started, and its counts (see count_batches); the counts
        # the other ranks told, by rank
        self._started: dict[tuple[int, int], int] = {}
        self._own_counts: dict[tuple[int, int], dict[str, int]] = {}
        self._counts: dict[tuple[int, int], dict[int, dict[str, int]]] = {}
        self._uneven_reported = False
        self._thread = threading.Thread(target=self._run, name="mpistrategy-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (returns once it has left MPI)."""
        self._stopping.set()
        self._thread.join()
        for request in self._sends:
            if not request.Test():
                request.Cancel()
        self._sends = []

    def wait_for_the_others(self) -> None:
        """At the end of the script: wait until every rank has ended its own, answering the others' watchdogs
        meanwhile (a rank whose watchdog reports a stall ends this process). Only in the process that started
        the watchdog (not in a forked child), while MPI runs."""
        if os.getpid() != self._pid or not MPI.Is_initialized() or MPI.Is_finalized():
            return
        self._ended = time.time()
        try:
            request = self.comm.Ibarrier()
            pause = 0.001
            while not request.Test():
                time.sleep(pause)
                pause = min(0.05, 2 * pause)
        except MPI.Exception:  # a rank that is gone: MPI_Finalize and the launcher take it from here
            pass

    def _interval(self) -> float:
        return 1.0 if _timeout <= 0 else min(1.0, max(0.05, _timeout / 10))

    def _run(self) -> None:
        while not self._stopping.wait(self._interval()):
            trigger = self._received_alarm()
            if trigger is None and _timeout > 0:
                trigger = self._uneven_data()
            if trigger is None and _timeout > 0 and self._ended is None:
                since = self._waiting_since()
                if since is not None:
                    trigger = self._own_stall(since)
            if trigger is not None:
                self._report(trigger)

    def batch_started(self, training_pass: tuple[int, int], batch: int) -> None:
        """This rank has started batch ``batch`` (1-based) of ``training_pass``."""
        if training_pass not in self._started:
            _keep_recent(self._started)
        self._started[training_pass] = max(batch, self._started.get(training_pass, 0))

    def count_batches(self, training_pass: tuple[int, int], batches: int, kind: str) -> None:
        """Tell every other rank the number of batches of this rank's ``training_pass``: ``kind`` ``"planned"`` (the
        most the loop will run: the loader's length or ``limit_train_batches``) or ``"ended"`` (where its data
        ended)."""
        self._own_counts.setdefault(training_pass, {})[kind] = batches
        _keep_recent(self._own_counts)
        if _timeout <= 0:
            return
        message = pickle.dumps((self.rank, training_pass, batches, kind))
        with self._sends_lock:
            self._sends = [request for request in self._sends if not request.Test()]
        for other in range(self.size):
            if other != self.rank:
                self._send(message, other, _DATA_END)

    # ------------------------------------------------------------------------------------------------ detection

    def _waiting_frames(self) -> dict[int, FrameType]:
        frames = sys._current_frames()
        watched = {threading.main_thread().ident, calls.current_thread}
        return {ident: frames[ident] for ident in watched if ident is not None and ident in frames}

    def _own_stall(self, since: float) -> dict[str, Any] | None:
        """This rank's alarm, once it has waited in mpistrategy (since ``since``) longer than the timeout (sent to
        every rank)."""
        waited = time.time() - since
        if waited <= _timeout or self._polled_key == self._reported_key:
            return None
        self._reported_key = self._polled_key
        return self._alarm(waited)

    def _waiting_since(self) -> float | None:
        """When this rank's current wait in mpistrategy began, once it has lasted a whole poll interval without a
        collective entered (``None``: not waiting).

        The threads' frames are looked at only then: a frame object held here keeps its locals (tensors) alive
        after the function returns, which must not happen while the program runs (it could not free a
        shared-memory window, for one)."""
        key = calls.entries()
        if key != self._polled_key:
            self._polled_key = key
            self._watched_key = -1
            return None
        if not any(_inside_package(frame) for frame in self._waiting_frames().values()):
            self._watched_key = -1
            return None
        if key != self._watched_key:
            self._watched_key = key
            current = calls.current
            self._since = current.started if current is not None else time.time()
        return self._since

    def _uneven_data(self) -> dict[str, Any] | None:
        """The alarm of a rank whose batches in a training pass cannot match a peer's (sent to every rank), else
        ``None``; once. Counts of one kind are compared (a planned count is only the most the loop runs: a stream
        capped by ``limit_train_batches`` may end before it), and no rank may start a batch beyond a peer's count."""
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, _DATA_END, status):
            message = bytearray(status.Get_count(MPI.BYTE))
            self.comm.Recv([message, MPI.BYTE], status.Get_source(), _DATA_END)
            rank, training_pass, batches, kind = pickle.loads(message)
            self._counts.setdefault(training_pass, {}).setdefault(rank, {})[kind] = batches
            _keep_recent(self._counts)
        if self._uneven_reported:
            return None
        for training_pass, peers in list(self._counts.items()):
            started, own = self._started.get(training_pass, 0), self._own_counts.get(training_pass, {})
            differing = {
                rank: counts
                for rank, counts in peers.items()
                if started > min(counts.values())
                or any(kind in own and own[kind] != count for kind, count in counts.items())
            }
            if differing:
                self._uneven_reported = True
                counts = {rank: _counted(counts) for rank, counts in differing.items()}
                counts[self.rank] = _counted(own, started)
                return self._alarm(0.0, uneven={"epoch": training_pass[1], "counts": dict(sorted(counts.items()))})
        return None

    def _alarm(self, waited: float, **cause: Any) -> dict[str, Any]:
        """This rank's alarm (it has waited ``waited`` seconds; ``cause``: what else it found), sent to every other
        rank."""
        alarm = {
            "rank": self.rank,
            "waited": waited,
            "call": _call_state(calls.current),
            "where": _innermost(self._waiting_frames()),
            "last": _call_state(calls.last),
            **cause,
        }
        message = pickle.dumps(alarm)
        for other in range(self.size):
            if other != self.rank:
                self._send(message, other, _ALARM)
        return alarm

    def _received_alarm(self) -> dict[str, Any] | None:
        alarm = None
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, _ALARM, status):
            message = bytearray(status.Get_count(MPI.BYTE))
            self.comm.Recv([message, MPI.BYTE], status.Get_source(), _ALARM)
            alarm = alarm or pickle.loads(message)
        if alarm is not None:
            self._reported_key = calls.entries()
        return alarm

    def _send(self, message: bytes, dest: int, tag: int) -> None:
        try:
            request = self.comm.Isend([message, MPI.BYTE], dest, tag)
        except MPI.Exception:  # a rank that is gone cannot be told
            return
        with self._sends_lock:
            self._sends.append(request)

    # --------------------------------------------------------------------------------------------------- report

    def _state(self) -> dict[str, Any]:
        frames = self._waiting_frames()
        stacks = {
            threading.main_thread().name if ident == threading.main_thread().ident else f"thread {ident}": "".join(
                traceback.format_stack(frame)
            )
            for ident, frame in frames.items()
        }
        current = calls.current
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": time.time(),
            "inside": any(_inside_package(frame) for frame in frames.values()),
            "ended": self._ended,
            "current": _call_state(current),
            "last": _call_state(calls.last),
            "counts": {calls.key(channel): count for channel, count in calls.counts.items()},
            "where": _innermost(frames),
            "now": _now_at(frames.get(threading.main_thread().ident or 0)),
            "stacks": stacks,
        }

    def _report(self, trigger: dict[str, Any]) -> None:
        mine = self._state()
        message = pickle.dumps(mine)
        for other in range(self.size):
            if other != self.rank:
                self._send(message, other, _STATE)
        states: dict[int, dict[str, Any]] = {self.rank: mine}
        deadline = time.monotonic() + _ANSWER_SECONDS
        status = MPI.Status()
        while len(states) < self.size and time.monotonic() < deadline and not self._stopping.is_set():
            if self.comm.Iprobe(MPI.ANY_SOURCE, _STATE, status):
                received = bytearray(status.Get_count(MPI.BYTE))
                self.comm.Recv([received, MPI.BYTE], status.Get_source(), _STATE)
                state = pickle.loads(received)
                states[state["rank"]] = state
            else:
                time.sleep(0.01)
        text = format_report(trigger, states, self.size, self.rank, _timeout, _action)
        flight.dump("stall", {"report": text, "states": {str(rank): state for rank, state in states.items()}})
        _write(text)
        if _action == "abort":
            self._wait_until_written(states)
            deadline = time.monotonic() + 1.0
            while self._sends and not MPI.Request.Testall(self._sends) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(_OUTPUT_SECONDS)  # the launcher forwards the output before it tears the job down
            if len(states) < self.size and self.rank == min(states):
                # Once every rank that can speak has reported and ended, the lowest of them (the same on every rank
                # that heard the same ranks) ends the ranks that could not answer with MPI_Abort: a launcher on a
                # cluster does not end the ranks on other nodes when one exits by itself.
                time.sleep(_ANSWER_SECONDS)
                abort_job(self.comm, STALL_EXIT_CODE, _exit_process)
            _exit_process(STALL_EXIT_CODE)

    def _wait_until_written(self, states: dict[int, dict[str, Any]]) -> None:
        """Tell the ranks that answered that this rank's report is written, and wait (at most
        ``_ANSWER_SECONDS``) until each of them says the same: the first rank to exit makes the launcher end the
        others, so none may exit before every report is out, however loaded the node."""
        for other in states:
            if other != self.rank:
                self._send(b"", other, _WRITTEN)
        waiting = set(states) - {self.rank}
        deadline = time.monotonic() + _ANSWER_SECONDS
        status = MPI.Status()
        while waiting and time.monotonic() < deadline:
            if self.comm.Iprobe(MPI.ANY_SOURCE, _WRITTEN, status):
                self.comm.Recv([bytearray(0), MPI.BYTE], status.Get_source(), _WRITTEN)
                waiting.discard(status.Get_source())
            else:
                time.sleep(0.01)


def _counted(counts: dict[str, int], started: int = 0) -> str:
    """A rank's batches of a pass as the uneven-data report gives them."""
    parts = []
    if "ended" in counts:
        parts.append(f"its data ended after {counts['ended']}")
    if "planned" in counts:
        parts.append(f"{counts['planned']} planned")
    if started and started > min(counts.values(), default=0):
        parts.append(f"started batch {started}")
    return ", ".join(parts) or f"started batch {started}"


def _keep_recent(per_pass: dict[tuple[int, int], Any]) -> None:
    """Forget all but the most recent training passes."""
    for training_pass in sorted(per_pass)[:-_PASSES_KEPT]:
        del per_pass[training_pass]


def _call_state(call: calls.Call | None) -> dict[str, Any] | None:
    if call is None:
        return None
    return {**call.as_dict(), "members": list(calls.members(call.channel)), "key": calls.key(call.channel)}


def _now_at(frame: FrameType | None) -> str:
    """``file:line (in function)`` of a thread's innermost frame."""
    if frame is None:
        return "?"
    return f"{calls.short_path(frame.f_code.co_filename)}:{frame.f_lineno} (in {frame.f_code.co_name})"


def _innermost(frames: dict[int, FrameType]) -> str | None:
    """``function (file:line)`` of the innermost mpistrategy frame of a watched thread that waits in mpistrategy."""
    for frame in frames.values():
        if _inside_package(frame):
            where = f"{frame.f_code.co_filename.removeprefix(_PACKAGE_ROOT)}:{frame.f_lineno}"
            return f"{frame.f_code.co_name} (mpistrategy/{where})"
    return None


def _write(text: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a broken stream must not stop the exit
        pass


def _ago(state: dict[str, Any], call: dict[str, Any]) -> float:
    return state["time"] - call["started"]


def format_report(
    trigger: dict[str, Any], states: dict[int, dict[str, Any]], size: int, rank: int, timeout: float, action: str
) -> str:
    """The stall report as rank ``rank`` prints it: which ranks have not arrived, every rank's last collective, and
    this rank's stack."""
    call = trigger["call"]
    if call is not None:
        waited_in = f"{call['call']} (call #{call['count']} on its communicator) at {call['site']}"
        members = [int(r) for r in call["members"]]
        missing = [
            other
            for other in members
            if other in states and states[other]["counts"].get(call["key"], 0) < call["count"]
        ]
    else:
        last = trigger["last"]
        after = "" if last is None else f"; its last collective: {last['call']} #{last['count']} at {last['site']}"
        waited_in, members, missing = f"{trigger['where']}{after}", list(range(size)), []
    silent = [other for other in range(size) if other not in states]
    uneven = trigger.get("uneven")
    if uneven is not None:
        counts = "; ".join(f"rank {other}: {count}" for other, count in uneven["counts"].items())
        lines = [
            f"[mpistrategy] uneven training data (found on rank {trigger['rank']}, reported on rank {rank}): the "
            f"ranks' training data of epoch {uneven['epoch']} has different numbers of batches ({counts}), so the "
            "ranks no longer run the same collectives (the longer ones wait for ranks that will not take part, or "
            "pair theirs with the next epoch's). Give every rank the same number of batches per epoch: split an "
            "IterableDataset evenly over the ranks (the remainder dropped), keep Lightning's DistributedSampler "
            "for a map-style dataset (use_distributed_sampler=True), or cap the epoch with limit_train_batches."
        ]
    else:
        lines = [
            f"[mpistrategy] stall (reported on rank {rank}): rank {trigger['rank']} has waited "
            f"{trigger['waited']:.1f} s in {waited_in} (MPISTRATEGY_STALL_TIMEOUT={timeout:g} s)."
        ]
    if missing:
        lines.append(f"  not arrived: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    if silent:
        lines.append(
            f"  did not answer: rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} (gone, or "
            "holding the GIL in a C call: its watchdog thread cannot run)"
        )
    for other in range(size):
        state = states.get(other)
        if state is None:
            lines.append(f"  rank {other}: did not answer")
            continue
        where = f"{state['host']}, pid {state['pid']}"
        current, last = state["current"], state["last"]
        if state.get("ended") is not None:
            text = f"ended its script {state['time'] - state['ended']:.1f} s ago, waiting at exit for the others"
            if last is not None:
                text += f"; its last collective: {last['call']} #{last['count']} at {last['site']}"
        elif state["inside"] and current is not None:
            text = f"waiting {_ago(state, current):.1f} s in {current['call']} #{current['count']} at {current['site']}"
        elif state["inside"]:
            text = f"waiting in {state['where']}"
            if last is not None:
                text += f"; its last collective: {last['call']} #{last['count']} at {last['site']}"
                text += f", entered {_ago(state, last):.1f} s ago"
        elif last is not None:
            text = (
                f"not in a collective, now at {state['now']}; last entered {last['call']} #{last['count']} at "
                f"{last['site']} {_ago(state, last):.1f} s ago"
            )
        else:
            text = f"not in a collective, now at {state['now']}; has entered none yet"
        lines.append(f"  rank {other} ({where}): {text}")
    own = states.get(rank)
    if own is not None:
        for name, stack in own["stacks"].items():
            lines.append(f"[mpistrategy] rank {rank}'s stack ({name}), innermost last:")
            lines.append(stack.rstrip("\n"))
    if action == "abort":
        lines.append(
            f"[mpistrategy] rank {rank} ends with exit code {STALL_EXIT_CODE} (stall watchdog; "
            "MPISTRATEGY_STALL_ACTION=warn only reports)."
        )
    return "\n".join(lines) + "\n"


_watchdog: Watchdog | None = None


def start(comm: MPI.Intracomm) -> None:
    """Start this rank's watchdog (collective over ``comm``; nothing to watch with one rank). Idempotent."""
    global _watchdog
    if _watchdog is None and comm.Get_size() > 1:
        _watchdog = Watchdog(comm)


def training_batch_started(training_pass: tuple[int, int], batch: int) -> None:
    """Tell this rank's watchdog that it has started batch ``batch`` (1-based) of the training pass
    ``training_pass`` (fit, epoch) (see the module docstring: uneven data)."""
    if _watchdog is not None:
        _watchdog.batch_started(training_pass, batch)


def training_batches(training_pass: tuple[int, int], batches: int, kind: str) -> None:
    """Tell every other rank's watchdog the number of batches of this rank's training pass ``training_pass`` (fit,
    epoch): ``kind`` ``"planned"`` (the most the loop will run) or ``"ended"`` (where the data ended)."""
    if _watchdog is not None:
        _watchdog.count_batches(training_pass, batches, kind)


_exit_hooks: set[Callable[[], None]] = set()


def watched_at_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` at exit while this rank's watchdog still watches, before MPI is finalised: a wait in it that
    never ends (for a peer that will not take part) is reported as a stall instead of holding the process.
    Registered on first use, after the watchdog's own exit hook, so that it runs first; once per ``hook``."""
    if hook not in _exit_hooks:
        _exit_hooks.add(hook)
        atexit.register(hook)


@atexit.register
def _stop() -> None:
    """Registered after mpi4py's finaliser, so it runs first: every rank has ended its script, and the thread has
    left MPI, when MPI is finalised."""
    if _watchdog is not None:
        _watchdog.wait_for_the_others()
        _watchdog.stop()
