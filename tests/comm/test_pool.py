"""The receive pool: host storages recycled by byte size, and only once nothing refers to them (one process)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from mpistrategy.comm import pool
from mpistrategy.comm.pool import ReceivePool

N = 1 << 14  # float64 elements: 128 KiB, above the pool's minimum size


def test_a_storage_is_handed_out_again_only_after_its_tensor_is_gone() -> None:
    receive = ReceivePool(1 << 30)
    first = receive.empty((N,), torch.float64)
    address = first.data_ptr()
    second = receive.empty((N,), torch.float64)
    assert second.data_ptr() != address
    del first
    third = receive.empty((2, N // 2), torch.float64)
    assert third.data_ptr() == address and third.shape == (2, N // 2) and third.is_contiguous()
    assert third._base is None and not third.requires_grad
    assert receive.held_bytes == 2 * N * 8


@pytest.mark.parametrize("holder", ["view", "numpy", "saved by autograd"])
def test_memory_a_view_array_or_autograd_node_still_uses_is_not_recycled(holder: str) -> None:
    receive = ReceivePool(1 << 30)
    tensor = receive.empty((N,), torch.float64)
    tensor.fill_(3.0)
    address = tensor.data_ptr()
    if holder == "view":
        kept = tensor[10:20]
    elif holder == "numpy":
        kept = tensor.numpy()
    else:
        leaf = torch.ones(N, dtype=torch.float64, requires_grad=True)
        kept = leaf * tensor  # mul saves ``tensor`` for its backward
    del tensor
    fresh = receive.empty((N,), torch.float64)
    assert fresh.data_ptr() != address
    fresh.fill_(-1.0)
    if holder == "saved by autograd":
        kept.sum().backward()
        assert torch.equal(leaf.grad, torch.full((N,), 3.0, dtype=torch.float64))
    else:
        assert (np.asarray(kept) == 3.0).all()


def test_any_dtype_of_the_same_byte_size_reuses_the_storage() -> None:
    receive = ReceivePool(1 << 30)
    doubles = receive.empty((N,), torch.float64)
    address = doubles.data_ptr()
    del doubles
    floats = receive.empty((2 * N,), torch.float32)
    assert floats.data_ptr() == address and floats.dtype == torch.float32 and floats.numel() == 2 * N


def test_small_requests_bypass_the_pool() -> None:
    receive = ReceivePool(1 << 30)
    small = receive.empty((16,), torch.float64)
    assert small.numel() == 16 and receive.held_bytes == 0


def test_the_pool_never_holds_more_than_its_capacity_and_drops_the_least_recent_sizes() -> None:
    receive = ReceivePool(3 * N * 8, per_size=2)
    for length in (N, N + 8, N + 16, N + 24, N + 32):
        receive.empty((length,), torch.float64)  # released at once
        assert receive.held_bytes <= 3 * N * 8
    sizes = [nbytes for nbytes, kept in receive._storages.items() for _ in kept]
    assert sizes == [(N + 24) * 8, (N + 32) * 8]


def test_a_request_larger_than_the_capacity_is_a_plain_allocation() -> None:
    receive = ReceivePool(N * 8)
    big = receive.empty((2 * N,), torch.float64)
    assert big.numel() == 2 * N and receive.held_bytes == 0


def test_live_buffers_are_not_evicted_to_make_room() -> None:
    receive = ReceivePool(2 * N * 8)
    live = [receive.empty((N,), torch.float64), receive.empty((N,), torch.float64)]
    receive.empty((N + 8,), torch.float64)  # no room: not kept, and neither live buffer is dropped
    assert receive.held_bytes == 2 * N * 8
    address = live[0].data_ptr()
    del live[0]
    assert receive.empty((N,), torch.float64).data_ptr() == address


def test_a_storage_resized_by_its_user_is_not_handed_out_again() -> None:
    receive = ReceivePool(1 << 30)
    tensor = receive.empty((N,), torch.float64)
    tensor.untyped_storage().resize_(0)
    del tensor
    fresh = receive.empty((N,), torch.float64)
    fresh.fill_(1.0)
    assert fresh.untyped_storage().nbytes() == N * 8


def test_clear_forgets_every_storage() -> None:
    receive = ReceivePool(1 << 30)
    tensor = receive.empty((N,), torch.float64)
    receive.clear()
    assert receive.held_bytes == 0 and not receive._storages
    del tensor
    receive.empty((N,), torch.float64)
    assert receive.held_bytes == N * 8


def test_threads_never_share_a_live_buffer() -> None:
    receive = ReceivePool(1 << 30, per_size=2)
    clashes: list[int] = []

    def work(mark: float) -> None:
        for _ in range(300):
            tensor = receive.empty((N,), torch.float64)
            tensor.fill_(mark)
            if not bool((tensor == mark).all()):
                clashes.append(1)

    threads = [threading.Thread(target=work, args=(float(i),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not clashes and receive.held_bytes <= 2 * N * 8


@pytest.mark.parametrize(("value", "expected"), [("", 256 << 20), ("0", 0), ("1048576", 1 << 20)])
def test_the_capacity_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, expected: int) -> None:
    monkeypatch.setenv("MPISTRATEGY_RECEIVE_POOL_BYTES", value)
    assert pool._capacity_from_environment() == expected


def test_a_capacity_that_is_not_a_number_names_the_variable_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPISTRATEGY_RECEIVE_POOL_BYTES", "256MB")
    with pytest.raises(ValueError, match=r"MPISTRATEGY_RECEIVE_POOL_BYTES='256MB'.*0 to switch"):
        pool._capacity_from_environment()
