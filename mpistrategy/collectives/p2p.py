"""Point-to-point ops: ``send``, ``recv``, ``sendrecv``, ``isend`` and ``irecv``, all on the autograd path.

Adjoints (objective = sum of every rank's loss, ``L = sum_r L_r``). A message is the linear map ``y_d = x_s``
from the sender s to the receiver d, so with ``g_d = dL_d/dy_d``:

- ``send(x, dst=d)`` on s: ``dL/dx = g_d``; backward receives the gradient from d. The sender holds no result,
  only a :class:`Placeholder` held by d; ``placeholder.backward()`` (or ``loss + placeholder``) runs that receive.
- ``recv(src=s)`` on d: backward sends ``g_d`` to s. Nothing flows into d's own graph.
- ``sendrecv(x, dst, src)``: ``y_r = x_src``; backward sends ``g_r`` to ``src`` and receives the gradient of
  ``x_r`` from ``dst``: a sendrecv of the gradients with ``dst`` and ``src`` swapped.
- ``isend``/``irecv``: as send/recv, split over the Start/Finish nodes of :mod:`handles`: irecv's backward
  posts an Isend of the gradient, isend's backward posts an Irecv that completes where autograd needs it.

Wire protocol. Receivers pass no tensor: every message is two MPI messages on ``comm.forward`` with the user's
tag, a header of ``HEADER_LENGTH + 1`` int64 values (:class:`TensorMeta`: dtype, requires_grad, shape; then the
sender's running *number* of the message for this destination) and then the data, moved bit-exactly with
:func:`transfer_type`. ``requires_grad`` in the header is the sender's ``tensor.requires_grad`` under grad mode;
when it is set, the received tensor requires grad and its backward returns the gradient. Gradients travel on
``comm.backward`` with tag ``number mod (MPI_TAG_UB + 1)``, so each gradient finds its message even when
backward passes run in another order than the forward messages (micro-batches of a pipeline, several messages
with one tag).

Message order. A header can only be received before its data, and the data receive can only be posted once the
header is there. Receives from the same ``(src, tag)`` are therefore queued per rank: only the oldest one has its
header receive posted; when its header arrives its data receive is posted and then the next header receive. So
MPI matches headers and data in order, and receives match messages in the order they were called (``irecv`` then
``recv`` from the same source and tag get the first and second message, as in MPI).

Deadlock safety.

- Forward: every wait in this module (a blocking op, ``Handle.wait()``, a backward receive) waits on its own
  requests *and* on the headers of queued receives, posting their data receives as soon as the headers arrive
  (:func:`_wait`). So two ranks that ``isend`` rendezvous-size tensors to each other and ``irecv`` them can wait
  for the handles in any order. ``Handle.test()`` makes the same progress without blocking.
- Backward: gradient *sends* (backward of recv, irecv and of sendrecv's receive) are ``Isend`` and never waited
  for inside backward: the request and a buffer it owns go to a list; finished ones are released at the end of
  each backward pass (``Variable._execution_engine.queue_callback``), by every later p2p call and by
  :func:`wait_backward_sends`; any left are waited for at interpreter exit. Gradient *receives* (backward of send,
  isend and sendrecv) block where autograd needs the value. A rank's backward therefore only waits for gradients
  it needs, never for a peer to take one: ranks exchanging rendezvous-size messages in both directions cannot
  deadlock in backward, and neither can ranks that run separate backward passes (such as a pipeline's
  micro-batches) in different orders. Waiting at the end of each backward pass would deadlock in the second case.

Errors. Point-to-point ops check their arguments locally, with no exchange. A sender whose checks fail (a
``None`` or ``meta`` tensor, a dtype that cannot be sent, sendrecv's ``src`` out of range) sends its ``dst`` a
failure notice instead of the message and raises; the receive that matches it, waiting already or called later,
raises a :class:`CommunicationError` naming the op, the sender and its error, so neither rank waits and the next
message pairs as it should. ``sendrecv`` also takes and drops the message its ``src`` sends it. An invalid
``dst`` or ``tag`` raises on the sender only, and an invalid ``src`` or ``tag`` on the receiver only: there is
no peer to tell. A peer waiting for that sender's message then waits until the job ends, and a message sent to
that receiver stays queued (a blocking send of a large one waits) until its next receive from that sender with
that tag takes it.

Self messages. ``sendrecv(x, dst=rank, src=rank)``, ``isend`` and ``irecv`` to and from the own rank always work.
A blocking ``send`` to the own rank works when an ``irecv`` from it with that tag is already posted and no earlier
message to itself will take it (as in MPI, where the send then completes); a blocking ``recv`` from the own rank
works when a message to itself with that tag (an ``isend``, a ``sendrecv``) is on its way that no earlier receive
will take. Otherwise they raise at once, naming what to post first: they would wait forever. The module counts,
per communicator and tag, the receives from the own rank still waiting for a header (``_arriving``) and the
messages to the own rank no receive has taken yet (``_self_sent``): MPI matches them in order, so the k-th such
message goes to the k-th such receive.

Limitations. ``MPI.ANY_SOURCE`` and ``MPI.ANY_TAG`` are not supported (the gradient must go back to a rank known
when the receive is posted). The data of an ``irecv`` is received while this rank is inside a p2p call (including
``handle.test()``); a peer blocked in a large ``send`` to it waits until then, so call ``handle.test()`` or
``wait()`` before blocking in a collective that the sender only reaches after its send. A rank that holds a
gradient-carrying result must run its backward, or the peer waiting for that gradient hangs. Receivers under
``torch.no_grad()`` must only receive from senders under ``no_grad`` too. Not thread-safe: call p2p ops (and
backward through them) from one thread.
"""

