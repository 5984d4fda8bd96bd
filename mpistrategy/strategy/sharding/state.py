"""Moving optimizer state between whole parameters and pieces (any number of shards to any other).

A piece's state is the state a torch optimizer keeps for the piece as a parameter: *elementwise* tensors (Adam's
``exp_avg`` and ``exp_avg_sq``, SGD's ``momentum_buffer``: one value per element, shaped like the piece) and other
values (the ``step`` count, scalars), which are the same for every piece of a parameter. Between layouts:

- a piece of a whole parameter's state: elementwise tensors flattened and cut to ``[start, stop)``, other values
  copied (:func:`piece_of`);
- a range of a parameter from saved pieces (another number of shards): the elementwise tensors of the saved pieces
  that overlap the range, cut and concatenated in element order, other values from the first of them
  (:func:`assemble`); over the whole parameter, reshaped to its shape, this is the unsharded state.

An optimizer whose state is neither elementwise nor the same for every piece (a factored second moment, per-tensor
norms) cannot be re-sharded: :func:`assemble` names the key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the optimizer state key that counts steps: never elementwise, even for a one-element parameter
STEP = "step"


@dataclass(frozen=True)
class SavedPiece:
    """Elements ``[start, stop)`` of a parameter and the optimizer state saved for them."""

    start: int
    stop: int
    state: dict[str, Any]

    @property
    def numel(self) -> int:
        return self.stop - self.start


def is_elementwise(key: str, value: Any, shape: Sequence[int]) -> bool:
    """Whether ``value`` holds one value per element of a tensor of ``shape`` (a parameter or a piece)."""
    if key == STEP or not isinstance(value, torch.Tensor):
        return False
    return tuple(value.shape) == tuple(shape)


def piece_of(state: dict[str, Any], shape: Sequence[int], start: int, stop: int) -> dict[str, Any]:
    """The state of elements ``[start, stop)`` of a parameter of ``shape`` whose whole state is ``state``."""
    return {
        key: value.reshape(-1)[start:stop].clone() if is_elementwise(key, value, shape) else _copy(value)
        for key, value in state.items()
    }


def assemble(saved: Sequence[SavedPiece], start: int, stop: int, what: str) -> dict[str, Any]:
    """The state of elements ``[start, stop)`` of one parameter from its saved pieces (see the module docstring);
    ``what`` names the parameter in errors. Empty if the optimizer kept no state for it."""
    covering = sorted((p for p in saved if p.start < stop and p.stop > start), key=lambda p: p.start)
    if not covering or not covering[0].state:
        return {}
    _check_coverage(covering, start, stop, what)
    first = covering[0]
    if len(covering) == 1 and (first.start, first.stop) == (start, stop):  # the same piece: any state as it is
        return {key: _copy(value) for key, value in first.state.items()}
    result: dict[str, Any] = {}
    for key, value in first.state.items():
        if key != STEP and isinstance(value, torch.Tensor) and value.dim() > 0:  # must be elementwise to be cut
            parts = [_cut(piece, key, start, stop, what) for piece in covering]
            result[key] = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        else:
            result[key] = _copy(value)
    return result


def whole(saved: Sequence[SavedPiece], shape: Sequence[int], what: str) -> dict[str, Any]:
    """The unsharded state of a parameter of ``shape`` from all its saved pieces."""
    numel = 1
    for size in shape:
        numel *= size
    state = assemble(saved, 0, numel, what)
    return {
        key: value.reshape(tuple(shape)) if is_elementwise(key, value, (numel,)) else value
        for key, value in state.items()
    }


def whole_states(saved: dict[int, list[SavedPiece]], shapes: Sequence[Sequence[int]]) -> dict[int, dict[str, Any]]:
    """The unsharded state of every parameter (``shapes`` by index) that has one, from the saved pieces by index."""
    states = {}
    for index, shape in enumerate(shapes):
        state = whole(saved.get(index, []), shape, f"parameter {index}")
        if state:
            states[index] = state
    return states


def _cut(piece: SavedPiece, key: str, start: int, stop: int, what: str) -> torch.Tensor:
    value = piece.state.get(key)
    if not is_elementwise(key, value, (piece.numel,)):
        raise ValueError(
            f"the optimizer state {key!r} of {what} is not one value per element in every piece (elements "
            f"{piece.start}-{piece.stop} hold {_describe(value)}), so it cannot be re-sharded; resume with the "
            "number of ranks it was saved with."
        )
    assert isinstance(value, torch.Tensor)
    return value[max(start, piece.start) - piece.start : min(stop, piece.stop) - piece.start]


def _check_coverage(covering: Sequence[SavedPiece], start: int, stop: int, what: str) -> None:
    reached = start
    for piece in covering:
        if piece.start > reached:
            break
        reached = max(reached, piece.stop)
    if reached < stop:
        raise ValueError(
            f"the saved optimizer state of {what} covers its elements only up to {reached} of {start}-{stop}: a "
            "shard file is missing from the checkpoint."
        )


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
