"""The messages under :mod:`~mpistrategy.collectives.p2p`: a header, then the data; the queue of receives per
source and tag and the progress that keeps it moving; gradients sent back in backward; failure notices.

The protocol, the order of messages, why no wait here can deadlock and how messages to the own rank are counted
are described in :mod:`~mpistrategy.collectives.p2p`, whose ops are the only users of this module.
"""

from __future__ import annotations

from collections import deque
from typing import cast

import torch
from mpi4py import MPI

from mpistrategy.collectives.handles import Pending
from mpistrategy.comm.buffers import check_tensor, empty_on_wire, mpi_buffer, off_wire, on_wire
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.errors import CommunicationError, with_note
from mpistrategy.comm.metadata import HEADER_LENGTH, TensorMeta
from mpistrategy.comm.watchdog import watched_at_exit

# The p2p header: TensorMeta's HEADER_LENGTH values, then the sender's number for the message.
_HEADER_LENGTH = HEADER_LENGTH + 1
CPU = torch.device("cpu")

_numbers: dict[tuple[Communicator, int], int] = {}  # next message number, per (communicator, destination)
_tag_bounds: dict[Communicator, int] = {}
arriving: dict[tuple[Communicator, int, int], deque[Incoming]] = {}  # receives without a posted data receive
self_sent: dict[tuple[Communicator, int], int] = {}  # per (communicator, tag): messages to itself not yet received
# Isends nobody waits for (gradients sent in backward, failure notices) and their buffers, released once complete.
detached_sends: list[tuple[MPI.Request, torch.Tensor]] = []

# A sender whose checks fail sends its peer a failure notice instead of the message: a header with _FAILED first
# and the length of the notice's text second, then the text (UTF-8, at most _NOTICE_BYTES) as the data.
_FAILED = -1
_NOTICE_BYTES = 2000


def tag_bound(comm: Communicator) -> int:
    """``MPI_TAG_UB`` of ``comm``: the largest tag a message on it may carry."""
    bound = _tag_bounds.get(comm)
    if bound is None:
        bound = _tag_bounds[comm] = int(cast(int, comm.comm.Get_attr(MPI.TAG_UB)))  # MPI sets it on every comm
    return bound


def _count_self_message(comm: Communicator, dst: int, tag: int, change: int) -> None:
    """Count a message to the own rank in ``self_sent`` (+1 when posted, -1 when its header is received)."""
    if dst == comm.rank:
        count = self_sent.get((comm, tag), 0) + change
        if count:
            self_sent[(comm, tag)] = count
        else:
            del self_sent[(comm, tag)]


