"""The math of every scheme on fixed tensors, at 1-4 ranks, against references computed here from every rank's
input (each rank can compute the others' fixed tensors)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mpistrategy.aggregation import (
    QSGD,
    LowPrecision,
    MajorityVote,
    MeanAggregator,
    MinMaxQuantization,
    PowerSGD,
    RandomK,
    ScaledSign,
    TopK,
)
from tests.aggregation.helpers import COMM, RANK, SIZE, bucket, combine, everyone, rank_tensor, setup

SHAPES = [[(6, 10), (10,), (4, 5)], [(32, 24)]]  # a flat bucket of three parameters and an own-gradient bucket


def _buckets(dtype: torch.dtype = torch.float32):
    return [bucket(shapes, index, dtype, own=index == 1) for index, shapes in enumerate(SHAPES)]


def _inputs(buckets, seed: int, dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """Per bucket, every rank's flat gradient."""
    return [everyone(b.buffer.numel(), seed=10 * seed + b.index, dtype=dtype) for b in buckets]


def _mean_result(inputs: list[list[torch.Tensor]], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """What MeanAggregator gives for ``inputs``."""
    reference = _buckets(dtype)
    mean = MeanAggregator()
    setup(mean, reference)
    combine(mean, reference, [x[RANK] for x in inputs])
    return [b.buffer.clone() for b in reference]


def _rounds(aggregator, buckets, count: int):
    """Combine ``count`` rounds of fixed inputs; yield each round's inputs (per bucket, every rank's) after it."""
    for round_ in range(count):
        inputs = _inputs(buckets, round_)
        combine(aggregator, buckets, [x[RANK] for x in inputs])
        yield inputs


def _zero_residuals(buckets) -> dict[int, list[torch.Tensor]]:
    """Per bucket, every rank's residual before the first round."""
    return {b.index: [torch.zeros(b.buffer.numel()) for _ in range(SIZE)] for b in buckets}


def _same_on_all_ranks(tensors: list[torch.Tensor]) -> None:
    mine = torch.cat([t.reshape(-1).double() for t in tensors])
    for rank, other in enumerate(COMM.allgather(mine)):
        assert torch.equal(other, mine), f"rank {rank} combined differently from rank {RANK}"


# ------------------------------------------------------------------------------------------------------- top-k


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
def test_topk_sends_exactly_k_pairs_and_keeps_the_residual() -> None:
    density = 0.1
    buckets = _buckets()
    aggregator = TopK(density=density)
    traffic = setup(aggregator, buckets)
    every_residual = _zero_residuals(buckets)  # rebuilt here for every rank
    for inputs in _rounds(aggregator, buckets, 3):
        expected_bytes = 0
        for b, xs in zip(buckets, inputs, strict=True):
            previous = every_residual[b.index]
            n = b.buffer.numel()
            k = math.ceil(density * n)
            expected_bytes += 2 * (-(-4 * k // 8) * 8)  # k int32 indices and k float32 values, 8-byte aligned
            combined = torch.zeros(n)
            for rank in range(SIZE):
                p = xs[rank] + previous[rank]
                top = p.abs().topk(k).indices
                combined[top] += p[top]
                previous[rank] = p.clone()
                previous[rank][top] = 0
            torch.testing.assert_close(b.buffer, combined / SIZE, rtol=1e-6, atol=1e-7)
        assert traffic.take() == (expected_bytes, 0)
        for b in buckets:
            mine = aggregator.memory.residual(b)
            assert torch.count_nonzero(mine) == b.buffer.numel() - math.ceil(density * b.buffer.numel())
            torch.testing.assert_close(mine, every_residual[b.index][RANK], rtol=1e-6, atol=1e-7)
    _same_on_all_ranks([b.buffer for b in buckets])


# ------------------------------------------------------------------------------------------------------- random-k


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
@pytest.mark.parametrize("error_feedback", [True, False])
def test_randomk_picks_the_same_indices_on_every_rank(error_feedback: bool) -> None:
    density = 0.2
    buckets = _buckets()
    aggregator = RandomK(density=density, seed=7, error_feedback=error_feedback)
    traffic = setup(aggregator, buckets)
    draws = np.random.Generator(np.random.PCG64(7))  # the same stream, drawn here
    residual = _zero_residuals(buckets)
    for inputs in _rounds(aggregator, buckets, 2):
        sent = 0
        for b, xs in zip(buckets, inputs, strict=True):
            n = b.buffer.numel()
            k = math.ceil(density * n)
            chosen = torch.from_numpy(np.sort(draws.choice(n, size=k, replace=False, shuffle=False)))
            p = [x + e for x, e in zip(xs, residual[b.index], strict=True)] if error_feedback else xs
            expected = torch.zeros(n)
            expected[chosen] = torch.stack([q[chosen] for q in p]).mean(0) * (1 if error_feedback else n / k)
            torch.testing.assert_close(b.buffer, expected, rtol=1e-6, atol=1e-7)
            assert torch.count_nonzero(b.buffer) == k
            for rank in range(SIZE):
                residual[b.index][rank] = p[rank].clone()
                residual[b.index][rank][chosen] = 0
            sent += 4 * k
        assert traffic.take() == (sent, 0)
    nonzero = [torch.nonzero(b.buffer).reshape(-1) for b in buckets]
    for rank, theirs in enumerate(COMM.allgather(nonzero)):
        assert all(torch.equal(a, c) for a, c in zip(theirs, nonzero, strict=True)), f"rank {rank} chose others"


# ------------------------------------------------------------------------------------------------------- QSGD


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=90)
def test_qsgd_is_unbiased_over_many_draws() -> None:
    draws = 600
    b = bucket([(16,)], 0, torch.float64)
    aggregator = QSGD(levels=2, block_size=8, seed=3)
    traffic = setup(aggregator, [b])
    inputs = everyone(16, seed=5, dtype=torch.float64)
    truth = torch.stack(inputs).mean(0)
    samples = torch.empty(draws, 16, dtype=torch.float64)
    for draw in range(draws):
        combine(aggregator, [b], [inputs[RANK]])
        samples[draw] = b.buffer
    # 2 levels -> codes in 0..4, 3 bits: 16 codes = 6 bytes -> 8; two float64 norms = 16 bytes
    assert traffic.take() == (draws * (16 + 8), 0)
    assert samples.std(0).min() > 0, "the quantiser did not round stochastically"
    standard_error = samples.std(0) / math.sqrt(draws)
    z = (samples.mean(0) - truth) / standard_error
    assert z.abs().max() < 3, f"QSGD mean off by {z.abs().max():.2f} standard errors: {z}"
    _same_on_all_ranks([b.buffer])


# ------------------------------------------------------------------------------------------------------- min-max


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
@pytest.mark.parametrize("bits", [8, 3])
def test_minmax_reconstructs_within_one_quantisation_step(bits: int) -> None:
    buckets = _buckets()
    aggregator = MinMaxQuantization(bits=bits, block_size=16)
    traffic = setup(aggregator, buckets)
    inputs = _inputs(buckets, 0)
    combine(aggregator, buckets, [x[RANK] for x in inputs])
    sent = 0
    for b, xs in zip(buckets, inputs, strict=True):
        n = b.buffer.numel()
        blocks = -(-n // 16)
        padded = [torch.cat([x, x[-1].expand(-n % 16)]).view(blocks, 16) for x in xs]
        steps = [((q.max(1).values - q.min(1).values) / (2**bits - 1)).repeat_interleave(16)[:n] for q in padded]
        bound = torch.stack(steps).mean(0) / 2  # the mean of per-rank errors of at most half a step
        error = (b.buffer - torch.stack(xs).mean(0)).abs()
        assert (error <= bound * (1 + 1e-5) + 1e-7).all(), f"error {error.max()} above the bound"
        assert (error > 0).any(), "nothing was quantised"
        residual = aggregator.memory.residual(b)
        assert (residual.abs() <= steps[RANK] / 2 * (1 + 1e-5) + 1e-7).all()
        sent += -(-blocks * 4 // 8) * 8 * 2 + -(-math.ceil(n * bits / 8) // 8) * 8
    assert traffic.take() == (sent, 0)
    _same_on_all_ranks([b.buffer for b in buckets])


# ------------------------------------------------------------------------------------------------------- signs


def _mean_magnitude_per_parameter(values: torch.Tensor, b) -> torch.Tensor:
    """Each parameter's mean |value|, repeated over its elements."""
    return torch.cat([values[o : o + n].abs().mean().expand(n) for o, n in zip(b.offsets, b.numels, strict=True)])


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
def test_scaled_sign_sends_signs_and_mean_magnitudes_with_error_feedback() -> None:
    buckets = _buckets()
    aggregator = ScaledSign()
    traffic = setup(aggregator, buckets)
    residual = _zero_residuals(buckets)
    for inputs in _rounds(aggregator, buckets, 2):
        sent = 0
        for b, xs in zip(buckets, inputs, strict=True):
            compressed = []
            for rank in range(SIZE):
                p = xs[rank] + residual[b.index][rank]
                scale = _mean_magnitude_per_parameter(p, b)
                c = torch.where(p >= 0, scale, -scale)
                residual[b.index][rank] = p - c
                compressed.append(c)
            torch.testing.assert_close(b.buffer, torch.stack(compressed).mean(0), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(aggregator.memory.residual(b), residual[b.index][RANK], rtol=1e-6, atol=1e-6)
            sent += -(-4 * len(b.numels) // 8) * 8 + -(-math.ceil(b.buffer.numel() / 8) // 8) * 8
        assert traffic.take() == (sent, 0)
    _same_on_all_ranks([b.buffer for b in buckets])


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
@pytest.mark.parametrize("scaled", [False, True])
def test_majority_vote_is_the_sign_of_the_sum_of_signs(scaled: bool) -> None:
    buckets = _buckets()
    aggregator = MajorityVote(scaled=scaled)
    traffic = setup(aggregator, buckets)
    inputs = _inputs(buckets, 0)
    combine(aggregator, buckets, [x[RANK] for x in inputs])
    sent = 0
    for b, xs in zip(buckets, inputs, strict=True):
        vote = torch.stack([torch.where(x >= 0, 1.0, -1.0) for x in xs]).sum(0).sign()
        if scaled:
            scales = [_mean_magnitude_per_parameter(x, b) for x in xs]
            vote = vote * torch.stack(scales).mean(0)
            sent += -(-4 * len(b.numels) // 8) * 8
        torch.testing.assert_close(b.buffer, vote, rtol=1e-6, atol=0)
        if SIZE % 2 == 0:
            assert (b.buffer == 0).any(), "ties between an even number of ranks vote 0"
        sent += -(-math.ceil(b.buffer.numel() / 8) // 8) * 8
    assert traffic.take() == (sent, 0)
    _same_on_all_ranks([b.buffer for b in buckets])


# ------------------------------------------------------------------------------------------------------- PowerSGD


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_powersgd_at_full_rank_reproduces_the_mean(dtype: torch.dtype) -> None:
    shapes = [[(6, 10), (10,), (12, 3), (2, 2, 3)], [(32, 24)]]
    buckets = [bucket(s, index, dtype, own=index == 1) for index, s in enumerate(shapes)]
    aggregator = PowerSGD(rank=32, start_iter=0, min_compression_rate=0)
    traffic = setup(aggregator, buckets)
    # float64: to 1e-6 (in fact to about 1e-14); float32: its rounding of values of size 1 through QR and two
    # products, a few units in the 6th digit
    tolerance = 1e-5 if dtype == torch.float32 else 1e-6
    for round_ in range(3):
        inputs = [everyone(b.buffer.numel(), seed=10 * round_ + b.index, dtype=dtype) for b in buckets]
        combine(aggregator, buckets, [x[RANK] for x in inputs])
        for b, xs in zip(buckets, inputs, strict=True):
            torch.testing.assert_close(b.buffer, torch.stack(xs).mean(0), rtol=tolerance, atol=tolerance)
        # P (n x r') and Q (m x r') of every matrix, r' = min(n, m), plus the 1-D parameter exactly
        assert traffic.take()[0] == dtype.itemsize * (
            6 * 6 + 10 * 6 + 10 + 12 * 3 + 3 * 3 + 2 * 2 + 6 * 2 + 32 * 24 + 24 * 24
        )
    _same_on_all_ranks([b.buffer for b in buckets])


def _reference_powersgd_round(ms: list[torch.Tensor], q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One round of the paper's algorithm on every rank's matrix ``ms`` from the starting ``q``: the
    approximation and the new Q (Gram-Schmidt through QR with a positive diagonal)."""

    def gram_schmidt(x: torch.Tensor) -> torch.Tensor:
        basis, r = torch.linalg.qr(x)
        return basis * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)

    q = gram_schmidt(q)
    p = gram_schmidt(torch.stack([m @ q for m in ms]).mean(0))
    q = torch.stack([m.T @ p for m in ms]).mean(0)
    return p @ q.T, q


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
def test_powersgd_rank_one_follows_the_paper_with_warm_start_and_error_feedback() -> None:
    b = bucket([(20, 16), (16,)], 0)
    aggregator = PowerSGD(rank=1, start_iter=1, seed=11)
    traffic = setup(aggregator, [b])
    q = torch.randn(16, 1, generator=torch.Generator().manual_seed(11))
    errors = [torch.zeros(20, 16) for _ in range(SIZE)]
    for round_ in range(4):
        inputs = everyone(336, seed=round_)
        combine(aggregator, [b], [inputs[RANK]])
        bias = torch.stack([x[320:] for x in inputs]).mean(0)
        if round_ == 0:  # before start_iter: the plain mean, no residual
            torch.testing.assert_close(b.buffer, torch.stack(inputs).mean(0), rtol=1e-6, atol=1e-6)
            assert traffic.take()[0] == 4 * 336
            continue
        ms = [x[:320].view(20, 16) + e for x, e in zip(inputs, errors, strict=True)]
        approximation, q = _reference_powersgd_round(ms, q)
        errors = [m - approximation for m in ms]
        torch.testing.assert_close(b.buffer[:320].view(20, 16), approximation, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.buffer[320:], bias, rtol=1e-6, atol=1e-6)
        assert traffic.take()[0] == 4 * (20 + 16 + 16)
    _same_on_all_ranks([b.buffer])


# ------------------------------------------------------------------------------------------------------- off


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
@pytest.mark.parametrize(
    "make",
    [
        lambda: TopK(density=1.0),
        lambda: RandomK(density=1.0),
        lambda: LowPrecision("float32"),
        lambda: PowerSGD(start_iter=10**9),
    ],
    ids=["topk-density-1", "randomk-density-1", "low-precision-fp32", "powersgd-before-start"],
)
def test_with_compression_off_every_scheme_is_the_mean(make) -> None:
    buckets = _buckets()
    aggregator = make()
    traffic = setup(aggregator, buckets)
    for round_ in range(2):
        inputs = _inputs(buckets, round_)
        combine(aggregator, buckets, [x[RANK] for x in inputs])
        for got, want in zip([b.buffer for b in buckets], _mean_result(inputs), strict=True):
            assert torch.equal(got, want)
        assert traffic.take()[0] == sum(b.nbytes for b in buckets)


def _lossless_inputs(b, seed: int) -> list[torch.Tensor]:
    """Per rank, values every lossy scheme represents exactly: per parameter one magnitude 2**j times signs, in
    pairs (3, 4) * 2**j (QSGD's grid for 5 levels and blocks of 2)."""
    values = []
    for rank in range(SIZE):
        generator = torch.Generator().manual_seed(100 * seed + rank)
        parts = []
        for n in b.numels:
            magnitude = 2.0 ** int(torch.randint(-3, 3, (), generator=generator))
            pattern = torch.tensor([3.0, 4.0]).repeat(-(-n // 2))[:n] * magnitude
            parts.append(pattern * torch.where(torch.rand(n, generator=generator) < 0.5, -1.0, 1.0))
        values.append(torch.cat(parts))
    return values


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
@pytest.mark.parametrize(
    "make",
    [
        lambda: QSGD(levels=5, block_size=2),
        lambda: MinMaxQuantization(bits=8, block_size=2),
        lambda: LowPrecision("float16"),
        lambda: LowPrecision("bfloat16"),
    ],
    ids=["qsgd", "minmax", "fp16", "bf16"],
)
def test_on_exactly_representable_gradients_the_lossy_schemes_are_the_mean(make) -> None:
    aggregator = make()
    buckets = _buckets()
    setup(aggregator, buckets)
    inputs = [_lossless_inputs(b, seed=1) for b in buckets]
    combine(aggregator, buckets, [x[RANK] for x in inputs])
    tolerance = 2e-7
    if isinstance(aggregator, LowPrecision) and SIZE & (SIZE - 1):  # dividing by 3 first rounds in half precision
        tolerance = 2.0**-10 if aggregator.dtype == "float16" else 2.0**-7
    for got, want in zip([b.buffer for b in buckets], _mean_result(inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=0)


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
def test_scaled_sign_of_equal_magnitudes_is_the_mean() -> None:
    buckets = _buckets()
    aggregator = ScaledSign()
    setup(aggregator, buckets)
    # one magnitude per parameter, the same on every rank, random signs: the scaled sign is exact
    inputs = []
    for b in buckets:
        scale = torch.cat([torch.full((n,), 2.0**-j) for j, n in enumerate(b.numels)])
        inputs.append([scale * torch.where(rank_tensor(b.buffer.numel(), r) < 0, -1.0, 1.0) for r in range(SIZE)])
    combine(aggregator, buckets, [x[RANK] for x in inputs])
    for got, want in zip([b.buffer for b in buckets], _mean_result(inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-7, atol=0)
    assert all(torch.count_nonzero(aggregator.memory.residual(b)) == 0 for b in buckets)


# ------------------------------------------------------------------------------------------------------- fp16/bf16


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=60)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_halves_the_bytes_and_divides_before_the_sum(dtype: str) -> None:
    buckets = _buckets()
    aggregator = LowPrecision(dtype)
    traffic = setup(aggregator, buckets)
    wire = getattr(torch, dtype)
    inputs = _inputs(buckets, 0)
    big = 60000.0 if dtype == "float16" else 1e38  # near the top of the range: a sum before dividing overflows
    for xs in inputs:
        for x in xs:
            x[0] = big
    combine(aggregator, buckets, [x[RANK] for x in inputs])
    assert traffic.take() == (sum(b.buffer.numel() * 2 for b in buckets), 0)
    for b, xs in zip(buckets, inputs, strict=True):
        shares = torch.stack([(x / SIZE).to(wire).float() for x in xs])
        total = shares[0].clone()
        for share in shares[1:]:
            total = (total.to(wire) + share.to(wire)).float()  # MPI adds pairs, rounding each sum to the wire type
        assert b.buffer.isfinite().all()
        tolerance = 2.0 ** (-10 if dtype == "float16" else -7) * math.ceil(math.log2(SIZE) + 1)
        # inputs of size 1 to 4: absolute errors up to the rounding of the largest (sums can cancel)
        exact = torch.stack(xs).double().mean(0).float()  # in float64: a float32 sum of 1e38s overflows too
        torch.testing.assert_close(b.buffer, exact, rtol=tolerance, atol=4 * tolerance)
        torch.testing.assert_close(b.buffer[0], torch.tensor(big), rtol=tolerance, atol=0)
        if SIZE <= 2:  # with two ranks every order of the pairwise sum is the same
            assert torch.equal(b.buffer, total)
    _same_on_all_ranks([b.buffer for b in buckets])


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_half_precision_gradients_are_summed_in_their_own_type() -> None:
    buckets = _buckets(torch.bfloat16)
    aggregator = LowPrecision("float16")  # not wider than the bucket: sent as bfloat16, never cast to float16
    traffic = setup(aggregator, buckets)
    inputs = _inputs(buckets, 0, torch.bfloat16)
    for xs in inputs:
        for x in xs:
            x[0] = 1e30  # beyond float16's range
    combine(aggregator, buckets, [x[RANK] for x in inputs])
    assert traffic.take() == (sum(b.buffer.numel() * 2 for b in buckets), 0)
    for b, xs in zip(buckets, inputs, strict=True):
        assert b.buffer.dtype == torch.bfloat16
        torch.testing.assert_close(b.buffer.float(), torch.stack(xs).float().mean(0), rtol=3e-2, atol=1e-2)
