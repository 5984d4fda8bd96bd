"""The gradient reducer: the backward hooks and the pass that combines a module's gradients in buckets.

Per backward pass (between :meth:`GradientReducer.prepare` and :meth:`GradientReducer.wait`):

- The optimizers' ``zero_grad`` (:meth:`GradientReducer.attach_optimizer`,
  :mod:`~mpistrategy.strategy.reducer.zero_grad`) zero the flat buckets in place, so ``.grad`` stay views and
  autograd accumulates into them in place. Whenever ``.grad`` is not the bucket view all the same (the first step, a
  large gradient copied into shared memory, or ``zero_grad(set_to_none=True)`` called on the module), the
  ``register_post_accumulate_grad_hook`` copies it into the view once and re-points ``.grad``; an own-gradient
  bucket instead adopts the new ``.grad`` as its buffer.
- That hook also counts: when a bucket's last gradient lands, the bucket is handed to the
  :class:`~mpistrategy.aggregation.Aggregator` (non-blocking), in index order on every rank
  (:mod:`~mpistrategy.strategy.reducer.launch`).
- Which parameters got a gradient on *some* rank is exchanged once per synchronised pass
  (:mod:`~mpistrategy.strategy.reducer.usage`). A rank posts it when its last bucket starts (during backward, in the
  common case that it used every parameter; it then needs no answer, and completes the exchange at its next one) or
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
read as a zero view of the bucket.

Parameters whose ``requires_grad`` is False when backward starts are left alone (their ``.grad`` is not touched
and buckets made only of them are skipped); ``requires_grad`` must be the same on every rank, as it is when every
rank runs the same code. Parameters frozen when the reducer was built and unfrozen later are picked up: the
buckets are rebuilt at the next backward.

Limitations: sparse gradients are not supported; ``create_graph=True`` (double backward) loses the graph of
``.grad`` when it is re-pointed into the bucket.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.aggregation.base import Aggregator, GradBucket
from mpistrategy.aggregation.mean import MeanAggregator
from mpistrategy.comm.buffers import cuda_aware
from mpistrategy.comm.checks import validation
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.errors import by_rank
from mpistrategy.comm.shm import buffer_ranks, build_group, release
from mpistrategy.comm.shm_window import room_for
from mpistrategy.comm.topology import Topology
from mpistrategy.comm.traffic import TrafficCounter
from mpistrategy.strategy.reducer.hooks import GradientHooks
from mpistrategy.strategy.reducer.launch import InOrderStarts
from mpistrategy.strategy.reducer.layout import MB, BucketLayout, LayoutPolicy, ParameterSpec, plan_layout
from mpistrategy.strategy.reducer.memory import BucketMemory, place_gradient
from mpistrategy.strategy.reducer.peer_sums import PeerSums
from mpistrategy.strategy.reducer.staging import DeviceStaging
from mpistrategy.strategy.reducer.usage import GradientFlags, UsageExchange
from mpistrategy.strategy.reducer.zero_grad import ZeroGradHook
from mpistrategy.sync.base import SyncContext, SyncMode
from mpistrategy.sync.flat import FlatSync

log = logging.getLogger(__name__)


class BucketLayoutError(RuntimeError):
    """Ranks built different gradient buckets: the models differ between ranks."""


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
        self.topology = topology
        self.bucket_cap_mb = bucket_cap_mb
        self.first_bucket_cap_mb = bucket_cap_mb if first_bucket_cap_mb is None else first_bucket_cap_mb
        self.own_bucket_mb = own_bucket_mb
        named = list(module.named_parameters())
        self._names = [name for name, _ in named]
        self._params = [param for _, param in named]
        self._flags = GradientFlags(len(self._params))
        self._usage = UsageExchange(len(self._params))
        self._zero_grad = ZeroGradHook(self._flags)
        self._starts = InOrderStarts()
        self._memory: BucketMemory | None = None
        self._staging: DeviceStaging | None = None
        self._peers: PeerSums | None = None  # CUDA buckets averaged on the GPU the ranks share
        self._aggregator: Aggregator | None = None  # the current (or last) pass's
        self._bucket_slots: list[np.ndarray] = []  # per bucket: its parameters' slots, for numpy indexing
        self._hooks = GradientHooks()
        self._requires_grad: tuple[bool, ...] = ()  # by slot, when the last pass began
        self._active: list[int] = []  # per bucket: its parameters that require a gradient
        try:
            self._build()
        except BaseException as error:
            if self._memory is not None:  # every rank fails the build together (its checks are agreed on)
                traceback.clear_frames(error.__traceback__)  # their locals view the shared segment
                self.remove()
            raise

    @property
    def memory(self) -> BucketMemory:
        """The buckets' buffers and shared segment."""
        assert self._memory is not None, "built in __init__"
        return self._memory

    @property
    def layout(self) -> BucketLayout:
        """Which parameter's gradient lies in which bucket, and where."""
        return self.memory.layout

    @property
    def buckets(self) -> list[GradBucket]:
        """The buckets, in launch order."""
        return self.memory.buckets

    @property
    def aggregator(self) -> Aggregator | None:
        """The aggregator of the current (or last) pass; ``None`` for a pass without communication."""
        return self._aggregator

    @property
    def started_in_backward(self) -> int:
        """Buckets the last synchronised pass started during backward."""
        return self._starts.started_in_backward

    @property
    def started_at_wait(self) -> int:
        """Buckets the last synchronised pass started in :meth:`wait`."""
        return self._starts.started_at_wait

    @property
    def stages_through_host(self) -> bool:
        """Whether CUDA buckets are combined through pinned host mirrors (MPI cannot read device memory; see
        :mod:`~mpistrategy.strategy.reducer.staging`)."""
        return self._staging is not None and self._staging.mirrored

    @property
    def sums_on_device(self) -> bool:
        """Whether CUDA buckets are averaged on the GPU that every rank shares, through each other's device memory
        (see :mod:`~mpistrategy.strategy.reducer.peer_sums`)."""
        return self._peers is not None

    @property
    def traffic(self) -> TrafficCounter:
        """The payload bytes this rank's gradient combination sent, by scope (the sync mode's counter)."""
        return self.sync.ctx.traffic

    # ----------------------------------------------------------------------------------------------- layout

    def _policy(self, machine: MPI.Intracomm | None, on_device: bool) -> LayoutPolicy:
        """Buckets are summed in shared memory where the ranks they are summed over share this machine: the node,
        in the sync modes that sum inside it, or every rank, for the mean (compressors send other messages). There
        a large gradient goes into the window too, copied by its hook (the allreduce would otherwise copy it into
        staging memory, a second copy of it). With every rank here and the mean, it needs no bucket of its own
        either (fewer buckets, fewer waits for the other ranks); elsewhere the buckets stay as they are. Buckets
        averaged on the device (``on_device``) need no host mirror, and buffers that stay put (no own-gradient
        bucket: the peers map each buffer once)."""
        on_one_machine = machine is not None and machine.Get_size() == self.topology.size
        mean = isinstance(self.sync.ctx.aggregator, MeanAggregator)
        return LayoutPolicy(
            self.bucket_cap_mb,
            self.first_bucket_cap_mb,
            self.own_bucket_mb,
            shared=machine is not None,
            copy_large=machine is not None and (self.sync.sums_in_node or (on_one_machine and mean)),
            merge_large=(on_one_machine and mean) or on_device,
            stage_cuda=not cuda_aware() and not on_device,
        )

    def _build(self) -> None:
        """(Re)build the buckets over the parameters that require gradients now (and those bucketed before),
        keeping current gradients (collective)."""
        self._remove_hooks()
        self._close_peers()
        bucketed = self._memory.layout.bucketed_slots if self._memory is not None else frozenset()
        chosen = [p.requires_grad or slot in bucketed for slot, p in enumerate(self._params)]
        devices = {p.device for slot, p in enumerate(self._params) if chosen[slot]}
        flat = isinstance(self.sync, FlatSync)
        on_device = flat and PeerSums.applies(self.topology, self.sync.ctx.aggregator, devices)
        machine = buffer_ranks()
        specs = [(name, ParameterSpec.of(p)) for name, p in zip(self._names, self._params, strict=True)]
        layout = plan_layout(specs, chosen, self._policy(machine, on_device))
        if machine is not None and not room_for(layout.shared_bytes, machine, "gradient buckets"):
            machine = None
            layout = plan_layout(specs, chosen, self._policy(machine, on_device))
        retired, self._memory = self._memory, BucketMemory(layout, self._params, machine)
        self._staging = None if on_device else DeviceStaging(self.buckets, self.memory.mirrors)
        self._peers = PeerSums(self.topology, self.buckets) if on_device else None
        self._starts.begin(None, (), ())  # lets go of the last pass's buckets
        self._bucket_slots = [np.array(spec.slots, dtype=np.intp) for spec in self.layout.buckets]
        for spec, bucket in zip(self.layout.buckets, self.buckets, strict=True):
            for place in spec.places:
                hook = self._hook(bucket, place.position, place.slot)
                self._hooks.add(self._params[place.slot], hook)
        self._check_layout()
        host = [m if m is not None else b.buffer for b, m in zip(self.buckets, self.memory.mirrors, strict=True)]
        if host and not on_device:
            largest = max(host, key=lambda buffer: buffer.numel() * buffer.element_size())
            for comm in self._gradient_comms():
                build_group(comm, largest)
        self._requires_grad = ()
        self._zero_grad.use(self.memory)
        self.sync.setup_buckets(self.buckets)
        if retired is not None:
            retired.retire()
        log.debug("GradientReducer: %s", self)

    def _check_layout(self) -> None:
        local = self.layout.signature()
        everyone = self.topology.control.allgather(local)
        if any(layout != local for layout in everyone):
            listing = by_rank(f"{len(x)} buckets, sizes {[s for s, _, _ in x]}" for x in everyone)
            raise BucketLayoutError(
                "ranks built different gradient buckets, so their models differ (parameter shapes, dtypes or "
                f"which parameters require gradients): {listing}. Every rank must build the same model."
            )

    def _hook(self, bucket: GradBucket, position: int, slot: int) -> Callable[[torch.Tensor], None]:
        """The hook of one parameter: note its gradient, move it into the bucket if autograd stored it elsewhere,
        and count it towards the bucket's start (everything it needs is bound here, once per layout)."""
        local, landed, twice = self._flags.local, self._flags.landed, self._flags.twice
        views, index, starts = bucket.views, bucket.index, self._starts
        gradient_ready, post_usage = starts.gradient_ready, self._post_usage

        def hook(param: torch.Tensor) -> None:
            if not param.requires_grad:  # frozen after the forward pass (toggle_optimizer): autograd kept no gradient
                return
            if starts.armed:
                if landed[slot]:
                    twice.append(bucket.names[position])
                landed[slot] = 1
            local[slot] = 1
            grad = param.grad
            if grad is not views[position] and grad is not None:
                if grad.is_sparse:
                    raise RuntimeError(
                        f"parameter {bucket.names[position]!r} has a sparse gradient, which the mpi_ad strategy "
                        "does not support; use a dense gradient (for example nn.Embedding(sparse=False))."
                    )
                place_gradient(bucket, position, param, grad)
            if gradient_ready(index):
                post_usage()

        return hook

    def _remove_hooks(self) -> None:
        self._hooks.remove()

    # ------------------------------------------------------------------------------------------- backward

    def prepare(self, sync: bool) -> None:
        """Called before backward: arm the hooks to start buckets (``sync``) or only accumulate (no sync)."""
        self._hooks.put_last()
        requires_grad = tuple(p.requires_grad for p in self._params)
        if requires_grad != self._requires_grad:
            bucketed = self.layout.bucketed_slots
            if any(flag and slot not in bucketed for slot, flag in enumerate(requires_grad)):
                self._build()
            self._requires_grad = requires_grad
            self._active = [sum(requires_grad[slot] for slot in spec.slots) for spec in self.layout.buckets]
        aggregator = self._aggregator = self.sync.gradient_aggregator() if sync else None
        if aggregator is not None:
            self._flags.begin_synchronised_pass()
            self._usage.begin_pass(aggregator)
        if self._peers is not None:
            combined = self._peers.around(aggregator)
        else:
            assert self._staging is not None, "built with the buckets"
            combined = self._staging.around(aggregator)
        self._starts.begin(combined, self.buckets, self._active)

    def _post_usage(self) -> None:
        self._usage.post(self._flags.local_view)

    def wait(self) -> None:
        """Called after backward, before clipping and the optimizer step: finish every bucket, in order, and
        leave ``.grad`` of the parameters that no rank used as one process would (see the module docstring).

        After a pass without communication (a micro-batch inside gradient accumulation, or a local step of the
        sync mode) only this rank's own gradients count: a parameter it has none for gets ``None`` back."""
        if not self._starts.armed:
            self._flags.drop_stand_ins(self._params, self._flags.local_view)
            return
        self._starts.armed = False
        if not self.buckets:
            return
        with validation(False):  # the layout was agreed on once, when it was built
            used = self._used_somewhere()
            self._starts.start_left(lambda index: self._must_start(index, used))
            self._starts.finish()
        self._flags.drop_stand_ins(self._params, used)
        self._flags.clear()
        self._flags.raise_if_landed_twice()

    def _used_somewhere(self) -> np.ndarray:
        """Which parameters have a gradient on some rank. A rank that started every bucket during backward used
        every parameter, so every rank's answer is known: it needs no wait. A rank with buckets left posts the
        exchange now if it has not, and waits for it."""
        if not self._usage.posted:
            self._forget_cleared_gradients()
            self._post_usage()
        if self._starts.all_started:
            return self._usage.sent
        self._usage.finish()
        return self._usage.used

    def _must_start(self, index: int, used: np.ndarray) -> bool:
        """Whether bucket ``index``, not started during backward, is started: when all its gradients landed, or
        some rank has a gradient in it (then this rank's missing ones count as zero); no rank has one, every rank
        skips it."""
        if self._starts.complete(index):
            return True
        if not used[self._bucket_slots[index]].any():
            return False
        self._adopt_gradients(index)
        return True

    def _forget_cleared_gradients(self) -> None:
        """A parameter of a bucket left whose ``.grad`` was set to ``None`` (by the module's ``zero_grad``) after
        a gradient accumulated into it has no gradient to contribute."""
        for spec in self.layout.buckets:
            if self._starts.complete(spec.index):
                continue
            for slot in spec.slots:
                if self._params[slot].grad is None:
                    self._flags.local[slot] = 0

    def _adopt_gradients(self, index: int) -> None:
        """Point the ``.grad`` of a bucket's active parameters that got no gradient this pass at the bucket (zero
        where they had none: this rank's contribution to another rank's gradient)."""
        bucket = self.buckets[index]
        for position, slot in enumerate(self.layout.buckets[index].slots):
            param, grad = self._params[slot], self._params[slot].grad
            if not self._requires_grad[slot] or grad is bucket.views[position]:
                continue
            if grad is None:
                self._flags.stand_in[slot] = 1
                if not bucket.own_gradient:
                    param.grad = bucket.views[position].zero_()
                    continue
            place_gradient(bucket, position, param, torch.zeros_like(param) if grad is None else grad)

    # ------------------------------------------------------------------------------------------- zero_grad

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *aliases: Any) -> None:
        """Make ``optimizer.zero_grad()`` zero the flat buckets in place instead of setting the gradients to
        ``None`` (see :mod:`~mpistrategy.strategy.reducer.zero_grad`). ``aliases`` are wrappers that must behave
        the same (Lightning's ``LightningOptimizer`` resolves ``zero_grad`` on its class, not on the wrapped
        object).

        ``set_to_none`` is honoured all the same where it is observable: a parameter that no rank gives a gradient
        before the next :meth:`wait` ends it with ``.grad`` ``None`` (or zero with ``set_to_none=False``), as in
        one process.
        """
        self._zero_grad.attach(optimizer, *aliases)

    # ------------------------------------------------------------------------------------------- lifetime

    def remove(self) -> None:
        """Remove the hooks and give the optimizers their own ``zero_grad`` back; free the buckets' shared memory
        (gradients in it are copied out first) and the gradient communicators' shared-memory groups. Collective:
        every rank calls it (the strategy's teardown)."""
        self._remove_hooks()
        self._zero_grad.detach()
        self._starts.begin(None, (), ())
        self._usage.close()
        self._close_peers()
        self.memory.retire()
        for comm in self._gradient_comms():
            release(comm)

    def _close_peers(self) -> None:
        if self._peers is not None:
            self._peers.close()
            self._peers = None

    def _gradient_comms(self) -> list[Communicator]:
        """The communicators the aggregators combine gradients over."""
        t = self.topology
        comms = (t.gradients, t.node_gradients, t.leader_gradients, t.cross_gradients)
        return [comm for comm in comms if comm is not None]

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.nbytes / MB:.2f} MB" for b in self.buckets)
        return f"GradientReducer({len(self.buckets)} buckets: [{sizes}], sync={self.sync!r})"
