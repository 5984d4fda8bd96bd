"""The gradient bucket layout: which parameter's gradient lies in which bucket, where, and in what memory.

A pure function of the parameters' sizes, dtypes and devices and of a :class:`LayoutPolicy`: :func:`plan_layout`
returns a frozen :class:`BucketLayout` that allocates nothing and touches no tensor, so every rank computes the
same one from the same model, and anything that works per bucket (the reducer, a sharded optimizer) can be planned
and tested without MPI.

The rules. The parameters to bucket are taken in reverse registration order (roughly the order their gradients
become ready in backward) and packed into buckets of one dtype and device: the first bucket closes once it holds
``first_bucket_cap_mb``, the others at ``bucket_cap_mb`` (:func:`assign_buckets`). A contiguous parameter of at
least ``own_bucket_mb`` is a bucket of its own whose buffer is its ``.grad`` (:attr:`BucketSpec.own_gradient`),
unless the policy sends large host gradients through shared memory: then its hook copies autograd's fresh gradient
into its bucket (:attr:`ParameterPlace.copied`), and where the policy merges them it joins the regular buckets.
Copied gradients come last in their bucket, so that the gradients that accumulate in place form one prefix
(:attr:`BucketSpec.accumulated_numel`). Host buckets other than own-gradient ones get a byte offset in this rank's
part of one shared segment (:attr:`BucketSpec.shared_offset`, 64-byte aligned) when the policy asks for one. Where
MPI cannot read CUDA memory and the policy stages it (:attr:`LayoutPolicy.stage_cuda`), every CUDA bucket is
combined through a host mirror of its buffer (:attr:`BucketSpec.staged`), placed in the shared segment the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

MB = 1024 * 1024
#: bytes: buckets in shared memory start on cache lines
SHARED_ALIGN = 64


@dataclass(frozen=True)
class ParameterSpec:
    """What the layout needs to know of one parameter: its size, dtype, device and whether it is contiguous (only
    a contiguous gradient can serve as a flat buffer)."""

    numel: int
    dtype: torch.dtype
    device: torch.device
    contiguous: bool = True

    @classmethod
    def of(cls, tensor: torch.Tensor) -> ParameterSpec:
        return cls(tensor.numel(), tensor.dtype, tensor.device, tensor.is_contiguous())

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class LayoutPolicy:
    """How gradients are bucketed.

    Attributes:
        bucket_cap_mb: size (MB) at which a bucket is closed.
        first_bucket_cap_mb: size (MB) at which the first bucket is closed (``None``: ``bucket_cap_mb``).
        own_bucket_mb: a contiguous gradient of at least this many MB is a bucket of its own.
        shared: host buckets live in one shared-memory segment (else in private tensors).
        copy_large: large host gradients are copied into their bucket by their hook (they are summed in shared
            memory, where the copy replaces the allreduce's own copy into its staging area).
        merge_large: large gradients join the regular buckets instead of getting their own (with ``copy_large``:
            fewer buckets, fewer waits for the other ranks).
        stage_cuda: CUDA buckets are combined through host mirrors (MPI cannot read device memory).
    """

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float | None = None
    own_bucket_mb: float = 1.0
    shared: bool = False
    copy_large: bool = False
    merge_large: bool = False
    stage_cuda: bool = False

    @property
    def first_cap_mb(self) -> float:
        return self.bucket_cap_mb if self.first_bucket_cap_mb is None else self.first_bucket_cap_mb

    def is_large(self, spec: ParameterSpec) -> bool:
        """Whether ``spec``'s gradient is large enough (and contiguous) to be a bucket of its own."""
        return owns_bucket(spec, self.own_bucket_mb)

    def stages(self, spec: ParameterSpec) -> bool:
        """Whether ``spec``'s bucket is combined through a host mirror."""
        return self.stage_cuda and spec.device.type == "cuda"

    def copies(self, spec: ParameterSpec) -> bool:
        """Whether ``spec``'s hook copies its gradient into its bucket."""
        return self.copy_large and spec.device.type == "cpu" and self.is_large(spec)


@dataclass(frozen=True)
class ParameterPlace:
    """Where one bucketed parameter's gradient lies.

    Attributes:
        slot: the parameter's position in the module's parameter list.
        name: its qualified name.
        bucket: the index of its bucket.
        position: its position in the bucket.
        offset: the element at which its gradient starts in the bucket's buffer.
        numel: its number of elements.
        copied: its hook copies autograd's fresh gradient into the bucket; ``zero_grad`` treats it as the
            optimizer would (it does not accumulate in place).
    """

    slot: int
    name: str
    bucket: int
    position: int
    offset: int
    numel: int
    copied: bool = False


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: its parameters in buffer order, its buffer's size, dtype and device, and its memory.

    Attributes:
        index: position in launch order (0 is started first).
        places: its parameters, in buffer order.
        dtype, device: of its buffer.
        own_gradient: one large parameter whose own ``.grad`` is the buffer.
        shared_offset: the byte offset of its host memory in this rank's part of the shared segment: its buffer, or
            for a staged bucket its mirror (``None``: private memory; an own-gradient host bucket adopts autograd's
            tensor).
        staged: a CUDA bucket combined through a host mirror of its buffer (MPI cannot read device memory).
    """

    index: int
    places: tuple[ParameterPlace, ...]
    dtype: torch.dtype
    device: torch.device
    own_gradient: bool = False
    shared_offset: int | None = None
    staged: bool = False

    @property
    def numel(self) -> int:
        return sum(place.numel for place in self.places)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(place.slot for place in self.places)

    @property
    def names(self) -> list[str]:
        return [place.name for place in self.places]

    @property
    def accumulated(self) -> tuple[ParameterPlace, ...]:
        """The parameters whose gradients accumulate in the buffer in place (all but the copied ones, which come
        last): the prefix of the buffer that ``zero_grad`` zeroes."""
        return tuple(place for place in self.places if not place.copied)

    @property
    def accumulated_numel(self) -> int:
        return sum(place.numel for place in self.accumulated)


@dataclass(frozen=True)
class BucketLayout:
    """Every bucket in launch order, and where each of the module's parameters lies.

    Attributes:
        buckets: the buckets, in launch order.
        places: by slot (the module's parameter order): where the parameter's gradient lies, ``None`` for a
            parameter outside the buckets.
        shared_bytes: the bytes of this rank's part of the shared segment the host buckets need (0 without one).
    """

    buckets: tuple[BucketSpec, ...]
    places: tuple[ParameterPlace | None, ...]
    shared_bytes: int = 0

    @property
    def bucketed_slots(self) -> frozenset[int]:
        return frozenset(place.slot for place in self.places if place is not None)

    def signature(self) -> list[tuple[int, str, int]]:
        """What every rank's layout must agree on: each bucket's element count, dtype and parameter count."""
        return [(bucket.numel, str(bucket.dtype), len(bucket.places)) for bucket in self.buckets]


def owns_bucket(spec: ParameterSpec, own_bucket_mb: float) -> bool:
    """Whether ``spec``'s gradient is its own bucket: at least ``own_bucket_mb`` and contiguous (so that its
    ``.grad`` can serve as the flat buffer)."""
    return spec.nbytes >= own_bucket_mb * MB and spec.contiguous


_Item = TypeVar("_Item")


def assign_buckets(
    params: Sequence[tuple[_Item, ParameterSpec]],
    bucket_cap_mb: float,
    first_bucket_cap_mb: float,
    own_bucket_mb: float = math.inf,
) -> list[list[tuple[_Item, ParameterSpec]]]:
    """Group ``params`` (already in launch order; each a key and its spec) into buckets by dtype and device with
    the size caps.

    A contiguous parameter of at least ``own_bucket_mb`` gets a bucket of its own, placed where it comes in the
    launch order; the flat buckets around it stay open, so that small parameters still share one message.
    """
    buckets: list[list[tuple[_Item, ParameterSpec]]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], list[tuple[_Item, ParameterSpec]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    cap = first_bucket_cap_mb * MB
    for item in params:
        spec = item[1]
        if owns_bucket(spec, own_bucket_mb):
            buckets.append([item])
            continue
        key = (spec.dtype, spec.device)
        open_buckets.setdefault(key, []).append(item)
        sizes[key] = sizes.get(key, 0) + spec.nbytes
        if sizes[key] >= cap:
            buckets.append(open_buckets.pop(key))
            sizes.pop(key)
            cap = bucket_cap_mb * MB
    buckets.extend(open_buckets.values())
    return buckets


def plan_layout(
    params: Sequence[tuple[str, ParameterSpec]], bucketed: Sequence[bool], policy: LayoutPolicy
) -> BucketLayout:
    """The layout of the gradients of ``params`` (the module's named parameters, in registration order) for which
    ``bucketed`` is true, under ``policy`` (see the module docstring)."""
    chosen = [((slot, name), spec) for slot, (name, spec) in enumerate(params) if bucketed[slot]]
    own_bucket_mb = math.inf if policy.merge_large else policy.own_bucket_mb
    groups = assign_buckets(chosen[::-1], policy.bucket_cap_mb, policy.first_cap_mb, own_bucket_mb)
    places: list[ParameterPlace | None] = [None] * len(params)
    buckets = []
    shared_bytes = 0
    for index, group in enumerate(groups):
        ordered = sorted(group, key=lambda item: policy.copies(item[1]))  # copied gradients last
        bucket_places = []
        offset = 0
        for position, ((slot, name), spec) in enumerate(ordered):
            place = ParameterPlace(slot, name, index, position, offset, spec.numel, policy.copies(spec))
            places[slot] = place
            bucket_places.append(place)
            offset += spec.numel
        first = ordered[0][1]
        own = len(ordered) == 1 and owns_bucket(first, own_bucket_mb) and not policy.copies(first)
        staged = policy.stages(first)
        shared_offset = None
        if policy.shared and ((first.device.type == "cpu" and not own) or staged):
            shared_offset = -(-shared_bytes // SHARED_ALIGN) * SHARED_ALIGN
            shared_bytes = shared_offset + offset * first.dtype.itemsize
        buckets.append(BucketSpec(index, tuple(bucket_places), first.dtype, first.device, own, shared_offset, staged))
    return BucketLayout(tuple(buckets), tuple(places), shared_bytes)
