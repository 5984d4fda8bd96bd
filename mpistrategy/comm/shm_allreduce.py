"""Allreduce through shared memory for ranks on one node: sum and avg of float32, float64, float16 and bfloat16.

Each rank's input is put where the others can read it: a tensor that lives in a shared segment
(:mod:`mpistrategy.comm.shm_window`, such as the strategy's gradient buckets) is read where it is; any other tensor
is copied once into the rank's *staging* segment, chunk by chunk, each chunk announced as soon as it is there (the
``ARRIVED`` counter of :mod:`mpistrategy.comm.shm_flags`). Then, with the message cut into chunks, one of two
plans, chosen from the message size and the number of ranks P alone (:func:`everyone_sums`), so that every rank
follows the same one:

- *owners* (larger messages): chunk c belongs to rank c mod P, which sums it from every rank's input, writes it
  over its own input (or into its staging segment when its input must stay as it is) and announces it
  (``REDUCED``), and into its result too when that is elsewhere, in the same pass; then every rank copies every
  other chunk from its owner into its result. When every rank reduces a tensor in a window in place, each owner
  writes its sums into every rank's tensor instead, in the same pass (only a chunk's owner reads that chunk
  anywhere): every input is read once and written once, and no rank waits for the others to finish reading it.
  A rank's own chunks of a private input are read from the tensor itself, so only the others' chunks are copied
  in.
- *everyone* (messages of at most :data:`EVERYONE_SUMS_BYTES` of others' input per rank): every rank sums every
  chunk itself, straight into its result: one wait for the others instead of two. A shared buffer reduced in
  place keeps each summed chunk in scratch until every rank has read that chunk (``REDUCED``), then writes it.

Every sum is taken in rank order, ``((x_0 + x_1) + x_2) + ...`` (float16 and bfloat16 in float32, rounded once),
then multiplied by 1/P for avg: the result is bitwise identical on every rank and in every run. float32 and
float64 are summed by a compiled kernel (:mod:`~mpistrategy.comm.rank_sum`: each input read once, the sum written
to every place it goes in the same pass, the same bits as torch's chain), the others with torch. The chunks of a
non-blocking operation make a pipeline: a rank sums chunk c while the others still copy in chunk c + 1, and a
summed chunk is still in the shared cache when the others copy it. A blocking one (:meth:`_Group.allreduce`) takes
the same plan in one straight pass, with one wait for all ranks per step instead of per chunk. With ranks that
share a machine, MPI's own allreduce copies every element through its queues several times.

Waiting (for a peer's chunk, its check or its ``DONE``) spins for a few microseconds (yielding the core between
looks where ranks outnumber cores), then sleeps in the kernel on a futex (see
:meth:`~mpistrategy.comm.shm_flags.Flags.wait_until`), driving MPI's progress and the operations of the other groups
between sleeps; a peer whose process has ended makes the wait raise
:class:`~mpistrategy.comm.errors.CommunicationError` within a second instead of waiting forever. The argument check
of an allreduce goes through the same flags once a group exists (:func:`agreement`), and is compared only after
the input is copied in. Operations complete in the order they started on their group; non-blocking operations
progress whenever this process calls into one (start, test, wait), as MPI's do when the library is called.

Where it is used (:func:`group_for`): on a communicator whose ranks all share memory, for sum and avg of those
dtypes, from :func:`min_bytes` bytes on (measured per rank count, lower for a tensor already in shared memory;
smaller messages stay with MPI, whose latency is lower), unless ``MPISTRATEGY_SHM=0``; ``MPISTRATEGY_SHM=1`` (or
:func:`set_shared_memory`) uses it for every size, also on one rank. Memory: each group (a communicator's forward
or backward channel) keeps a control segment of 12 KiB per rank and, once used for a message, a staging segment
of twice the largest message (grown by doubling; address space only until a message that is not already in
shared memory is copied in); every rank keeps up to three chunks of scratch. :func:`release` frees a
communicator's groups.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from mpistrategy.comm import rank_sum
from mpistrategy.comm.buffers import DTYPE_CODES, deliver, receive_buffer, same_memory
from mpistrategy.comm.checks import Exchange
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.errors import CommunicationError
from mpistrategy.comm.shm_flags import ARRIVED, CHECKED, DONE, REDUCED, RING, Flags, reached
from mpistrategy.comm.shm_window import Segment, allocate, find, locate, machine_comm, world_ranks

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)

MODE_VARIABLE = "MPISTRATEGY_SHM"
MIN_BYTES_VARIABLE = "MPISTRATEGY_SHM_MIN_BYTES"
MODES = ("auto", "on", "off")
#: the smallest message that goes through shared memory in "auto" mode, by (2 ranks?, tensor already in shared
#: memory?): where it beat MPI's allreduce in benchmarks/collectives.py on a 2-core x86_64 VM (docs/shared_memory.md).
#: A tensor that must be copied in first gains later than one that lives in a shared segment (the strategy's
#: gradient buckets); with more ranks than two, MPI's busy-polling ranks lose earlier.
DEFAULT_MIN_BYTES = {(True, False): 8 << 20, (True, True): 1 << 20, (False, False): 2 << 20, (False, True): 1 << 20}

#: bytes per chunk: one chunk of every rank stays in the 32 MB L3 cache with room to spare, and the Python cost
#: per chunk (a few torch calls, 20-40 µs) stays small next to moving it
CHUNK_BYTES = 1 << 20
_CHUNK_ALIGN = 64  # bytes: chunk boundaries on cache lines
_STAGING_ALIGN = 4096
#: every rank sums the whole message when it reads at most this many bytes of the others' inputs
EVERYONE_SUMS_BYTES = 256 << 10
_STAGING_DEPTH = 2  # staging space of the previous operation is never reused: the segment grows instead
_KIND = {0: "non-blocking", 1: "blocking"}  # by the _SYNCHRONOUS bit
#: bits of a descriptor's last field: a blocking operation; every sum stays where the rank's input was (owners, in
#: a window, in place)
_SYNCHRONOUS, _SUMMED_WHERE_IT_IS = 1, 2
_REMEMBERED_SCRATCH_VIEWS = 64
_REMEMBERED_PLACES = 64


# ------------------------------------------------------------------------------------------------------- settings


@dataclass
class _Settings:
    mode: str
    min_bytes: int | None  # None: the measured defaults


def _mode_from(text: str) -> str:
    value = text.strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes", "force"):
        return "on"
    raise ValueError(
        f"{MODE_VARIABLE}={text!r} is not a shared-memory mode; set it to auto (the default), 1 (always, for "
        "tests) or 0 (never)."
    )


def _min_bytes_from(text: str) -> int | None:
    if not text.strip():
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(
            f"{MIN_BYTES_VARIABLE}={text!r} is not a whole number of bytes; set it to e.g. 1048576, or leave it "
            "unset for the measured defaults."
        ) from None
    return max(value, 0)


_settings = _Settings(
    _mode_from(os.environ.get(MODE_VARIABLE, "")), _min_bytes_from(os.environ.get(MIN_BYTES_VARIABLE, ""))
)


def set_shared_memory(mode: str = "auto", min_bytes: int | None = None) -> None:
    """Choose when allreduce goes through shared memory, on every rank alike: ``"auto"`` (ranks that share a
    node, messages of at least :func:`min_bytes`), ``"on"`` (every size, also one rank: for tests) or ``"off"``.
    ``min_bytes``: one threshold for every case instead of the measured defaults (``None``: keep the current
    choice)."""
    if mode not in MODES:
        raise ValueError(f"set_shared_memory: mode={mode!r}; choose one of {', '.join(MODES)}.")
    _settings.mode = mode
    if min_bytes is not None:
        _settings.min_bytes = max(int(min_bytes), 0)


def shared_memory_mode() -> str:
    """The current mode (see :func:`set_shared_memory`)."""
    return _settings.mode


def min_bytes(size: int = 2, shared: bool = False) -> int:
    """The smallest message (bytes) that goes through shared memory in ``"auto"`` mode over ``size`` ranks, for
    a tensor that lives in a shared segment already (``shared``) or must be copied in."""
    if _settings.min_bytes is not None:
        return _settings.min_bytes
    return DEFAULT_MIN_BYTES[size == 2, shared]


@contextlib.contextmanager
def shared_memory(mode: str, min_bytes: int | None = None) -> Iterator[None]:
    """:func:`set_shared_memory` inside a ``with`` block (every rank must enter it alike)."""
    saved = (_settings.mode, _settings.min_bytes)
    set_shared_memory(mode, min_bytes)
    try:
        yield
    finally:
        _settings.mode, _settings.min_bytes = saved


def wanted(tensor: torch.Tensor, op: str, size: int) -> bool:
    """Whether this rank's settings send an allreduce of ``tensor`` with ``op`` over ``size`` ranks through
    shared memory, if the ranks share memory (local: no communication; the ranks agree on it in the argument
    check, so they must pass tensors alike: all in shared memory, or none, between the two thresholds)."""
    mode, dtype = _settings.mode, tensor.dtype
    if mode == "off" or dtype not in SUPPORTED_DTYPES or op not in ("sum", "avg"):
        return False
    if mode == "on":
        return True
    nbytes = tensor.numel() * dtype.itemsize
    if size < 2 or nbytes < min_bytes(size, shared=True):
        return False
    return nbytes >= min_bytes(size, shared=False) or locate(tensor) is not None


# --------------------------------------------------------------------------------------------------- groups


_groups: dict[int, _Group | None] = {}
_active: set[_Group] = set()
_registry_lock = threading.Lock()


def group_for(channel: MPI.Intracomm, tensor: torch.Tensor, op: str) -> _Group | None:
    """The shared-memory group that reduces ``tensor`` with ``op`` on ``channel``, or ``None`` for MPI.

    Collective over ``channel`` the first time a message qualifies on it (it finds out whether the ranks share
    memory, and builds the group).
    """
    if not wanted(tensor, op, channel.Get_size()):
        return None
    key = channel.py2f()
    if key in _groups:
        return _groups[key]
    with _registry_lock:
        group = _groups[key] = _Group.create(channel)
    return group


def built_group(channel: MPI.Intracomm) -> _Group | None:
    """``channel``'s shared-memory group if it has been built (no communication)."""
    return _groups.get(channel.py2f())


