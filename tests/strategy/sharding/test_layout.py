"""The shard layout and the moves of optimizer state between layouts, in one process: every element belongs to
exactly one shard, shards differ by at most one element, and state cut into the pieces of one number of shards and
assembled for another is the state it was."""

from __future__ import annotations

import pytest
import torch

from mpistrategy.strategy.sharding.layout import bucket_ranges, overlaps, shard_bounds, shard_pieces
from mpistrategy.strategy.sharding.state import SavedPiece, assemble, piece_of, whole

SIZES = [7, 1, 30, 0, 12, 5]


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 7, 80])
def test_every_element_is_in_one_shard_and_shards_differ_by_one_at_most(shards: int) -> None:
    total = sum(SIZES)
    bounds = shard_bounds(total, shards)
    lengths = [high - low for low, high in zip(bounds, bounds[1:], strict=False)]
    assert sum(lengths) == total and max(lengths) - min(lengths) <= 1
    owner = torch.full((total,), -1)
    for shard in range(shards):
        for piece in shard_pieces(SIZES, shards, shard):
            assert 0 <= piece.start < piece.stop <= SIZES[piece.index]
            assert (owner[piece.offset : piece.offset + piece.numel] == -1).all()
            owner[piece.offset : piece.offset + piece.numel] = shard
    assert (owner >= 0).all()
    assert torch.equal(owner.sort().values, owner), "shards are not contiguous ranges of the flat order"


def test_uneven_at_three_shards_and_cut_parameters() -> None:
    assert shard_bounds(55, 3) == [0, 18, 36, 55]
    assert [(p.index, p.start, p.stop) for p in shard_pieces(SIZES, 3, 1)] == [(2, 10, 28)]
    assert [(p.index, p.start, p.stop) for p in shard_pieces(SIZES, 3, 2)] == [(2, 28, 30), (4, 0, 12), (5, 0, 5)]
    assert overlaps(shard_bounds(55, 3), 10, 40) == [8, 18, 4]


def test_buckets_are_runs_of_consecutive_parameters_under_the_cap() -> None:
    ranges = bucket_ranges(SIZES, 13)
    spans = [(r.first, r.last, r.start, r.stop) for r in ranges]
    assert spans == [(0, 2, 0, 8), (2, 3, 8, 38), (3, 5, 38, 50), (5, 6, 50, 55)]
    assert ranges[1].numel == 30  # a parameter larger than the cap is a bucket of its own


def _adam_like(shape: tuple[int, ...], step: float) -> dict:
    g = torch.Generator().manual_seed(int(step))
    return {"step": torch.tensor(step), "exp_avg": torch.randn(shape, generator=g), "exp_avg_sq": torch.rand(shape)}


@pytest.mark.parametrize(("saved", "loaded"), [(3, 2), (2, 3), (4, 1), (1, 4)])
def test_state_cut_for_some_shards_and_assembled_for_others_is_unchanged(saved: int, loaded: int) -> None:
    shapes = [(7,), (1,), (5, 6), (0,), (3, 4), (5,)]
    states = [_adam_like(shape, 3.0 + index) for index, shape in enumerate(shapes)]
    pieces: dict[int, list[SavedPiece]] = {}
    for shard in range(saved):
        for p in shard_pieces(SIZES, saved, shard):
            pieces.setdefault(p.index, []).append(
                SavedPiece(p.start, p.stop, piece_of(states[p.index], shapes[p.index], p.start, p.stop))
            )
    for shard in range(loaded):
        for p in shard_pieces(SIZES, loaded, shard):
            got = assemble(pieces[p.index], p.start, p.stop, f"parameter {p.index}")
            want = piece_of(states[p.index], shapes[p.index], p.start, p.stop)
            assert got.keys() == want.keys() and torch.equal(got["step"], want["step"])
            assert torch.equal(got["exp_avg"], want["exp_avg"]) and got["exp_avg"].shape == (p.numel,)
    for index, shape in enumerate(shapes):
        if SIZES[index]:
            rebuilt = whole(pieces[index], shape, "parameter")
            assert all(torch.equal(rebuilt[key], states[index][key]) for key in states[index])


def test_state_that_is_not_elementwise_cannot_be_resharded() -> None:
    saved = [SavedPiece(0, 4, {"factor": torch.ones(2)}), SavedPiece(4, 8, {"factor": torch.ones(2)})]
    with pytest.raises(ValueError, match="'factor' of parameter 3 is not one value per element"):
        assemble(saved, 2, 6, "parameter 3")
    with pytest.raises(ValueError, match="a shard file is missing"):
        assemble([SavedPiece(0, 4, {"step": torch.tensor(1.0)})], 2, 6, "parameter 3")
