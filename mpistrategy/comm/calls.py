"""The call log: which collective this process entered last, from where, and its last ``N`` collectives.

Every collective registers here once, in its argument check (:func:`mpistrategy.comm.checks.agree`), whether
validation is on or off: :func:`enter` counts the call on its communicator (the counts of all ranks agree while
the ranks make the same calls in the same order), finds the caller's place in the user's code
(:func:`mpistrategy.comm.frames.call_site`) and writes a :class:`Call` into a ring buffer of the last
:data:`RECORDS` calls (``MPISTRATEGY_FLIGHT_RECORDS``, default 256). :func:`leave` (called when the public op
returns) stores the call's duration. The cross-rank check puts the op, its arguments and the call site into its
error messages; the stall watchdog and the flight recorder read the current call and the ring buffer. About 1 µs
per call.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpistrategy.comm.frames import call_site, short_path

#: how many of its last collectives each process keeps (``MPISTRATEGY_FLIGHT_RECORDS``)
RECORDS = max(1, int(os.environ.get("MPISTRATEGY_FLIGHT_RECORDS", "256")))


#: values that arguments given as codes stand for, by argument name (e.g. the reduction op's code)
CODE_NAMES: dict[str, dict[int, str]] = {}
# Flags shown in a call only when set (``requires_grad=1``), to keep the common call short.
_FLAGS = frozenset({"requires_grad", "shared memory"})


class Call:
    """One collective call of this process: its op, the arguments all ranks must agree on, where it was made."""

    __slots__ = ("channel", "count", "what", "local", "describe", "file", "line", "started", "duration")

    def __init__(
        self, channel: int, count: int, what: str, local: Sequence[object], describe: str, site: tuple[str, int]
    ) -> None:
        self.channel = channel  # the communicator's id in this process (see :func:`register`)
        self.count = count  # the how-manieth collective call on that communicator, from 1
        self.what = what
        self.local = local
        self.describe = describe
        self.file, self.line = site
        self.started = time.time()  # seconds since the epoch
        self.duration: float | None = None  # seconds, once the op returned

    @property
    def site(self) -> str:
        """``file:line`` of the call in the caller's code."""
        return f"{short_path(self.file)}:{self.line}"

    def signature(self) -> str:
        """The call as the user wrote it, e.g. ``allreduce(float32[4], op=sum)``."""
        return f"{self.what}({describe_arguments(self.local, self.describe)})"

    def __str__(self) -> str:
        return f"{self.signature()} at {self.site}"

    def as_dict(self) -> dict[str, Any]:
        """The call as JSON-ready values (for the flight recorder and the stall report)."""
        return {
            "count": self.count,
            "channel": self.channel,
            "op": self.what,
            "call": self.signature(),
            "site": self.site,
            "file": self.file,
            "line": self.line,
            "started": self.started,
            "duration": self.duration,
        }


def _shown(name: str, item: object) -> str:
    if isinstance(item, torch.dtype):
        return str(item).removeprefix("torch.")
    if isinstance(item, (tuple, list)):
        return str(tuple(item))
    names = CODE_NAMES.get(name)
    if names is not None and isinstance(item, int) and item in names:
        return names[item]
    return str(item)


def describe_arguments(local: Sequence[object], describe: str) -> str:
    """A signature as call arguments: ``float32[4]`` for a dtype and shape, then ``name=value`` by ``describe``."""
    names = [name.strip() for name in describe.replace(" and ", ", ").split(",") if name.strip()]
    items = list(local)
    shown: list[str] = []
    if len(items) >= 2 and isinstance(items[0], torch.dtype) and isinstance(items[1], (tuple, list, torch.Size)):
        shown.append(f"{_shown('', items[0])}[{', '.join(str(int(s)) for s in items[1])}]")
        items, names = items[2:], [name for name in names if not name.startswith(("dtype", "shape"))]
    for index, item in enumerate(items):
        name = names[index] if index < len(names) else ""
        if name in _FLAGS and not item:
            continue
        shown.append(f"{name}={_shown(name, item)}" if name else _shown(name, item))
    return ", ".join(shown)


_ring: list[Call | None] = [None] * RECORDS
_next = 0
_keys: list[str] = []
_lock = threading.Lock()