def header_of(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The header of a message carrying ``tensor`` (its number still unset); raises if it cannot be sent."""
    check_tensor(tensor, what)
    header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)
    header[:HEADER_LENGTH] = torch.tensor(TensorMeta.of(tensor).encode(what), dtype=torch.int64)
    return header


def notify(problem: Exception, comm: Communicator, dst: int, tag: int, what: str) -> None:
    """Send ``dst`` a failure notice in place of the message whose checks found ``problem``."""
    text = f"{type(problem).__name__}: {problem}".encode()[:_NOTICE_BYTES]
    header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)
    header[0], header[1] = _FAILED, len(text)
    data = torch.tensor(list(text), dtype=torch.uint8)
    for buffer in (header, data):
        _detach(comm.forward.Isend(mpi_buffer(buffer), dst, tag), buffer)
    _count_self_message(comm, dst, tag, +1)
    with_note(problem, f"{what} raised this on rank {comm.rank}; rank {dst}, its peer, raises too when it receives.")


def number_message(header: torch.Tensor, comm: Communicator, dst: int) -> int:
    """Give the message its number for ``dst`` (once every check has passed)."""
    number = _numbers.get((comm, dst), 0)
    _numbers[(comm, dst)] = number + 1
    header[HEADER_LENGTH] = number
    return number


def _backward_tag(number: int, comm: Communicator) -> int:
    return number % (tag_bound(comm) + 1)


# ---------------------------------------------------------------------------------------------------------------
# Progress: queued receives, waits that keep them moving, gradient sends in flight


class Incoming:
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
        self.buffer = empty_on_wire(meta.shape, meta.dtype, CPU if self.failed else self.device)
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


def expect(comm: Communicator, src: int, tag: int, device: torch.device, what: str) -> Incoming:
    """Queue a receive from ``src`` with ``tag``; its header receive is posted when it reaches the queue's head."""
    entry = Incoming(comm, src, tag, device, what)
    queue = arriving.setdefault((comm, src, tag), deque())
    queue.append(entry)
    if len(queue) == 1:
        entry.post_header()
    progress()
    return entry


def progress() -> None:
    """Never blocks: post the data receive of every queued message whose header has arrived (then the next
    header receive of its queue), and release the gradient sends that have completed."""
    for key in list(arriving):
        queue = arriving[key]
        while queue and queue[0].request.Test():
            queue.popleft().post_data()
            if queue:
                queue[0].post_header()
        if not queue:
            del arriving[key]
    if detached_sends:
        detached_sends[:] = [(request, buffer) for request, buffer in detached_sends if not request.Test()]


def _heads() -> list[MPI.Request]:
    return [queue[0].request for queue in arriving.values()]


def wait_all(requests: list[MPI.Request]) -> None:
    """``MPI_Waitall(requests)`` that meanwhile posts the data receives of queued messages whose headers arrive,
    so that a peer's send to this rank never waits for this rank to leave the wait."""
    requests = list(requests)
    while any(request != MPI.REQUEST_NULL for request in requests):
        progress()
        heads = _heads()
        if not heads:
            MPI.Request.Waitall(requests)
            break
        MPI.Request.Waitany(requests + heads)  # completed requests become MPI.REQUEST_NULL in place


def wait_header(entry: Incoming) -> None:
    """Wait until the header of ``entry`` has arrived; raise if it was a failure notice."""
    progress()
    while entry.meta is None:  # still queued, so there is at least one header receive to wait on
        MPI.Request.Waitany(_heads())
        progress()
    if entry.failed:
        wait_all([entry.request])
        raise entry.failure()


def receive(entry: Incoming) -> torch.Tensor:
    wait_header(entry)
    wait_all([entry.request])
    return entry.result()


def send_gradient(grad: torch.Tensor, peer: int, number: int, comm: Communicator) -> None:
    """Post the gradient of message ``number`` back to ``peer`` without waiting for it (see Deadlock safety)."""
    buffer = on_wire(grad)
    if buffer.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
        buffer = buffer.clone()  # the send outlives this backward node: it must own its buffer
    _detach(comm.backward.Isend(mpi_buffer(buffer), peer, _backward_tag(number, comm)), buffer)
    try:
        torch.autograd.Variable._execution_engine.queue_callback(progress)
    except RuntimeError:  # not inside a backward pass: later p2p calls release it
        pass


def receive_gradient(
    shape: torch.Size, dtype: torch.dtype, device: torch.device, peer: int, number: int, comm: Communicator
) -> Requests:
    """Post the receive of the gradient of message ``number`` from ``peer``; ``wait()`` returns it."""
    buffer = empty_on_wire(tuple(shape), dtype, device)
    request = comm.backward.Irecv(mpi_buffer(buffer), peer, _backward_tag(number, comm))
    return Requests([request], lambda: off_wire(buffer, dtype, device), keepalive=(buffer,))


def wait_for_detached_sends() -> None:
    """Block until every detached send (gradients sent in backward, failure notices) has been received."""
    wait_all([request for request, _ in detached_sends])
    progress()


def _detach(request: MPI.Request, buffer: torch.Tensor) -> None:
    """Keep ``request`` and its buffer until the send completes; at exit, wait for it (watched: a send no rank ever
    receives, from a peer that skipped backward, is reported as a stall)."""
    watched_at_exit(_complete_at_exit)
    detached_sends.append((request, buffer))


def _complete_at_exit() -> None:
    if detached_sends and MPI.Is_initialized() and not MPI.Is_finalized():
        wait_for_detached_sends()


class Requests(Pending):
    """A :class:`Pending` whose ``wait`` and ``test`` keep queued receives progressing."""

    __slots__ = ()

    def wait(self):
        wait_all(self.requests)
        return self.finish()

    def test(self) -> bool:
        progress()
        return super().test()


class Arrival(Pending):
    """irecv's forward request: done when the message's data has arrived."""

    __slots__ = ("entry",)

    def __init__(self, entry: Incoming) -> None:
        super().__init__([], entry.result)
        self.entry = entry

    def wait(self) -> torch.Tensor:
        return receive(self.entry)

    def test(self) -> bool:
        progress()
        return self.entry.meta is not None and self.entry.request.Test()


def post_send(
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
