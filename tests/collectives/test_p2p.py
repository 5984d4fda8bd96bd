"""send, recv, sendrecv, isend, irecv on 2-4 ranks (run under the MPI harness).

Adjoint tests use random per-rank inputs and cotangents; the large cases (2**20 float64 = 8 MiB per message)
are far above the eager limit, so every message is a rendezvous and a send completes only when its receive is
posted: the both-directions tests deadlock if any wait (forward or backward) blocks on a peer taking delivery.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy import CommunicationError, Placeholder
from mpistrategy.collectives import _p2p_wire, p2p
from mpistrategy.comm.buffers import DTYPE_CODES
from tests.adjoint import assert_adjoint, random_like_rank, rank, rank_generator, size

pytestmark = pytest.mark.mpi(ranks=(2, 3, 4))

COMM = MPI.COMM_WORLD
LARGE = 1 << 20
SIZES = {"small": (3, 5), "rendezvous": (LARGE,)}


def _right() -> int:
    return (rank() + 1) % size()


def _left() -> int:
    return (rank() - 1) % size()


@pytest.fixture(autouse=True)
def _no_leftovers():
    """Every test leaves no queued receive and no gradient send in flight."""
    yield
    p2p.wait_backward_sends()
    assert not _p2p_wire.arriving, "a receive is still queued"
    assert not _p2p_wire.self_sent, "a message to the own rank is counted as not received"
    assert not _p2p_wire.detached_sends
    COMM.Barrier()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaN, -0.0 and half precision compare exactly."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(_bits(actual), _bits(expected))


def _rank_tensor(source: int, dtype: torch.dtype, shape: tuple[int, int] = (4, 6)) -> torch.Tensor:
    """What rank ``source`` sends in the dtype tests: reproducible on every rank, with special values."""
    generator = torch.Generator().manual_seed(17 + source)
    values = torch.randn(shape, dtype=torch.float64, generator=generator) * 100
    if dtype == torch.bool:
        return values > 0
    if dtype.is_floating_point or dtype.is_complex:
        tensor = values.to(dtype)
        flat = tensor.view(-1)
        flat[:5] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e-40]).to(dtype)
        if dtype.is_complex:
            tensor = tensor + 1j * values.flip(0).to(dtype)
        return tensor
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype, generator=generator)


# ---------------------------------------------------------------------------------------------------------------
# Adjoint tests


@pytest.mark.parametrize("shape", SIZES.values(), ids=SIZES.keys())
def test_send_recv_ring_adjoint(shape):
    # Rank 0 sends first and the others receive first, so the blocking ring completes.
    def forward(x):
        if rank() == 0:
            placeholder = ms.send(x, _right(), tag=3)
            y = ms.recv(_left(), tag=3)
        else:
            y = ms.recv(_left(), tag=3)
            placeholder = ms.send(x * 2, _right(), tag=3)
        assert isinstance(placeholder, Placeholder) and placeholder.requires_grad
        return y + placeholder

    assert_adjoint(forward, random_like_rank(shape, seed=1), seed=1)


@pytest.mark.parametrize("shape", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("shift", [1, -1, 2, 0])
def test_sendrecv_shift_adjoint(shift, shape):
    def forward(x):
        return ms.sendrecv(x, (rank() + shift) % size(), (rank() - shift) % size())

    assert_adjoint(forward, random_like_rank(shape, seed=2), seed=2)


@pytest.mark.parametrize("shape", SIZES.values(), ids=SIZES.keys())
def test_sendrecv_both_directions_adjoint(shape):
    """Two sendrecvs in opposite directions: their backwards send and receive in both directions at once."""

    def forward(x):
        y = ms.sendrecv(x, _right(), _left(), tag=1)
        z = ms.sendrecv(x * (1 + rank()), _left(), _right(), tag=1)
        return y + 3 * z

    assert_adjoint(forward, random_like_rank(shape, seed=3), seed=3)


@pytest.mark.parametrize("shape", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("order", ["sends first", "receives first", "interleaved"])
def test_isend_irecv_both_directions_adjoint(order, shape):
    # On 2 ranks right() == left(): both messages go to the same peer with the same tag and must match in order.
    def forward(x):
        to_right = ms.isend(x, _right(), tag=5)
        to_left = ms.isend(x * (2 + rank()), _left(), tag=5)
        from_left = ms.irecv(_left(), tag=5)
        from_right = ms.irecv(_right(), tag=5)
        if order == "sends first":
            placeholders = [to_right.wait(), to_left.wait()]
            received = [from_left.wait(), from_right.wait()]
        elif order == "receives first":
            received = [from_left.wait(), from_right.wait()]
            placeholders = [to_right.wait(), to_left.wait()]
        else:
            a = from_right.wait()
            placeholders = [to_left.wait()]
            received = [from_left.wait(), a]
            placeholders.append(to_right.wait())
        return received[0] + 5 * received[1] + placeholders[0] + placeholders[1]

    assert_adjoint(forward, random_like_rank(shape, seed=4), seed=4)


@pytest.mark.parametrize("dtype", [torch.complex128, torch.float32], ids=str)
def test_a_complex_or_float32_message_of_isend_and_irecv_carries_its_cotangent_back(dtype):
    """A ring of non-blocking messages: the sender's gradient is the receiver's cotangent, in the message's dtype
    (the receive's link to autograd is a float32 token, whose gradient keeps the token's type)."""
    x = random_like_rank((4, 3), seed=8).to(dtype).requires_grad_()
    sent = ms.isend(x, _right(), tag=9)
    received = ms.irecv(_left(), tag=9).wait()
    cotangent = torch.randn(received.shape, dtype=dtype, generator=rank_generator(31))
    (received + sent.wait()).backward(cotangent)  # the placeholder joins backward through the sum
    assert x.grad is not None and x.grad.dtype == dtype
    assert torch.equal(x.grad, COMM.allgather(cotangent)[_right()])


def test_mixed_requires_grad_sendrecv():
    """Only even ranks' tensors require grad: gradients flow exactly where a sender asked for them."""
    shape = (4, 3)
    x = random_like_rank(shape, seed=5).requires_grad_(rank() % 2 == 0)
    y = ms.sendrecv(x, _right(), _left())
    assert y.requires_grad == (rank() % 2 == 0 or _left() % 2 == 0)
    weight = torch.randn(shape, dtype=torch.float64, generator=rank_generator(6))
    if y.requires_grad:
        (y * weight).sum().backward()
    if x.requires_grad:
        expected = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6000 + _right()))
        torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_backward_passes_in_different_orders():
    """A chain 0 -> 1 -> ... with two rendezvous-size messages per link, whose backward passes run in opposite
    orders on neighbouring ranks. Gradient sends must not wait for the peer inside (or at the end of) a backward
    pass, or rank r waits for r-1 to take gradient 0 while r-1 waits for gradient 1."""
    first, last = rank() == 0, rank() == size() - 1
    x = random_like_rank((2, LARGE), seed=7).requires_grad_()
    outputs = []
    for k in range(2):
        value = x[k] * 2 if first else ms.recv(rank() - 1, tag=0) + x[k]
        outputs.append(value if last else ms.send(value * (1 + rank()), rank() + 1, tag=0))
    cotangents = torch.randn((2, LARGE), dtype=torch.float64, generator=rank_generator(8))
    lhs = 0.0
    for k in (0, 1) if rank() % 2 == 0 else (1, 0):
        if last:
            outputs[k].backward(cotangents[k])
            lhs += float((outputs[k].detach() * cotangents[k]).sum())
        else:
            outputs[k].backward()
    rhs = float((x.detach() * x.grad).sum())
    assert math.isclose(COMM.allreduce(lhs), COMM.allreduce(rhs), rel_tol=1e-10)


