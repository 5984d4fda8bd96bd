"""The collectives under ``torch.compile``: every op runs eagerly, at a graph break.

An op sends MPI messages and keeps state in Python (message numbers, queued receives, argument checks): a
compiled graph must neither contain it (graphs may be reordered, replayed or pruned) nor specialise on that state.
:func:`eager_under_compile` wraps each public op: called eagerly, it calls the op (0.6 µs more here) and then
tells the call log (:mod:`mpistrategy.comm.calls`) that the op returned; traced
by dynamo (``torch.compiler.is_dynamo_compiling()`` is true while dynamo traces), it calls the op through
``torch.compiler.disable``, so dynamo breaks the graph there and runs the op, and everything the op calls, as in
eager mode. The op's autograd node joins the backward of the compiled code around it as in eager code, so values
and gradients equal eager ones.

Two choices keep this cheap:

- The disabled version is made on the first traced call, not at import: importing ``torch._dynamo`` roughly
  doubles the CPU time of ``import mpistrategy`` (2.7 s to 5.1 s here), and by the time dynamo traces, it is
  imported anyway.
- Each op's wrapper has its own code object. Dynamo compiles the wrapper's frame once the graph breaks inside it
  and caches compiled frames per code object: with one shared code object, every further op would count as a
  recompilation of the first, and the ninth op would hit dynamo's recompile limit.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import TypeVar

import torch

from mpistrategy.comm.calls import leave

F = TypeVar("F", bound=Callable)

# True while dynamo traces (it folds the call to a constant); torch 2.2 has only the slower is_compiling().
_tracing = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)


def eager_under_compile(op: F) -> F:
    """``op``, run eagerly (never traced into a graph) when a ``torch.compile``'d function calls it."""
    disabled: Callable | None = None

    def run(*args, **kwargs):
        nonlocal disabled
        if not _tracing():
            try:
                return op(*args, **kwargs)
            finally:
                leave()  # the call log's duration of the call the op entered
        if disabled is None:
            disabled = torch.compiler.disable(op)
        return disabled(*args, **kwargs)

    own_code = run.__code__.replace(co_name=op.__name__)
    wrapper = types.FunctionType(own_code, run.__globals__, op.__name__, None, run.__closure__)
    return functools.wraps(op)(wrapper)  # type: ignore[return-value]
