"""Allreduce through shared memory for ranks on one node: sum and avg of float32, float64, float16 and bfloat16.

Each rank's input is put where the others can read it: a tensor that lives in a shared segment
(:mod:`mpistrategy.comm.shm_window`, such as the strategy's gradient buckets) is read where it is; any other tensor
is copied once into the rank's *staging* segment (:mod:`~mpistrategy.comm.shm.staging`). The message is cut into
chunks, and a plan chosen from the message size and the number of ranks alone (:mod:`~mpistrategy.comm.shm.plan`)
says who sums which chunk: each chunk's owner, which the others copy the sum from, or every rank itself for small
messages. When every rank reduces a tensor in a window in place, each owner writes its sums into every rank's
tensor in the same pass: every input is read once and written once, and no rank waits for the others to finish
reading it.

Every sum is taken in rank order, ``((x_0 + x_1) + x_2) + ...`` (float16 and bfloat16 in float32, rounded once),
then multiplied by 1/P for avg: the result is bitwise identical on every rank and in every run
(:mod:`~mpistrategy.comm.shm.sums`; float32 and float64 by the compiled kernel of :mod:`~mpistrategy.comm.rank_sum`).
The ranks step through each operation on shared counters (:mod:`~mpistrategy.comm.shm.protocol`): a non-blocking
operation chunk by chunk, as a pipeline, a blocking one in one straight pass with one wait for all ranks per
stage. With ranks that share a machine, MPI's own allreduce copies every element through its queues several times.

Waiting (for a peer's chunk, its check or its ``DONE``) spins for a few microseconds (yielding the core between
looks where ranks outnumber cores), then sleeps in the kernel on a futex (see
:meth:`~mpistrategy.comm.shm_flags.Flags.wait_until`), driving MPI's progress and the operations of the other groups
between sleeps; a peer whose process has ended makes the wait raise
:class:`~mpistrategy.comm.errors.CommunicationError` within a second instead of waiting forever. The argument check
of an allreduce goes through the same flags once a group exists (:func:`check_exchange`), and is compared only
after the input is copied in.

Where it is used (:func:`group_for`): on a communicator whose ranks all share memory, for sum and avg of those
dtypes, from :func:`min_bytes` bytes on (measured per rank count, lower for a tensor already in shared memory;
smaller messages stay with MPI, whose latency is lower), unless ``MPISTRATEGY_SHM=0``; ``MPISTRATEGY_SHM=1`` (or
:func:`set_shared_memory`) uses it for every size, also on one rank (:mod:`~mpistrategy.comm.shm.settings`).
Memory: each group (:class:`SharedMemoryGroup`, a communicator's forward or backward channel) keeps a control
segment of 12 KiB per rank and, once used for a message, a staging segment of twice the largest message (grown by
doubling; address space only until a message that is not already in shared memory is copied in); every rank keeps
up to three chunks of scratch. :func:`release` frees a communicator's groups.
"""

from mpistrategy.comm.shm.group import SharedMemoryGroup, SharedWork
from mpistrategy.comm.shm.plan import CHUNK_BYTES, EVERYONE_SUMS_BYTES, Plan, Results, Source, Summing, plan_allreduce
from mpistrategy.comm.shm.registry import buffer_ranks, build_group, built_group, check_exchange, group_for, release
from mpistrategy.comm.shm.settings import (
    DEFAULT_MIN_BYTES,
    MIN_BYTES_VARIABLE,
    MODE_VARIABLE,
    MODES,
    SUPPORTED_DTYPES,
    min_bytes,
    set_shared_memory,
    shared_memory,
    shared_memory_mode,
    uses_shared_memory,
)

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_MIN_BYTES",
    "EVERYONE_SUMS_BYTES",
    "MIN_BYTES_VARIABLE",
    "MODES",
    "MODE_VARIABLE",
    "SUPPORTED_DTYPES",
    "Plan",
    "Results",
    "SharedMemoryGroup",
    "SharedWork",
    "Source",
    "Summing",
    "buffer_ranks",
    "build_group",
    "built_group",
    "check_exchange",
    "group_for",
    "min_bytes",
    "plan_allreduce",
    "release",
    "set_shared_memory",
    "shared_memory",
    "shared_memory_mode",
    "uses_shared_memory",
]
