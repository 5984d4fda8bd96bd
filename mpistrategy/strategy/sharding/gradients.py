"""ZeRO stage 2: gradient buckets reduce-scattered during backward, each rank keeping its shard's gradients.

The parameters of every space (see :mod:`~mpistrategy.strategy.sharding.layout`) are cut into buckets of
consecutive parameters, so that a bucket is a contiguous range of the flat order and the block of it that shard
``r`` owns is contiguous. A bucket's buffer exists only while it is needed: it is allocated (zeroed) when backward
reaches the bucket, the bucket's parameters' ``.grad`` become views of it (autograd accumulates into them in place),
and once its last gradient landed it is reduce-scattered in place (non-blocking, in bucket order on every rank), its
``.grad`` are dropped and the next bucket is opened; before that, the previous bucket's reduce-scatter is completed
and its block added to this rank's gradient shard, ``g_shard += (1/P) sum_r g_r[block]``, and its buffer freed. So
at most two buckets exist at a time, the one in flight and the one backward fills: buckets are cut at half of
``bucket_cap_mb``, and a rank holds its gradient shard (``1/N`` of the gradients) plus at most one ``bucket_cap_mb``
(a parameter larger than half of it is a bucket of its own). Under hierarchical sync the reduce-scatter runs inside
the node and the ranks holding the same shard on every node then sum its block across nodes (an allreduce).

Every backward pass is reduce-scattered, also inside gradient accumulation (``block_backward_sync``), so that no
rank ever holds a whole gradient; the passes' blocks add up in the shard. After a synchronised pass the pieces of
the optimizers get their ``.grad``, views of the shard, and a piece whose parameter got a gradient on no rank since
``zero_grad`` gets ``None``, as that parameter would without sharding (which parameters got one is exchanged in a
bitwise-or allreduce of one byte per parameter). ``optimizer.zero_grad()`` empties the shard: the next pass writes
it instead of adding (``set_to_none=False`` zeroes it, and pieces that had a gradient keep a zero one).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from mpistrategy.comm.buffers import mpi_buffer, mpi_op, off_wire, on_wire, reduction_dtype
from mpistrategy.comm.traffic import INTER_NODE, NODE, TrafficCounter
from mpistrategy.strategy.reducer.hooks import GradientHooks
from mpistrategy.strategy.sharding.flat import FlatParameters
from mpistrategy.strategy.sharding.group import ShardGroup
from mpistrategy.strategy.sharding.layout import BucketRange, Piece, bucket_ranges, overlaps
from mpistrategy.strategy.sharding.optimizer import ShardedOptimizer

_MB = 1024 * 1024


@dataclass
class _Space:
    """A space's gradient shard (allocated when a gradient first reaches it, so that a frozen space takes no
    memory): ``fresh`` until a pass wrote it after ``zero_grad``."""

    flat: FlatParameters
    held: torch.Tensor | None = None
    fresh: bool = True
    writing: bool = True  # this pass writes the shard (it was fresh when the pass began) instead of adding

    @property
    def shard(self) -> torch.Tensor:
        if self.held is None:
            flat = self.flat.flat
            self.held = torch.zeros(self.flat.shard.numel(), dtype=flat.dtype, device=flat.device)
        return self.held


@dataclass
class _Bucket:
    """A bucket: parameters ``params`` at ``offsets`` of its ``numel`` elements; ``counts[r]`` of them are shard r's,
    this rank's block goes to ``shard[target:target + counts[rank]]``."""

    index: int
    space: _Space
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    counts: list[int]
    target: int
    active: list[bool] = field(default_factory=list)  # its parameters that require a gradient
    expected: list[bool] = field(default_factory=list)  # those this pass's graph reaches (their .grad are views)
    pending: int = 0
    staging: torch.Tensor | None = None
    views: list[torch.Tensor] = field(default_factory=list)
    wire: torch.Tensor | None = None
    block: torch.Tensor | None = None  # this rank's summed block (its own buffer: see GradientShards._post)
    request: MPI.Request | None = None

    @property
    def active_count(self) -> int:
        return sum(self.active)


