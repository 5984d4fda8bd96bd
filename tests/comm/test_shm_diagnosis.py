"""Desynchronised ranks around the shared-memory allreduce: a rank in another collective meets the allreduce's
check in the node's flags, and every rank raises at once the error that names each rank's call (not the stall
watchdog after its timeout); the next allreduce works. 2 and 3 ranks on one node, shared memory forced on."""

from __future__ import annotations

import gc
import re
from collections.abc import Callable

import pytest
import torch

import mpistrategy as ms
from mpistrategy import CommunicationError
from mpistrategy.comm import shm_window
from mpistrategy.comm.shm import built_group, shared_memory
from tests.adjoint import rank, size

pytestmark = pytest.mark.mpi(ranks=(2, 3), timeout=120)

NUMEL = 1000


@pytest.fixture(autouse=True)
def group_built():
    """Shared memory on for every size, and the world's group built by a first allreduce."""
    with shared_memory("on"):
        ms.allreduce(torch.ones(NUMEL))
        assert built_group(ms.world().forward) is not None
        yield


def late() -> bool:
    return rank() == size() - 1


def raised(call: Callable[..., object], *args: object) -> str:
    """The message of the :class:`CommunicationError` that ``call(*args)`` raises (no reference to its traceback,
    which holds the tensors of the call, is kept)."""
    try:
        call(*args)
    except CommunicationError as error:
        return str(error)
    raise AssertionError("the ranks' different calls raised nothing")


def assert_names_every_call(message: str, mine: str, theirs: str) -> None:
    """``message`` says the ranks called different collectives, ``mine`` on every rank but the last, ``theirs`` on
    the last (regular expressions of the calls)."""
    assert "ranks called different collectives" in message, message
    for other in range(size() - 1):
        assert re.search(rf"rank {other}: {mine} at \S*test_shm_diagnosis\.py:\d+", message), message
    assert re.search(rf"rank {size() - 1}: {theirs} at \S*test_shm_diagnosis\.py:\d+", message), message


def still_in_step() -> None:
    assert torch.equal(ms.allreduce(torch.ones(NUMEL)), torch.full((NUMEL,), float(size())))


def test_a_blocking_shared_memory_allreduce_and_a_broadcast_raise_on_every_rank() -> None:
    x = torch.ones(NUMEL)
    message = raised(lambda: ms.broadcast(x, root=0) if late() else ms.allreduce(x))
    assert_names_every_call(
        message, r"allreduce\(float32\[1000\], op=sum, shared memory=True\)", r"broadcast\(root=0\)"
    )
    still_in_step()


def test_a_non_blocking_shared_memory_allreduce_and_an_allgather_raise_on_every_rank() -> None:
    x = torch.ones(NUMEL)
    message = raised(lambda: ms.allgather(x) if late() else ms.iallreduce(x).wait())
    assert_names_every_call(
        message, r"iallreduce\(float32\[1000\], op=sum, shared memory=True\)", r"allgather\(float32\[1000\], dim=0\)"
    )
    still_in_step()


def test_an_allreduce_in_the_shared_window_and_a_reduce_raise_on_every_rank() -> None:
    segment = shm_window.allocate(NUMEL * 4, ms.world().comm)
    window = segment.typed(segment.rank, 0, NUMEL, torch.float32).fill_(1.0)
    with torch.no_grad():
        call = (lambda w: ms.reduce(w, root=0)) if late() else (lambda w: ms.allreduce(w, out=w))
        message = raised(call, window)
    assert_names_every_call(
        message,
        r"allreduce\(float32\[1000\], op=sum, shared memory=True\)",
        r"reduce\(float32\[1000\], op=sum, root=0\)",
    )
    assert torch.equal(window, torch.ones(NUMEL)), "a rank reduced although the check failed"
    with torch.no_grad():
        assert torch.equal(ms.allreduce(window, out=window), torch.full((NUMEL,), float(size())))
    del window
    gc.collect()  # the error raised and the frame that raised it refer to each other, and its frames to the window
    assert segment.free()


def test_ops_that_agree_still_pass_their_payload_on_a_communicator_with_a_group() -> None:
    """A broadcast checks through the flags and then sends its header through MPI: the receivers learn shape and
    dtype from the root."""
    sent = torch.arange(15.0).reshape(3, 5) if rank() == 0 else None
    assert torch.equal(ms.broadcast(sent, root=0), torch.arange(15.0).reshape(3, 5))
    still_in_step()
