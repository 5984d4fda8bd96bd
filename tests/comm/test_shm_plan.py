"""The plan of a shared-memory allreduce, a pure function: the chunks, which rank sums each one, which chunks a
rank copies in, and where its sums go, for 1-5 ranks, odd sizes and messages with fewer elements than ranks
(one process, no MPI)."""

from __future__ import annotations

import dataclasses

import pytest

from mpistrategy.comm.shm.plan import (
    CHUNK_BYTES,
    EVERYONE_SUMS_BYTES,
    Plan,
    Results,
    Source,
    Summing,
    everyone_sums,
    plan_allreduce,
)

FLOAT32 = 4
#: 3 MiB + 5 float32: capped at 1 MiB chunks on 2 and 3 ranks, one chunk per rank on 4 and 5
ODD = 3 * (CHUNK_BYTES // FLOAT32) + 5


def plan_of(numel: int, size: int, rank: int, itemsize: int = FLOAT32, source: Source = Source.HOST) -> Plan:
    """The plan of a private host tensor reduced into a new host tensor."""
    return plan_allreduce(numel, itemsize, size, rank, source, False, True)


def chunk_lengths(plan: Plan) -> list[int]:
    return [min(plan.step, plan.numel - chunk * plan.step) for chunk in range(plan.chunks)]


@pytest.mark.parametrize(
    ("size", "step", "lengths", "owners", "summed_by_rank"),
    [
        (2, 262144, [262144, 262144, 262144, 5], (0, 1, 0, 1), [[0, 2], [1, 3]]),
        (3, 262144, [262144, 262144, 262144, 5], (0, 1, 2, 0), [[0, 3], [1], [2]]),
        (4, 196624, [196624, 196624, 196624, 196565], (0, 1, 2, 3), [[0], [1], [2], [3]]),
        (5, 157296, [157296, 157296, 157296, 157296, 157253], (0, 1, 2, 3, 4), [[0], [1], [2], [3], [4]]),
    ],
)
def test_each_chunk_of_a_large_odd_message_is_summed_by_rank_chunk_mod_p(
    size: int, step: int, lengths: list[int], owners: tuple[int, ...], summed_by_rank: list[list[int]]
) -> None:
    for rank in range(size):
        plan = plan_of(ODD, size, rank)
        assert plan.summing is Summing.OWNERS
        assert (plan.step, plan.chunks, chunk_lengths(plan)) == (step, len(lengths), lengths)
        assert plan.owners == owners
        assert list(plan.summed_here) == summed_by_rank[rank]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("numel", "step"), [(1, 16), (2, 16), (3, 16), (4, 16), (7, 16), (1003, 1008)])
def test_a_message_smaller_than_the_rank_count_or_small_is_one_chunk_that_every_rank_sums(
    size: int, numel: int, step: int
) -> None:
    for rank in range(size):
        plan = plan_of(numel, size, rank)
        assert plan.summing is Summing.EVERY_RANK
        assert (plan.step, plan.chunks, list(plan.summed_here), plan.owners) == (step, 1, [0], (rank,))
        assert plan.results is Results.TARGET and plan.staged == (0,)


def test_one_rank_sums_every_chunk_of_any_message_itself() -> None:
    plan = plan_of(ODD, 1, 0)
    assert (plan.summing, plan.step, plan.chunks) == (Summing.EVERY_RANK, 262144, 4)
    assert list(plan.summed_here) == [0, 1, 2, 3] and plan.owners == (0, 0, 0, 0)


@pytest.mark.parametrize(
    ("size", "numel", "summing", "chunks"),
    [
        (2, 65536, Summing.EVERY_RANK, 1),  # 256 KiB of the other rank's input
        (2, 65537, Summing.OWNERS, 2),
        (5, 16384, Summing.EVERY_RANK, 1),  # 4 x 64 KiB of the others' inputs
        (5, 16385, Summing.OWNERS, 5),
    ],
)
def test_every_rank_sums_up_to_256_kib_of_the_others_input(
    size: int, numel: int, summing: Summing, chunks: int
) -> None:
    assert everyone_sums(numel * FLOAT32, size) == (summing is Summing.EVERY_RANK)
    plan = plan_of(numel, size, size - 1)
    assert (plan.summing, plan.chunks, sum(chunk_lengths(plan))) == (summing, chunks, numel)
    assert list(plan.summed_here) == ([size - 1] if summing is Summing.OWNERS else [0])


@pytest.mark.parametrize(("itemsize", "align"), [(2, 32), (4, 16), (8, 8)])
@pytest.mark.parametrize("size", [2, 3, 5])
def test_chunks_start_on_cache_lines_and_cover_the_message(itemsize: int, align: int, size: int) -> None:
    numel = 9 * (CHUNK_BYTES // itemsize) + 11
    plan = plan_of(numel, size, 0, itemsize)
    assert plan.step % align == 0 and plan.step * itemsize <= CHUNK_BYTES
    assert sum(chunk_lengths(plan)) == numel and 0 < chunk_lengths(plan)[-1] <= plan.step
    assert plan.chunks == 10 and EVERYONE_SUMS_BYTES < numel * itemsize


@pytest.mark.parametrize(("rank", "staged"), [(0, (1, 2)), (1, (0, 2, 3)), (2, (0, 1, 3))])
def test_a_host_input_copies_in_only_the_chunks_other_ranks_sum(rank: int, staged: tuple[int, ...]) -> None:
    host = plan_of(ODD, 3, rank, source=Source.HOST)
    device = plan_of(ODD, 3, rank, source=Source.DEVICE)
    window = plan_of(ODD, 3, rank, source=Source.WINDOW)
    assert (host.staged, device.staged, window.staged) == (staged, (0, 1, 2, 3), ())
    assert (host.copies_in, device.copies_in, window.copies_in) == (True, True, False)


@pytest.mark.parametrize(
    ("numel", "size", "source", "in_place", "target_on_host", "results", "waits"),
    [
        (ODD, 3, Source.WINDOW, True, True, Results.OVER_INPUT, True),
        (7, 3, Source.WINDOW, True, True, Results.WRITE_BACK, False),
        (7, 1, Source.WINDOW, True, True, Results.TARGET, False),
        (ODD, 3, Source.WINDOW, False, True, Results.STAGING_AND_TARGET, False),
        (ODD, 3, Source.HOST, True, True, Results.STAGING_AND_TARGET, False),
        (ODD, 3, Source.DEVICE, False, False, Results.STAGING, False),
        (7, 3, Source.WINDOW, False, True, Results.TARGET, True),
        (7, 3, Source.HOST, True, True, Results.TARGET, False),
    ],
)
def test_where_the_sums_go_and_whether_the_rank_waits_for_its_readers(
    numel: int, size: int, source: Source, in_place: bool, target_on_host: bool, results: Results, waits: bool
) -> None:
    plan = plan_allreduce(numel, FLOAT32, size, 0, source, in_place, target_on_host)
    assert (plan.results, plan.waits_for_readers) == (results, waits)
    assert plan.sums_in_staging == (results in (Results.STAGING_AND_TARGET, Results.STAGING))


def test_the_plan_is_a_frozen_value_of_its_arguments() -> None:
    plan = plan_of(ODD, 4, 2)
    assert plan == Plan(4, 2, ODD, 196624, 4, Summing.OWNERS, Source.HOST, Results.STAGING_AND_TARGET)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rank = 3  # type: ignore[misc]
