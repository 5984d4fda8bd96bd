"""The base of every op's autograd function."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from mpistrategy.comm.buffers import refuse_transformed


class CollectiveFunction(torch.autograd.Function):
    """An autograd function whose backward communicates.

    Its backward refuses cotangents batched by a torch.func transform (``jacobian(..., vectorize=True)`` runs the
    backward under ``vmap``) with an error that names the op and the fix, before anything is sent. Every rank runs
    the same backward, so every rank raises it.
    """

    #: the op as errors name it (default: the class name in snake case, ``_ReduceScatter``: reduce_scatter)
    op_name = ""

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
            return inner(ctx, *grads)

        cls.backward = staticmethod(unbatched)  # type: ignore[method-assign]
