"""Gradient buckets and the backward hooks that start their combination while backward is still running.

Layout. The parameters that require gradients are taken in reverse registration order (roughly the order their
gradients become ready in backward) and packed into flat buckets, one dtype and device per bucket: the first
bucket closes once it reaches ``first_bucket_cap_mb`` (DDP makes it small, 1 MB, so that communication starts
early; here it defaults to the others' cap), the others at ``bucket_cap_mb`` (25 MB, DDP's default). Every
parameter's ``.grad`` is a view into its bucket, so the combined result lands directly in ``.grad``: nothing is
flattened before or copied back after communication.

A parameter of at least ``own_bucket_mb`` (1 MB) gets a bucket of its own whose buffer *is* its ``.grad``
(Horovod reduces tensors above its fusion threshold the same way): autograd's fresh gradient after
``zero_grad(set_to_none=True)`` is combined in place where autograd stored it, so these gradients are neither
zeroed nor accumulated into a flat buffer each step (four passes over their memory fewer). Fusing gains nothing
at that size: one message per megabyte costs microseconds of latency.

Shared memory (unless ``MPISTRATEGY_SHM=0``, see :mod:`mpistrategy.comm.shm`). The host buckets live in
one shared segment over the ranks of this machine, so that the node-local allreduce reads every rank's bucket
where backward wrote it and reduces it in place, with no copy. Where buckets are summed in shared memory (inside
the node, for the sync modes that sum there, :attr:`~mpistrategy.sync.base.SyncMode.sums_in_node`; over the world,
for the mean when every rank is on this machine), large gradients move into the segment too: their hook copies
autograd's fresh gradient into their bucket once (the copy the allreduce would otherwise make into its staging
area), and the optimizer's ``zero_grad`` treats them as any other gradient. With every rank on this machine and the
mean they also join the regular buckets (fewer buckets, fewer waits for the other ranks); otherwise the layout stays, as
compressors, which work per bucket, need. The segment is freed when the buckets are rebuilt and by
:meth:`GradientReducer.remove`, after the gradients in it are copied out.

Per backward pass (between :meth:`GradientReducer.prepare` and :meth:`GradientReducer.wait`):

- The optimizers' ``zero_grad`` (see :meth:`GradientReducer.attach_optimizer`) zero the flat buckets in place, so
  ``.grad`` stay views and autograd accumulates into them in place. Whenever ``.grad`` is not the bucket view all
  the same (the first step, or ``zero_grad(set_to_none=True)`` called on the module), the
  ``register_post_accumulate_grad_hook`` copies it into the view once and re-points ``.grad``; an own-gradient
  bucket instead adopts the new ``.grad`` as its buffer.
- That hook also counts: when a bucket's last gradient lands, the bucket is handed to the
  :class:`~mpistrategy.aggregation.Aggregator` (non-blocking). Buckets are started strictly in index order on
  every rank (a ready bucket waits for the ones before it), because MPI matches collectives on a communicator by
  order.
- Which parameters got a gradient on *some* rank is exchanged once per synchronised pass: a bitwise-or allreduce
  of one byte per parameter (1: a gradient accumulated into it on this rank since it was last combined or
  zeroed, in this pass or in the unsynchronised micro-batches before it), non-blocking, among the ranks the
  step's aggregator spans (``AggregationContext.span``: all ranks for flat and hierarchical averaging, the node for
  node-local averaging, so that nodes stay decoupled; through shared memory when they share it, else on a private
  duplicate of that communicator, see :mod:`mpistrategy.comm.shm_or`), so that every rank that combines
  a bucket skips the same buckets. A rank posts it when its last bucket starts (during backward, in the common
  case that it used every parameter; it then needs no answer, and completes the exchange at its next one) or
  else in :meth:`~GradientReducer.wait`.
- :meth:`~GradientReducer.wait` (Lightning's ``post_backward``, before clipping and the optimizer step) finishes
  the buckets. A rank with buckets left (parameters it did not use) waits for that exchange first; then it starts
  every bucket left in which some rank has a gradient, with a zero contribution for its own unused parameters
  (so the result is the average over all ranks, as DDP's ``find_unused_parameters=True`` gives), and skips the
  buckets in which no rank has one (every rank decides the same, from the same exchange). Then every bucket is
  finished in order.

A parameter for which no rank has a gradient ends the pass with ``.grad`` as one process would have it:
``None`` if it had none (after ``zero_grad(set_to_none=True)``, or never trained), else unchanged (zero after
``zero_grad(set_to_none=False)``, or the value combined by an earlier pass of the same step). Optimizers skip a
``None`` gradient, so weight decay and momentum do not move a parameter that no rank used, which then trains the
same at one rank and at N. Between ``zero_grad`` and the end of :meth:`~GradientReducer.wait` such a ``.grad`` can
read as a zero view of the bucket (a stand-in for ``None``, kept so that the flat buckets need no copy per step).

Parameters whose ``requires_grad`` is False when backward starts are left alone (their ``.grad`` is not touched
and buckets made only of them are skipped); ``requires_grad`` must be the same on every rank, as it is when every
rank runs the same code. Parameters frozen when the reducer was built and unfrozen later are picked up: the
buckets are rebuilt at the next backward.

Limitations: sparse gradients are not supported; ``create_graph=True`` (double backward) loses the graph of
``.grad`` when it is re-pointed into the bucket.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.aggregation.base import Aggregator, GradBucket, Work
from mpistrategy.aggregation.mean import MeanAggregator
from mpistrategy.comm.checks import validation
from mpistrategy.comm.shm import buffer_ranks, release
from mpistrategy.comm.shm_or import OrExchange, or_exchange
from mpistrategy.comm.shm_window import Segment, allocate, locate
from mpistrategy.comm.topology import Topology
from mpistrategy.comm.traffic import TrafficCounter
from mpistrategy.sync.base import SyncContext, SyncMode
from mpistrategy.sync.flat import FlatSync

log = logging.getLogger(__name__)

_MB = 1024 * 1024
_SHARED_ALIGN = 64  # bytes: buckets in shared memory start on cache lines


class BucketLayoutError(RuntimeError):
    """Ranks built different gradient buckets: the models differ between ranks."""


def owns_bucket(param: nn.Parameter, own_bucket_mb: float) -> bool:
    """Whether ``param``'s gradient is its own bucket: at least ``own_bucket_mb`` and contiguous (so that its
    ``.grad`` can serve as the flat buffer)."""
    return param.numel() * param.element_size() >= own_bucket_mb * _MB and param.is_contiguous()


def assign_buckets(
    params: Sequence[tuple[str, nn.Parameter]],
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    own_bucket_mb: float = math.inf,
) -> list[list[tuple[str, nn.Parameter]]]:
    """Group ``params`` (already in launch order) into buckets by dtype and device with the size caps.

    A contiguous parameter of at least ``own_bucket_mb`` gets a bucket of its own, placed where it comes in the
    launch order; the flat buckets around it stay open, so that small parameters still share one message.
    """
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    cap = first_bucket_cap_mb * _MB
    for name, param in params:
        if owns_bucket(param, own_bucket_mb):
            buckets.append([(name, param)])
            continue
        nbytes = param.numel() * param.element_size()
        key = (param.dtype, param.device)
        bucket = open_buckets.setdefault(key, [])
        bucket.append((name, param))
        sizes[key] = sizes.get(key, 0) + nbytes
        if sizes[key] >= cap:
            buckets.append(open_buckets.pop(key))
            sizes.pop(key)
            cap = bucket_cap_mb * _MB
    buckets.extend(open_buckets.values())
    return buckets


def _copy_out(param: nn.Parameter, segment: Segment) -> None:
    """Give ``param`` a private copy of its gradient if that lives in ``segment``."""
    grad = param.grad
    if grad is not None and (where := locate(grad)) is not None and where[0] is segment:
        param.grad = grad.clone()


#: what one optimizer's zero_grad does: flat buffers and views to zero, other parameters (reset as the optimizer
#: would), and the slots of its bucketed parameters
_ZeroPlan = tuple[list[torch.Tensor], list[torch.Tensor], list[nn.Parameter], np.ndarray]


class GradientReducer:
    """Flat gradient buckets over a module's parameters, combined by an aggregator during backward.

    Args:
        module: the model; its parameters that require gradients are bucketed.
        sync: the step-level :class:`~mpistrategy.sync.SyncMode` (already set up) that picks each step's
            aggregator, or an :class:`~mpistrategy.aggregation.Aggregator` to combine every step's buckets over
            all ranks (the flat mode).
        topology: this process's ranks and communicators.
        bucket_cap_mb: size at which a bucket is closed.
        first_bucket_cap_mb: size at which the first bucket is closed (default: ``bucket_cap_mb``).
        own_bucket_mb: a gradient of at least this many MB is its own bucket.
        traffic: where an aggregator given as ``sync`` counts the bytes it sends (a new counter by default).

    Building it is collective: ranks check once that they built the same layout.
    """

    def __init__(
        self,
        module: nn.Module,
        sync: SyncMode | Aggregator,
        topology: Topology,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float | None = None,
        own_bucket_mb: float = 1.0,
        traffic: TrafficCounter | None = None,
    ) -> None:
        self.module = module
        if isinstance(sync, Aggregator):
            flat = FlatSync()
            flat.setup(SyncContext(module, topology, sync, traffic if traffic is not None else TrafficCounter()))
            sync = flat
        self.sync = sync
        self.aggregator: Aggregator | None = None
        self.topology = topology
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = bucket_cap_mb if first_bucket_cap_mb is None else first_bucket_cap_mb
        self.own_bucket_mb = own_bucket_mb
        self.buckets: list[GradBucket] = []
        self._named = self._all_parameters()
        self._covered: set[int] = set()
        # Per parameter of self._named, by position (a "slot"): bytes the hooks set, with numpy views of them.
        count = len(self._named)
        self._slot_of = {id(p): slot for slot, (_, p) in enumerate(self._named)}
        self._slots: list[np.ndarray] = []  # per bucket: the slots of its parameters, in bucket order
        self._local_bytes = bytearray(count)  # 1: a gradient accumulated here since the last combine or zero_grad
        self._local = np.frombuffer(self._local_bytes, dtype=np.uint8)
        self._stand_in = np.zeros(count, dtype=np.uint8)  # 1: no gradient, though .grad may be a zero bucket view
        self._sent = np.zeros(count, dtype=np.uint8)  # the snapshot of _local in flight
        self._used = np.zeros(count, dtype=np.uint8)  # 1: some rank has a gradient (the exchange's result)
        # private duplicates, per communicator an aggregator spans, for the exchange of which parameters are used
        self._usage_exchanges: dict[int, OrExchange] = {}
        self._usage_exchange: OrExchange | None = None
        self._usage: OrExchange | None = None  # the exchange in flight (possibly an earlier pass's)
        self._posted = False  # whether this pass's exchange was posted
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._flags: tuple[bool, ...] = ()
        self._active: list[list[bool]] = []
        self._active_count: list[int] = []
        self._pending: list[int] = []
        self._works: list[Work | None] = []
        self._next = 0
        self._armed = False
        self.started_in_backward = 0
        self.started_at_wait = 0
        self._patched: list[tuple[Any, bool]] = []
        self._zero_plans: dict[tuple[int, int], _ZeroPlan] = {}
        self._segment: Segment | None = None  # the shared memory of the host buckets
        self._copied: set[int] = set()  # ids of large parameters whose gradient their hook copies into a bucket
        self._build()

    # ----------------------------------------------------------------------------------------------- layout

    def _all_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def _build(self) -> None:
        """(Re)build the buckets over the parameters that require gradients now, keeping current gradients."""
        self._remove_hooks()
        chosen = [(n, p) for n, p in self._named if p.requires_grad or id(p) in self._covered]
        self._covered = {id(p) for _, p in chosen}
        retired, old_segment = self.buckets, self._segment
        machine = buffer_ranks()
        on_one_machine = machine is not None and machine.Get_size() == self.topology.size
        mean = isinstance(self.sync.ctx.aggregator, MeanAggregator)
        # Buckets are summed in shared memory where the ranks they are summed over share this machine: the node,
        # in the sync modes that sum inside it, or every rank, for the mean (compressors send other messages).
        # There a large gradient goes into the window too, copied by its hook (the allreduce would otherwise copy
        # it into staging memory, a second copy of it). With every rank here and the mean, it needs no bucket of
        # its own either (fewer buckets, fewer waits for the other ranks); elsewhere the buckets stay as they are.
        reduced_here = machine is not None and (self.sync.sums_in_node or (on_one_machine and mean))
        merge_large = on_one_machine and mean
        own_bucket_mb = math.inf if merge_large else self.own_bucket_mb
        groups = assign_buckets(list(reversed(chosen)), self.bucket_cap_mb, self.first_bucket_cap_mb, own_bucket_mb)
        self._copied = {
            id(p) for _, p in chosen if reduced_here and p.device.type == "cpu" and owns_bucket(p, self.own_bucket_mb)
        }
        groups = [sorted(group, key=lambda item: id(item[1]) in self._copied) for group in groups]  # copied last
        self._segment, places = self._shared_layout(groups, machine)
        self.buckets = []
        self._slots = []
        for index, group in enumerate(groups):
            numels = [p.numel() for _, p in group]
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            first = group[0][1]
            params = [p for _, p in group]
            own = len(group) == 1 and owns_bucket(first, own_bucket_mb) and id(first) not in self._copied
            place = places[index]
            if place is not None:
                assert self._segment is not None, "a shared place lies in the shared segment"
                buffer = self._segment.typed(self._segment.rank, place, sum(numels), first.dtype).zero_()
            elif own:  # no buffer of its own: it adopts the gradient autograd stores (a zero stand-in until then)
                buffer = torch.zeros((), dtype=first.dtype, device=first.device).expand(numels[0])
            else:
                buffer = torch.zeros(sum(numels), dtype=first.dtype, device=first.device)
            views = [buffer[o : o + n].view_as(p) for o, n, (_, p) in zip(offsets, numels, group, strict=True)]
            bucket = GradBucket(index, buffer, [n for n, _ in group], offsets, numels, params, views, own)
            for position, param in enumerate(params):
                if param.grad is not None:
                    self._place(bucket, position, param, param.grad)
            self.buckets.append(bucket)
            slots = [self._slot_of[id(p)] for p in params]
            self._slots.append(np.array(slots, dtype=np.intp))
            for position, (param, slot) in enumerate(zip(params, slots, strict=True)):
                self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(index, position, slot)))
        self._check_layout()
        self._flags = ()
        self._zero_plans = {}
        self.sync.setup_buckets(self.buckets)
        self._retire(retired, old_segment)
        log.debug("GradientReducer: %s", self)

    def _shared_layout(
        self, groups: list[list[tuple[str, nn.Parameter]]], machine: MPI.Intracomm | None
    ) -> tuple[Segment | None, list[int | None]]:
        """A shared-memory segment over ``machine`` (collective; ``None``: shared memory is off) for the host
        buckets, and each bucket's byte offset in it (``None``: a private buffer, or an own-gradient bucket that
        adopts autograd's tensor)."""
        places: list[int | None] = [None] * len(groups)
        if machine is None:
            return None, places
        total = 0
        for index, group in enumerate(groups):
            first = group[0][1]
            if first.device.type != "cpu" or (
                len(group) == 1 and id(first) not in self._copied and owns_bucket(first, self.own_bucket_mb)
            ):
                continue
            total = -(-total // _SHARED_ALIGN) * _SHARED_ALIGN
            places[index] = total
            total += sum(p.numel() for _, p in group) * first.element_size()
        return allocate(total, machine), places

    def _retire(self, buckets: list[GradBucket], segment: Segment | None) -> None:
        """Let go of ``buckets`` (no longer the reducer's) and free ``segment``, their shared memory, when nothing
        refers to it any more (collective over the machine's ranks). Gradients still in it are copied out first,
        so that ``.grad`` stays readable."""
        if segment is None:
            return
        for bucket in buckets:
            for param in bucket.params:
                _copy_out(param, segment)
            bucket.buffer, bucket.views = bucket.buffer.new_empty(0), []
        if not segment.free():
            log.debug("GradientReducer: tensors still refer to %s; it stays allocated", segment)

    def _check_layout(self) -> None:
        local = [(sum(b.numels), str(b.buffer.dtype), len(b.names)) for b in self.buckets]
        everyone = self.topology.control.allgather(local)
        if any(layout != local for layout in everyone):
            listing = "; ".join(
                f"rank {r}: {len(x)} buckets, sizes {[s for s, _, _ in x]}" for r, x in enumerate(everyone)
            )
            raise BucketLayoutError(
                "ranks built different gradient buckets, so their models differ (parameter shapes, dtypes or "
                f"which parameters require gradients): {listing}. Every rank must build the same model."
            )

    def _hook(self, index: int, position: int, slot: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index, position, slot, param)

        return hook

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ------------------------------------------------------------------------------------------- backward

    def prepare(self, sync: bool) -> None:
        """Called before backward: arm the hooks to start buckets (``sync``) or only accumulate (no sync)."""
        flags = tuple(p.requires_grad for _, p in self._named)
        if flags != self._flags:
            if any(p.requires_grad and id(p) not in self._covered for _, p in self._named):
                self._build()
            self._flags = flags
            self._active = [[p.requires_grad for p in b.params] for b in self.buckets]
            self._active_count = [sum(a) for a in self._active]
        self.aggregator = self.sync.gradient_aggregator() if sync else None
        if self.aggregator is not None:
            self._usage_exchange = self._usage_exchange_for(self.aggregator)
        self._armed = self.aggregator is not None
        if self._armed:
            self._posted = False
            self._pending = list(self._active_count)
            self._works = [None] * len(self.buckets)
            self._next = 0
            self.started_in_backward = 0
            self.started_at_wait = 0

    def _on_grad_ready(self, index: int, position: int, slot: int, param: torch.Tensor) -> None:
        self._local_bytes[slot] = 1
        bucket = self.buckets[index]
        grad = param.grad
        if grad is not bucket.views[position] and grad is not None:
            if grad.is_sparse:
                raise RuntimeError(
                    f"parameter {bucket.names[position]!r} has a sparse gradient, which the mpi_ad strategy does "
                    "not support; use a dense gradient (for example nn.Embedding(sparse=False))."
                )
            self._place(bucket, position, param, grad)
        if not self._armed or self._pending[index] <= 0:
            return
        self._pending[index] -= 1
        if self._pending[index] == 0:
            self._start_ready()
        else:
            self._progress()

    def _start_ready(self) -> None:
        """Start, in order, every bucket from the next one on that is ready (or has nothing to send)."""
        count = len(self.buckets)
        aggregator = self.aggregator
        assert aggregator is not None, "buckets start only after setup"
        with validation(False):  # the layout was agreed on once, when it was built
            while self._next < count and self._pending[self._next] <= 0:
                if self._active_count[self._next]:
                    self._works[self._next] = aggregator.start(self.buckets[self._next])
                    self.started_in_backward += 1
                self._next += 1
        if self._next == count:
            self._exchange_usage()

    def _usage_exchange_for(self, aggregator: Aggregator) -> OrExchange:
        """The exchange through which the ranks ``aggregator`` combines tell each other which parameters they
        used (shared memory on one node, else a private communicator): created on first use (collective over
        those ranks, which all reach this step together)."""
        assert aggregator.context is not None and aggregator.context.span is not None
        span = aggregator.context.span.comm
        key = span.py2f()
        found = self._usage_exchanges.get(key)
        if found is None:
            self._finish_usage()
            found = self._usage_exchanges[key] = or_exchange(span, len(self._named))
        return found

    def _exchange_usage(self) -> None:
        """Post the bitwise-or allreduce of which parameters have a gradient on this rank (into ``_used``)."""
        self._finish_usage()
        np.copyto(self._sent, self._local)
        assert self._usage_exchange is not None, "set up with the buckets"
        self._usage_exchange.post(self._sent, self._used)
        self._usage = self._usage_exchange
        self._posted = True

    def _finish_usage(self) -> None:
        if self._usage is not None:
            self._usage.wait()
            self._usage = None

    def _progress(self) -> None:
        """Let MPI advance the buckets in flight (MPI progresses non-blocking collectives inside MPI calls)."""
        for index in range(self._next):
            work = self._works[index]
            if work is not None:
                work.test()
                return

    @property
    def traffic(self) -> TrafficCounter:
        """The payload bytes this rank's gradient combination sent, by scope (the sync mode's counter)."""
        return self.sync.ctx.traffic

    def wait(self) -> None:
        """Called after backward, before clipping and the optimizer step: finish every bucket, in order, and
        leave ``.grad`` of the parameters that no rank used as one process would (see the module docstring).

        After a pass without communication (a micro-batch inside gradient accumulation, or a local step of the
        sync mode) only this rank's own gradients count: a parameter it has none for gets ``None`` back."""
        count = len(self.buckets)
        if not self._armed:
            self._drop_missing_gradients(self._local)
            return
        self._armed = False
        if not count:
            return
        aggregator = self.aggregator
        assert aggregator is not None, "buckets exist only after setup"
        with validation(False):  # the layout was agreed on once, when it was built
            used = self._sent  # on a rank that used every parameter, every rank's answer is known: no need to wait
            if not self._posted:  # buckets are left: this rank did not use some parameters
                self._forget_cleared_gradients()
                self._exchange_usage()
            if self._next < count:
                self._finish_usage()
                used = self._used
                for index in range(self._next, count):
                    if not self._active_count[index]:
                        continue
                    if self._pending[index] > 0:
                        if not used[self._slots[index]].any():
                            continue  # no rank has a gradient for it: every rank skips it
                        self._adopt_gradients(index)
                    self._works[index] = aggregator.start(self.buckets[index])
                    self.started_at_wait += 1
                self._next = count
            for index, work in enumerate(self._works):
                if work is not None:
                    aggregator.finish(self.buckets[index], work)
        self._works = [None] * count
        self._drop_missing_gradients(used)
        self._local.fill(0)  # every gradient is combined now, or absent
        self._stand_in.fill(0)

    def _forget_cleared_gradients(self) -> None:
        """A parameter of a bucket left whose ``.grad`` was set to ``None`` (by the module's ``zero_grad``) after
        a gradient accumulated into it has no gradient to contribute."""
        for index in range(self._next, len(self.buckets)):
            if self._pending[index] > 0:
                for slot, param in zip(self._slots[index], self.buckets[index].params, strict=True):
                    if param.grad is None:
                        self._local_bytes[slot] = 0

    def _drop_missing_gradients(self, used: np.ndarray) -> None:
        """Set ``.grad`` back to ``None`` where it is a zero stand-in for no gradient and ``used`` says that no
        rank has one."""
        for slot in np.flatnonzero(self._stand_in > used):
            self._named[slot][1].grad = None

    def _adopt_gradients(self, index: int) -> None:
        """Point the ``.grad`` of a bucket's active parameters that got no gradient this pass at the bucket (zero
        where they had none: this rank's contribution to another rank's gradient)."""
        bucket = self.buckets[index]
        for position, (active, param) in enumerate(zip(self._active[index], bucket.params, strict=True)):
            grad = param.grad
            if not active or grad is bucket.views[position]:
                continue
            if grad is None:
                self._stand_in[self._slots[index][position]] = 1
                if not bucket.own_gradient:
                    param.grad = bucket.views[position].zero_()
                    continue
            self._place(bucket, position, param, torch.zeros_like(param) if grad is None else grad)

    @staticmethod
    def _place(bucket: GradBucket, position: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Make ``grad`` (a gradient autograd stored outside the bucket) the bucket's: in a flat bucket it is
        copied into its view; an own-gradient bucket adopts the tensor itself (contiguous), with no copy."""
        if bucket.own_gradient:
            grad = grad.contiguous()
            bucket.buffer, bucket.views[0] = grad.view(-1), grad
        else:
            bucket.views[position].copy_(grad)
            grad = bucket.views[position]
        param.grad = grad

    # ------------------------------------------------------------------------------------------- zero_grad

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *aliases: Any) -> None:
        """Make ``optimizer.zero_grad()`` zero the flat buckets in place instead of setting the gradients to
        ``None``.

        The ``.grad`` then stay views into the buckets from step to step, and backward accumulates into them in
        place: no copy into the buckets, and no fresh gradient allocation per step. Gradients of parameters
        outside the flat buckets keep the optimizer's own behaviour. ``aliases`` are wrappers that must behave the
        same (Lightning's ``LightningOptimizer`` resolves ``zero_grad`` on its class, not on the wrapped object).

        ``set_to_none`` is honoured all the same where it is observable: a parameter that no rank gives a gradient
        before the next :meth:`wait` ends it with ``.grad`` ``None`` (or zero with ``set_to_none=False``), as in
        one process.
        """
        original = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            self.zero_grad(optimizer, original, set_to_none)

        for target in (optimizer, *aliases):
            had_attribute = "zero_grad" in vars(target)
            target.zero_grad = zero_grad
            self._patched.append((target, had_attribute))

    def zero_grad(self, optimizer: torch.optim.Optimizer, original, set_to_none: bool = True) -> None:
        """Zero ``optimizer``'s gradients in flat buckets in place (whole buffers where it owns a whole bucket);
        other gradients, own-gradient buckets included, are reset as the optimizer would (``None`` or zero).
        With ``set_to_none`` the zeroed flat gradients count as absent (see :meth:`wait`)."""
        buffers, views, others, slots = self._zero_plan(optimizer)
        if set_to_none:
            self._stand_in[slots] = 1
        else:  # a gradient that was absent stays absent, as torch's zero_grad leaves None alone
            self._stand_in[slots] &= self._local[slots] ^ 1
        self._local[slots] = 0
        for buffer in buffers:
            buffer.zero_()
        for view in views:
            view.zero_()
        for param in others:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:  # as torch's zero_grad does (a view, such as a bucket's, cannot be detached in place)
                    grad = param.grad
                    if grad.grad_fn is not None:
                        grad.detach_()
                    else:
                        grad.requires_grad_(False)
                    grad.zero_()

    def _zero_plan(self, optimizer: torch.optim.Optimizer) -> _ZeroPlan:
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        key = (id(optimizer), count)
        plan = self._zero_plans.get(key)
        if plan is None:
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            buffers, views, bucketed = [], [], set()
            # own-gradient buckets and large gradients copied into their bucket follow the optimizer's rule
            for bucket in (b for b in self.buckets if not b.own_gradient):
                accumulated = [p for p in bucket.params if id(p) not in self._copied]  # laid out first
                mine = [id(p) in owned for p in accumulated]
                bucketed |= {id(p) for p in accumulated}
                if all(mine):
                    if accumulated:
                        buffers.append(bucket.buffer[: sum(bucket.numels[: len(accumulated)])])
                else:
                    views += [view for view, m in zip(bucket.views, mine, strict=False) if m]
            others = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in bucketed]
            slots = [self._slot_of[id(p)] for b in self.buckets for p in b.params if id(p) in owned]
            plan = self._zero_plans[key] = (buffers, views, others, np.array(slots, dtype=np.intp))
        return plan

    # ------------------------------------------------------------------------------------------- lifetime

    def remove(self) -> None:
        """Remove the hooks and give the optimizers their own ``zero_grad`` back; free the buckets' shared memory
        (gradients in it are copied out first) and the gradient communicators' shared-memory groups. Collective:
        every rank calls it (the strategy's teardown)."""
        self._remove_hooks()
        for target, had_attribute in reversed(self._patched):
            if not had_attribute and "zero_grad" in vars(target):
                del target.zero_grad
        self._patched = []
        self._armed = False
        self._finish_usage()
        for exchange in self._usage_exchanges.values():
            exchange.close()
        self._usage_exchanges = {}
        self._usage_exchange = None
        self._zero_plans = {}
        self._retire(self.buckets, self._segment)
        self._segment = None
        release(self.topology.gradients)
        release(self.topology.node_gradients)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.nbytes / _MB:.2f} MB" for b in self.buckets)
        return f"GradientReducer({len(self.buckets)} buckets: [{sizes}], sync={self.sync!r})"
