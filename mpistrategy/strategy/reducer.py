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
- :meth:`~GradientReducer.wait` (Lightning's ``post_backward``, before clipping and the optimizer step) starts
  the buckets that did not complete, for parameters this rank did not use in this pass, with their current
  gradient (zero if none) so that no rank waits for a bucket another rank never sends, then finishes every
  bucket in order.

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

import torch
from torch import nn

from mpistrategy.aggregation.base import Aggregator, GradBucket, Work
from mpistrategy.comm.checks import validation
from mpistrategy.comm.topology import Topology
from mpistrategy.comm.traffic import TrafficCounter
from mpistrategy.sync.base import SyncContext, SyncMode
from mpistrategy.sync.flat import FlatSync

log = logging.getLogger(__name__)

_MB = 1024 * 1024


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
        self._patched: list[tuple[object, bool]] = []
        self._zero_plans: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor], list[nn.Parameter]]]
        self._zero_plans = {}
        self._build()

    # ----------------------------------------------------------------------------------------------- layout

    def _all_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.module.named_parameters())

    def _build(self) -> None:
        """(Re)build the buckets over the parameters that require gradients now, keeping current gradients."""
        self._remove_hooks()
        chosen = [(n, p) for n, p in self._named if p.requires_grad or id(p) in self._covered]
        self._covered = {id(p) for _, p in chosen}
        groups = assign_buckets(
            list(reversed(chosen)), self.bucket_cap_mb, self.first_bucket_cap_mb, self.own_bucket_mb
        )
        self.buckets = []
        for index, group in enumerate(groups):
            numels = [p.numel() for _, p in group]
            offsets = [sum(numels[:i]) for i in range(len(numels))]
            first = group[0][1]
            params = [p for _, p in group]
            own = len(group) == 1 and owns_bucket(first, self.own_bucket_mb)
            if own:  # no buffer of its own: it adopts the gradient autograd stores (a zero stand-in until then)
                buffer = torch.zeros((), dtype=first.dtype, device=first.device).expand(numels[0])
            else:
                buffer = torch.zeros(sum(numels), dtype=first.dtype, device=first.device)
            views = [buffer[o : o + n].view_as(p) for o, n, (_, p) in zip(offsets, numels, group, strict=True)]
            bucket = GradBucket(index, buffer, [n for n, _ in group], offsets, numels, params, views, own)
            for position, param in enumerate(params):
                if param.grad is not None:
                    self._place(bucket, position, param, param.grad)
            self.buckets.append(bucket)
            for position, param in enumerate(params):
                self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(index, position)))
        self._check_layout()
        self._flags = ()
        self._zero_plans = {}
        self.sync.setup_buckets(self.buckets)
        log.debug("GradientReducer: %s", self)

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

    def _hook(self, index: int, position: int):
        def hook(param: torch.Tensor) -> None:
            self._on_grad_ready(index, position, param)

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
        self._armed = self.aggregator is not None
        if self._armed:
            self._pending = list(self._active_count)
            self._works = [None] * len(self.buckets)
            self._next = 0
            self.started_in_backward = 0
            self.started_at_wait = 0

    def _on_grad_ready(self, index: int, position: int, param: torch.Tensor) -> None:
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
        with validation(False):  # the layout was agreed on once, when it was built
            while self._next < count and self._pending[self._next] <= 0:
                if self._active_count[self._next]:
                    self._works[self._next] = self.aggregator.start(self.buckets[self._next])
                    self.started_in_backward += 1
                self._next += 1

    def _progress(self) -> None:
        """Let MPI advance the buckets in flight (MPI progresses non-blocking collectives inside MPI calls)."""
        for index in range(self._next):
            work = self._works[index]
            if work is not None:
                work.test()
                return

    def wait(self) -> None:
        """Called after backward, before clipping and the optimizer step: finish every bucket, in order."""
        if not self._armed:
            return
        self._armed = False
        with validation(False):  # the layout was agreed on once, when it was built
            for index in range(self._next, len(self.buckets)):
                if not self._active_count[index]:
                    continue
                bucket = self.buckets[index]
                if self._pending[index] > 0:
                    self._adopt_gradients(index)
                self._works[index] = self.aggregator.start(bucket)
                self.started_at_wait += 1
            self._next = len(self.buckets)
            for index, work in enumerate(self._works):
                if work is not None:
                    self.aggregator.finish(self.buckets[index], work)
        self._works = [None] * len(self.buckets)

    def _adopt_gradients(self, index: int) -> None:
        """Point the ``.grad`` of a bucket's active parameters that got no gradient this pass at the bucket."""
        bucket = self.buckets[index]
        for position, (active, param) in enumerate(zip(self._active[index], bucket.params, strict=True)):
            grad = param.grad
            if not active or grad is bucket.views[position]:
                continue
            if grad is None and not bucket.own_gradient:
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

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *aliases: object) -> None:
        """Make ``optimizer.zero_grad()`` zero the bucketed gradients in place instead of setting them to ``None``.

        The ``.grad`` then stay views into the buckets from step to step, and backward accumulates into them in
        place: no copy into the buckets, and no fresh gradient allocation per step. Gradients of parameters
        outside the buckets keep the optimizer's own behaviour. ``aliases`` are wrappers that must behave the
        same (Lightning's ``LightningOptimizer`` resolves ``zero_grad`` on its class, not on the wrapped object).

        As with ``zero_grad(set_to_none=False)``, a bucketed parameter that gets no gradient in a step has a zero
        gradient rather than ``None`` (optimizers with momentum or weight decay still move it), as with DDP's
        ``gradient_as_bucket_view=True``.
        """
        original = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            self.zero_grad(optimizer, original, set_to_none)

        for target in (optimizer, *aliases):
            had_attribute = "zero_grad" in vars(target)
            target.zero_grad = zero_grad  # type: ignore[method-assign]
            self._patched.append((target, had_attribute))

    def zero_grad(self, optimizer: torch.optim.Optimizer, original, set_to_none: bool = True) -> None:
        """Zero ``optimizer``'s gradients in flat buckets in place (whole buffers where it owns a whole bucket);
        other gradients, own-gradient buckets included, are reset as the optimizer would (``None`` or zero)."""
        buffers, views, others = self._zero_plan(optimizer)
        for buffer in buffers:
            buffer.zero_()
        for view in views:
            view.zero_()
        for param in others:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_().zero_()

    def _zero_plan(self, optimizer: torch.optim.Optimizer):
        count = sum(len(group["params"]) for group in optimizer.param_groups)
        key = (id(optimizer), count)
        plan = self._zero_plans.get(key)
        if plan is None:
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            buffers, views, bucketed = [], [], set()
            for bucket in (b for b in self.buckets if not b.own_gradient):  # those follow the optimizer's rule
                mine = [id(p) in owned for p in bucket.params]
                bucketed |= {id(p) for p in bucket.params}
                if all(mine):
                    buffers.append(bucket.buffer)
                else:
                    views += [view for view, m in zip(bucket.views, mine, strict=True) if m]
            others = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in bucketed]
            plan = self._zero_plans[key] = (buffers, views, others)
        return plan

    # ------------------------------------------------------------------------------------------- lifetime

    def remove(self) -> None:
        """Remove the hooks and give the optimizers their own ``zero_grad`` back (the gradients stay where they
        are)."""
        self._remove_hooks()
        for target, had_attribute in reversed(self._patched):
            if not had_attribute and "zero_grad" in vars(target):
                del target.zero_grad
        self._patched = []
        self._armed = False

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.nbytes / _MB:.2f} MB" for b in self.buckets)
        return f"GradientReducer({len(self.buckets)} buckets: [{sizes}], sync={self.sync!r})"
