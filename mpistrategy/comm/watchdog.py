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

Calls every rank must make (``trainer.save_checkpoint``, ``fabric.save``) are found made on some ranks only the
same way: a rank entering one tells every other rank's watchdog which call (the how-manieth) and at which batch; a
rank that starts a later batch, or ends its script, without having entered it raises the alarm at once, and the
report names the call, the rank and line that made it, and what the others did instead. A rank that waits
elsewhere meanwhile (in the same batch) is found by the stall timeout, and the report names the call there too.

Waits proven endless (:mod:`mpistrategy.comm.deadlocks`) raise the alarm without the timeout: a rank that has
waited :data:`_CROSS_GRACE` seconds in a call tells every other rank's watchdog which, with its collective counts,
and a rank whose wait crosses a peer's (each in a call the other has not entered) reports both calls; a rank that
ends its script tells the others, and a rank that has waited :data:`_SKIP_GRACE` seconds for such a rank reports it.

When a rank raises, :func:`every_rank_raised` tells the others on the same channel and waits a few seconds to hear
that they raised too, in step (the same number of collectives on every communicator of all ranks): then no rank
waits for another, and the job need not be aborted (the next point of a sweep can run).

A rank that ends its script waits at exit (an ``atexit`` hook that runs before ``MPI_Finalize``) until every rank
has ended its own, its watchdog still answering: a rank that finished while another waits in a collective is named
in the report as ended, and every rank exits by itself, instead of one sitting silent in ``MPI_Finalize`` until
``MPI_Abort`` reaches it. The wait at exit never raises an alarm of its own (ranks end at different times).

Settings: :mod:`mpistrategy.comm.stall_settings`. A rank whose watchdog thread cannot run (a C extension holding
the GIL, a dead process) does not answer and is named as such.
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from mpi4py import MPI

from mpistrategy.comm import calls, flight
from mpistrategy.comm.abort import abort_job
from mpistrategy.comm.deadlocks import crossed_peer, ended_members
from mpistrategy.comm.frames import call_site, innermost_inside, inside_package, now_at, short_path
from mpistrategy.comm.stall_report import STALL_EXIT_CODE, counted, format_report
from mpistrategy.comm.stall_settings import stall_action, stall_timeout

