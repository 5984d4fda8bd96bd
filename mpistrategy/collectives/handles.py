"""Non-blocking ops that stay on the autograd path.

A non-blocking op is split into two autograd nodes joined by an empty *token* tensor::

    x --Start--> token --Finish--> result        (forward: Start posts the MPI request, Finish waits)
    dx <-Start-- token <-Finish-- g               (backward: Finish posts the adjoint request, Start waits)

so the backward communication overlaps with whatever autograd computes between the two nodes, exactly as the
forward one did. The user sees a :class:`Handle`; ``handle.wait()`` applies Finish and returns the result.

A handle dropped before its op completed (never waited on, or lost to an exception) does not free the buffers MPI
still reads and writes: its requests and buffers are parked and released once MPI reports them complete (checked
whenever a non-blocking op is posted, and waited for at exit, before MPI is finalized, while the stall watchdog
still watches: an op some rank never joins is reported instead of holding the process at exit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from mpi4py import MPI

from mpistrategy.collectives._compile import eager_under_compile
from mpistrategy.collectives._function import CollectiveFunction
from mpistrategy.collectives._second_order import recording, refuse_if_recording
from mpistrategy.comm.communicator import Communicator
from mpistrategy.comm.watchdog import watched_at_exit

#: requests of dropped :class:`Pending` objects still in flight, each with the buffers it uses
_parked: list[tuple[list[MPI.Request], tuple]] = []


def _release_completed() -> None:
    """Forget the parked requests that have completed (never blocks)."""
    _parked[:] = [entry for entry in _parked if not MPI.Request.Testall(entry[0])]


def _complete_parked() -> None:
    if _parked and MPI.Is_initialized() and not MPI.Is_finalized():
        for requests, _ in _parked:
            MPI.Request.Waitall(requests)
    _parked.clear()


class Pending:
    """MPI requests in flight, the buffers they use, and how to turn them into the op's result. Dropped before
    the requests complete, it parks them with their buffers (see the module doc)."""

    __slots__ = ("requests", "finish", "keepalive")

    def __init__(self, requests: list[MPI.Request], finish: Callable[[], Any], keepalive: tuple = ()) -> None:
        if _parked:
            _release_completed()
        self.requests = requests
        self.finish = finish
        self.keepalive = keepalive

    def __del__(self) -> None:
        requests = getattr(self, "requests", None)
        if requests and not MPI.Is_finalized() and not MPI.Request.Testall(requests):
            watched_at_exit(_complete_parked)
            _parked.append((requests, self.keepalive))

    def wait(self) -> Any:
        """Block until every request completes, then return the result."""
        if self.requests:
            MPI.Request.Waitall(self.requests)
        return self.finish()

    def test(self) -> bool:
        """Whether every request has completed (never blocks)."""
        return not self.requests or MPI.Request.Testall(self.requests)


class Then:
    """A result in flight (a :class:`Pending`, or the shared-memory allreduce's work), passed through ``then`` once
    complete; the interface of :class:`Pending`."""

    __slots__ = ("pending", "then")

    def __init__(self, pending: Any, then: Callable[[Any], Any]) -> None:
        self.pending = pending
        self.then = then

    def wait(self) -> Any:
        """Block until the result is complete; return ``then(result)``."""
        return self.then(self.pending.wait())

    def test(self) -> bool:
        """Whether the result is complete (never blocks)."""
        return self.pending.test()


class Work(Protocol):
    """A result in flight: :class:`Pending`, :class:`Then` or the shared-memory allreduce's work."""

    def wait(self) -> Any: ...

    def test(self) -> bool: ...


class Completed:
    """A result already computed (the interface of :class:`Pending`)."""

    __slots__ = ("result",)

    def __init__(self, result: Any) -> None:
        self.result = result

    def wait(self) -> Any:
        return self.result

    def test(self) -> bool:
        return True


class Link:
    """The state shared by one op's Start and Finish nodes.

    ``adjoint``, where the op has one, computes the backward through differentiable ops: it replaces
    ``start_backward`` while autograd records the backward (``create_graph=True``), so that the gradient can be
    differentiated again; without it, such a backward raises (``what`` names the op). ``agreement``: for a
    collective, its communicator, call count and op name, which its backward checks across ranks (see
    :class:`~mpistrategy.collectives._function.CollectiveFunction`)."""

    __slots__ = ("start_forward", "start_backward", "adjoint", "what", "agreement", "forward", "backward")

    def __init__(
        self,
        start_forward: Callable[[torch.Tensor], Work],
        start_backward: Callable[[torch.Tensor], Work],
        what: str,
        adjoint: Callable[[torch.Tensor], torch.Tensor] | None = None,
        agreement: tuple[Communicator, int, str] | None = None,
    ) -> None:
        self.start_forward = start_forward
        self.start_backward = start_backward
        self.what = what
        self.adjoint = adjoint
        self.agreement = agreement
        self.forward: Work | None = None
        self.backward: Work | None = None


class _Start(CollectiveFunction):
    op_name = "a non-blocking op"
    collective_backward = False  # waits for what Finish's backward posted

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link = link
        link.forward = link.start_forward(tensor)
        return tensor.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad: torch.Tensor):
        return ctx.link.backward.wait(), None


class _Finish(CollectiveFunction):
    op_name = "a non-blocking op"
    collective_backward = False  # checked through the link's agreement, taken when the op was posted

    @staticmethod
    def forward(ctx, token: torch.Tensor, link: Link) -> torch.Tensor:
        ctx.link = link
        ctx.agreement = link.agreement
        ctx.token = (token.dtype, token.device)  # its gradient has its type, whatever the result's is
        assert link.forward is not None  # posted by Start
        return link.forward.wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        link = ctx.link
        dtype, device = ctx.token
        if link.adjoint is None:
            refuse_if_recording(link.what)
        elif recording():
            link.backward = Completed(link.adjoint(grad))
            return torch.empty(0, dtype=dtype, device=device), None
        link.backward = link.start_backward(grad)
        return torch.empty(0, dtype=dtype, device=device), None


class Handle:
    """A non-blocking op in flight. ``wait()`` returns its result (once; later calls return the same object).

    When autograd does not record the op (``torch.no_grad()``, or an input that does not require grad) the
    Start/Finish nodes are skipped and the handle completes the MPI requests directly: the op then costs no more
    than the MPI calls, which matters for the strategy's gradient buckets.
    """

    def __init__(self, tensor: torch.Tensor, link: Link, wrap: Callable[[torch.Tensor], Any] | None = None) -> None:
        self._link = link
        self._wrap = wrap
        self._result: Any = None
        self._recorded = torch.is_grad_enabled() and tensor.requires_grad
        if self._recorded:
            self._token = _Start.apply(tensor, link)
        else:
            link.forward = link.start_forward(tensor.detach())

    @eager_under_compile
    def wait(self) -> Any:
        """Complete the op and return its result, linked into the autograd graph when the input was."""
        assert self._link.forward is not None  # posted at construction
        if self._result is None:
            result = _Finish.apply(self._token, self._link) if self._recorded else self._link.forward.wait()
            self._result = self._wrap(result) if self._wrap else result
        return self._result

    @eager_under_compile
    def test(self) -> bool:
        """Whether the op has completed; ``wait()`` must still be called to get the result."""
        assert self._link.forward is not None  # posted at construction
        return self._result is not None or self._link.forward.test()

    def is_completed(self) -> bool:
        """Alias of :meth:`test`, as in ``torch.distributed.Work``."""
        return self.test()