# ---------------------------------------------------------------------------------------------------------------
# What travels: dtypes, shapes, requires_grad, order


@pytest.mark.parametrize("dtype", DTYPE_CODES, ids=str)
def test_dtype_round_trip_bit_exact(dtype):
    sent = _rank_tensor(rank(), dtype)
    received = ms.sendrecv(sent.t(), _right(), _left())  # a non-contiguous input
    _assert_bit_equal(received, _rank_tensor(_left(), dtype).t())

    if rank() == 0:
        ms.send(sent.t(), _right(), tag=9)
        received = ms.recv(_left(), tag=9)
    else:
        received = ms.recv(_left(), tag=9)
        ms.send(sent.t(), _right(), tag=9)
    _assert_bit_equal(received, _rank_tensor(_left(), dtype).t())

    handle = ms.irecv(_left(), tag=9)
    ms.isend(sent[:, ::2], _right(), tag=9).wait()
    _assert_bit_equal(handle.wait(), _rank_tensor(_left(), dtype)[:, ::2])


CASES = {
    "float requires grad": (torch.float64, (3, 4), True, True),
    "float no grad": (torch.float32, (5,), False, True),
    "under no_grad": (torch.float64, (2, 2), True, False),
    "bfloat16 requires grad": (torch.bfloat16, (2, 3), True, True),
    "int64": (torch.int64, (2, 1, 3), False, True),
    "bool": (torch.bool, (7,), False, True),
    "0-d": (torch.float64, (), True, True),
    "empty": (torch.float64, (2, 0, 3), True, True),
    "12 dims": (torch.float64, (1,) * 11 + (2,), True, True),
}