# How long a rank waits for the others' states once a stall is reported (their watchdogs poll once a second).
_ANSWER_SECONDS = 3.0
_ALARM, _STATE, _WRITTEN, _DATA_END, _ENTERED, _RAISED, _WAITING, _ENDED = 1, 2, 3, 4, 5, 6, 7, 8
# How long a rank may wait in mpistrategy, knowing that a peer entered a call every rank must make, before it is
# found to have gone on without the call (the collectives the peer had passed end within moments).
_SKIP_GRACE = 5.0
# How long a rank waits in a collective before it tells the others which (and compares their waits with its own).
_CROSS_GRACE = 2 * _SKIP_GRACE
# How many recent training passes a watchdog keeps the batch counts of.
_PASSES_KEPT = 8
# The launcher forwards a report's output before it tears the job down within this time.
_OUTPUT_SECONDS = 0.5
# At exit, after every rank has ended its script, how long a rank waits for the others' last messages to arrive.
_DRAIN_SECONDS = 2.0
_exit_process = os._exit


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
        # calls every rank must make: this rank's entries by name, and the peers' entries it has not matched yet
        self._entered: dict[str, int] = {}
        self._unmatched: list[dict[str, Any]] = []
        self._skip_reported = False
        # the collective each peer said it waits in, with its counts; the wait of this rank told last (its key)
        self._peer_waits: dict[int, dict[str, Any]] = {}
        self._told_wait = -1
        self._cross_reported = False
        # when each peer that told so ended its script (time.time() of its message's arrival here)
        self._peers_ended: dict[int, float] = {}
        self._heard_ended: set[int] = set()  # the peers whose _ENDED has been received
        self._all_ended = False  # every rank has ended its script (wait_for_the_others' barrier completed)
        self._thread = threading.Thread(target=self._run, name="mpistrategy-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (returns once it has left MPI); after :meth:`wait_for_the_others`, receive what the other
        watchdogs sent that the thread had not (MPI must not be finalised with messages left unreceived)."""
        self._stopping.set()
        self._thread.join()
        if self._all_ended:
            self._drain()
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
        self._tell_others(self._ended, _ENDED)
        try:
            request = self.comm.Ibarrier()
            pause = 0.001
            while not request.Test():
                time.sleep(pause)
                pause = min(0.05, 2 * pause)
        except MPI.Exception:  # a rank that is gone: MPI_Finalize and the launcher take it from here
            return
        self._all_ended = True

    def _drain(self) -> None:
        """Receive every message still on its way here: each rank's ``_ENDED`` is the last it sends to each other
        rank before the barrier, and messages from one rank arrive in order, so once every peer's has arrived
        nothing more is coming (bounded wait: a peer whose message never comes is left to ``MPI_Finalize``)."""
        peers = set(range(self.size)) - {self.rank} - self._heard_ended
        self._receive_until_heard(peers, _ENDED, _DRAIN_SECONDS, MPI.ANY_TAG)

    def _receive_until_heard(self, waiting: set[int], tag: int, seconds: float, probed: int) -> None:
        """Receive the messages with tag ``probed`` (``tag``, or ``MPI.ANY_TAG``) until one with ``tag`` has come from
        every rank in ``waiting``, for at most ``seconds``."""
        deadline = time.monotonic() + seconds
        status = MPI.Status()
        while waiting and time.monotonic() < deadline:
            if self.comm.Iprobe(MPI.ANY_SOURCE, probed, status):
                self._receive(status)
                if status.Get_tag() == tag:
                    waiting.discard(status.Get_source())
            else:
                time.sleep(0.01)

    def _receive(self, status: MPI.Status) -> bytearray:
        """The message ``status`` describes (from a probe), received."""
        message = bytearray(status.Get_count(MPI.BYTE))
        self.comm.Recv([message, MPI.BYTE], status.Get_source(), status.Get_tag())
        return message

    def _interval(self) -> float:
        timeout = stall_timeout()
        return 1.0 if timeout <= 0 else min(1.0, max(0.05, timeout / 10))

    def _run(self) -> None:
        while not self._stopping.wait(self._interval()):
            trigger = self._received_alarm()
            if trigger is None and stall_timeout() > 0:
                since = self._waiting_since() if self._ended is None else None
                trigger = (
                    self._uneven_data()
                    or self._skipped_call(since)
                    or self._crossed_wait(since)
                    or self._waiting_for_ended(since)
                )
                if trigger is None and since is not None:
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
        if stall_timeout() <= 0:
            return
        self._tell_others((self.rank, training_pass, batches, kind), _DATA_END)

    def entered(self, name: str, advice: str) -> None:
        """This rank has entered ``name``, a call every rank must make (``advice``: how to call it right); tells
        every other rank's watchdog."""
        count = self._entered[name] = self._entered.get(name, 0) + 1
        if stall_timeout() <= 0:
            return
        file, line = call_site()
        entry = {"rank": self.rank, "name": name, "count": count, "advice": advice, "at": self._position()}
        self._tell_others({**entry, "site": f"{short_path(file)}:{line}"}, _ENTERED)

    def _position(self) -> tuple[tuple[int, int], int] | None:
        """This rank's latest training pass and the batch of it started last (``None``: none started)."""
        if not self._started:
            return None
        latest = max(self._started)
        return latest, self._started[latest]

    def every_rank_raised(self, within: float) -> bool:
        """Tell every other rank that this one raised, with its collective counts on the communicators of all
        ranks, and wait at most ``within`` seconds for each to say the same: True once every rank has, with the same
        counts (they are in step), False otherwise."""
        everyone = tuple(range(self.size))
        mine = sorted(
            (calls.key(channel), n) for channel, n in calls.counts.items() if calls.members(channel) == everyone
        )
        self._tell_others(mine, _RAISED)
        heard: dict[int, Any] = {}
        deadline = time.monotonic() + within
        while len(heard) < self.size - 1 and time.monotonic() < deadline:
            arrived = self._arrived(_RAISED)
            heard.update(arrived)
            if not arrived:
                time.sleep(0.01)
        return len(heard) == self.size - 1 and all(theirs == mine for theirs in heard.values())

    # ------------------------------------------------------------------------------------------------ detection

    def _waiting_frames(self) -> dict[int, FrameType]:
        frames = sys._current_frames()
        watched = {threading.main_thread().ident, calls.current_thread}
        return {ident: frames[ident] for ident in watched if ident is not None and ident in frames}

    def _own_stall(self, since: float) -> dict[str, Any] | None:
        """This rank's alarm, once it has waited in mpistrategy (since ``since``) longer than the timeout (sent to
        every rank)."""
        waited = time.time() - since
        if waited <= stall_timeout() or self._polled_key == self._reported_key:
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
        if not any(inside_package(frame) for frame in self._waiting_frames().values()):
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
        for _, (rank, training_pass, batches, kind) in self._arrived(_DATA_END):
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
                counts = {rank: counted(counts) for rank, counts in differing.items()}
                counts[self.rank] = counted(own, started)
                return self._alarm(0.0, uneven={"epoch": training_pass[1], "counts": dict(sorted(counts.items()))})
        return None

    def _skipped_call(self, since: float | None) -> dict[str, Any] | None:
        """The alarm of a rank that went on past a call a peer entered without entering it itself (sent to every
        rank), else ``None``; once. Went on: started a later batch, ended its script, or has waited in mpistrategy
        (since ``since``) for :data:`_SKIP_GRACE` seconds with the peer's entry known as long (the peer is in the
        call and no longer in any collective this rank waits in: those it has passed end within moments)."""
        for _, entry in self._arrived(_ENTERED):
            self._unmatched.append({**entry, "received": time.time()})
        self._unmatched = [e for e in self._unmatched if self._entered.get(e["name"], 0) < e["count"]]
        if self._skip_reported:
            return None
        own, now = self._position(), time.time()
        waited = 0.0 if since is None else now - since
        for entry in self._unmatched:
            beyond = own is not None and (entry["at"] is None or own > tuple(entry["at"]))
            waiting = since is not None and min(waited, now - entry["received"]) > _SKIP_GRACE
            if beyond or waiting or self._ended is not None:
                self._skip_reported = True
                went_on = {
                    "rank": self.rank,
                    "at": own,
                    "ended": self._ended is not None,
                    "waiting": (waited, _call_state(calls.current), innermost_inside(self._waiting_frames()))
                    if waiting and not beyond
                    else None,
                }
                return self._alarm(
                    0.0, skipped={**entry, "went_on": went_on, "entered": self._entered.get(entry["name"], 0)}
                )
        return None

    def _crossed_wait(self, since: float | None) -> dict[str, Any] | None:
        """The alarm of a rank whose wait crosses a peer's (:func:`~mpistrategy.comm.deadlocks.crossed_peer`; each
        rank tells the members of its call where it waits; the alarm goes to every rank), else ``None``; once. Each
        side has waited :data:`_CROSS_GRACE` seconds."""
        self._peer_waits.update(self._arrived(_WAITING))
        current = calls.current
        if since is None or current is None or self._cross_reported or time.time() - since <= _CROSS_GRACE:
            return None
        mine = _call_state(current)
        assert mine is not None
        own_counts = {calls.key(channel): count for channel, count in calls.counts.items()}
        if self._told_wait != self._watched_key:
            self._told_wait = self._watched_key
            self._tell_others({"call": mine, "counts": own_counts}, _WAITING, mine["members"])
        crossed = crossed_peer(self.rank, mine, own_counts, self._peer_waits)
        if crossed is None:
            return None
        self._cross_reported = True
        return self._alarm(time.time() - since, crossed={"rank": crossed, "call": self._peer_waits[crossed]["call"]})

    def _waiting_for_ended(self, since: float | None) -> dict[str, Any] | None:
        """The alarm of a rank that waits for ranks that ended their script
        (:func:`~mpistrategy.comm.deadlocks.ended_members`; sent to every rank), else ``None``; once."""
        for peer, _ in self._arrived(_ENDED):
            self._peers_ended.setdefault(peer, time.time())
            self._heard_ended.add(peer)
        current, now = calls.current, time.time()
        if since is None or current is None or now - since <= _SKIP_GRACE:
            return None
        gone = ended_members(calls.members(current.channel), self._peers_ended, now, _SKIP_GRACE)
        if not gone:
            return None
        self._peers_ended.clear()  # reported once
        return self._alarm(now - since, waiting_for_ended=gone)

    def _alarm(self, waited: float, **cause: Any) -> dict[str, Any]:
        """This rank's alarm (it has waited ``waited`` seconds; ``cause``: what else it found), sent to every other
        rank."""
        alarm = {
            "rank": self.rank,
            "waited": waited,
            "call": _call_state(calls.current),
            "where": innermost_inside(self._waiting_frames()),
            "last": _call_state(calls.last),
            **cause,
        }
        self._tell_others(alarm, _ALARM)
        return alarm

    def _received_alarm(self) -> dict[str, Any] | None:
        alarm = None
        for _, received in self._arrived(_ALARM):
            alarm = alarm or received
        if alarm is not None:
            self._reported_key = calls.entries()
        return alarm

    def _tell_others(self, what: Any, tag: int, to: Iterable[int] | None = None) -> None:
        """Send ``what`` (pickled) to every other rank's watchdog (or those in ``to``) with ``tag``, without
        waiting."""
        self._send(pickle.dumps(what), range(self.size) if to is None else to, tag)

    def _arrived(self, tag: int) -> list[tuple[int, Any]]:
        """The messages with ``tag`` that have arrived (source rank, unpickled), without waiting."""
        arrived = []
        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, tag, status):
            arrived.append((status.Get_source(), pickle.loads(self._receive(status))))
        return arrived

    def _send(self, message: bytes, ranks: Iterable[int], tag: int) -> None:
        """``message`` to the watchdogs of ``ranks`` (this one's excepted), without waiting."""
        requests = []
        for dest in ranks:
            if dest != self.rank:
                try:
                    requests.append(self.comm.Isend([message, MPI.BYTE], dest, tag))
                except MPI.Exception:  # a rank that is gone cannot be told
                    continue
        with self._sends_lock:  # the sends still in flight (those done are forgotten)
            self._sends = [sent for sent in self._sends if not sent.Test()] + requests

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
            "inside": any(inside_package(frame) for frame in frames.values()),
            "ended": self._ended,
            "current": _call_state(current),
            "last": _call_state(calls.last),
            "counts": {calls.key(channel): count for channel, count in calls.counts.items()},
            "entered": dict(self._entered),
            "phase": calls.phase,
            "where": innermost_inside(frames),
            "now": now_at(frames.get(threading.main_thread().ident or 0)),
            "stacks": stacks,
        }

    def _report(self, trigger: dict[str, Any]) -> None:
        mine = self._state()
        self._tell_others(mine, _STATE)
        states: dict[int, dict[str, Any]] = {self.rank: mine}
        deadline = time.monotonic() + _ANSWER_SECONDS
        while len(states) < self.size and time.monotonic() < deadline and not self._stopping.is_set():
            arrived = self._arrived(_STATE)
            states.update((state["rank"], state) for _, state in arrived)
            if not arrived:
                time.sleep(0.01)
        report = functools.partial(
            format_report, trigger, states, self.size, self.rank, stall_timeout(), stall_action()
        )
        path = flight.dump(
            "stall", {"report": report(), "states": {str(rank): state for rank, state in states.items()}}
        )
        _write(report(flight.where(path)))
        if stall_action() == "abort":
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
        self._send(b"", states, _WRITTEN)
        self._receive_until_heard(set(states) - {self.rank}, _WRITTEN, _ANSWER_SECONDS, _WRITTEN)


def _keep_recent(per_pass: dict[tuple[int, int], Any]) -> None:
    """Forget all but the most recent training passes."""
    for training_pass in sorted(per_pass)[:-_PASSES_KEPT]:
        del per_pass[training_pass]


def _call_state(call: calls.Call | None) -> dict[str, Any] | None:
    if call is None:
        return None
    return {**call.as_dict(), "members": list(calls.members(call.channel)), "key": calls.key(call.channel)}


def _write(text: str) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.write(text)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a broken stream must not stop the exit
        pass


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


def entered_every_rank_call(name: str, advice: str) -> None:
    """Tell every other rank's watchdog that this rank has entered ``name``, a call every rank must make
    (``advice``: how to call it right); a rank that goes on without it is reported (see the module docstring)."""
    if _watchdog is not None:
        _watchdog.entered(name, advice)


def every_rank_raised(within: float) -> bool:
    """Whether every rank has raised too, in step, told within ``within`` seconds (see the module docstring); True
    with one rank, False where the watchdog does not run."""
    if MPI.COMM_WORLD.Get_size() == 1:
        return True
    return _watchdog is not None and _watchdog.every_rank_raised(within)


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
