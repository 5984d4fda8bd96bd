"""What a rank holds, measured from the tensors themselves: bytes of parameters, gradients and optimizer state.

Each memory block is counted once, however many tensors view it (the parameters viewing a flat buffer, the
``.grad`` viewing a gradient bucket, the pieces' gradients viewing a gradient shard), with the block's whole size:
``storage.nbytes()``. So the figures are what the process holds, not what the tensors' shapes suggest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class MemoryReport:
    """Bytes this rank holds for training a model."""

    params: int
    grads: int
    optimizer_state: int

    def as_dict(self) -> dict[str, int]:
        return {"param_bytes": self.params, "grad_bytes": self.grads, "optimizer_state_bytes": self.optimizer_state}


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct memory blocks ``tensors`` lie in (each block counted once, whole)."""
    blocks: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor is None or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        blocks[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(blocks.values())


def state_tensors(optimizers: Iterable[Any]) -> list[torch.Tensor]:
    """Every tensor in the optimizers' state."""
    found = []
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            found += [value for value in per_param.values() if isinstance(value, torch.Tensor)]
    return found


def measure(module: nn.Module, optimizers: Iterable[Any], gradient_buffers: Iterable[torch.Tensor]) -> MemoryReport:
    """Bytes of ``module``'s parameters, of its gradients (the ``.grad`` and ``gradient_buffers``, what the strategy
    holds for them) and of the ``optimizers``' state."""
    params = list(module.parameters())
    grads = [p.grad for p in params] + list(gradient_buffers)
    return MemoryReport(held_bytes(params), held_bytes(grads), held_bytes(state_tensors(optimizers)))