@pytest.mark.parametrize(("dtype", "shape", "requires_grad", "grad_mode"), CASES.values(), ids=CASES.keys())
def test_receiver_learns_shape_dtype_requires_grad(dtype, shape, requires_grad, grad_mode):
    tensor = torch.ones(shape, dtype=dtype).requires_grad_(requires_grad)
    expected_grad = requires_grad and grad_mode
    with torch.set_grad_enabled(grad_mode):
        if rank() == 0:
            placeholder = ms.send(tensor, _right(), tag=2)
            received = ms.recv(_left(), tag=2)
        else:
            received = ms.recv(_left(), tag=2)
            placeholder = ms.send(tensor, _right(), tag=2)
        exchanged = ms.sendrecv(tensor, _right(), _left(), tag=2)
        handle = ms.irecv(_left(), tag=2, device="cpu")
        isent = ms.isend(tensor, _right(), tag=2).wait()
        ireceived = handle.wait()
    for result in (received, exchanged, ireceived):
        assert result.shape == torch.Size(shape) and result.dtype == dtype and result.device.type == "cpu"
        assert result.requires_grad == expected_grad
        assert torch.equal(result, torch.ones(shape, dtype=dtype))
    for sent, op in ((placeholder, "send"), (isent, "isend")):
        assert (sent.op, sent.holder, sent.shape, sent.dtype) == (op, _right(), torch.Size(shape), dtype)
        assert sent.requires_grad == expected_grad
    if expected_grad:  # every rank takes part in backward of its messages
        (received.sum() + exchanged.sum() + ireceived.sum() + placeholder + isent).backward()
        assert torch.equal(tensor.grad, torch.full(shape, 3.0, dtype=dtype))


def test_messages_with_one_tag_arrive_in_order():
    """Messages from one source with one tag, of different shapes and dtypes, received by a mix of irecv and
    recv, waited for out of order: each gets the message MPI would match it with (the order of the calls)."""
    messages = [torch.arange(3.0), torch.ones(2, 5, dtype=torch.int32), torch.zeros(LARGE), torch.tensor(7.0)]
    sends = [ms.isend(m * (1 + rank()), _right(), tag=4) for m in messages]
    first = ms.irecv(_left(), tag=4)
    second = ms.irecv(_left(), tag=4)
    third = ms.recv(_left(), tag=4)
    fourth = ms.irecv(_left(), tag=4)
    received = [first, second, third, fourth]
    for index in (3, 1, 0):
        received[index] = received[index].wait()
    for sent in sends:
        assert isinstance(sent.wait(), Placeholder)
    for got, message in zip(received, messages, strict=True):
        _assert_bit_equal(got, message * (1 + _left()))


def test_test_polls_without_blocking():
    receive = ms.irecv(_left(), tag=6)
    send = ms.isend(torch.full((LARGE,), float(rank())), _right(), tag=6)
    while not (receive.test() & send.test()):  # both polled every round
        pass
    assert receive.is_completed() and send.is_completed()
    assert torch.equal(receive.wait(), torch.full((LARGE,), float(_left())))
    assert isinstance(send.wait(), Placeholder)


