"""The gradient bucket layout as a pure function: boundaries, launch order, offsets, frozen parameters, large
gradients (own buckets, copied, merged) and shared-memory offsets. No MPI, no memory."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mpistrategy.strategy.reducer import (
    BucketLayout,
    LayoutPolicy,
    ParameterSpec,
    assign_buckets,
    plan_layout,
)

F32 = torch.float32
CPU = torch.device("cpu")


def _specs(**numels: int) -> list[tuple[str, ParameterSpec]]:
    """Contiguous float32 host parameters, in registration order."""
    return [(name, ParameterSpec(numel, F32, CPU)) for name, numel in numels.items()]


def _names(layout: BucketLayout) -> list[list[str]]:
    return [bucket.names for bucket in layout.buckets]


#: w2 (1 KB) fills the 1 KB first bucket; b1 + w1 (2088 B) close a 2 KB one; b0 + w0 stay open until the end
_MLP = _specs(w0=256, b0=10, w1=512, b1=10, w2=256)
_MLP_POLICY = LayoutPolicy(bucket_cap_mb=2 / 1024, first_bucket_cap_mb=1 / 1024, own_bucket_mb=math.inf, shared=True)


def test_assign_buckets_caps_and_order() -> None:
    params = [(f"p{i}", ParameterSpec.of(torch.zeros(256))) for i in range(6)]  # 1 KB each
    groups = assign_buckets(params, bucket_cap_mb=2.5 / 1024, first_bucket_cap_mb=1 / 1024)
    assert [[n for n, _ in g] for g in groups] == [["p0"], ["p1", "p2", "p3"], ["p4", "p5"]]
    mixed = [("a", ParameterSpec.of(torch.zeros(4))), ("b", ParameterSpec.of(torch.zeros(4, dtype=torch.float64)))]
    assert len(assign_buckets(mixed, 25, 1)) == 2  # one dtype per bucket


def test_large_parameters_get_their_own_bucket_in_launch_order() -> None:
    sizes = {"small0": 256, "large1": 4096, "small2": 256, "strided": 4096, "large4": 8192}  # float32 elements
    params = [(n, ParameterSpec.of(torch.zeros(k))) for n, k in sizes.items()]
    params[3] = ("strided", ParameterSpec.of(torch.zeros(2, 4096)[:, ::2].t()))  # 16 KB, not contiguous
    groups = assign_buckets(params, bucket_cap_mb=25, first_bucket_cap_mb=25, own_bucket_mb=16 / 1024)
    assert [[n for n, _ in g] for g in groups] == [["large1"], ["large4"], ["small0", "small2", "strided"]]


def test_buckets_follow_reverse_registration_order_with_the_caps() -> None:
    layout = plan_layout(_MLP, [True] * 5, _MLP_POLICY)
    assert _names(layout) == [["w2"], ["b1", "w1"], ["b0", "w0"]]
    assert [bucket.index for bucket in layout.buckets] == [0, 1, 2]
    assert [bucket.numel for bucket in layout.buckets] == [256, 522, 266]
    assert [[p.offset for p in bucket.places] for bucket in layout.buckets] == [[0], [0, 10], [0, 10]]
    assert layout.signature() == [(256, "torch.float32", 1), (522, "torch.float32", 2), (266, "torch.float32", 2)]


def test_every_parameter_has_one_record_by_slot() -> None:
    layout = plan_layout(_MLP, [True] * 5, _MLP_POLICY)
    records = [(p.slot, p.name, p.bucket, p.position, p.offset, p.numel, p.copied) for p in layout.places]
    assert records == [
        (0, "w0", 2, 1, 10, 256, False),
        (1, "b0", 2, 0, 0, 10, False),
        (2, "w1", 1, 1, 10, 512, False),
        (3, "b1", 1, 0, 0, 10, False),
        (4, "w2", 0, 0, 0, 256, False),
    ]
    assert [bucket.slots for bucket in layout.buckets] == [(4,), (3, 2), (1, 0)]
    assert layout.bucketed_slots == frozenset(range(5))


def test_shared_offsets_are_cache_line_aligned_and_packed() -> None:
    layout = plan_layout(_MLP, [True] * 5, _MLP_POLICY)
    # 1024 B, then 2088 B (ends at 3112, rounded up to 3136), then 1064 B
    assert [bucket.shared_offset for bucket in layout.buckets] == [0, 1024, 3136]
    assert layout.shared_bytes == 3136 + 1064
    private = plan_layout(_MLP, [True] * 5, dataclasses.replace(_MLP_POLICY, shared=False))
    assert [bucket.shared_offset for bucket in private.buckets] == [None, None, None]
    assert private.shared_bytes == 0


def test_parameters_not_bucketed_have_no_place_and_shift_the_boundaries() -> None:
    layout = plan_layout(_MLP, [True, True, False, False, True], _MLP_POLICY)  # w1 and b1 frozen
    assert _names(layout) == [["w2"], ["b0", "w0"]]
    assert layout.places[2] is None and layout.places[3] is None
    assert layout.bucketed_slots == frozenset({0, 1, 4})
    assert [bucket.shared_offset for bucket in layout.buckets] == [0, 1024]


_LARGE = [
    ("small", ParameterSpec(256, F32, CPU)),
    ("big", ParameterSpec(4096, F32, CPU)),  # 16 KB: large
    ("strided", ParameterSpec(4096, F32, CPU, contiguous=False)),  # 16 KB, but cannot be a flat buffer
    ("tail", ParameterSpec(256, F32, CPU)),
]
_LARGE_POLICY = LayoutPolicy(bucket_cap_mb=25, own_bucket_mb=16 / 1024, shared=True)


def test_a_large_gradient_is_its_own_bucket_outside_shared_memory() -> None:
    layout = plan_layout(_LARGE, [True] * 4, _LARGE_POLICY)
    assert _names(layout) == [["big"], ["tail", "strided", "small"]]
    assert [bucket.own_gradient for bucket in layout.buckets] == [True, False]
    assert [bucket.shared_offset for bucket in layout.buckets] == [None, 0]  # it adopts autograd's tensor
    assert layout.shared_bytes == (256 + 4096 + 256) * 4
    assert not any(place.copied for place in layout.places if place is not None)


def test_a_copied_large_gradient_gets_a_shared_bucket_of_its_own() -> None:
    layout = plan_layout(_LARGE, [True] * 4, dataclasses.replace(_LARGE_POLICY, copy_large=True))
    assert _names(layout) == [["big"], ["tail", "strided", "small"]]
    assert [bucket.own_gradient for bucket in layout.buckets] == [False, False]
    assert [bucket.shared_offset for bucket in layout.buckets] == [0, 4096 * 4]
    assert [p.name for p in layout.places if p is not None and p.copied] == ["big"]
    assert [bucket.accumulated_numel for bucket in layout.buckets] == [0, 256 + 4096 + 256]


def test_merged_large_gradients_come_last_in_a_regular_bucket() -> None:
    policy = dataclasses.replace(_LARGE_POLICY, copy_large=True, merge_large=True)
    layout = plan_layout(_LARGE, [True] * 4, policy)
    (bucket,) = layout.buckets
    assert bucket.names == ["tail", "strided", "small", "big"]  # copied last, the others in launch order
    assert [p.offset for p in bucket.places] == [0, 256, 4352, 4608]
    assert bucket.accumulated_numel == 4608 and [p.name for p in bucket.accumulated] == ["tail", "strided", "small"]
    assert bucket.shared_offset == 0 and not bucket.own_gradient


def test_device_gradients_are_bucketed_apart_and_never_shared() -> None:
    specs = [("on_gpu", ParameterSpec(256, F32, torch.device("cuda", 0))), ("on_host", ParameterSpec(256, F32, CPU))]
    policy = LayoutPolicy(bucket_cap_mb=25, shared=True, copy_large=True, own_bucket_mb=0.0)
    layout = plan_layout(specs, [True, True], policy)
    assert _names(layout) == [["on_host"], ["on_gpu"]]
    # on the host a large gradient is copied into shared memory; on the device it is its own bucket
    assert [bucket.own_gradient for bucket in layout.buckets] == [False, True]
    assert [bucket.shared_offset for bucket in layout.buckets] == [0, None]
    assert [bucket.device.type for bucket in layout.buckets] == ["cpu", "cuda"]


def test_the_layout_is_frozen_and_computed_alike_every_time() -> None:
    layout = plan_layout(_MLP, [True] * 5, _MLP_POLICY)
    assert plan_layout(_MLP, [True] * 5, _MLP_POLICY) == layout
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.buckets[0].shared_offset = 64  # type: ignore[misc]
    spec = ParameterSpec.of(torch.empty(3, 4, dtype=torch.float64, device="meta"))
    assert (spec.numel, spec.nbytes, spec.contiguous) == (12, 96, True)