def agreement(channel: MPI.Intracomm, tensor: object, op: str) -> Exchange | None:
    """How the argument check of an allreduce of ``tensor`` with ``op`` on ``channel`` combines its two values
    over the ranks, once the channel's shared-memory group exists (else ``None``: MPI's allreduce).

    Through the group's flags, woken by futexes, instead of an MPI allreduce whose busy-polling ranks wait for each
    other's time slices on a loaded node. When this rank's allreduce goes through the group too, the check is only
    offered here and compared by the allreduce once its input is copied in: the two waits become one.
    """
    group = built_group(channel)
    if group is None:
        return None
    if isinstance(tensor, torch.Tensor) and not tensor.is_meta and wanted(tensor, op, group.size):
        return group.offer
    return group.exchange


def buffer_ranks() -> MPI.Intracomm | None:
    """The ranks that share this machine, over which to allocate buffers that allreduces on node-local
    communicators read in place (the strategy's gradient buckets, see :func:`~mpistrategy.comm.shm_window.allocate`);
    ``None`` when shared memory is off, or in ``"auto"`` mode when this machine runs one rank. Collective over the
    world; ranks with different settings raise the same error."""
    modes = MPI.COMM_WORLD.allgather(_settings.mode)
    if len(set(modes)) > 1:
        listing = "; ".join(f"rank {r}: {m}" for r, m in enumerate(modes))
        raise ValueError(
            f"shared-memory buffers: ranks have different modes ({listing}); set {MODE_VARIABLE} (or call "
            "set_shared_memory) alike on every rank."
        )
    machine = machine_comm()
    if _settings.mode == "off" or (_settings.mode == "auto" and machine.Get_size() == 1):
        return None
    return machine


