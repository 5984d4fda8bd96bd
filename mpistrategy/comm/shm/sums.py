"""The sum of one chunk over the ranks, in rank order: ``((x_0 + x_1) + x_2) + ...``, times ``scale``.

float32 and float64 go to the compiled kernel (:mod:`~mpistrategy.comm.rank_sum`: each input read once, the sum
written to every output in the same pass). The others, and every dtype where the kernel is not built, are summed
with torch: float16 and bfloat16 in float32, rounded once; float32 and float64 in their own dtype, the same
operations in the same order as the kernel, so the same bits. The private scratch memory they need is kept
between operations (:class:`Scratch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpistrategy.comm import rank_sum
from mpistrategy.comm.shm.plan import CHUNK_BYTES

_HALF = (torch.float16, torch.bfloat16)
_REMEMBERED_VIEWS = 64


class Scratch:
    """Rows of private scratch memory by use and dtype, grown on demand and kept (and so are the views handed
    out: chunks repeat)."""

    def __init__(self) -> None:
        self._memory: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._views: dict[tuple[str, torch.dtype, int, int], torch.Tensor] = {}

    def rows(self, dtype: torch.dtype, count: int, numel: int, use: str = "sum") -> torch.Tensor:
        """``count`` rows of ``numel`` elements of ``dtype`` for ``use`` (the same memory for the same use)."""
        key = (use, dtype, count, numel)
        view = self._views.get(key)
        if view is not None:
            return view
        memory = self._memory.get((use, dtype))
        if memory is None or memory.shape[0] < count or memory.shape[1] < numel:
            memory = self._memory[use, dtype] = torch.empty(
                count, max(numel, CHUNK_BYTES // dtype.itemsize), dtype=dtype
            )
            self._views = {k: v for k, v in self._views.items() if k[:2] != (use, dtype)}
        if len(self._views) >= _REMEMBERED_VIEWS:
            self._views.clear()
        view = self._views[key] = memory[:count, :numel]
        return view

    def clear(self) -> None:
        """Free the memory."""
        self._memory.clear()
        self._views.clear()


def rank_order_sum(
    outputs: Sequence[torch.Tensor], parts: Sequence[torch.Tensor], scale: float, rank: int, scratch: Scratch
) -> None:
    """Write ``((parts[0] + parts[1]) + ...) * scale`` into every tensor of ``outputs``; ``outputs[0]`` may be
    ``parts[rank]`` (this rank's input, overwritten by its sum), no other output may overlap a part."""
    dtype = parts[0].dtype
    if rank_sum.available(dtype):
        rank_sum.sum_to(outputs, parts, scale)
        return
    out = outputs[0]
    if dtype in _HALF:
        total = scratch.rows(torch.float32, 2, out.numel())
        total[0].copy_(parts[0])
        for part in parts[1:]:
            total[1].copy_(part)
            total[0].add_(total[1])
        if scale != 1.0:
            total[0].mul_(scale)
        out.copy_(total[0])
    else:
        _torch_chain(out, parts, scale, rank, scratch)
    for other in outputs[1:]:
        other.copy_(out)


def _torch_chain(out: torch.Tensor, parts: Sequence[torch.Tensor], scale: float, rank: int, scratch: Scratch) -> None:
    """``out`` <- the rank-order sum of ``parts`` times ``scale``, in their dtype. Where ``out`` is input 2 or
    later, the partial sums go to scratch until the last addition (they would overwrite it before it is read)."""
    overwrites_own = out.data_ptr() == parts[rank].data_ptr()
    if len(parts) == 1:
        if not overwrites_own:
            out.copy_(parts[0])
        return
    if not overwrites_own or rank < 2 or len(parts) == 2:
        torch.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            out.add_(part)
    else:
        total = scratch.rows(out.dtype, 1, out.numel())[0]
        torch.add(parts[0], parts[1], out=total)
        for part in parts[2:-1]:
            total.add_(part)
        torch.add(total, parts[-1], out=out)
    if scale != 1.0:
        out.mul_(scale)