from __future__ import annotations

import atexit
import contextlib
from collections import deque
from typing import cast

import torch
from mpi4py import MPI

from mpistrategy.collectives._compile import eager_under_compile
from mpistrategy.collectives.handles import Handle, Link, Pending
from mpistrategy.collectives.placeholder import Placeholder, anchor
from mpistrategy.comm.buffers import check_tensor, empty_on_wire, mpi_buffer, off_wire, on_wire
from mpistrategy.comm.checks import attempt, check_rank
from mpistrategy.comm.communicator import Communicator, resolve
from mpistrategy.comm.errors import CommunicationError, with_note
from mpistrategy.comm.metadata import HEADER_LENGTH, TensorMeta

# The p2p header: TensorMeta's HEADER_LENGTH values, then the sender's number for the message.
_HEADER_LENGTH = HEADER_LENGTH + 1
_CPU = torch.device("cpu")

_numbers: dict[tuple[Communicator, int], int] = {}  # next message number, per (communicator, destination)
_tag_bounds: dict[Communicator, int] = {}
_arriving: dict[tuple[Communicator, int, int], deque[_Incoming]] = {}  # receives without a posted data receive
_self_sent: dict[tuple[Communicator, int], int] = {}  # per (communicator, tag): messages to itself not yet received
# Isends nobody waits for (gradients sent in backward, failure notices) and their buffers, released once complete.
_detached_sends: list[tuple[MPI.Request, torch.Tensor]] = []

# A sender whose checks fail sends its peer a failure notice instead of the message: a header with _FAILED first
# and the length of the notice's text second, then the text (UTF-8, at most _NOTICE_BYTES) as the data.
_FAILED = -1
_NOTICE_BYTES = 2000


# ---------------------------------------------------------------------------------------------------------------
# Arguments


def _tag_bound(comm: Communicator) -> int:
    bound = _tag_bounds.get(comm)
    if bound is None:
        bound = _tag_bounds[comm] = int(cast(int, comm.comm.Get_attr(MPI.TAG_UB)))  # MPI sets it on every comm
    return bound


def _check_tag(tag: int, comm: Communicator, what: str) -> None:
    bound = _tag_bound(comm)
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= bound:
        raise ValueError(
            f"{what}: tag={tag!r} is not a valid tag; pass an int between 0 and {bound} (MPI_TAG_UB of this "
            "communicator). MPI.ANY_TAG is not supported."
        )


def _check_peer(peer: int, comm: Communicator, what: str, role: str) -> None:
    if role == "src" and isinstance(peer, int) and not isinstance(peer, bool) and peer == MPI.ANY_SOURCE:
        raise ValueError(
            f"{what}: {role}=MPI.ANY_SOURCE is not supported (the gradient must go back to a rank known when the "
            f"receive is posted); pass the sending rank, between 0 and {comm.size - 1}."
        )
    check_rank(peer, comm, what, role)


