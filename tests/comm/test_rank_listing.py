"""Per-rank values in messages, ranks with the same value grouped (one process: plain text formatting)."""

from __future__ import annotations

from mpistrategy.comm.errors import by_rank, ranks_named


def test_ranks_with_one_value_are_grouped_in_spans() -> None:
    assert by_rank([64, 64, 64, 128, 64, 7]) == "ranks 0-2, 4: 64; rank 3: 128; rank 5: 7"
    assert by_rank({2: "b", 0: "a"}) == "rank 2: b; rank 0: a"  # groups in the order given
    assert by_rank(["x"] * 1024) == "ranks 0-1023: x"  # one line however many ranks


def test_ranks_are_named_as_spans() -> None:
    assert ranks_named([3]) == "rank 3"
    assert ranks_named([8, 0, 1, 2, 5, 7]) == "ranks 0-2, 5, 7-8"
