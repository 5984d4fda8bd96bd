"""The shared-memory allreduce, forced on for every size: references, bitwise agreement across ranks, adjoints,
tensors in shared memory, non-blocking order, checks, settings and the gradient buckets (1-4 ranks)."""

from __future__ import annotations

import math

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpistrategy as ms
from mpistrategy import CommunicationError
from mpistrategy.aggregation import MeanAggregator
from mpistrategy.comm import rank_sum, shm_window
from mpistrategy.comm.shm import CHUNK_BYTES, EVERYONE_SUMS_BYTES, built_group, settings, shared_memory
from mpistrategy.comm.topology import topology
from mpistrategy.strategy.reducer import GradientReducer
from tests.adjoint import assert_adjoint, gather_reference, rank, rank_generator, size

pytestmark = pytest.mark.mpi(timeout=120)

COMM = MPI.COMM_WORLD
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture(autouse=True)
def forced_on():
    with shared_memory("on"):
        yield


def sizes(dtype: torch.dtype) -> list[int]:
    """Element counts: empty, fewer than the ranks, unaligned, two chunks, and a message whose chunks are summed
    by their owners on every rank count (several chunks per rank)."""
    item = dtype.itemsize
    return [0, 1, 7, 1003, CHUNK_BYTES // item + 5, (EVERYONE_SUMS_BYTES + 3 * CHUNK_BYTES) // item + 3]


def per_rank(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(numel, dtype=torch.float64, generator=rank_generator(seed)).to(dtype)


def shm_operations() -> int:
    """Operations the world's forward group has started (it exists once the first allreduce ran)."""
    group = built_group(ms.world().forward)
    return group.seq if group is not None else 0


def same_bits_everywhere(tensor: torch.Tensor) -> bool:
    raw = tensor.contiguous().view(torch.uint8) if tensor.numel() else tensor
    return all(torch.equal(other, raw) for other in COMM.allgather(raw))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_results_are_the_float64_reference_within_rounding_and_the_same_bits_on_every_rank(dtype, op) -> None:
    """Each element is summed in rank order in float32 (float64 for float64), scaled by 1/P for avg and rounded
    once: within (P - 1) roundings of the accumulation on sum |x_r| plus one rounding of the result."""
    accumulation = UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]
    for numel in sizes(dtype):
        x = per_rank(numel, dtype, seed=numel)
        started = shm_operations()
        y = ms.allreduce(x, op)
        assert y.dtype == dtype and y.shape == x.shape
        assert shm_operations() == started + (1 if numel else 0), "the allreduce did not use shared memory"
        inputs = torch.stack([t.double() for t in gather_reference(x)]) if numel else torch.zeros(size(), 0)
        exact = inputs.sum(0) / (size() if op == "avg" else 1)
        bound = size() * accumulation * inputs.abs().sum(0) + UNIT_ROUNDOFF[dtype] * exact.abs() + 1e-300
        error = (y.double() - exact).abs()
        assert bool((error <= bound).all()), f"{numel} elements: error {float((error / bound).max()):.2f}x bound"
        assert same_bits_everywhere(y), f"{numel} elements: ranks hold different bits"
        assert torch.equal(ms.allreduce(x, op).view(torch.uint8), y.view(torch.uint8)), "a second run differs"


@pytest.mark.parametrize("layout", ["strided column", "transposed", "expanded"])
def test_inputs_that_are_not_contiguous_are_summed_by_their_values_forward_and_backward(layout: str) -> None:
    """Several chunks per rank (each rank sums its own chunks from its input): a column of a matrix (1-D, stride
    2), a transposed matrix and an expanded row (stride 0, as the cotangent of ``y.sum()`` is) equal the sum of
    their contiguous copies; the gradient of ``allreduce(z).sum()`` is P everywhere."""
    rows = (EVERYONE_SUMS_BYTES + 3 * CHUNK_BYTES) // 8 + 3
    base = per_rank(2 * rows, torch.float64, seed=11).reshape(rows, 2)
    x = {
        "strided column": base[:, 0],
        "transposed": base.t(),
        "expanded": base[0].reshape(1, 2).expand(rows, 2),
    }[layout]
    assert not x.is_contiguous()
    started = shm_operations()
    got = ms.allreduce(x)
    assert shm_operations() == started + 1, "the allreduce did not use shared memory"
    assert torch.equal(got, ms.allreduce(x.contiguous()))
    torch.testing.assert_close(got, torch.stack([t.contiguous() for t in gather_reference(x)]).sum(0))
    z = per_rank(rows, torch.float64, seed=12).requires_grad_()
    ms.allreduce(z).sum().backward()
    assert torch.equal(z.grad, torch.full_like(z, float(size())))


def test_half_precision_is_accumulated_in_float32() -> None:
    """Sums of 1.5 and 2.25 are exact in both formats; 60000 on every rank overflows float16 when summed in
    float16 (its largest value is 65504), but its average, accumulated in float32, is 60000."""
    for dtype in (torch.float16, torch.bfloat16):
        value = 1.5 if rank() % 2 == 0 else 2.25
        total = sum(1.5 if r % 2 == 0 else 2.25 for r in range(size()))
        assert torch.equal(ms.allreduce(torch.full((5,), value, dtype=dtype)), torch.full((5,), total, dtype=dtype))
    large = ms.allreduce(torch.full((9,), 60000.0, dtype=torch.float16), "avg")
    assert torch.equal(large, torch.full((9,), 60000.0, dtype=torch.float16))


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_adjoint_and_reference_gradients(op: str) -> None:
    scale = size() if op == "avg" else 1
    for numel in sizes(torch.float64):
        x = per_rank(numel, torch.float64, seed=numel + 1)
        assert_adjoint(lambda t: ms.allreduce(t, op), x, seed=numel)
        assert_adjoint(lambda t: ms.iallreduce(t, op).wait(), x, seed=numel + 2)
        leaf = x.clone().requires_grad_(True)
        cotangent = per_rank(numel, torch.float64, seed=numel + 3)
        ms.allreduce(leaf, op).backward(cotangent)
        reference = torch.stack(gather_reference(cotangent)).sum(0) / scale if numel else torch.zeros(0)
        torch.testing.assert_close(leaf.grad, reference.double(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensors_in_shared_memory_are_reduced_where_they_are(dtype: torch.dtype) -> None:
    """In place (``out=`` the tensor) no copy is made and the bits equal a private tensor's result; reduced into
    another tensor, the input stays as it was."""
    largest = max(sizes(dtype))
    segment = shm_window.allocate(largest * dtype.itemsize, COMM)
    try:
        for numel in sizes(dtype):
            x = per_rank(numel, dtype, seed=numel + 4)
            expected = ms.allreduce(x, "avg")
            window = segment.typed(segment.rank, 0, numel, dtype).copy_(x)
            address = window.data_ptr()
            with torch.no_grad():
                assert ms.iallreduce(window, "avg", out=window).wait() is window
            assert window.data_ptr() == address and torch.equal(window.view(torch.uint8), expected.view(torch.uint8))
            window.copy_(x)
            assert ms.allreduce(window, "avg", out=window) is window  # blocking: owners write into every window
            assert window.data_ptr() == address and torch.equal(window.view(torch.uint8), expected.view(torch.uint8))
            window.copy_(x)
            separate = torch.empty_like(x)
            ms.allreduce(window, "avg", out=separate)
            assert torch.equal(separate.view(torch.uint8), expected.view(torch.uint8))
            assert torch.equal(window, x), "an allreduce into another tensor changed its input"
            mixed = window.copy_(x) if rank() % 2 == 0 else x.clone()  # in a window on even ranks only
            assert ms.allreduce(mixed, "avg", out=mixed) is mixed
            assert torch.equal(mixed.view(torch.uint8), expected.view(torch.uint8))
        del window, mixed
    finally:
        assert segment.free()


@pytest.mark.parametrize("dtype", rank_sum.SUPPORTED_DTYPES)
def test_compiled_and_torch_sums_give_the_same_bits_also_when_ranks_mix_them(dtype: torch.dtype) -> None:
    """Every plan (every rank sums, owners, owners writing into every window) with the compiled sum on every
    rank, with torch's on every rank, and with torch's on odd ranks only: the same bits."""
    largest = max(sizes(dtype))
    segment = shm_window.allocate(largest * dtype.itemsize, COMM)
    try:
        for numel in sizes(dtype)[1:]:
            x = per_rank(numel, dtype, seed=numel + 9)
            window = segment.typed(segment.rank, 0, numel, dtype)
            results = []
            for compiled_here in (True, False, rank() % 2 == 0):
                with rank_sum.compiled(compiled_here), torch.no_grad():
                    blocking = ms.allreduce(x, "avg")
                    pending = ms.iallreduce(x, "avg").wait()
                    window.copy_(x)
                    ms.allreduce(window, "avg", out=window)
                    blocking_in_place = window.clone()
                    window.copy_(x)
                    ms.iallreduce(window, "avg", out=window).wait()
                    pending_in_place = window.clone()
                outcomes = (blocking, pending, blocking_in_place, pending_in_place)
                results.append([t.view(torch.uint8) for t in outcomes])
            for result in results:
                assert all(torch.equal(a, b) for a, b in zip(result, results[0], strict=True)), f"{numel} elements"
            assert same_bits_everywhere(results[0][0])
        del window
    finally:
        assert segment.free()


def test_non_blocking_allreduces_complete_in_any_wait_order() -> None:
    segment = shm_window.allocate(1 << 20, COMM)
    window = segment.typed(segment.rank, 0, 1000, torch.float64)
    inputs = [per_rank(n, torch.float64, seed=n) for n in (5, 300_000, 1000, 700_001)]
    window.copy_(inputs[2])
    with torch.no_grad():
        handles = [ms.iallreduce(inputs[0]), ms.iallreduce(inputs[1], "avg"), ms.iallreduce(window, out=window)]
        handles.append(ms.iallreduce(inputs[3]))
        results = [handle.wait() for handle in reversed(handles)][::-1]
    for index, (value, op) in enumerate(zip(inputs, ["sum", "avg", "sum", "sum"], strict=True)):
        reference = torch.stack(gather_reference(value)).sum(0) / (size() if op == "avg" else 1)
        torch.testing.assert_close(results[index], reference, rtol=1e-12, atol=1e-12)
    del window, results, handles
    assert segment.free()


def test_owners_write_into_every_window_while_other_allreduces_are_in_flight() -> None:
    """Non-blocking, in place in windows, several chunks per rank: each owner writes its sums into every rank's
    window. Two such operations and a private one in flight at once, waited in reverse order: the bits of the
    blocking allreduce of the same values."""
    numel = (EVERYONE_SUMS_BYTES + 3 * CHUNK_BYTES) // 4 + 3
    second_at = -(-numel * 4 // 64) * 64
    segment = shm_window.allocate(2 * second_at, COMM)
    first = segment.typed(segment.rank, 0, numel, torch.float32)
    second = segment.typed(segment.rank, second_at, numel, torch.float32)
    values = [per_rank(numel, torch.float32, seed=seed) for seed in (21, 22, 23)]
    expected = [ms.allreduce(value, "avg") for value in values]
    first.copy_(values[0])
    second.copy_(values[1])
    with torch.no_grad():
        handles = [
            ms.iallreduce(first, "avg", out=first),
            ms.iallreduce(values[2], "avg"),
            ms.iallreduce(second, "avg", out=second),
        ]
        results = [handle.wait() for handle in reversed(handles)][::-1]
    assert results[0] is first and results[2] is second
    for result, reference in zip((first, results[1], second), (expected[0], expected[2], expected[1]), strict=True):
        assert torch.equal(result.view(torch.uint8), reference.view(torch.uint8))
    del first, second, results, handles, result
    assert segment.free()


def test_a_segment_stays_allocated_while_any_rank_holds_a_view_or_its_storage_object() -> None:
    """Freeing is collective: a view held on one rank keeps every rank's window, and so does the Python storage
    object of a view kept after the view itself was dropped (it holds no C++ reference of its own)."""
    segment = shm_window.allocate(4096, COMM)
    holder = size() - 1
    view = segment.typed(segment.rank, 0, 16, torch.float32).fill_(float(rank()))
    kept_storage = view.untyped_storage() if rank() == holder else None
    held = view if rank() == holder and size() > 1 else None
    del view
    assert segment.free() is False, "a rank's view did not keep the segment"
    del held
    assert segment.free() is False, "a view's storage object did not keep the segment"
    assert kept_storage is None or torch.equal(
        torch.empty(0, dtype=torch.float32).set_(kept_storage, 0, (16,)), torch.full((16,), float(rank()))
    )
    del kept_storage
    assert segment.free() is True


def test_disagreeing_ranks_raise_on_every_rank_and_the_next_allreduce_works() -> None:
    if size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(CommunicationError, match="disagree"):
        ms.allreduce(torch.ones(1000 + 500_000 * rank()))  # one chunk here, many there: the copies happen first
    with pytest.raises(CommunicationError, match="shared memory"):
        with shared_memory("on" if rank() else "off"):
            ms.allreduce(torch.ones(10))
    with pytest.raises(TypeError if rank() == 0 else CommunicationError, match="avg"):
        ms.allreduce(torch.ones(100, dtype=torch.int64) if rank() == 0 else torch.ones(100), "avg")
    started = shm_operations()
    assert torch.equal(ms.allreduce(torch.ones(600_000)), torch.full((600_000,), float(size())))
    assert shm_operations() == started + 1


def test_blocking_on_one_rank_and_non_blocking_on_another_raise_on_every_rank() -> None:
    """The ranks must agree on allreduce or iallreduce (a blocking one is completed in one pass): the check of the
    calls tells them apart and names both; every rank drops that operation, and the next one works."""
    if size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    x = torch.ones(1000)
    different = r"ranks called different .*rank 0: allreduce\(float32\[1000\].*rank 1: iallreduce\(float32\[1000\]"
    with pytest.raises(CommunicationError, match=different):
        with torch.no_grad():
            ms.allreduce(x) if rank() == 0 else ms.iallreduce(x).wait()
    assert torch.equal(ms.allreduce(x), torch.full((1000,), float(size())))


def test_auto_mode_keeps_small_messages_and_other_ops_on_mpi() -> None:
    with shared_memory("auto", min_bytes=4096):
        started = shm_operations()
        small, large = torch.ones(1023), torch.ones(1024)  # 4092 and 4096 bytes
        assert torch.equal(ms.allreduce(small), torch.full((1023,), float(size())))
        assert shm_operations() == started
        assert torch.equal(ms.allreduce(large), torch.full((1024,), float(size())))
        assert shm_operations() == started + (1 if size() > 1 else 0)
        assert torch.equal(ms.allreduce(large, "max"), large)
        assert torch.equal(ms.allreduce(large.long()), torch.full((1024,), size()))
        assert shm_operations() == started + (1 if size() > 1 else 0)
    with shared_memory("off"):
        ms.allreduce(torch.ones(1 << 20))
        assert shm_operations() == started + (1 if size() > 1 else 0)


def test_settings_from_the_environment_are_checked() -> None:
    assert settings._mode_from("") == "auto" and settings._mode_from("0") == "off"
    assert settings._mode_from("1") == "on" and settings._mode_from(" On ") == "on"
    with pytest.raises(ValueError, match="MPISTRATEGY_SHM='maybe'"):
        settings._mode_from("maybe")
    with pytest.raises(ValueError, match="MPISTRATEGY_SHM_MIN_BYTES='1MB'.*whole number"):
        settings._min_bytes_from("1MB")
    with pytest.raises(ValueError, match="auto, on, off"):
        ms.set_shared_memory("sometimes")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 256), nn.Tanh(), nn.Linear(256, 3)).double()


def test_gradient_buckets_are_shared_memory_and_teardown_frees_it() -> None:
    """The reducer's buckets live in one segment (the 48x256 weight, 96 KB, is its own bucket, copied in by its
    hook): gradients are averaged where backward put them, and remove() copies them out and frees the segment."""
    net, reference = _net(), _net()
    reducer = GradientReducer(net, MeanAggregator(), topology(), own_bucket_mb=64 / 1024)
    segment = reducer.memory.segment
    copied = [place.name for bucket in reducer.layout.buckets for place in bucket.places if place.copied]
    assert segment is not None and len(copied) == 1
    assert all(shm_window.locate(b.buffer)[0] is segment for b in reducer.buckets)
    batches = torch.randn(size(), 4, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for _ in range(2):
        net.zero_grad(set_to_none=True)
        reducer.prepare(sync=True)
        net(batches[rank()]).pow(2).sum().backward()
        reducer.wait()
    reference(batches.reshape(-1, 48)).pow(2).sum().div(size()).backward()
    for param, expected in zip(net.parameters(), reference.parameters(), strict=True):
        assert shm_window.locate(param.grad)[0] is segment
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-10, atol=1e-12)
    reducer.remove()
    assert shm_window.find(segment.id) is None, "the buckets' shared memory was not freed"
    for param, expected in zip(net.parameters(), reference.parameters(), strict=True):
        assert shm_window.locate(param.grad) is None
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-10, atol=1e-12)
    assert math.isfinite(float(ms.allreduce(torch.ones(3)).sum()))  # the released groups are rebuilt on demand


def test_room_in_dev_shm_is_checked_on_every_rank_before_large_buckets_go_there(caplog) -> None:
    """A segment that /dev/shm cannot hold would kill the ranks when its pages are touched (SIGBUS): every rank
    gets the same answer, and rank 0 says what to do."""
    machine = shm_window.machine_comm()
    assert shm_window.room_for(4096, machine, "test buckets")
    with caplog.at_level("WARNING", logger=shm_window.__name__):
        assert not shm_window.room_for(2**50, machine, "test buckets")
    said = [r.getMessage() for r in caplog.records if "test buckets" in r.getMessage()]
    assert len(said) == (1 if machine.Get_rank() == 0 else 0)
    assert all("--shm-size" in message and "/dev/shm" in message for message in said)


def test_non_blocking_prod_backward_sums_the_cotangents_through_shared_memory() -> None:
    """iallreduce prod's backward allreduces the cotangents with sum, which goes through shared memory: rank r's
    gradient is (sum_s g_s) * prod_{s != r} x_s (a regression: its backward once expected MPI requests)."""
    x = per_rank(1003, torch.float64, seed=5).requires_grad_()
    g = per_rank(1003, torch.float64, seed=6)
    started = shm_operations()
    ms.iallreduce(x, "prod").wait().backward(g)
    inputs, cotangents = gather_reference(x), gather_reference(g)
    others = torch.stack([t for r, t in enumerate(inputs) if r != rank()]).prod(0) if size() > 1 else torch.ones(1003)
    torch.testing.assert_close(x.grad, torch.stack(cotangents).sum(0) * others, rtol=1e-12, atol=1e-12)
    assert built_group(ms.world().backward) is not None and shm_operations() == started