def _check_blocking_self(peer: int, tag: int, comm: Communicator, what: str) -> None:
    """Raise if a blocking ``send`` (``what="send"``, ``peer`` its dst) or ``recv`` (its src) with the own rank
    would wait forever: nothing posted earlier on this rank completes it (see Self messages)."""
    if peer != comm.rank:
        return
    unmatched = len(_arriving.get((comm, peer, tag), ())) - _self_sent.get((comm, tag), 0)
    if what == "send" and unmatched <= 0:
        raise ValueError(
            f"send: dst={peer} is this rank itself, and no irecv(src={peer}, tag={tag}) posted before is waiting "
            f"for the message, so a blocking send would wait forever. Post that irecv first, or use isend (or "
            f"sendrecv(tensor, dst={peer}, src={peer}))."
        )
    if what == "recv" and unmatched >= 0:
        raise ValueError(
            f"recv: src={peer} is this rank itself, and no message from this rank to itself with tag={tag} (an "
            "isend or sendrecv posted before) is on its way that an earlier receive does not take, so a blocking "
            f"recv would wait forever. Post isend(tensor, dst={peer}, tag={tag}) first, or use irecv."
        )


def _count_self_message(comm: Communicator, dst: int, tag: int, change: int) -> None:
    """Count a message to the own rank in ``_self_sent`` (+1 when posted, -1 when its header is received)."""
    if dst == comm.rank:
        count = _self_sent.get((comm, tag), 0) + change
        if count:
            _self_sent[(comm, tag)] = count
        else:
            del _self_sent[(comm, tag)]


def _prepare_send(
    tensor: torch.Tensor,
    dst: int,
    tag: int,
    comm: MPI.Comm | Communicator | None,
    what: str,
    src: int | None = None,
) -> tuple[Communicator, torch.Tensor]:
    """Check the arguments of a send (and sendrecv's ``src``) and build its header (numbered by :func:`_number`).

    An invalid ``dst`` or ``tag``, or a blocking send to the own rank that would wait forever, raises here alone:
    there is no peer to tell. Any other problem is first sent to
    ``dst`` as a failure notice, so that the receive waiting for this message raises too; sendrecv then also
    takes the message ``src`` sends it (and drops it), so that ``src`` is not left waiting either.
    """
    comm = resolve(comm, collective=False)
    _check_peer(dst, comm, what, "dst")
    _check_tag(tag, comm, what)
    _check_blocking_self(dst, tag, comm, what)
    header, problem = attempt(_header_of, tensor, what)
    source = None if src is None else attempt(_check_peer, src, comm, what, "src")[1]
    if problem is None and source is None:
        assert header is not None  # _header_of returned
        return comm, header
    problem = problem or source
    assert problem is not None
    _notify(problem, comm, dst, tag, what)
    if src is not None and source is None:
        with contextlib.suppress(CommunicationError):  # src failed too: its notice is dropped like its message
            _receive(_expect(comm, src, tag, _CPU, what))
    raise problem


