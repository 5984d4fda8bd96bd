"""The object a rank holds where an op's result is not valid on that rank.

``gather`` and ``reduce`` leave their result on the root only, and ``send`` leaves none on the sender. Instead of
``None``, an empty tensor or uninitialised memory, those ranks get a :class:`Placeholder`: it says which rank holds
the value and carries its shape and dtype. It is still part of the autograd graph: the rank takes part in the op's
backward by calling ``placeholder.backward()`` or by adding the placeholder to its loss (``loss + placeholder``
adds zero and links the graphs), so the backward collective runs on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def anchor(requires_grad: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty tensor that links an op with no tensor input on this rank into the autograd graph."""
    usable = dtype.is_floating_point or dtype.is_complex
    return torch.zeros(0, dtype=dtype if usable else torch.float32, requires_grad=requires_grad and usable)


class Placeholder:
    """Stands for a tensor that lives on another rank.

    Attributes:
        holder: the rank (in the op's communicator) that holds the value, or ``None`` when several do.
        shape, dtype: those of the value on the holder.
        requires_grad: whether the value takes part in autograd.
        op: the name of the op that produced it.
    """

    __slots__ = ("holder", "shape", "dtype", "requires_grad", "op", "_anchor")

    def __init__(
        self, op: str, holder: int | None, shape: tuple[int, ...], dtype: torch.dtype, anchor: torch.Tensor
    ) -> None:
        self.op = op
        self.holder = holder
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._anchor = anchor
        self.requires_grad = anchor.requires_grad

    def __repr__(self) -> str:
        where = f"rank {self.holder}" if self.holder is not None else "other ranks"
        return (
            f"Placeholder(op={self.op!r}, held by {where}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"requires_grad={self.requires_grad})"
        )

    def backward(
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: torch.Tensor | Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Run this rank's part of the op's backward, taking :meth:`torch.Tensor.backward`'s arguments, so that one
        line serves the rank that holds the value and the others. This rank contributes a zero cotangent: the value
        is not here, so ``gradient`` (the holder's cotangent) is not used."""
        if self._anchor.grad_fn is not None:
            self.as_loss_term().backward(retain_graph=retain_graph, create_graph=create_graph, inputs=inputs)

    def as_loss_term(self) -> torch.Tensor:
        """A real scalar zero linked to the op's graph (for complex values too), to add to a loss."""
        return self._anchor.real.sum()

    def __add__(self, other: object) -> torch.Tensor:
        if isinstance(other, (torch.Tensor, int, float)):
            return self.as_loss_term() + other
        return NotImplemented

    __radd__ = __add__

    def not_here(self) -> str:
        """Why this rank cannot use the value, and what it can do instead."""
        where = f"rank {self.holder}" if self.holder is not None else "other ranks"
        return (
            f"{self.op}'s result is not on this rank: it is held by {where}. This rank holds a Placeholder "
            "(shape and dtype only); call .backward() on it or add it to the loss to take part in backward."
        )

    def __getattr__(self, name: str) -> object:
        # only names a Placeholder lacks get here (``ph.sum``, ``ph.item``); protocol lookups stay plain
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(f"Placeholder has no .{name}: {self.not_here()}")

    def _refuse(self, *args: object) -> torch.Tensor:
        raise TypeError(self.not_here())

    # arithmetic other than addition, indexing and conversions: the value is elsewhere
    __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _refuse
    __matmul__ = __rmatmul__ = __pow__ = __rpow__ = __mod__ = __rmod__ = __neg__ = __abs__ = _refuse
    __getitem__ = __setitem__ = __iter__ = __len__ = __float__ = __int__ = __bool__ = __index__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ADDITIONS:
            linked = [a.as_loss_term() if isinstance(a, Placeholder) else a for a in args]
            return func(*linked, **kwargs)
        holder = _find_placeholder((*args, *kwargs.values()))
        assert holder is not None  # torch calls this only when an argument is a Placeholder
        raise TypeError(holder.not_here())


_ADDITIONS = (torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)


def _find_placeholder(values: tuple | list) -> Placeholder | None:
    """The first Placeholder among ``values``, looking into lists and tuples (``torch.cat([p, x])``)."""
    for value in values:
        if isinstance(value, Placeholder):
            return value
        if isinstance(value, (list, tuple)):
            found = _find_placeholder(value)
            if found is not None:
                return found
    return None
