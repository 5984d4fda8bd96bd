"""Whether anything beyond its keeper still refers to a tensor storage.

A storage's holders show in two counts. Tensors, views, arrays and autograd nodes hold it in C++ (its use count,
``torch._C._storage_Use_Count``). A Python storage object (``tensor.untyped_storage()``) is one object per storage:
a caller that keeps it after dropping every tensor adds no C++ reference of its own but one Python reference to the
object the keeper holds. A :class:`HolderCheck` compares both counts with those of a storage it measured once, held
the same way and read through the same method, so that the interpreter's own references cancel out.
"""

from __future__ import annotations

import sys

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)

AVAILABLE = _use_count is not None
"""Whether this torch exposes storage use counts (without them no keeper can tell, and none recycles memory)."""


def _counts(kept: list[torch.UntypedStorage], index: int) -> tuple[int, int]:
    """The C++ use count and the Python reference count of ``kept[index]``, as this function sees them."""
    assert _use_count is not None, "storage use counts are not available in this torch"
    storage = kept[index]
    return _use_count(storage._cdata), sys.getrefcount(storage)


class HolderCheck:
    """Tells whether storages a keeper holds, each in a list and through ``own_tensors`` tensors of its own, have
    holders beyond the keeper.

    Args:
        own_tensors: how many tensors the keeper itself keeps on each storage.
    """

    def __init__(self, own_tensors: int = 0) -> None:
        kept = [torch.UntypedStorage(0)]
        own = [torch.empty(0, dtype=torch.uint8).set_(kept[0]) for _ in range(own_tensors)]
        self._alone = _counts(kept, 0) if AVAILABLE else (0, 0)
        del own

    def held_elsewhere(self, kept: list[torch.UntypedStorage], index: int) -> bool:
        """Whether something other than the keeper refers to ``kept[index]`` (always False without use counts)."""
        return AVAILABLE and _counts(kept, index) != self._alone