def _header_of(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The header of a message carrying ``tensor`` (its number still unset); raises if it cannot be sent."""
    check_tensor(tensor, what)
    header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)
    header[:HEADER_LENGTH] = torch.tensor(TensorMeta.of(tensor).encode(what), dtype=torch.int64)
    return header


def _notify(problem: Exception, comm: Communicator, dst: int, tag: int, what: str) -> None:
    """Send ``dst`` a failure notice in place of the message whose checks found ``problem``."""
    text = f"{type(problem).__name__}: {problem}".encode()[:_NOTICE_BYTES]
    header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)
    header[0], header[1] = _FAILED, len(text)
    data = torch.tensor(list(text), dtype=torch.uint8)
    for buffer in (header, data):
        _detached_sends.append((comm.forward.Isend(mpi_buffer(buffer), dst, tag), buffer))
    _count_self_message(comm, dst, tag, +1)
    with_note(problem, f"{what} raised this on rank {comm.rank}; rank {dst}, its peer, raises too when it receives.")


def _number(header: torch.Tensor, comm: Communicator, dst: int) -> int:
    """Give the message its number for ``dst`` (once every check has passed)."""
    number = _numbers.get((comm, dst), 0)
    _numbers[(comm, dst)] = number + 1
    header[HEADER_LENGTH] = number
    return number


def _backward_tag(number: int, comm: Communicator) -> int:
    return number % (_tag_bound(comm) + 1)


# ---------------------------------------------------------------------------------------------------------------
# Progress: queued receives, waits that keep them moving, gradient sends in flight


class _Incoming:
    """One message on its way in: first its header, then its data."""

    __slots__ = ("comm", "src", "tag", "device", "what", "header", "request", "meta", "number", "buffer", "failed")

    def __init__(self, comm: Communicator, src: int, tag: int, device: torch.device, what: str) -> None:
        self.comm, self.src, self.tag, self.device, self.what = comm, src, tag, device, what
        self.header = torch.empty(_HEADER_LENGTH, dtype=torch.int64)
        self.request = MPI.REQUEST_NULL  # the header receive, then the data receive
        self.meta: TensorMeta | None = None  # set once the header has arrived
        self.number = -1
        self.buffer: torch.Tensor | None = None
        self.failed = False  # the sender's checks failed: a failure notice comes instead of the message

    def post_header(self) -> None:
        self.request = self.comm.forward.Irecv(mpi_buffer(self.header), self.src, self.tag)

    def post_data(self) -> None:
        self.failed = int(self.header[0]) == _FAILED
        if self.failed:
            meta = TensorMeta((int(self.header[1]),), torch.uint8, False)
        else:
            meta = TensorMeta.decode(self.header[:HEADER_LENGTH])
        self.number = int(self.header[HEADER_LENGTH])
        self.buffer = empty_on_wire(meta.shape, meta.dtype, _CPU if self.failed else self.device)
        self.request = self.comm.forward.Irecv(mpi_buffer(self.buffer), self.src, self.tag)
        self.meta = meta
        _count_self_message(self.comm, self.src, self.tag, -1)

    def result(self) -> torch.Tensor:
        assert self.buffer is not None and self.meta is not None  # the data receive was posted
        return off_wire(self.buffer, self.meta.dtype, self.device)

    def failure(self) -> CommunicationError:
        """The error of a receive that got a failure notice (once its text has arrived)."""
        assert self.buffer is not None  # the data receive was posted
        text = bytes(self.buffer.tolist()).decode(errors="replace")
        return CommunicationError(
            f"{self.what}: rank {self.src} failed the checks of the message it was sending to rank "
            f"{self.comm.rank} with tag {self.tag}, so nothing was received (on rank {self.src}: {text})."
        )


def _expect(comm: Communicator, src: int, tag: int, device: torch.device, what: str) -> _Incoming:
    """Queue a receive from ``src`` with ``tag``; its header receive is posted when it reaches the queue's head."""
    entry = _Incoming(comm, src, tag, device, what)
    queue = _arriving.setdefault((comm, src, tag), deque())
    queue.append(entry)
    if len(queue) == 1:
        entry.post_header()
    _progress()
    return entry


def _progress() -> None:
    """Never blocks: post the data receive of every queued message whose header has arrived (then the next
    header receive of its queue), and release the gradient sends that have completed."""
    for key in list(_arriving):
        queue = _arriving[key]
        while queue and queue[0].request.Test():
            queue.popleft().post_data()
            if queue:
                queue[0].post_header()
        if not queue:
            del _arriving[key]
    if _detached_sends:
        _detached_sends[:] = [(request, buffer) for request, buffer in _detached_sends if not request.Test()]


def _heads() -> list[MPI.Request]:
    return [queue[0].request for queue in _arriving.values()]


def _wait(requests: list[MPI.Request]) -> None:
    """``MPI_Waitall(requests)`` that meanwhile posts the data receives of queued messages whose headers arrive,
    so that a peer's send to this rank never waits for this rank to leave the wait."""
    requests = list(requests)
    while any(request != MPI.REQUEST_NULL for request in requests):
        _progress()
        heads = _heads()
        if not heads:
            MPI.Request.Waitall(requests)
            break
        MPI.Request.Waitany(requests + heads)  # completed requests become MPI.REQUEST_NULL in place


def _wait_header(entry: _Incoming) -> None:
    """Wait until the header of ``entry`` has arrived; raise if it was a failure notice."""
    _progress()
    while entry.meta is None:  # still queued, so there is at least one header receive to wait on
        MPI.Request.Waitany(_heads())
        _progress()
    if entry.failed:
        _wait([entry.request])
        raise entry.failure()


def _receive(entry: _Incoming) -> torch.Tensor:
    _wait_header(entry)
    _wait([entry.request])
    return entry.result()


def _send_gradient(grad: torch.Tensor, peer: int, number: int, comm: Communicator) -> None:
    """Post the gradient of message ``number`` back to ``peer`` without waiting for it (see Deadlock safety)."""
    buffer = on_wire(grad)
    if buffer.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        buffer = buffer.clone()  # the send outlives this backward node: it must own its buffer
    request = comm.backward.Isend(mpi_buffer(buffer), peer, _backward_tag(number, comm))
    _detached_sends.append((request, buffer))
    try:
        torch.autograd.Variable._execution_engine.queue_callback(_progress)
    except RuntimeError:  # not inside a backward pass: later p2p calls release it
        pass


def _receive_gradient(
    shape: torch.Size, dtype: torch.dtype, device: torch.device, peer: int, number: int, comm: Communicator
) -> _Requests:
    """Post the receive of the gradient of message ``number`` from ``peer``; ``wait()`` returns it."""
    buffer = empty_on_wire(tuple(shape), dtype, device)
    request = comm.backward.Irecv(mpi_buffer(buffer), peer, _backward_tag(number, comm))
    return _Requests([request], lambda: off_wire(buffer, dtype, device), keepalive=(buffer,))


@eager_under_compile
def wait_backward_sends() -> None:
    """Block until every gradient this rank sent in a backward pass (and every failure notice) has been received.

    Gradient sends are never waited for inside backward (so that backward cannot deadlock); this completes them,
    for instance before freeing a communicator. It runs by itself at interpreter exit.
    """
    _wait([request for request, _ in _detached_sends])
    _progress()


@atexit.register
def _complete_at_exit() -> None:
    if _detached_sends and MPI.Is_initialized() and not MPI.Is_finalized():
        wait_backward_sends()


class _Requests(Pending):
    """A :class:`Pending` whose ``wait`` and ``test`` keep queued receives progressing."""

    __slots__ = ()

    def wait(self):
        _wait(self.requests)
        return self.finish()

    def test(self) -> bool:
        _progress()
        return super().test()


class _Arrival(Pending):
    """irecv's forward request: done when the message's data has arrived."""

    __slots__ = ("entry",)

    def __init__(self, entry: _Incoming) -> None:
        super().__init__([], entry.result)
        self.entry = entry

    def wait(self) -> torch.Tensor:
        return _receive(self.entry)

    def test(self) -> bool:
        _progress()
        return self.entry.meta is not None and self.entry.request.Test()


def _post_send(
    tensor: torch.Tensor, header: torch.Tensor, dst: int, tag: int, comm: Communicator
) -> tuple[list[MPI.Request], tuple[torch.Tensor, torch.Tensor]]:
    """Post the header and the data of one message; returns the requests and the buffers they use."""
    data = on_wire(tensor)
    requests = [
        comm.forward.Isend(mpi_buffer(header), dst, tag),
        comm.forward.Isend(mpi_buffer(data), dst, tag),
    ]
    _count_self_message(comm, dst, tag, +1)
    return requests, (header, data)


# ---------------------------------------------------------------------------------------------------------------
# Autograd nodes of the blocking ops


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, header: torch.Tensor, dst: int, tag: int, comm: Communicator):
        ctx.dst, ctx.comm, ctx.number = dst, comm, int(header[HEADER_LENGTH])
        ctx.shape, ctx.dtype, ctx.device = tensor.shape, tensor.dtype, tensor.device
        requests, _buffers = _post_send(tensor, header, dst, tag, comm)
        _wait(requests)
        return tensor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        pending = _receive_gradient(ctx.shape, ctx.dtype, ctx.device, ctx.dst, ctx.number, ctx.comm)
        return pending.wait(), None, None, None, None


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, link: torch.Tensor, entry: _Incoming, comm: Communicator):
        ctx.src, ctx.number, ctx.comm = entry.src, entry.number, comm
        return _receive(entry)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _send_gradient(grad, ctx.src, ctx.number, ctx.comm)
        return None, None, None