def test_self_messages():
    x = random_like_rank((4,), seed=9).requires_grad_()
    y = ms.sendrecv(x, rank(), rank())
    handle = ms.irecv(rank(), tag=1)
    placeholder = ms.isend(x * 2, rank(), tag=1).wait()
    z = handle.wait()
    assert torch.equal(y, x) and torch.equal(z, x * 2)
    ((y * 3).sum() + (z * 5).sum() + placeholder).backward()
    assert torch.equal(x.grad, torch.full((4,), 13.0, dtype=torch.float64))


@pytest.mark.parametrize("shape", SIZES.values(), ids=SIZES.keys())
def test_blocking_send_and_recv_with_oneself_once_the_other_side_is_posted(shape):
    """As in MPI: a blocking send to oneself completes when an irecv is posted, a blocking recv from oneself when
    an isend is on its way; gradients flow back through both (rendezvous-size messages included)."""
    x = random_like_rank(shape, seed=11).requires_grad_()
    weights = random_like_rank(shape, seed=12)
    receiving = ms.irecv(rank(), tag=2)
    sent = ms.send(x * 3, rank(), tag=2)
    z = receiving.wait()
    sending = ms.isend(x * 5, rank(), tag=3)
    y = ms.recv(rank(), tag=3)
    assert torch.equal(z, x * 3) and torch.equal(y, x * 5)
    ((z * weights).sum() + (y * weights).sum() + sent + sending.wait()).backward()
    torch.testing.assert_close(x.grad, 8 * weights, rtol=1e-15, atol=0)


def test_blocking_self_messages_that_would_wait_forever_are_refused():
    """Messages to oneself match receives in order: only a receive (or message) no earlier one takes counts."""
    x = torch.arange(3.0)
    never = r"is this rank itself, and no .* so a blocking (send|recv) would wait forever"
    with pytest.raises(ValueError, match=never):
        ms.send(x, rank(), tag=4)  # no irecv posted
    with pytest.raises(ValueError, match=never):
        ms.recv(rank(), tag=4)  # no message on its way
    first, second = ms.isend(x, rank(), tag=4), ms.isend(x + 1, rank(), tag=4)
    earlier = ms.irecv(rank(), tag=4)  # takes the first message
    assert torch.equal(ms.recv(rank(), tag=4), x + 1)  # the second
    with pytest.raises(ValueError, match=never):
        ms.recv(rank(), tag=4)  # both are taken
    receiving = ms.irecv(rank(), tag=5)
    later = ms.isend(x + 2, rank(), tag=5)  # takes the posted irecv
    with pytest.raises(ValueError, match=never):
        ms.send(x, rank(), tag=5)
    with pytest.raises(ValueError, match="dst=.* tag=6"):
        ms.send(x, rank(), tag=6)  # an irecv with another tag does not count
    assert torch.equal(earlier.wait(), x) and torch.equal(receiving.wait(), x + 2)
    for handle in (first, second, later):
        handle.wait()


def test_no_gradient_messages_without_grad():
    # Neither side runs a backward: nothing must be left waiting.
    x = torch.arange(4.0)
    y = ms.sendrecv(x, _right(), _left())
    assert not y.requires_grad
    ms.isend(x, _right()).wait().backward()  # a no-op for a placeholder without grad
    assert not ms.irecv(_left()).wait().requires_grad


def test_wrapped_subcommunicator():
    sub = COMM.Split(color=rank() % 2, key=rank())
    try:
        wrapped = ms.Communicator(sub)
        x = random_like_rank((3,), seed=10)
        y = ms.sendrecv(x, (sub.rank + 1) % sub.size, (sub.rank - 1) % sub.size, comm=sub)
        source = (sub.rank - 1) % sub.size
        world_source = sub.group.Translate_ranks([source], COMM.group)[0]
        expected = torch.randn((3,), dtype=torch.float64, generator=torch.Generator().manual_seed(10000 + world_source))
        assert torch.equal(y, expected)
        assert wrapped.size == sub.size
    finally:
        COMM.Barrier()


# ---------------------------------------------------------------------------------------------------------------
# Errors. A bad peer or tag raises on its rank before anything is sent (there is no peer to tell); a sender whose
# other checks fail sends its dst a failure notice in place of the message, which the matching receive raises.