def release(comm: Communicator) -> None:
    """Free the shared memory of ``comm``'s groups (collective over ``comm``; they are rebuilt when needed)."""
    for channel in (comm.forward, comm.backward):
        group = _groups.pop(channel.py2f(), None)
        if group is not None:
            group.close()


# ---------------------------------------------------------------------------------------------- operations


class _Operation:
    """One allreduce on a group: its plan, where its chunks are (tuples of flat views, one per chunk), and how far
    it got. Class attributes are the defaults (most operations change few of them)."""

    seq = base = numel = chunks = to_reduce = gathered = 0
    step = 1
    owners = True  # each chunk summed by its owner (else every rank sums every chunk)
    copy_in = False  # the input is copied into staging (else it is in a shared segment already)
    source_chunks: tuple[torch.Tensor, ...] = ()  # this rank's input in shared memory
    own_chunks: tuple[torch.Tensor, ...] = ()  # where this rank sums its own input from
    result_chunks: tuple[torch.Tensor, ...] = ()  # owners: where this rank's sums go (shared memory)
    target_chunks: tuple[torch.Tensor, ...] = ()  # where every summed chunk ends up on this rank
    skip_own = False  # target is result: own chunks are already there
    sums_to_target = False  # owners with a separate target: each sum is written there too as it is summed
    push = False  # every rank's target is its result (a window, in place): owners write their sums into every one
    in_place = False  # the sums overwrite this rank's own input
    write_back = False  # every rank sums: this rank's sums wait in scratch until every rank has read the chunk
    written = -1  # write_back: the chunk whose sum is in scratch (-1: none)
    inputs: list[tuple[torch.Tensor, ...]] | None = None  # every rank's input chunks
    results: list[tuple[torch.Tensor, ...]] | None = None  # every rank's result chunks (owners)
    announced = False
    verified = False  # its argument check is compared (until then, no other rank's data is read)
    await_done = False
    complete = False
    target: torch.Tensor | None = None  # the result tensor (None: out, reduced where it is)

    def __init__(self, tensor: torch.Tensor, out: torch.Tensor | None, average: bool, synchronous: bool) -> None:
        self.dtype, self.device, self.out, self.average = tensor.dtype, tensor.device, out, average
        self.synchronous = synchronous  # blocking: completed in one pass (see _Group.allreduce)

    def result(self) -> torch.Tensor:
        """The allreduce's result, once complete: ``out`` or a new tensor, in the input's dtype and device."""
        if self.target is None:
            assert self.out is not None, "without a result tensor of its own, the allreduce writes into out"
            return self.out
        return deliver(self.target, self.out, self.dtype, self.device, "allreduce")

    def release(self) -> None:
        """Drop the references to the tensors it used."""
        self.own_chunks = self.target_chunks = self.source_chunks = self.result_chunks = ()
        self.inputs = self.results = None
        self.out = self.target = None


class _Disagreement(Exception):
    """The ranks' argument checks differ; ``report`` raises the error every rank raises."""

    def __init__(self, report: Callable[[], None]) -> None:
        super().__init__("ranks disagree on an allreduce")
        self.report = report


class SharedWork:
    """A shared-memory allreduce in flight (the interface of :class:`~mpistrategy.collectives.handles.Pending`)."""

    __slots__ = ("_group", "_operation", "_result")

    def __init__(self, group: _Group, operation: _Operation) -> None:
        self._group = group
        self._operation = operation
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        """Block until the allreduce is complete; return its result."""
        if self._result is None:
            self._group.wait(self._operation)
            self._result = self._operation.result()
            self._operation.release()
        return self._result

    def test(self) -> bool:
        """Advance the group's work without blocking; whether this allreduce is complete."""
        return self._result is not None or self._group.test(self._operation)