class _SendRecv(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        tensor: torch.Tensor,
        link: torch.Tensor,
        entry: _Incoming,
        sending: tuple[list[MPI.Request], tuple],
        number: int,
        dst: int,
        comm: Communicator,
    ):
        ctx.comm, ctx.dst, ctx.src = comm, dst, entry.src
        ctx.sent_number, ctx.received_number = number, entry.number
        ctx.shape, ctx.dtype, ctx.device = tensor.shape, tensor.dtype, tensor.device
        assert entry.meta is not None  # the header has arrived
        ctx.return_gradient = entry.meta.requires_grad  # src expects the gradient of what it sent
        result = _receive(entry)
        _wait(sending[0])
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.return_gradient:
            _send_gradient(grad, ctx.src, ctx.received_number, ctx.comm)
        grad_in = None
        if ctx.needs_input_grad[0]:
            pending = _receive_gradient(ctx.shape, ctx.dtype, ctx.device, ctx.dst, ctx.sent_number, ctx.comm)
            grad_in = pending.wait()
        return grad_in, None, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Public ops


@eager_under_compile
def send(tensor: torch.Tensor, dst: int, tag: int = 0, comm: MPI.Comm | Communicator | None = None) -> Placeholder:
    """Send ``tensor`` to rank ``dst``; returns when the tensor may be reused (``MPI_Send`` semantics).

    The sender holds no result: it gets a :class:`Placeholder` held by ``dst``. If ``tensor`` requires grad, the
    placeholder takes part in backward: ``placeholder.backward()`` (or adding it to the loss) receives the
    gradient ``dst`` computes for the received tensor and flows it into ``tensor``'s graph.

    Args:
        tensor: any shape (up to 12 dimensions), dtype, layout or device (CUDA is staged through host memory
            unless MPI is CUDA-aware); its shape, dtype and requires_grad travel ahead of it.
        dst: the receiving rank; this rank only when an :func:`irecv` from it with ``tag`` is already posted
            (else it raises: the send would wait forever; :func:`isend` and :func:`sendrecv` always work).
        tag: an int between 0 and ``MPI_TAG_UB``; messages with one ``(dst, tag)`` arrive in order.
        comm: an mpi4py communicator or :class:`Communicator` (default: the world). A communicator other than
            the world must have been wrapped with ``mpistrategy.Communicator(comm)`` on all its ranks first.
    """
    comm, header = _prepare_send(tensor, dst, tag, comm, "send")
    _progress()
    _number(header, comm, dst)
    result = _Send.apply(tensor, header, dst, tag, comm)
    return Placeholder("send", dst, tuple(tensor.shape), tensor.dtype, result)


