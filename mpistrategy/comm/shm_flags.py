"""Progress flags in shared memory: counters one rank raises and the others wait for, asleep in the kernel.

:class:`Flags` lives in a small :class:`~mpistrategy.comm.shm_window.Segment`. Every rank's part holds, each on
its own cache line, 32-bit words:

- counters (:data:`ARRIVED`, :data:`REDUCED`, :data:`DONE`, :data:`CHECKED`) that only their rank writes and
  that only grow (compared modulo 2**32, so they may wrap);
- a doorbell that the others write and this rank sleeps on (a Linux futex), and a flag saying it may be asleep;
- its pid and process start time, so that a waiting rank can tell a dead peer from a slow one;

two int64 values per rank for the argument check of the next operation (:meth:`Flags.post_values`, two slots used
in turn), and a ring of int64 descriptors that an operation in flight publishes for the others
(:meth:`Flags.describe`).

Publishing: store the counter, a full fence (``MPI_Win_sync``), then ring the doorbell of every peer whose sleeping
flag is up. Sleeping: raise the flag, fence, check once more whether the awaited counters moved, and only then
sleep on the doorbell. With a fence on both sides, either the sleeper sees the new counter or the publisher sees
the flag (Dekker's argument), so no wake-up is lost; every ring writes a value never rung before, so a sleeper
whose doorbell changed since it looked does not sleep at all. A timeout bounds every sleep all the same. Where
futexes are not available (not Linux, or an unknown architecture) a sleep is a short ``time.sleep``.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys
import time
from collections.abc import Callable

from mpi4py import MPI

from mpistrategy.comm.communicator import world_ranks
from mpistrategy.comm.errors import CommunicationError
from mpistrategy.comm.shm_window import Segment, allocate

#: counter words (indices of 32-bit words, 64 bytes apart)
ARRIVED, REDUCED, DONE, CHECKED = 0, 16, 32, 48
_BELL, _SLEEPING, _PID = 64, 80, 96
_LONGS_BYTE = 448  # int64: the process start time, then two slots of two posted values
_DESCRIPTOR_BYTES = 512
#: how many operations can publish descriptors at once (a ring)
RING = 64
#: int64 fields of one descriptor
DESCRIPTOR_FIELDS = 8
_DESCRIPTOR = struct.Struct(f"={DESCRIPTOR_FIELDS}q")
_BLOCK_BYTES = _DESCRIPTOR_BYTES + RING * DESCRIPTOR_FIELDS * 8

_MASK = 0xFFFFFFFF
_HALF = 0x80000000
_SPIN_SECONDS = float(os.environ.get("SHM_SPIN", 10e-6))
_SLEEP_SECONDS = 2e-3
#: a ``sched_yield`` that took longer gave the core to another process (a context switch and its time slice)
_HANDOFF_SECONDS = 20e-6
_LIVENESS_SECONDS = 1.0

_FUTEX_SYSCALLS = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "riscv64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


def _idle() -> bool:
    return False


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_syscall():
    number = _FUTEX_SYSCALLS.get(platform.machine().lower()) if sys.platform.startswith("linux") else None
    if number is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    return number, syscall


_FUTEX = _futex_syscall()


def reached(value: int, target: int) -> bool:
    """Whether a counter at ``value`` has reached ``target`` (both modulo 2**32)."""
    return (value - target) & _MASK < _HALF


def _start_time(pid: int) -> int:
    """The start time of process ``pid`` (clock ticks after boot), or -1 if it does not run: it does not exist, is
    unknown, or has ended and waits for its parent to collect it (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return -1 if fields[0] in (b"Z", b"X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return -1


class Flags:
    """The counters, doorbells and descriptors of one group of ranks that share memory (collective over
    ``comm`` to build).

    Args:
        comm: the ranks; they must share memory.
    """

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.participants = world_ranks(comm)
        self.spin_seconds = _SPIN_SECONDS
        # more ranks than cores: a waiting rank yields its core (to the ranks it waits for) rather than spin
        self.oversubscribed = self.size > len(os.sched_getaffinity(0))
        self._comm = comm
        self._checked_at = time.monotonic()
        self._segment: Segment | None = allocate(_BLOCK_BYTES, comm)
        segment = self._segment
        segment.part(self.rank).zero_()  # the MPI library may hand out memory it used before
        arrays = [segment.part(r).numpy() for r in range(self.size)]
        # numpy's stubs give ndarray the buffer protocol only for Python >= 3.12
        self._words = [memoryview(a).cast("I") for a in arrays]  # type: ignore[arg-type]
        self._longs = [memoryview(a[_LONGS_BYTE:_DESCRIPTOR_BYTES]).cast("q") for a in arrays]  # type: ignore[arg-type]
        self._descriptors = [memoryview(a[_DESCRIPTOR_BYTES:]) for a in arrays]  # type: ignore[arg-type]
        self._bells = [segment.part(r).data_ptr() + 4 * _BELL for r in range(self.size)]
        self._mine = self._words[self.rank]
        self._peers = [r for r in range(self.size) if r != self.rank]
        self._fence = segment.fence
        self._rings = 0
        pid = os.getpid()
        self._mine[_PID] = pid & _MASK
        self._longs[self.rank][0] = _start_time(pid)
        comm.Barrier()
        self._start_times = [longs[0] for longs in self._longs]
        # a peer can be checked for life only if its pid means the same process here (same pid namespace)
        self._checkable = [r for r in self._peers if _start_time(self._words[r][_PID]) == self._start_times[r] != -1]

    # ------------------------------------------------------------------------------------------------ counters

    def value(self, rank: int, counter: int) -> int:
        """Rank ``rank``'s ``counter``."""
        return self._words[rank][counter]

    def all_reached(self, counter: int, target: int) -> bool:
        """Whether every rank's ``counter`` has reached ``target``."""
        return all((words[counter] - target) & _MASK < _HALF for words in self._words)

    def publish(self, counter: int, value: int) -> None:
        """Set this rank's ``counter`` to ``value`` (after everything this rank wrote before, for any reader
        that sees the new value) and wake the ranks that may be asleep."""
        self._mine[counter] = value & _MASK
        self._fence()
        for peer in self._peers:
            if self._words[peer][_SLEEPING]:
                self._ring(peer)

    def store(self, counter: int, value: int) -> None:
        """Set this rank's ``counter`` to ``value`` with no fence and no wake-up: for a value no rank waits for,
        which keeps the counter close to those that will be waited for (they are compared modulo 2**32)."""
        self._mine[counter] = value & _MASK

    def acquire(self) -> None:
        """A fence after seeing a counter move: what its rank wrote before publishing it is visible now."""
        self._fence()

    def _ring(self, peer: int) -> None:
        self._rings += 1
        self._words[peer][_BELL] = ((self._rings << 8) | (self.rank & 0xFF)) & _MASK
        if _FUTEX is not None:
            number, syscall = _FUTEX
            syscall(number, ctypes.c_void_p(self._bells[peer]), _FUTEX_WAKE, 1, None, None, 0)

    # ---------------------------------------------------------------------------------------- posted values

    def post_values(self, round_: int, first: int, second: int) -> None:
        """Post two int64 values in round ``round_`` (1, 2, ...) and publish ``CHECKED``; every rank reads them
        once it sees every ``CHECKED`` reach the round (:meth:`posted_values`). A rank reuses a slot two rounds later,
        after it saw every rank reach the round in between, hence done reading this one."""
        slot = 1 + 2 * (round_ & 1)
        self._longs[self.rank][slot] = first
        self._longs[self.rank][slot + 1] = second
        self.publish(CHECKED, round_)

    def posted_values(self, round_: int) -> list[tuple[int, int]]:
        """Every rank's two values of round ``round_`` (call once every ``CHECKED`` has reached it)."""
        self._fence()
        slot = 1 + 2 * (round_ & 1)
        return [(longs[slot], longs[slot + 1]) for longs in self._longs]

    # ---------------------------------------------------------------------------------------------- descriptors

    def describe(self, slot: int, fields: tuple[int, ...]) -> None:
        """Write this rank's descriptor ``slot``, :data:`DESCRIPTOR_FIELDS` int64 (visible to a peer once it sees
        a counter published after)."""
        _DESCRIPTOR.pack_into(self._descriptors[self.rank], (slot % RING) * _DESCRIPTOR.size, *fields)

    def descriptor(self, rank: int, slot: int) -> tuple[int, ...]:
        """Rank ``rank``'s descriptor ``slot``."""
        return _DESCRIPTOR.unpack_from(self._descriptors[rank], (slot % RING) * _DESCRIPTOR.size)

    # ------------------------------------------------------------------------------------------------- sleeping

    def sleep(self, still_blocked: Callable[[], bool], timeout: float) -> None:
        """Sleep until a peer rings this rank's doorbell or ``timeout`` seconds pass, unless ``still_blocked()``
        (called after the sleeping flag is up) returns False."""
        bell = self._mine[_BELL]
        self._mine[_SLEEPING] = 1
        self._fence()
        try:
            if not still_blocked():
                return
            if _FUTEX is None:
                time.sleep(min(timeout, 1e-4))
                return
            number, syscall = _FUTEX
            seconds = int(timeout)
            wait = _Timespec(seconds, int((timeout - seconds) * 1e9))
            syscall(number, ctypes.c_void_p(self._bells[self.rank]), _FUTEX_WAIT, bell, ctypes.byref(wait), None, 0)
        finally:
            self._mine[_SLEEPING] = 0

    def dead_peers(self) -> list[int]:
        """The ranks whose process has ended (among those this process can see)."""
        return [r for r in self._checkable if _start_time(self._words[r][_PID]) != self._start_times[r]]

    def poke(self) -> None:
        """Drive MPI's progress engine once. Non-blocking MPI collectives posted on this process (the strategy's
        small exchanges) advance only inside MPI calls; a rank whose traffic goes through shared memory may
        otherwise make none until it waits for them, and would then wait for a peer to make one too."""
        self._comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)

    def wait_until(
        self, done: Callable[[], bool], work: Callable[[], bool] = _idle, between: Callable[[], object] = _idle
    ) -> None:
        """Call ``work()`` (steps that are ready; True if it did any) until ``done()``: when nothing is ready,
        spin for :attr:`spin_seconds`, then sleep until a peer publishes (or a short timeout), then call
        ``between()`` and drive MPI's progress. Raises :class:`CommunicationError` when a peer's process has
        ended (checked every second while asleep), instead of waiting for it forever.

        With more ranks than cores, spinning yields the core (``sched_yield``) between looks, and only the time
        of looks whose yield came straight back (no other process wanted the core) counts as spun: the core goes
        to the ranks waited for, and is burnt for at most :attr:`spin_seconds` when they are not runnable."""
        spun, start = 0.0, time.perf_counter()
        while not done():
            if work():
                spun, start = 0.0, time.perf_counter()
                continue
            if spun < self.spin_seconds:
                if self.oversubscribed:
                    yielded = time.perf_counter()
                    os.sched_yield()
                    now = time.perf_counter()
                    if now - yielded < _HANDOFF_SECONDS:
                        spun += now - start
                    start = now
                else:
                    spun = time.perf_counter() - start
                continue
            self.sleep(lambda: not work() and not done(), _SLEEP_SECONDS)
            spun, start = 0.0, time.perf_counter()
            between()
            self.poke()
            self._check_peers()

    def _check_peers(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < _LIVENESS_SECONDS:
            return
        self._checked_at = now
        dead = self.dead_peers()
        if dead:
            ranks = ", ".join(str(self.participants[r]) for r in dead)
            raise CommunicationError(
                f"shared memory: the process of world rank(s) {ranks} has ended while this rank waits for it; the "
                "job cannot continue."
            )

    def close(self) -> bool:
        """Collective: free the shared memory (False if a rank still uses it, see :meth:`Segment.free`)."""
        if self._segment is None:
            return True
        self._words, self._longs, self._descriptors = [], [], []
        self._mine = memoryview(bytearray(_DESCRIPTOR_BYTES)).cast("I")
        freed = self._segment.free()
        self._segment = None
        return freed