class _Group:
    """The ranks of one communicator channel that share memory: their flags, staging memory and operations."""

    @classmethod
    def create(cls, channel: MPI.Intracomm) -> _Group | None:
        shared = channel.Split_type(MPI.COMM_TYPE_SHARED, key=channel.Get_rank())
        if shared.Get_size() != channel.Get_size():
            shared.Free()
            return None
        settings = shared.allgather((_settings.mode, _settings.min_bytes))
        if len(set(settings)) > 1:
            shared.Free()
            listing = "; ".join(f"rank {r}: mode {m}, min_bytes {b}" for r, (m, b) in enumerate(settings))
            raise ValueError(
                f"shared-memory allreduce: ranks have different settings ({listing}); set {MODE_VARIABLE} and "
                f"{MIN_BYTES_VARIABLE} (or call set_shared_memory) alike on every rank."
            )
        return cls(shared)  # type: ignore[arg-type]  # mpi4py types Split_type's result as Comm

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.participants = world_ranks(comm)
        self.flags = Flags(comm)
        self.staging: Segment | None = None
        self.regions: collections.deque[tuple[int, int, int]] = collections.deque()  # (seq, start, end) reserved
        self.head = 0  # where the next staging reservation starts
        self.seq = 0  # operations started
        self.checks = 0  # argument checks exchanged
        self.pending: tuple[int, Callable[[], None]] | None = None  # an offered check not yet compared
        self._before: tuple[tuple, int] = ((), 0)  # the staging reservations before the last operation
        self.chunk_count = 0  # chunks of the operations started (what ARRIVED and REDUCED count)
        self.flight: collections.deque[_Operation] = collections.deque()
        self.lock = threading.RLock()
        self._covers: dict[int, bool] = {}
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._scratch_views: dict[tuple[str, torch.dtype, int, int], torch.Tensor] = {}
        self._done_by_all = 0  # every rank has published DONE of every operation up to this one
        self._located: dict[tuple[int, int], tuple[Segment, int] | None] = {}  # see _locate
        rank_sum.available(torch.float32)  # builds the compiled sum now rather than inside the first allreduce

    # ------------------------------------------------------------------------------------------------- check

    def exchange(self, extremes: np.ndarray, disagreement: Callable[[], None]) -> None:
        """Replace ``extremes`` (two int64) by their MAX over the ranks, through the flags. On a disagreement the
        group is first resynchronised (every rank gets here or to a failed :meth:`_settle`), then the caller
        reports."""
        with self.lock:
            self._settle()
            round_ = self._offer(extremes)
            self._wait_until(lambda: self.flags.all_reached(CHECKED, round_))
            offers = self.flags.offers(round_)
            extremes[0] = max(first for first, _ in offers)
            extremes[1] = max(second for _, second in offers)
            if extremes[0] != -extremes[1]:
                self._resync(None)

    def offer(self, extremes: np.ndarray, disagreement: Callable[[], None]) -> None:
        """Offer this rank's check values and leave ``extremes`` as they are: the allreduce that follows on this
        group compares every rank's offer (:meth:`_settle`) once its own input is copied in, and calls
        ``disagreement`` (which raises on every rank) if they differ. A rank whose own checks failed exchanges
        at once instead."""
        if extremes[0] < 0:
            self.exchange(extremes, disagreement)
            return
        with self.lock:
            self._settle()
            self.pending = (self._offer(extremes), disagreement)

    def _offer(self, extremes: np.ndarray) -> int:
        self.checks += 1
        self.flags.offer(self.checks, int(extremes[0]), int(extremes[1]))
        return self.checks

    def _settle(self) -> None:
        """Compare the offers of a pending check (waiting for every rank's); raise :class:`_Disagreement` if
        they differ."""
        if self.pending is None:
            return
        round_, disagreement = self.pending
        self._wait_until(lambda: self.flags.all_reached(CHECKED, round_))
        self.pending = None
        offers = self.flags.offers(round_)
        if len(set(offers)) > 1:
            raise _Disagreement(disagreement)
        for operation in self.flight:
            operation.verified = True

    def _resync(self, cancelled: _Operation | None) -> None:
        """After a failed check: drop the operation it began, finish the others, and let every rank continue
        from the same operation and chunk numbers (the largest any rank reached). Collective."""
        self.pending = None
        if cancelled is not None:
            with contextlib.suppress(ValueError):
                self.flight.remove(cancelled)
            self.regions, self.head = collections.deque(self._before[0]), self._before[1]
        self._wait_until(lambda: not self.flight)
        counts = np.array([self.seq, self.chunk_count], dtype=np.int64)
        self.comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.MAX)
        self.seq, self.chunk_count = int(counts[0]), int(counts[1])
        self.flags.publish(DONE, self.seq)

    # ------------------------------------------------------------------------------------------------- start

    def start(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None) -> SharedWork:
        """Start an allreduce of ``tensor`` (``op`` sum or avg) into ``out`` (or a new tensor), completed by the
        returned work's ``wait``. A check offered for it (:meth:`offer`) is compared once the input is copied in,
        before returning."""
        with self.lock:
            operation = self._open(tensor, op, out, synchronous=False)
            if operation.chunks:
                self.advance()
            self.flags.poke()
            return SharedWork(self, operation)

    def allreduce(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None) -> torch.Tensor:
        """Blocking allreduce of ``tensor`` (``op`` sum or avg) into ``out`` (or a new tensor): the result.

        The same plan and sums as :meth:`start`, in one straight pass with a single wait per step for all ranks
        (no per-chunk progress bookkeeping); every rank must call this one, or every rank :meth:`start`, for an
        operation (it is part of what the ranks describe to each other)."""
        with self.lock:
            if self.flight:  # earlier operations complete first, through the flags
                self._wait_until(lambda: not self.flight)
            operation = self._open(tensor, op, out, synchronous=True)
            if operation.chunks:
                self._run(operation)
            self.flags.poke()
            operation.complete = True
            result = operation.result()
            operation.release()
            return result

    def _open(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None, synchronous: bool) -> _Operation:
        """Begin an operation, put its input where the others read it and compare its argument check (on a
        disagreement, resynchronise the group and raise the check's error on every rank)."""
        operation = None
        try:
            operation = self._begin(tensor, op, out, synchronous)
            if operation.chunks:
                self._publish_input(operation, tensor, synchronous)
                if not synchronous:
                    _active.add(self)
            self._settle()
        except _Disagreement as failure:
            self._resync(operation)
            failure.report()
            raise AssertionError("a failed argument check did not raise") from None
        operation.verified = True
        return operation

    def _run(self, operation: _Operation) -> None:
        """Complete a blocking operation in one pass: wait for every input, sum this rank's share, wait for every
        rank's sums (or, for a write-back, for every rank to have read the inputs), write back or copy the others'
        sums, and wait for the others to finish where they still read this rank's tensor.

        When every rank reduces a tensor in a window in place, each owner writes its sums into every rank's tensor
        instead (only the owner of a chunk reads that chunk of any rank): then, once every rank's sums are
        written, each rank's tensor holds the result and nobody reads it any more, one wait fewer."""
        flags, base, chunks = self.flags, operation.base, operation.chunks
        if not flags.all_reached(ARRIVED, base + chunks):
            self._wait_until(lambda: flags.all_reached(ARRIVED, base + chunks))
        self._resolve(operation)
        stride = self.size if operation.owners else 1
        destination = operation.result_chunks if operation.owners else operation.target_chunks
        for chunk in range(operation.to_reduce, chunks, stride):
            if operation.write_back:
                self._sum_chunk(operation, chunk, (self._write_back_scratch(destination[chunk]),))
            else:
                self._sum_chunk(operation, chunk, self._places(operation, destination, chunk))
        if operation.push:
            self._meet(REDUCED, base + chunks)
            flags.publish(DONE, operation.seq)
            return
        if operation.owners or operation.write_back:
            self._meet(REDUCED, base + chunks)  # every rank's sums are written, every input read
        else:
            flags.store(REDUCED, base + chunks)
        if operation.write_back:  # one chunk: every rank sums at most EVERYONE_SUMS_BYTES
            destination[0].copy_(self._write_back_scratch(destination[0]))
        elif operation.owners:
            self._copy_sums(operation)
        if operation.await_done:
            self._meet(DONE, operation.seq)  # no peer reads this rank's tensor any more
        else:
            flags.publish(DONE, operation.seq)

    def _copy_sums(self, operation: _Operation) -> None:
        """Owners: copy every chunk's sum from its owner into this rank's result."""
        size, rank, results = self.size, self.rank, operation.results
        assert results is not None, "resolved: owners know every rank's result chunks"
        for chunk in range(operation.chunks):
            owner = chunk % size
            if owner != rank:
                operation.target_chunks[chunk].copy_(results[owner][chunk])
            elif not (operation.skip_own or operation.sums_to_target):
                operation.target_chunks[chunk].copy_(operation.result_chunks[chunk])

    def _meet(self, counter: int, value: int) -> None:
        """Publish this rank's ``counter`` at ``value`` and wait until every rank's has reached it (then what every
        rank wrote before publishing is visible here)."""
        flags = self.flags
        flags.publish(counter, value)
        if not flags.all_reached(counter, value):
            self._wait_until(lambda: flags.all_reached(counter, value))
        flags.acquire()

    def _begin(self, tensor: torch.Tensor, op: str, out: torch.Tensor | None, synchronous: bool) -> _Operation:
        """Number the operation, choose its plan, find (or reserve) where its input and result live, and describe
        it to the other ranks (with whether it is blocking: the ranks must agree, as a blocking operation waits
        once per step for every rank's whole message, a non-blocking one chunk by chunk)."""
        numel, dtype = tensor.numel(), tensor.dtype
        operation = _Operation(tensor, out, op == "avg", synchronous)
        if not numel:  # nothing to exchange: every rank knows (the shapes agree)
            operation.target = receive_buffer(out, tuple(tensor.shape), dtype, tensor.device)
            operation.complete = True
            return operation
        self.seq += 1
        seq = self.seq
        if seq > RING and not self._all_done(seq - RING):  # its descriptor slot's last user
            self._wait_until(lambda: self._all_done(seq - RING))
        nbytes = numel * dtype.itemsize
        owners, step = _plan(numel, dtype, self.size)
        operation.seq, operation.base, operation.numel, operation.step = seq, self.chunk_count, numel, step
        operation.chunks, operation.owners = -(-numel // step), owners
        operation.to_reduce = self.rank if owners else 0  # owned chunks: rank, rank + P, ...
        self.chunk_count += operation.chunks
        self._before = (tuple(self.regions), self.head)
        staging_offset, staging_busy_until = self._reserve(seq, nbytes)
        staging = self.staging
        assert staging is not None, "_reserve allocates the staging segment"
        staged_at = (staging.id, staging_offset)
        where = self._locate(tensor) if tensor.is_cpu else None
        in_window = where is not None and self._covered_by(where[0])
        in_place = out is tensor or (out is not None and same_memory(out, tensor))
        if where is not None and in_window:
            segment, offset = where
            source_at = (segment.id, offset)
            operation.source_chunks = segment.chunks(segment.rank, offset, numel, dtype, step)
        else:
            source_at = staged_at
            operation.source_chunks = staging.chunks(staging.rank, staging_offset, numel, dtype, step)
            operation.copy_in = True
        operation.own_chunks = operation.source_chunks
        result_at = (-1, 0)
        if owners and in_window and in_place:  # summed where it is
            result_at = source_at
            operation.result_chunks = operation.target_chunks = operation.source_chunks
            operation.skip_own = operation.await_done = True
        elif in_window and in_place and self.size > 1:  # each sum is written back once every rank read the chunk
            operation.target_chunks = operation.source_chunks
            operation.write_back = True
        else:
            if owners and in_window:  # an input in a segment must stay as it is: the sums go to staging
                result_at = staged_at
                operation.result_chunks = staging.chunks(staging.rank, staging_offset, numel, dtype, step)
            elif owners:
                result_at, operation.result_chunks = source_at, operation.source_chunks
            operation.target = receive_buffer(out, tuple(tensor.shape), dtype, tensor.device)
            operation.target_chunks = _split(operation.target.view(-1), step)
            operation.sums_to_target = owners and operation.target.is_cpu  # a device target gets copies instead
            # every rank sums from this rank's tensor: it must stay as it is until all are done
            operation.await_done = in_window and not owners and self.size > 1
        busy = staging_busy_until and not self._all_done(staging_busy_until)
        if busy and (operation.copy_in or result_at == staged_at):
            self._wait_until(lambda: self._all_done(staging_busy_until))
        code = DTYPE_CODES.index(dtype)
        manner = synchronous * _SYNCHRONOUS | operation.skip_own * _SUMMED_WHERE_IT_IS
        self.flags.describe(seq, (seq, numel, code, *source_at, *result_at, manner))
        return operation

    def _all_done(self, seq: int) -> bool:
        """Whether every rank has completed operation ``seq`` (``DONE``; remembered, and asked for the latest
        operation, so that most calls look at no flag)."""
        if seq - self._done_by_all <= 0:
            return True
        if self.flags.all_reached(DONE, self.seq - 1):
            self._done_by_all = self.seq - 1
        elif self.flags.all_reached(DONE, seq):
            self._done_by_all = seq
        return seq - self._done_by_all <= 0

    def _locate(self, tensor: torch.Tensor) -> tuple[Segment, int] | None:
        """:func:`~mpistrategy.comm.shm_window.locate`, remembered by address and size while the segment found
        is still allocated (operations repeat on the same buffers)."""
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        where = self._located.get(key)
        if key not in self._located or (where is not None and find(where[0].id) is not where[0]):
            if len(self._located) >= _REMEMBERED_PLACES:
                self._located.clear()
            where = self._located[key] = locate(tensor) if tensor.is_contiguous() else None
        return where

    def _publish_input(self, operation: _Operation, tensor: torch.Tensor, synchronous: bool) -> None:
        """Copy ``tensor`` into staging unless it is in shared memory already, announcing every chunk (a
        non-blocking operation, whose chunks are summed as they arrive) or all at once (a blocking one). When each
        chunk is summed by its owner, only the chunks other ranks sum are copied from a host tensor: this rank sums
        its own chunks from the tensor itself."""
        if not synchronous:
            self.flight.append(operation)
        if not operation.copy_in:
            self.flags.publish(ARRIVED, operation.base + operation.chunks)
            return
        flat = _split(tensor.detach().reshape(-1), operation.step)
        skip = -1
        if tensor.is_cpu:
            operation.own_chunks = flat
            skip = self.rank if operation.owners else -1
        size, base = self.size, operation.base
        for chunk, (staged, own) in enumerate(zip(operation.source_chunks, flat, strict=True)):
            if chunk % size == skip:
                continue
            staged.copy_(own)
            if not synchronous:
                self.flags.publish(ARRIVED, base + chunk + 1)
        if synchronous or skip == (operation.chunks - 1) % size:  # the last chunk was not announced
            self.flags.publish(ARRIVED, base + operation.chunks)

    def _covered_by(self, segment: Segment) -> bool:
        """Whether every rank of this group takes part in ``segment`` (then every rank can read its data)."""
        covered = self._covers.get(segment.id)
        if covered is None:
            covered = self._covers[segment.id] = all(segment.index_of(p) is not None for p in self.participants)
        return covered

    def _reserve(self, seq: int, nbytes: int) -> tuple[int, int]:
        """Staging space for operation ``seq`` and the last operation that used any of it (which every rank must
        have finished before this one writes there).

        Every operation reserves its size, whether or not this rank copies in, and the space is handed out as a
        ring: so every rank reserves the same offsets and decides alike, at the same operation, to grow the
        segment (a collective) when the space of one of the last :data:`_STAGING_DEPTH` operations would be
        reused. Older space is reused, after waiting for its operation if this one writes staging.
        """
        need = -(-nbytes // _STAGING_ALIGN) * _STAGING_ALIGN
        regions = self.regions
        while regions and regions[0][0] <= seq - RING:  # every rank is done with it (see _begin)
            regions.popleft()
        while True:
            capacity = self.staging.nbytes if self.staging is not None else 0
            start = self.head if self.head + need <= capacity else 0
            end = start + need
            busy_until, kept = 0, []
            for region in regions:
                if region[1] < end and start < region[2]:
                    busy_until = max(busy_until, region[0])
                else:
                    kept.append(region)
            if end <= capacity and (not busy_until or seq - busy_until >= _STAGING_DEPTH):
                break
            self._grow(max(need, 2 * capacity))
            regions = self.regions
        kept.append((seq, start, end))
        self.regions = collections.deque(kept)
        self.head = end
        return start, busy_until

    def _grow(self, capacity: int) -> None:
        """Replace the staging segment by one of ``capacity`` bytes (collective: every rank grows at the same
        operation, after completing what is in flight and waiting until the others have)."""
        self._settle()  # growing is collective: only once every rank is known to grow here
        self._wait_until(lambda: not self.flight)
        self._wait_until(lambda: self.flags.all_reached(DONE, self.seq - 1))
        if self.staging is not None:
            self.staging.free()
        self.staging = allocate(capacity, self.comm)
        self.regions.clear()
        self.head = 0
        self._covers.clear()

    # --------------------------------------------------------------------------------------------- progress

    def advance(self) -> bool:
        """Do every step that is ready (sums, copies out, completions) without waiting; whether any was."""
        reduced = self._reduce()
        gathered = self._gather()
        completed = self._complete()
        return reduced or gathered or completed

    def _reduce(self) -> bool:
        progressed = False
        flags, size = self.flags, self.size
        for operation in self.flight:
            if not operation.verified:
                return progressed
            base, stride = operation.base, size if operation.owners else 1
            destination = operation.result_chunks if operation.owners else operation.target_chunks
            while operation.to_reduce < operation.chunks:
                chunk = operation.to_reduce
                if operation.written == chunk:  # its sum waits in scratch until every rank has read the chunk
                    if not flags.all_reached(REDUCED, base + chunk + 1):
                        return progressed
                    destination[chunk].copy_(self._write_back_scratch(destination[chunk]))
                    operation.to_reduce = chunk + 1
                    progressed = True
                    continue
                if not flags.all_reached(ARRIVED, base + chunk + 1):
                    return progressed
                if operation.inputs is None:
                    self._resolve(operation)
                if operation.write_back:
                    self._sum_chunk(operation, chunk, (self._write_back_scratch(destination[chunk]),))
                    operation.written = chunk
                else:
                    self._sum_chunk(operation, chunk, self._places(operation, destination, chunk))
                    operation.to_reduce = chunk + stride
                flags.publish(REDUCED, base + chunk + 1)  # this rank has read every rank's chunk
                progressed = True
        return progressed

    def _places(
        self, operation: _Operation, destination: tuple[torch.Tensor, ...], chunk: int
    ) -> tuple[torch.Tensor, ...]:
        """Where this rank writes its sum of chunk ``chunk``: ``destination``'s chunk, then its target's when the
        operation writes sums there as they are summed, or every other rank's result when it pushes."""
        if operation.sums_to_target:
            return destination[chunk], operation.target_chunks[chunk]
        if operation.push:
            assert operation.results is not None, "a pushing operation is resolved"
            others = (results[chunk] for peer, results in enumerate(operation.results) if peer != self.rank)
            return destination[chunk], *others
        return (destination[chunk],)

    def _write_back_scratch(self, chunk: torch.Tensor) -> torch.Tensor:
        return self._scratch_of(chunk.dtype, 1, chunk.numel(), "write back")[0]

    def _gather(self) -> bool:
        progressed = False
        flags, size, rank = self.flags, self.size, self.rank
        for operation in self.flight:
            if not operation.owners and operation.to_reduce < operation.chunks:
                return progressed
            base = operation.base
            while operation.owners and operation.gathered < operation.chunks:
                chunk = operation.gathered
                owner = chunk % size
                if owner == rank:
                    if operation.to_reduce <= chunk:
                        return progressed
                    if not (operation.skip_own or operation.sums_to_target):
                        operation.target_chunks[chunk].copy_(operation.result_chunks[chunk])
                else:
                    if not reached(flags.value(owner, REDUCED), base + chunk + 1):
                        return progressed
                    flags.acquire()
                    if operation.results is None:
                        self._resolve(operation)
                    if not operation.push:  # else the owner wrote the sum here
                        assert operation.results is not None, "resolved just above"
                        operation.target_chunks[chunk].copy_(operation.results[owner][chunk])
                operation.gathered = chunk + 1
                progressed = True
            if not operation.announced:
                flags.publish(DONE, operation.seq)
                operation.announced = progressed = True
        return progressed

    def _complete(self) -> bool:
        progressed = False
        while self.flight and self.flight[0].announced:
            operation = self.flight[0]
            if operation.await_done and not self.flags.all_reached(DONE, operation.seq):
                break
            self.flight.popleft()
            operation.complete = progressed = True
        if not self.flight:
            _active.discard(self)
        return progressed

    def _resolve(self, operation: _Operation) -> None:
        """Every rank's input and result chunks of ``operation`` (from their descriptors)."""
        self.flags.acquire()
        inputs, results = [], []
        dtype, numel, step = operation.dtype, operation.numel, operation.step
        push = operation.skip_own
        for rank in range(self.size):
            if rank == self.rank:
                inputs.append(operation.own_chunks)
                results.append(operation.result_chunks)
                continue
            seq, count, code, input_id, input_offset, result_id, result_offset, manner = self.flags.descriptor(
                rank, operation.seq
            )
            synchronous = manner & _SYNCHRONOUS
            push = push and bool(manner & _SUMMED_WHERE_IT_IS)
            if (seq, count, code) != (operation.seq, numel, DTYPE_CODES.index(dtype)):
                raise CommunicationError(
                    f"shared-memory allreduce: rank {rank} of the node is at operation {seq} with {count} elements "
                    f"of {DTYPE_CODES[code] if 0 <= code < len(DTYPE_CODES) else code}, this rank at operation "
                    f"{operation.seq} with {numel} of {dtype}; every rank must call allreduce with the same shape "
                    "and dtype, in the same order."
                )
            if synchronous != operation.synchronous:  # seen alike by both ranks: both drop the operation
                self._abandon(operation)
                raise CommunicationError(
                    f"shared-memory allreduce: rank {rank} of the node called the {_KIND[synchronous]} allreduce "
                    f"where this rank called the {_KIND[operation.synchronous]} one (operation {seq}); every rank "
                    "must call allreduce, or every rank iallreduce, in the same order."
                )
            inputs.append(self._chunks(input_id, rank, input_offset, numel, dtype, step))
            if operation.owners:
                results.append(self._chunks(result_id, rank, result_offset, numel, dtype, step))
        operation.inputs = inputs
        operation.results = results if operation.owners else None
        operation.push = bool(push)
        operation.await_done = operation.await_done and not push  # pushed: nobody reads this rank's tensor later
        destination = operation.result_chunks if operation.owners else operation.target_chunks
        own = operation.own_chunks[0].data_ptr() == destination[0].data_ptr()
        operation.in_place = own and not operation.write_back

    def _abandon(self, operation: _Operation) -> None:
        """Drop ``operation`` before any rank has read another's data, as done (every rank drops it alike)."""
        if self.flight and self.flight[0] is operation:
            self.flight.popleft()
        if not self.flight:
            _active.discard(self)
        self.flags.publish(DONE, operation.seq)

    def _chunks(
        self, segment_id: int, rank: int, offset: int, numel: int, dtype: torch.dtype, step: int
    ) -> tuple[torch.Tensor, ...]:
        segment = find(segment_id)
        index = segment.index_of(self.participants[rank]) if segment is not None else None
        if segment is None or index is None:
            raise CommunicationError(
                f"shared-memory allreduce: rank {rank} of the node names shared segment {segment_id}, which this "
                "rank does not share."
            )
        return segment.chunks(index, offset, numel, dtype, step)

    def _sum_chunk(self, operation: _Operation, chunk: int, outputs: tuple[torch.Tensor, ...]) -> None:
        """Sum chunk ``chunk`` of every rank's input in rank order into every tensor of ``outputs`` (the first may
        be this rank's own input): compiled for float32 and float64 (:mod:`~mpistrategy.comm.rank_sum`), else
        with torch, float16 and bfloat16 in float32."""
        assert operation.inputs is not None, "summed only once resolved"
        parts = [chunks[chunk] for chunks in operation.inputs]
        scale = 1.0 / self.size if operation.average else 1.0
        if rank_sum.available(operation.dtype):
            rank_sum.sum_to(outputs, parts, scale)
            return
        out = outputs[0]
        if operation.dtype in _HALF:
            total = self._scratch_of(torch.float32, 2, out.numel())
            total[0].copy_(parts[0])
            for part in parts[1:]:
                total[1].copy_(part)
                total[0].add_(total[1])
            if operation.average:
                total[0].mul_(scale)
            out.copy_(total[0])
        elif len(parts) == 1:
            if not operation.in_place:
                out.copy_(parts[0])
        elif not operation.in_place or self.rank < 2 or len(parts) == 2:
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)
        else:  # out overwrites input 2 or later: sum into scratch until the last addition
            total = self._scratch_of(operation.dtype, 1, out.numel())[0]
            torch.add(parts[0], parts[1], out=total)
            for part in parts[2:-1]:
                total.add_(part)
            torch.add(total, parts[-1], out=out)
        if operation.average and operation.dtype not in _HALF and len(parts) > 1:
            out.mul_(scale)
        for other in outputs[1:]:
            other.copy_(out)

    def _scratch_of(self, dtype: torch.dtype, count: int, numel: int, use: str = "sum") -> torch.Tensor:
        """``count`` rows of ``numel`` elements of private scratch memory for ``use`` (kept, and so are the views
        of it handed out: chunks repeat)."""
        key = (use, dtype, count, numel)
        view = self._scratch_views.get(key)
        if view is not None:
            return view
        scratch = self._scratch.get((use, dtype))
        if scratch is None or scratch.shape[0] < count or scratch.shape[1] < numel:
            scratch = self._scratch[use, dtype] = torch.empty(
                count, max(numel, CHUNK_BYTES // dtype.itemsize), dtype=dtype
            )
            self._scratch_views = {k: v for k, v in self._scratch_views.items() if k[:2] != (use, dtype)}
        if len(self._scratch_views) >= _REMEMBERED_SCRATCH_VIEWS:
            self._scratch_views.clear()
        view = self._scratch_views[key] = scratch[:count, :numel]
        return view

    # ----------------------------------------------------------------------------------------------- waiting

    def test(self, operation: _Operation) -> bool:
        with self.lock:
            self.advance()
            return operation.complete

    def wait(self, operation: _Operation) -> None:
        with self.lock:
            self.flags.poke()
            self._wait_until(lambda: operation.complete)

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Advance until ``done()``, asleep while nothing is ready (see :meth:`Flags.wait_until`)."""
        self.flags.wait_until(done, self.advance, self._advance_others)

    def _advance_others(self) -> None:
        """Advance the other groups' operations in flight: they may be what a peer waits for."""
        for group in list(_active):
            if group is not self and group.lock.acquire(blocking=False):
                try:
                    group.advance()
                finally:
                    group.lock.release()

    # ------------------------------------------------------------------------------------------------ closing

    def close(self) -> None:
        """Collective: complete what is in flight and free the flags and the staging segment."""
        with self.lock:
            self._wait_until(lambda: not self.flight)
            self._wait_until(lambda: self.flags.all_reached(DONE, self.seq))
            if self.staging is not None:
                self.staging.free()
                self.staging = None
            self.flags.close()
            self._scratch.clear()
            self._scratch_views.clear()
        self.comm.Free()


def everyone_sums(nbytes: int, size: int) -> bool:
    """The plan of an allreduce of ``nbytes`` over ``size`` ranks (the same on every rank): every rank sums the
    whole message itself (one wait for the others' inputs, ``size`` inputs read per rank), or, above
    :data:`EVERYONE_SUMS_BYTES` of others' input per rank, each chunk is summed by its owner and copied by the
    others (two waits, one input's worth read)."""
    return nbytes * (size - 1) <= EVERYONE_SUMS_BYTES


@functools.lru_cache(maxsize=64)
def _plan(numel: int, dtype: torch.dtype, size: int) -> tuple[bool, int]:
    """The plan of an allreduce of ``numel`` elements of ``dtype`` over ``size`` ranks: whether each chunk has an
    owner (:func:`everyone_sums`), and the elements per chunk (remembered: operations repeat on the same sizes)."""
    owners = not everyone_sums(numel * dtype.itemsize, size)
    return owners, _chunk_elements(numel, dtype, size, owners)


def _split(flat: torch.Tensor, step: int) -> tuple[torch.Tensor, ...]:
    """``flat`` in chunks of ``step`` elements (no call into torch for a single chunk)."""
    return (flat,) if flat.numel() <= step else flat.split(step)


def _chunk_elements(numel: int, dtype: torch.dtype, size: int, owners: bool) -> int:
    """Elements per chunk, cache-line aligned: at most :data:`CHUNK_BYTES`; when each chunk has an owner, at least
    one chunk per rank if the message allows it."""
    align = _CHUNK_ALIGN // dtype.itemsize
    wanted = -(-numel // size) if owners else numel
    return max(min(CHUNK_BYTES // dtype.itemsize, -(-wanted // align) * align), align)