@eager_under_compile
def recv(
    src: int,
    tag: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Receive the tensor that rank ``src`` sends with ``tag``; no buffer or shape is needed.

    The result has the sender's shape and dtype and lives on ``device`` (default: the CPU). If the sender's tensor
    required grad, the result requires grad and its backward sends the gradient back to ``src`` (where the
    sender's placeholder receives it). ``src`` is this rank only when a message to itself with ``tag`` is already
    on its way (an :func:`isend` or :func:`sendrecv`) that no earlier receive takes; else it raises (the receive
    would wait forever).
    """
    comm = resolve(comm, collective=False)
    _check_peer(src, comm, "recv", "src")
    _check_tag(tag, comm, "recv")
    _check_blocking_self(src, tag, comm, "recv")
    entry = _expect(comm, src, tag, torch.device(device) if device is not None else _CPU, "recv")
    _wait_header(entry)
    assert entry.meta is not None
    return _Recv.apply(anchor(entry.meta.requires_grad, entry.meta.dtype), entry, comm)


@eager_under_compile
def sendrecv(
    tensor: torch.Tensor, dst: int, src: int, tag: int = 0, comm: MPI.Comm | Communicator | None = None
) -> torch.Tensor:
    """Send ``tensor`` to ``dst`` and receive the tensor ``src`` sends, at once (``MPI_Sendrecv``, deadlock-free).

    The received tensor may differ in shape and dtype from ``tensor``; it lives on ``tensor``'s device. ``dst``
    and ``src`` may be this rank. Backward: the gradient of the result goes back to ``src`` (if ``src``'s tensor
    required grad) and the gradient of ``tensor`` comes from ``dst``: a sendrecv with ``dst`` and ``src`` swapped.
    If only this rank's ``tensor`` requires grad, the result still carries the graph that receives its gradient,
    so it must reach this rank's loss.
    """
    comm, header = _prepare_send(tensor, dst, tag, comm, "sendrecv", src=src)
    _progress()
    number = _number(header, comm, dst)
    sending = _post_send(tensor, header, dst, tag, comm)
    entry = _expect(comm, src, tag, tensor.device, "sendrecv")
    try:
        _wait_header(entry)
    except CommunicationError:  # src sent a failure notice; dst still receives this rank's message
        _detached_sends.extend(zip(*sending, strict=True))
        raise
    assert entry.meta is not None
    link = anchor(entry.meta.requires_grad, entry.meta.dtype)
    return _SendRecv.apply(tensor, link, entry, sending, number, dst, comm)


@eager_under_compile
def isend(tensor: torch.Tensor, dst: int, tag: int = 0, comm: MPI.Comm | Communicator | None = None) -> Handle:
    """Non-blocking :func:`send`: ``handle.wait()`` returns the :class:`Placeholder` once ``tensor`` may be reused.

    Do not modify ``tensor`` before ``wait()``. ``dst`` may be this rank (matched by an :func:`irecv`). Backward of
    the placeholder posts the receive of the gradient when autograd reaches the Finish node and waits for it at
    the Start node, where ``tensor``'s gradient is needed.
    """
    comm, header = _prepare_send(tensor, dst, tag, comm, "isend")
    _progress()
    number = _number(header, comm, dst)
    shape, dtype, device = tensor.shape, tensor.dtype, tensor.device

    def start_forward(source: torch.Tensor) -> Pending:
        requests, buffers = _post_send(source, header, dst, tag, comm)
        return _Requests(requests, lambda: torch.empty(0, dtype=dtype, device=device), keepalive=buffers)

    def start_backward(_grad: torch.Tensor) -> Pending:
        return _receive_gradient(shape, dtype, device, dst, number, comm)

    def wrap(result: torch.Tensor) -> Placeholder:
        return Placeholder("isend", dst, tuple(shape), dtype, result)

    return Handle(tensor, Link(start_forward, start_backward), wrap)


@eager_under_compile
def irecv(
    src: int,
    tag: int = 0,
    comm: MPI.Comm | Communicator | None = None,
    device: torch.device | str | None = None,
) -> Handle:
    """Non-blocking :func:`recv`: ``handle.wait()`` returns the received tensor, ``handle.test()`` polls.

    The header receive is posted now (behind earlier receives from the same ``src`` and ``tag``); the data
    receive is posted as soon as the header has arrived and this rank is in a p2p call (``test()``, ``wait()``
    or any other). ``src`` may be this rank. Backward posts an Isend of the gradient to ``src``.
    """
    comm = resolve(comm, collective=False)
    _check_peer(src, comm, "irecv", "src")
    _check_tag(tag, comm, "irecv")
    target = torch.device(device) if device is not None else _CPU
    entry = _expect(comm, src, tag, target, "irecv")
    # Whether the result requires grad is only known when the header arrives: link it for now (wrap drops the
    # link if the sender wants no gradient). The link lives on the result's device, as handles' token must.
    link = torch.zeros(0, device=target, requires_grad=True)

    def start_forward(_link: torch.Tensor) -> Pending:
        return _Arrival(entry)

    def start_backward(grad: torch.Tensor) -> Pending:
        _send_gradient(grad, src, entry.number, comm)
        return _Requests([], lambda: None)

    def wrap(result: torch.Tensor) -> torch.Tensor:
        assert entry.meta is not None  # the data has arrived
        return result if entry.meta.requires_grad else result.detach()

    return Handle(link, Link(start_forward, start_backward), wrap)


__all__ = ["irecv", "isend", "recv", "send", "sendrecv", "wait_backward_sends"]
