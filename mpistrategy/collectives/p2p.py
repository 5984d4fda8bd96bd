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

Wire protocol (the messages are sent and received by ``mpistrategy.collectives._p2p_wire``). Receivers pass no
tensor: every message is two MPI messages on ``comm.forward`` with the user's tag, a header of ``HEADER_LENGTH + 1``
int64 values (:class:`TensorMeta`: dtype, requires_grad, shape; then the sender's running *number* of the message
for this destination) and then the data, moved bit-exactly with :func:`transfer_type`. ``requires_grad`` in the
header is the sender's ``tensor.requires_grad`` under grad mode; when it is set, the received tensor requires grad
and its backward returns the gradient. Gradients travel on ``comm.backward`` with tag ``number mod (MPI_TAG_UB +
1)``, so each gradient finds its message even when backward passes run in another order than the forward messages
(micro-batches of a pipeline, several messages with one tag).

Message order. A header can only be received before its data, and the data receive can only be posted once the
header is there. Receives from the same ``(src, tag)`` are therefore queued per rank: only the oldest one has its
header receive posted; when its header arrives its data receive is posted and then the next header receive. So
MPI matches headers and data in order, and receives match messages in the order they were called (``irecv`` then
``recv`` from the same source and tag get the first and second message, as in MPI).

Deadlock safety.

- Forward: every wait of these ops (a blocking op, ``Handle.wait()``, a backward receive) waits on its own
  requests *and* on the headers of queued receives, posting their data receives as soon as the headers arrive
  (``_p2p_wire.wait_all``). So two ranks that ``isend`` rendezvous-size tensors to each other and ``irecv`` them
  can wait for the handles in any order. ``Handle.test()`` makes the same progress without blocking.
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
will take. Otherwise they raise at once, naming what to post first: they would wait forever. The wire module
counts, per communicator and tag, the receives from the own rank still waiting for a header
(``_p2p_wire.arriving``) and the messages to the own rank no receive has taken yet (``_p2p_wire.self_sent``): MPI
matches them in order, so the k-th such message goes to the k-th such receive.

