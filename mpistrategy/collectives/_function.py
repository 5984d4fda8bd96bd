"""The base of every op's autograd function."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from mpistrategy.comm import calls
from mpistrategy.comm.buffers import refuse_transformed
from mpistrategy.comm.checks import BACKWARD_PREFIX, agree

#: what a backward check compares across ranks: the how-manieth call on the communicator its forward was
BACKWARD_AGREES = "forward call"


class CollectiveFunction(torch.autograd.Function):
    """An autograd function whose backward communicates.

    Its backward refuses cotangents batched by a torch.func transform (``jacobian(..., vectorize=True)`` runs the
    backward under ``vmap``) with an error that names the op and the fix, before anything is sent. Every rank runs
    the same backward, so every rank raises it.

    A backward that is a collective over ``ctx.comm`` (``collective_backward``) is checked across ranks as the
    forward calls are, before it sends anything: every rank must be in the backward of the same forward call (the
    op, and the how-manieth call on the communicator it was). A rank whose loss skips an op's output (autograd
    prunes that op's backward there) or that differentiates other outputs then raises on every rank, with each
    rank's backward and where it runs, instead of pairing its messages with another op's (wrong gradients).
    """

    #: the op as errors name it (default: the class name in snake case, ``_ReduceScatter``: reduce_scatter)
    op_name = ""
    #: whether the backward is a collective over ``ctx.comm`` (not for point-to-point ops, or one sending nothing)
    collective_backward = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backward = cls.__dict__.get("backward")
        if backward is None:
            return
        name = cls.op_name or re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.lstrip("_")).lower()
        what = f"the backward of {name}"
        inner = backward.__func__

        @functools.wraps(inner)
        def unbatched(ctx: Any, *grads: Any) -> Any:
            for grad in grads:
                if isinstance(grad, torch.Tensor):
                    refuse_transformed(grad, what)
            agreement = getattr(ctx, "agreement", None)
            if agreement is None:
                return inner(ctx, *grads)
            comm, forward_call, op = agreement
            agree(comm, f"{BACKWARD_PREFIX}{op}", (forward_call,), BACKWARD_AGREES)
            try:
                return inner(ctx, *grads)
            finally:
                calls.leave()

        cls.backward = staticmethod(unbatched)  # type: ignore[method-assign]
        if cls.collective_backward:
            forward = cls.__dict__["forward"].__func__

            @functools.wraps(forward)
            def counted(ctx: Any, *args: Any) -> Any:
                result = forward(ctx, *args)
                ctx.agreement = (ctx.comm, ctx.comm.calls, name)
                return result

            cls.forward = staticmethod(counted)  # type: ignore[method-assign]