class GradientShards:
    """The reduce-scattered gradients of the sharded optimizers' parameters (see the module docstring).

    Args:
        group: the shard group.
        bucket_cap_mb: the memory the buckets may take together (each is cut at half of it).
        traffic: where the bytes sent are counted.
        spans_nodes: whether the shard group's ranks are on several nodes.
    """

    def __init__(self, group: ShardGroup, bucket_cap_mb: float, traffic: TrafficCounter, spans_nodes: bool) -> None:
        self.group, self.span, self.traffic = group, group.span, traffic
        self.cap_bytes = bucket_cap_mb * _MB / 2
        self.scope = INTER_NODE if spans_nodes else NODE
        self.spaces: list[_Space] = []
        self.buckets: list[_Bucket] = []
        self.optimizers: list[ShardedOptimizer] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}
        self._slot: dict[int, int] = {}
        self._local = np.zeros(0, dtype=np.uint8)  # 1: a gradient accumulated here since zero_grad or the last sync
        self._kept = np.zeros(0, dtype=np.uint8)  # 1: zeroed, not set to None, by zero_grad
        self._hooks = GradientHooks()
        self._hooked: set[int] = set()  # the parameters with a hook (those that required a gradient at a pass)
        self._patched: list[tuple[Any, bool]] = []
        self._flags: tuple[bool, ...] = ()
        self._armed = self._sync = False
        self._trace = True  # whether the next pass looks for the parameters its graph does not reach
        self._next = 0
        self._in_flight: list[_Bucket] = []

    # ------------------------------------------------------------------------------------------------ layout

    def add(self, sharded: ShardedOptimizer) -> None:
        """Reduce-scatter the gradients of ``sharded``'s parameters from now on."""
        self.optimizers.append(sharded)
        for flat in sharded.spaces:
            space = _Space(flat)
            self.spaces.append(space)
            cap = max(1, int(self.cap_bytes // flat.flat.element_size()))
            for span in bucket_ranges(flat.sizes, cap):
                self._add_bucket(space, span)
        self._local = np.zeros(len(self._slot), dtype=np.uint8)
        self._kept = np.zeros(len(self._slot), dtype=np.uint8)
        self._flags = ()

    def _add_bucket(self, space: _Space, span: BucketRange) -> None:
        flat = space.flat
        params = flat.params[span.first : span.last]
        offsets = [flat.offsets[i] - span.start for i in range(span.first, span.last)]
        counts = overlaps(flat.bounds, span.start, span.stop)
        low = flat.bounds[self.group.rank]
        target = max(span.start, low) - low
        bucket = _Bucket(len(self.buckets), space, params, offsets, span.numel, counts, target)
        for position, param in enumerate(params):
            self._where[id(param)] = (bucket, position)
            self._slot[id(param)] = len(self._slot)
        self.buckets.append(bucket)

    # ------------------------------------------------------------------------------------------------ backward

    def prepare(self, sync: bool, loss: torch.Tensor | None = None) -> None:
        """Before a backward pass (``sync``: the pass ends an accumulation, the pieces get their gradients) of
        ``loss``: the parameters its graph does not reach get no gradient on this rank, so their buckets need not
        wait for them (found from the graph after a pass in which some parameter got none; without ``loss``, a
        bucket with such a parameter waits until the end of backward)."""
        self._update_hooks()
        self._hooks.put_last()
        reached = _reached(loss) if loss is not None and self._trace else None
        for bucket in self.buckets:
            bucket.expected = [
                active and (reached is None or id(p) in reached)
                for p, active in zip(bucket.params, bucket.active, strict=True)
            ]
            bucket.pending = sum(bucket.expected)
        for space in self.spaces:
            space.writing = space.fresh
        self._sync, self._armed, self._next, self._in_flight = sync, True, 0, []
        self._open_after(-1)

    def _update_hooks(self) -> None:
        """After ``requires_grad`` changed: which parameters are active, and hooks on those that train now."""
        flags = tuple(p.requires_grad for b in self.buckets for p in b.params)
        if flags != self._flags:
            for bucket in self.buckets:
                bucket.active = [p.requires_grad for p in bucket.params]
                for param in bucket.params:
                    if param.requires_grad and id(param) not in self._hooked:
                        self._hooks.add(param, self._on_gradient)
                        self._hooked.add(id(param))
            self._flags = flags

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self._armed or not param.requires_grad:  # frozen after the forward pass: autograd kept no gradient
            return
        bucket, position = self._where[id(param)]
        if bucket.index < self._next:
            raise RuntimeError(
                f"a parameter of gradient bucket {bucket.index} got a second gradient in one backward pass, after the "
                "bucket was reduce-scattered; under shard='gradients' each parameter may get its gradient once per "
                "backward pass (call backward once between the strategy's backward hooks). A module used in more than "
                "one reentrant activation checkpoint does this: use torch.utils.checkpoint's use_reentrant=False."
            )
        if bucket.staging is None:
            self._open(bucket)
        elif param.grad is not None and param.grad is not bucket.views[position]:
            bucket.views[position].copy_(param.grad)
            param.grad = bucket.views[position]
        if not bucket.expected[position]:
            raise RuntimeError(
                f"parameter {position} of gradient bucket {bucket.index} got a gradient that the graph of the loss "
                "did not lead to; under shard='gradients' every gradient of a backward pass must come from the "
                "loss the strategy's backward was given. A reentrant activation checkpoint hides its part of the "
                "graph: use torch.utils.checkpoint's use_reentrant=False."
            )
        self._local[self._slot[id(param)]] = 1
        bucket.pending -= 1
        if bucket.pending == 0:
            self._post_ready()
        elif self._in_flight and self._in_flight[0].request is not None:
            self._in_flight[0].request.Test()  # MPI advances non-blocking collectives inside MPI calls

    def _open(self, bucket: _Bucket) -> None:
        """Allocate ``bucket``'s buffer and make its active parameters' ``.grad`` views of it (a gradient already
        there is copied in)."""
        first = bucket.params[0]
        bucket.staging = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
        bucket.views = [
            bucket.staging[offset : offset + p.numel()].view_as(p)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True)
        ]
        for param, view, expected in zip(bucket.params, bucket.views, bucket.expected, strict=True):
            if expected:
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view

    def _open_after(self, index: int) -> None:
        """Open the first active bucket after bucket ``index`` unless it is open already."""
        for bucket in self.buckets[index + 1 :]:
            if bucket.active_count:
                if bucket.staging is None:
                    self._open(bucket)
                return

    def _post_ready(self) -> None:
        """Post, in order, every bucket from the next one on whose gradients all landed."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending <= 0:
            self._post(self._next)

    def _post(self, index: int) -> None:
        """Complete the bucket in flight, start bucket ``index``'s reduce-scatter, open the next bucket."""
        bucket = self.buckets[index]
        self._next = index + 1
        if not bucket.active_count:
            return
        self._complete_in_flight()
        if bucket.staging is None:
            self._open(bucket)
        assert bucket.staging is not None
        for param, expected in zip(bucket.params, bucket.expected, strict=True):
            if expected:
                param.grad = None
        bucket.wire = on_wire(bucket.staging, reduction_dtype(bucket.staging.dtype, "sum", "shard='gradients'"))
        mine = bucket.counts[self.group.rank]
        if self.group.size > 1:
            # Not in place: MPICH's in-place reduce-scatter copies each rank's block to the buffer's start with
            # memcpy, which fails its overlap assertion for a large block that starts before its own length
            # (uneven blocks, a bucket inside one shard).
            bucket.block = self._receiving_block(bucket, mine)
            memory, _, datatype = mpi_buffer(bucket.wire)
            operation = mpi_op(bucket.wire.dtype, "sum")
            receive = mpi_buffer(bucket.block)
            bucket.request = self.group.comm.Ireduce_scatter([memory, datatype], receive, bucket.counts, operation)
        else:
            bucket.block = bucket.wire[:mine]
        self.traffic.add(self.scope, bucket.staging.nbytes)
        self._in_flight.append(bucket)
        self._open_after(index)

    def _receiving_block(self, bucket: _Bucket, count: int) -> torch.Tensor:
        """Where ``bucket``'s block of ``count`` elements is received: straight into the shard when this pass writes
        it and MPI can address it (no memory beyond the shard), else (a pass adding to the shard, or a shard on a
        device that MPI cannot read) a buffer of its own beside the wire."""
        assert bucket.wire is not None
        space = bucket.space
        target = space.shard[bucket.target : bucket.target + count]
        receivable = target.dtype == bucket.wire.dtype and target.device == bucket.wire.device
        if space.writing and receivable and self.group.cross is None:
            return target
        return torch.empty(count, dtype=bucket.wire.dtype, device=bucket.wire.device)

    def _complete_in_flight(self) -> None:
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def _complete(self, bucket: _Bucket) -> None:
        """Finish ``bucket``'s reduce-scatter (and, across nodes, the sum of its block), add its block into the
        shard, free its buffer."""
        assert bucket.wire is not None and bucket.staging is not None
        if bucket.request is not None:
            bucket.request.Wait()
        block = bucket.block
        assert block is not None
        if self.group.cross is not None:
            self.group.cross.Allreduce(MPI.IN_PLACE, mpi_buffer(block), mpi_op(block.dtype, "sum"))
            self.traffic.add(INTER_NODE, block.nbytes)
        block = off_wire(block, bucket.staging.dtype, bucket.staging.device)
        space = bucket.space
        target = space.shard[bucket.target : bucket.target + block.numel()]
        scale = 1.0 / self.group.world_size
        if block.numel() and block.data_ptr() == target.data_ptr():  # received in the shard
            target.mul_(scale)
        elif space.writing:
            torch.mul(block, scale, out=target)
        else:
            target.add_(block, alpha=scale)
        bucket.staging = bucket.wire = bucket.block = bucket.request = None
        bucket.views = []

    def wait(self) -> None:
        """After the backward pass: post the buckets left (zeros for gradients this rank did not produce), finish
        every bucket; after a synchronised pass, give the pieces their gradients."""
        if not self._armed:
            return
        self._armed = False
        # look at the next pass's graph if some active parameter got no gradient in this one
        self._trace = any(b.pending > 0 or sum(b.expected) < b.active_count for b in self.buckets)
        while self._next < len(self.buckets):
            self._post(self._next)
        self._complete_in_flight()
        for bucket in self.buckets:
            if bucket.active_count:  # a space frozen in this pass (toggle_optimizer) keeps its shard as it was
                bucket.space.fresh = False
        if self._sync:
            self._expose()

    def _expose(self) -> None:
        """Point every piece's ``.grad`` at its gradient shard, or ``None`` where no rank has a gradient."""
        used = self._local.copy()
        if self.span.Get_size() > 1:
            self.span.Allreduce(MPI.IN_PLACE, used, op=MPI.BOR)
        used |= self._kept
        low = {id(space): space.flat.bounds[self.group.rank] for space in self.spaces}
        for sharded in self.optimizers:
            for tensor, piece, space in self._pieces_of(sharded):
                offset = piece.offset - low[id(space)]
                keep = used[self._slot[id(space.flat.params[piece.index])]]
                tensor.grad = space.shard[offset : offset + piece.numel] if keep else None
        self._local.fill(0)
        self._kept.fill(0)

    def _pieces_of(self, sharded: ShardedOptimizer) -> Iterable[tuple[torch.Tensor, Piece, _Space]]:
        """``sharded``'s piece tensors, with their pieces and spaces."""
        spaces = {id(space.flat): space for space in self.spaces}
        for flat in sharded.spaces:
            for tensor, piece in zip(flat.tensors, flat.pieces, strict=True):
                yield tensor, piece, spaces[id(flat)]

    # ------------------------------------------------------------------------------------------------ zero_grad

    def attach_optimizer(self, sharded: ShardedOptimizer, *aliases: Any) -> None:
        """Make ``zero_grad`` of ``sharded``'s optimizer (and of its wrappers ``aliases``) empty its gradient shards."""

        def zero_grad(set_to_none: bool = True) -> None:
            self.zero_grad(sharded, set_to_none)

        for target in (sharded.optimizer, *aliases):
            self._patched.append((target, "zero_grad" in vars(target)))
            target.zero_grad = zero_grad

    def zero_grad(self, sharded: ShardedOptimizer, set_to_none: bool = True) -> None:
        """Empty ``sharded``'s gradient shards (see the module docstring)."""
        for space in self.spaces:
            if any(space.flat is flat for flat in sharded.spaces):
                if not set_to_none and space.held is not None:
                    space.held.zero_()
                space.fresh = set_to_none
        for tensor, piece, space in self._pieces_of(sharded):
            slot = self._slot[id(space.flat.params[piece.index])]
            self._local[slot] = 0
            if set_to_none:
                tensor.grad = None
            elif tensor.grad is not None:
                self._kept[slot] = 1

    # ------------------------------------------------------------------------------------------------ lifetime

    def buffers(self) -> list[torch.Tensor]:
        """The gradient memory it holds now: the shards and the buckets' buffers."""
        held = [space.held for space in self.spaces if space.held is not None]
        for bucket in self.buckets:
            held += [t for t in (bucket.staging, bucket.wire, bucket.block) if t is not None]
        return held

    def remove(self) -> None:
        """Remove the hooks and give the optimizers their own ``zero_grad`` back."""
        self._hooks.remove()
        self._hooked, self._flags = set(), ()
        for target, had_attribute in reversed(self._patched):
            if not had_attribute and "zero_grad" in vars(target):
                del target.zero_grad
        self._patched = []


def _reached(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors whose gradients backward from ``loss`` accumulates."""
    found: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.add(id(variable))
        stack.extend(child for child, _ in node.next_functions)
    return found