#: the call this process entered last and has not left (``None`` between calls), and the thread that entered it
current: Call | None = None
current_thread = 0
#: the call this process entered last
last: Call | None = None
_held: Call | None = None
#: this process's collective calls per communicator id (see :func:`register`)
counts: dict[int, int] = {}
#: what the layer above says this process is doing (the strategy: the evaluation pass it is in), a picklable value
#: or ``None``; every rank's goes with a collective mismatch and a stall report (see :func:`set_phase`)
phase: Any = None
_explain_phases: Callable[[dict[int, Any]], str | None] | None = None


def set_phase(value: Any, explain: Callable[[dict[int, Any]], str | None] | None = None) -> None:
    """This process's phase (``None``: none); ``explain`` (kept once given) turns every rank's phase, by rank, into a
    sentence for the reports, or ``None`` when the phases explain nothing (see :func:`explain_phases`)."""
    global phase, _explain_phases
    phase = value
    if explain is not None:
        _explain_phases = explain


def explain_phases(phases: dict[int, Any]) -> str | None:
    """What the ranks' phases (by rank) say about a collective mismatch or a stall, if anything."""
    return None if _explain_phases is None else _explain_phases(phases)


def register(members: tuple[int, ...]) -> int:
    """A new communicator's id in this process; ``members``: its ranks' world ranks, in its rank order.

    Its :func:`key` names it alike on every member: the members and how many communicators with the same members
    were wrapped before it (wrapping is collective, so every member counts the same)."""
    with _lock:
        prefix = ",".join(map(str, members)) + "#"
        _keys.append(f"{prefix}{sum(key.startswith(prefix) for key in _keys)}")
        return len(_keys) - 1


def key(channel: int) -> str:
    """The communicator with id ``channel`` as ``"<world ranks>#<n>"``, the same string on each of its ranks."""
    return _keys[channel]


def members(channel: int) -> tuple[int, ...]:
    """The world ranks of the communicator with id ``channel``."""
    return tuple(int(rank) for rank in _keys[channel].split("#")[0].split(","))


def count(channel: int) -> None:
    """Count a call on the communicator with id ``channel`` that is made outside the checked ops and not recorded
    (a non-blocking decision posted every step): the in-step comparison of the ranks' counts after an error sees
    it (see :func:`mpistrategy.comm.watchdog.every_rank_raised`)."""
    with _lock:
        counts[channel] = counts.get(channel, 0) + 1


def entries() -> int:
    """How many collectives this process has entered (on any communicator)."""
    return _next


def enter(comm: Any, what: str, local: Sequence[object], describe: str, near: bool = False) -> Call:
    """Register this process's next collective on ``comm`` (a :class:`~mpistrategy.comm.communicator.Communicator`):
    count it, record it in the ring buffer and make it the current call. ``near``: record the nearest call site
    outside mpistrategy (see :func:`call_site`; for calls with validation off, such as the strategy's buckets)."""
    global _next, current, current_thread, last
    comm.calls += 1
    channel = comm.channel
    counts[channel] = comm.calls
    call = Call(channel, comm.calls, what, local, describe, call_site(2, near))
    _ring[_next % RECORDS] = call
    _next += 1
    current = last = call
    current_thread = threading.get_ident()
    return call


def hold(call: Call) -> None:
    """Make ``call`` (entered earlier) the current call until :func:`release`, also between the collectives the
    caller makes meanwhile: the caller waits for it to complete (the strategy's gradient sync)."""
    global current, current_thread, _held
    current = _held = call
    current_thread = threading.get_ident()


def release() -> None:
    """The held call is complete: store its duration; no call is current."""
    global current, _held
    if _held is not None:
        _held.duration = time.time() - _held.started
    current = _held = None


def leave() -> None:
    """The op that entered the current call has returned: store its duration (the held call, if any, is current
    again)."""
    global current
    call = current
    if call is not None and call is not _held:
        call.duration = time.time() - call.started
    current = _held


def recent() -> list[Call]:
    """The recorded calls, oldest first."""
    count = min(_next, RECORDS)
    start = _next - count
    return [call for call in (_ring[(start + i) % RECORDS] for i in range(count)) if call is not None]