def _unaddressed_calls(x: torch.Tensor) -> list[tuple[type[Exception], str, Callable[[], object]]]:
    ub = COMM.Get_attr(MPI.TAG_UB)
    return [
        (ValueError, rf"dst={size()} is not a rank .* between 0 and {size() - 1}", lambda: ms.send(x, size())),
        (ValueError, r"dst=-1 is not a rank", lambda: ms.isend(x, -1)),
        (ValueError, r"src=7\.0 is not a rank", lambda: ms.recv(7.0)),
        (ValueError, r"src=MPI.ANY_SOURCE is not supported", lambda: ms.recv(MPI.ANY_SOURCE)),
        (ValueError, r"src=MPI.ANY_SOURCE is not supported", lambda: ms.irecv(MPI.ANY_SOURCE)),
        (ValueError, rf"dst={rank()} is this rank itself.*sendrecv", lambda: ms.send(x, rank())),
        (ValueError, rf"src={rank()} is this rank itself", lambda: ms.recv(rank())),
        (ValueError, rf"tag=-1 is not a valid tag; pass an int between 0 and {ub}", lambda: ms.send(x, _right(), -1)),
        (ValueError, r"tag=.* is not a valid tag", lambda: ms.irecv(_left(), tag=ub + 1)),
        (ValueError, r"tag=.* is not a valid tag", lambda: ms.recv(_left(), tag=MPI.ANY_TAG)),
        (ValueError, r"tag=1\.5 is not a valid tag", lambda: ms.sendrecv(x, _right(), _left(), tag=1.5)),
    ]


def _failed_sends(x: torch.Tensor) -> list[tuple[type[Exception], str, Callable[[], object]]]:
    """Sends to ``right()`` (tag 0) whose checks fail; each leaves a failure notice for it."""
    return [
        (TypeError, r"send: expected a torch.Tensor", lambda: ms.send([1.0, 2.0], _right())),
        (TypeError, r"cannot be communicated", lambda: ms.send(torch.zeros(2, dtype=torch.uint16), _right())),
        (ValueError, r"more than 12 dimensions", lambda: ms.isend(torch.zeros((1,) * 13), _right())),
        (ValueError, r"meta device", lambda: ms.isend(torch.zeros(2, device="meta"), _right())),
        (ValueError, rf"src={size() + 3} is not a rank", lambda: ms.sendrecv(x, _right(), size() + 3)),
    ]


def test_errors_raise_on_every_rank_and_failed_sends_tell_their_receivers():
    x = torch.ones(3, requires_grad=True)
    for error, pattern, call in _unaddressed_calls(x):
        with pytest.raises(error, match=pattern):
            call()
    assert not _p2p_wire.arriving
    for error, pattern, call in _failed_sends(x):
        with pytest.raises(error, match=pattern) as caught:
            call()
        assert f"rank {_right()}, its peer, raises too" in "".join(getattr(caught.value, "__notes__", []))
        with pytest.raises(CommunicationError, match=rf"recv: rank {_left()} failed the checks .*{pattern}"):
            ms.recv(_left())
    assert not _p2p_wire.arriving


@pytest.mark.parametrize("culprit", [0, -1])
def test_errors_on_one_rank_do_not_hang_the_others(culprit):
    """Only one rank makes the bad calls (its right neighbour receives the failure notices); all then take part in
    a normal exchange, whose message numbers and queues must be intact (a failed call consumes no message number
    and leaves no queued receive)."""
    x = torch.arange(3.0, requires_grad=True)
    if rank() == culprit % size():
        for error, pattern, call in _unaddressed_calls(x) + _failed_sends(x):
            with pytest.raises(error, match=pattern):
                call()
    elif _left() == culprit % size():
        for _ in _failed_sends(x):
            with pytest.raises(CommunicationError, match=f"rank {_left()} failed the checks"):
                ms.irecv(_left()).wait()
    y = ms.sendrecv(x * (1 + rank()), _right(), _left(), tag=8)
    assert torch.equal(y, torch.arange(3.0) * (1 + _left()))
    (y * (1 + rank())).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float((1 + rank()) * (1 + _right()))))


def test_unwrapped_communicator_is_refused():
    dup = COMM.Dup()
    try:
        with pytest.raises(ValueError, match=r"mpistrategy.Communicator\(comm\) on every rank"):
            ms.send(torch.ones(2), _right(), comm=dup)
        with pytest.raises(ValueError, match=r"mpistrategy.Communicator\(comm\) on every rank"):
            ms.irecv(_left(), comm=dup)
    finally:
        dup.Free()