Limitations. ``MPI.ANY_SOURCE`` and ``MPI.ANY_TAG`` are not supported (the gradient must go back to a rank known
when the receive is posted). The data of an ``irecv`` is received while this rank is inside a p2p call (including
``handle.test()``); a peer blocked in a large ``send`` to it waits until then, so call ``handle.test()`` or
``wait()`` before blocking in a collective that the sender only reaches after its send. A rank that holds a
gradient-carrying result must run its backward, or the peer waiting for that gradient hangs. Receivers under
``torch.no_grad()`` must only receive from senders under ``no_grad`` too. Not thread-safe: call p2p ops (and
backward through them) from one thread.
"""

from __future__ import annotations

import contextlib

import torch
from mpi4py import MPI

from mpistrategy.collectives import _p2p_wire as wire
from mpistrategy.collectives._compile import eager_under_compile
from mpistrategy.collectives._function import CollectiveFunction
from mpistrategy.collectives._second_order import refuse_if_recording
from mpistrategy.collectives.handles import Handle, Link, Pending
from mpistrategy.collectives.placeholder import Placeholder, anchor
from mpistrategy.comm.checks import attempt, check_rank, is_integer
from mpistrategy.comm.communicator import Communicator, resolve
from mpistrategy.comm.errors import CommunicationError
from mpistrategy.comm.metadata import HEADER_LENGTH

# ---------------------------------------------------------------------------------------------------------------
# Arguments


def _check_tag(tag: int, comm: Communicator, what: str) -> None:
    bound = wire.tag_bound(comm)
    if not is_integer(tag) or not 0 <= tag <= bound:
        raise ValueError(
            f"{what}: tag={tag!r} is not a valid tag; pass an int between 0 and {bound} (MPI_TAG_UB of this "
            "communicator). MPI.ANY_TAG is not supported."
        )


def _check_peer(peer: int, comm: Communicator, what: str, role: str) -> None:
    if role == "src" and is_integer(peer) and peer == MPI.ANY_SOURCE:
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
    unmatched = len(wire.arriving.get((comm, peer, tag), ())) - wire.self_sent.get((comm, tag), 0)
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


def _prepare_send(
    tensor: torch.Tensor,
    dst: int,
    tag: int,
    comm: MPI.Comm | Communicator | None,
    what: str,
    src: int | None = None,
) -> tuple[Communicator, torch.Tensor]:
    """Check the arguments of a send (and sendrecv's ``src``) and build its header (numbered later, by
    ``_p2p_wire.number_message``).

    An invalid ``dst`` or ``tag``, or a blocking send to the own rank that would wait forever, raises here alone:
    there is no peer to tell. Any other problem is first sent to ``dst`` as a failure notice, so that the receive
    waiting for this message raises too; sendrecv then also takes the message ``src`` sends it (and drops it), so
    that ``src`` is not left waiting either.
    """
    comm = resolve(comm, collective=False)
    _check_peer(dst, comm, what, "dst")
    _check_tag(tag, comm, what)
    _check_blocking_self(dst, tag, comm, what)
    header, problem = attempt(wire.header_of, tensor, what)
    source = None if src is None else attempt(_check_peer, src, comm, what, "src")[1]
    if problem is None and source is None:
        assert header is not None  # wire.header_of returned
        return comm, header
    problem = problem or source
    assert problem is not None
    with torch._C._DisableFuncTorch():  # plain buffers also inside a torch.func transform (which header_of refuses)
        wire.notify(problem, comm, dst, tag, what)
        if src is not None and source is None:
            with contextlib.suppress(CommunicationError):  # src failed too: its notice is dropped like its message
                wire.receive(wire.expect(comm, src, tag, wire.CPU, what))
    raise problem


@eager_under_compile
def wait_backward_sends() -> None:
    """Block until every gradient this rank sent in a backward pass (and every failure notice) has been received.

    Gradient sends are never waited for inside backward (so that backward cannot deadlock); this completes them,
    for instance before freeing a communicator. It runs by itself at interpreter exit.
    """
    wire.wait_for_detached_sends()


# ---------------------------------------------------------------------------------------------------------------
# Autograd nodes of the blocking ops


class _Send(CollectiveFunction):
    collective_backward = False

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, header: torch.Tensor, dst: int, tag: int, comm: Communicator):
        ctx.dst, ctx.comm, ctx.number = dst, comm, int(header[HEADER_LENGTH])
        ctx.shape, ctx.dtype, ctx.device = tensor.shape, tensor.dtype, tensor.device
        requests, _buffers = wire.post_send(tensor, header, dst, tag, comm)
        wire.wait_all(requests)
        return tensor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        refuse_if_recording("send")
        pending = wire.receive_gradient(ctx.shape, ctx.dtype, ctx.device, ctx.dst, ctx.number, ctx.comm)
        return pending.wait(), None, None, None, None


class _Recv(CollectiveFunction):
    collective_backward = False

    @staticmethod
    def forward(ctx, link: torch.Tensor, entry: wire.Incoming, comm: Communicator):
        ctx.src, ctx.number, ctx.comm = entry.src, entry.number, comm
        return wire.receive(entry)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_if_recording("recv")
        wire.send_gradient(grad, ctx.src, ctx.number, ctx.comm)
        return None, None, None


class _SendRecv(CollectiveFunction):
    collective_backward = False

    @staticmethod
    def forward(
        ctx,
        tensor: torch.Tensor,
        link: torch.Tensor,
        entry: wire.Incoming,
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
        result = wire.receive(entry)
        wire.wait_all(sending[0])
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_if_recording("sendrecv")
        if ctx.return_gradient:
            wire.send_gradient(grad, ctx.src, ctx.received_number, ctx.comm)
        grad_in = None
        if ctx.needs_input_grad[0]:
            pending = wire.receive_gradient(ctx.shape, ctx.dtype, ctx.device, ctx.dst, ctx.sent_number, ctx.comm)
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
    wire.progress()
    wire.number_message(header, comm, dst)
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
    entry = wire.expect(comm, src, tag, torch.device(device) if device is not None else wire.CPU, "recv")
    wire.wait_header(entry)
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
    wire.progress()
    number = wire.number_message(header, comm, dst)
    sending = wire.post_send(tensor, header, dst, tag, comm)
    entry = wire.expect(comm, src, tag, tensor.device, "sendrecv")
    try:
        wire.wait_header(entry)
    except CommunicationError:  # src sent a failure notice; dst still receives this rank's message
        wire.detached_sends.extend(zip(*sending, strict=True))
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
    wire.progress()
    number = wire.number_message(header, comm, dst)
    shape, dtype, device = tensor.shape, tensor.dtype, tensor.device

    def start_forward(source: torch.Tensor) -> Pending:
        requests, buffers = wire.post_send(source, header, dst, tag, comm)
        return wire.Requests(requests, lambda: torch.empty(0, dtype=dtype, device=device), keepalive=buffers)

    def start_backward(_grad: torch.Tensor) -> Pending:
        return wire.receive_gradient(shape, dtype, device, dst, number, comm)

    def wrap(result: torch.Tensor) -> Placeholder:
        return Placeholder("isend", dst, tuple(shape), dtype, result)

    return Handle(tensor, Link(start_forward, start_backward, "isend"), wrap)


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
    target = torch.device(device) if device is not None else wire.CPU
    entry = wire.expect(comm, src, tag, target, "irecv")
    # Whether the result requires grad is only known when the header arrives: link it for now (wrap drops the
    # link if the sender wants no gradient). The link lives on the result's device, as handles' token must.
    link = torch.zeros(0, device=target, requires_grad=True)

    def start_forward(_link: torch.Tensor) -> Pending:
        return wire.Arrival(entry)

    def start_backward(grad: torch.Tensor) -> Pending:
        wire.send_gradient(grad, src, entry.number, comm)
        return wire.Requests([], lambda: None)

    def wrap(result: torch.Tensor) -> torch.Tensor:
        assert entry.meta is not None  # the data has arrived
        return result if entry.meta.requires_grad else result.detach()

    return Handle(link, Link(start_forward, start_backward, "irecv"), wrap)


__all__ = ["irecv", "isend", "recv", "send", "sendrecv", "wait_backward_sends"]
