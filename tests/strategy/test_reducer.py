"""The gradient buckets outside Lightning: views, overlap, unused and frozen parameters, layout checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mpistrategy.aggregation import MeanAggregator
from mpistrategy.comm.shm import shared_memory
from mpistrategy.comm.topology import topology
from mpistrategy.strategy.reducer import BucketLayoutError, GradientReducer
from mpistrategy.sync import HierarchicalSync, SyncContext
from tests.strategy.helpers import COMM, RANK, SIZE


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3)).double()


#: own_bucket_mb values: every gradient in flat buckets, or every gradient its own bucket (combined in place)
LAYOUTS = {"flat": math.inf, "own": 0.0}


def _reducer(net: nn.Module, cap_mb: float = 0.002, own_bucket_mb: float = math.inf) -> GradientReducer:
    return GradientReducer(
        net,
        MeanAggregator(),
        topology(),
        bucket_cap_mb=cap_mb,
        first_bucket_cap_mb=cap_mb / 4,
        own_bucket_mb=own_bucket_mb,
    )


def _backward(reducer: GradientReducer, loss: torch.Tensor, sync: bool = True) -> None:
    reducer.prepare(sync)
    loss.backward()
    reducer.wait()


def _rank_batch(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SIZE * 3, 5, generator=g, dtype=torch.float64)
    return x, x[RANK * 3 : RANK * 3 + 3]


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradients_are_views_and_averaged_during_backward(layout: str) -> None:
    net = _net()
    reducer = _reducer(net, own_bucket_mb=LAYOUTS[layout])
    assert len(reducer.buckets) >= 3
    full, mine = _rank_batch()
    _backward(reducer, net(mine).pow(2).sum() * (1 + RANK))
    assert reducer.started_in_backward == len(reducer.buckets) and reducer.started_at_wait == 0
    for bucket in reducer.buckets:
        start = bucket.buffer.data_ptr()
        end = start + bucket.nbytes
        for param in bucket.params:
            assert start <= param.grad.data_ptr() < end, "param.grad is not a view into its bucket"
    # Expected: the mean over ranks of each rank's gradient.
    ref = _net()
    for rank in range(SIZE):
        (ref(full[rank * 3 : rank * 3 + 3]).pow(2).sum() * (1 + rank) / SIZE).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    got = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    reducer.remove()


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_accumulation_without_sync_then_sync(layout: str) -> None:
    net = _net()
    reducer = _reducer(net, own_bucket_mb=LAYOUTS[layout])
    full, mine = _rank_batch()
    _backward(reducer, net(mine).sum(), sync=False)
    local = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).clone()
    everyone = COMM.allgather(local)
    assert SIZE == 1 or not all(torch.equal(everyone[0], other) for other in everyone[1:]), "synced without sync"
    _backward(reducer, net(mine).sum(), sync=True)
    got = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(got, 2 * sum(everyone) / SIZE, rtol=1e-12, atol=1e-12)
    reducer.remove()


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_parameter_unused_on_some_ranks_does_not_hang(layout: str) -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    net = nn.ModuleDict({"a": a, "b": b})
    reducer = _reducer(net, cap_mb=1e-5, own_bucket_mb=LAYOUTS[layout])
    x = torch.ones(2, 4, dtype=torch.float64)
    _backward(reducer, a(x).sum() if RANK % 2 == 0 else b(x).sum())  # even ranks never touch b, odd never a
    ranks_using_b = len([r for r in range(SIZE) if r % 2 == 1])
    torch.testing.assert_close(b.bias.grad, torch.full((4,), 2.0 * ranks_using_b / SIZE, dtype=torch.float64))
    ranks_using_a = len([r for r in range(SIZE) if r % 2 == 0])
    torch.testing.assert_close(a.bias.grad, torch.full((4,), 2.0 * ranks_using_a / SIZE, dtype=torch.float64))
    reducer.remove()


class _Branchy(nn.Module):
    """A trunk and head every pass uses, a branch that a pass uses only when asked, a layer no pass uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk, self.branch = nn.Linear(5, 6), nn.Linear(6, 6)
        self.never, self.head = nn.Linear(6, 3), nn.Linear(6, 3)
        self.double()

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h + torch.tanh(self.branch(h)) if use_branch else h)


def _branchy_reducer(net: nn.Module, layout: str) -> GradientReducer:
    """One flat bucket, a flat bucket per parameter, an own-gradient bucket per parameter, or a bucket per
    parameter averaged through the node hierarchy (virtual nodes of 2 ranks: at 3 ranks, nodes of 2 and 1)."""
    if layout == "hierarchical":
        nodes = topology(ranks_per_node=2)
        sync = HierarchicalSync()
        sync.setup(SyncContext(net, nodes, MeanAggregator()))
        return GradientReducer(net, sync, nodes, bucket_cap_mb=1e-5, own_bucket_mb=math.inf)
    cap, own = {"one-bucket": (25, math.inf), "per-parameter": (1e-5, math.inf), "own": (25, 0.0)}[layout]
    return GradientReducer(net, MeanAggregator(), topology(), bucket_cap_mb=cap, own_bucket_mb=own)


#: (zero_grad with set_to_none, or "module": the module's own zero_grad) or (sync, ranks that use the branch)
_ZERO, _PASS = "zero", "pass"
_PROGRAM = [
    (_ZERO, True), (_PASS, True, {0}),  # used on rank 0 only: the average over all ranks
    (_ZERO, True), (_PASS, True, set()),  # no rank: None (the never layer always)
    (_ZERO, True), (_PASS, False, {0}), (_PASS, True, set()),  # accumulated in an unsynchronised micro-batch
    (_ZERO, True), (_PASS, False, set()), (_PASS, True, {SIZE - 1}),  # only in the synchronised one
    (_ZERO, False), (_PASS, True, set()),  # set_to_none=False after a gradient: zero, as in one process
    (_PASS, True, {0}), (_PASS, True, set()), (_PASS, True, set(range(SIZE))),  # passes without zero_grad
    (_ZERO, "module"), (_PASS, False, {0}), (_ZERO, "module"), (_PASS, True, set()),  # module.zero_grad: None
    (_ZERO, True), (_PASS, True, set(range(SIZE))),
]  # fmt: skip


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("layout", ["one-bucket", "per-parameter", "own", "hierarchical"])
def test_parameters_no_rank_used_end_with_the_gradient_of_one_process(layout: str) -> None:
    """After every synchronised pass, every ``.grad`` is what one process computes from all ranks' data: ``None``
    where no rank produced a gradient since ``zero_grad(set_to_none=True)``, the average over all ranks where some
    did (zero from the others); buckets in which no rank produced one are not sent. After a pass without
    communication, ``None`` where this rank has no gradient."""
    net, ref = _Branchy(), _Branchy()
    reducer = _branchy_reducer(net, layout)
    optimizer, ref_optimizer = torch.optim.SGD(net.parameters(), lr=0.0), torch.optim.SGD(ref.parameters(), lr=0.0)
    reducer.attach_optimizer(optimizer)
    fresh: set[str] = set()  # parameters of the reference that got a gradient since they were last combined
    for name, param in ref.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _, name=name: fresh.add(name))
    full, mine = _rank_batch()
    for step, (kind, *args) in enumerate(_PROGRAM):
        if kind == _ZERO:
            if args[0] == "module":
                net.zero_grad()
                ref.zero_grad()
            else:
                optimizer.zero_grad(set_to_none=args[0])
                ref_optimizer.zero_grad(set_to_none=args[0])
            fresh.clear()
            continue
        sync, users = args
        for rank in range(SIZE):
            (ref(full[rank * 3 : rank * 3 + 3], rank in users).pow(2).sum() * (1 + rank) / SIZE).backward()
        _backward(reducer, net(mine, RANK in users).pow(2).sum() * (1 + RANK), sync)
        if not sync:  # every unsynchronised pass of the program directly follows a zero_grad that clears
            assert net.never.weight.grad is None and (net.branch.weight.grad is None) == (RANK not in users)
            continue
        names = {id(p): n for n, p in net.named_parameters()}
        expected = sum(any(names[id(p)] in fresh for p in b.params) for b in reducer.buckets)
        assert reducer.started_in_backward + reducer.started_at_wait == expected, f"step {step}: buckets sent"
        fresh.clear()
        for (name, got), want in zip(net.named_parameters(), ref.parameters(), strict=True):
            if want.grad is None:
                assert got.grad is None, f"step {step}: {name}.grad is not None"
            else:
                assert got.grad is not None, f"step {step}: {name}.grad is None"
                torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12, msg=f"step {step}: {name}")
    assert net.never.weight.grad is None and net.branch.weight.grad is not None
    reducer.remove()


@pytest.mark.mpi(ranks=(2,), timeout=60)
def test_frozen_parameters_untouched_and_unfrozen_later_picked_up() -> None:
    net = _net()
    first = net[0]
    for p in first.parameters():
        p.requires_grad_(False)
    reducer = _reducer(net)
    _, mine = _rank_batch()
    _backward(reducer, net(mine).sum())
    assert first.weight.grad is None and first.bias.grad is None
    for p in first.parameters():
        p.requires_grad_(True)
    _backward(reducer, net(mine).sum())
    gathered = COMM.allgather(first.weight.grad.clone())
    assert all(torch.equal(gathered[0], g) for g in gathered), "unfrozen parameter was not synchronised"
    # Frozen again, now inside a flat bucket: zero_grad(set_to_none=True) leaves it without a gradient, as in one
    # process (an optimizer would otherwise apply weight decay to it), while the others are averaged.
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    reducer.attach_optimizer(optimizer)
    for p in first.parameters():
        p.requires_grad_(False)
    optimizer.zero_grad()
    _backward(reducer, net(mine).sum())
    assert first.weight.grad is None and first.bias.grad is None
    gathered = COMM.allgather(net[2].weight.grad.clone())
    assert all(torch.equal(gathered[0], g) for g in gathered), "the trained parameters were not synchronised"
    reducer.remove()


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_parameter_frozen_after_the_forward_pass_leaves_the_others_averaged(layout: str) -> None:
    """``toggle_optimizer`` between the forward pass and backward: autograd keeps no gradient for the frozen layer,
    and its hook must not count it towards its bucket (the bucket would start before the other gradients land)."""
    net = _net()
    reducer = _reducer(net, cap_mb=25.0, own_bucket_mb=LAYOUTS[layout])  # flat: the frozen layer shares a bucket
    full, mine = _rank_batch()
    loss = net(mine).sum()
    last = net[4]
    last.requires_grad_(False)
    _backward(reducer, loss)
    assert last.weight.grad is None and last.bias.grad is None
    reference = _net()
    reference[4].requires_grad_(False)
    (reference(full).sum() / SIZE).backward()
    for name, param in net.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, reference.get_parameter(name).grad, rtol=1e-12, atol=1e-12)
    reducer.remove()


@pytest.mark.mpi(ranks=(2,), timeout=60)
def test_different_models_raise_clearly() -> None:
    torch.manual_seed(0)
    net = nn.Linear(3, 2 + RANK)
    with pytest.raises(BucketLayoutError, match="ranks built different gradient buckets"):
        _reducer(net)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_own_gradient_buckets_combine_the_gradient_autograd_stored(set_to_none: bool) -> None:
    """A large gradient is its own bucket: after zero_grad(set_to_none=True) autograd stores a fresh gradient and
    the bucket adopts that very tensor (no zeroing, no copy); with set_to_none=False it is zeroed in place. (With
    shared memory on, and every rank on this machine, it is copied into shared memory instead: see
    tests/comm/test_shm_allreduce.py.)"""
    net = _net()
    with shared_memory("off"):
        reducer = _reducer(net, cap_mb=25, own_bucket_mb=16 / 1024)  # the 64x64 float64 weight (32 KB) only
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    reducer.attach_optimizer(optimizer)
    weight = net[2].weight
    own = [b for b in reducer.buckets if b.own_gradient]
    assert len(own) == 1 and own[0].params[0] is weight and len(own[0].params) == 1
    stand_in = own[0].buffer  # until the first gradient: no memory of the parameter's size
    assert stand_in.numel() == weight.numel() and stand_in.untyped_storage().nbytes() == stand_in.element_size()
    full, mine = _rank_batch()
    ref = _net()
    for rank in range(SIZE):
        (ref(full[rank * 3 : rank * 3 + 3]).pow(2).sum() * (1 + rank) / SIZE).backward()
    for step in range(3):
        optimizer.zero_grad(set_to_none=set_to_none)
        before = weight.grad
        if step:  # before the first backward there is no gradient either way
            assert (before is None) == set_to_none and (set_to_none or torch.count_nonzero(before) == 0)
        _backward(reducer, net(mine).pow(2).sum() * (1 + RANK))
        assert own[0].buffer.data_ptr() == weight.grad.data_ptr() and own[0].buffer.numel() == weight.numel()
        assert set_to_none or not step or weight.grad is before, "zero_grad(set_to_none=False) replaced the tensor"
        torch.testing.assert_close(weight.grad, ref[2].weight.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(net[0].bias.grad, ref[0].bias.grad, rtol=1e-12, atol=1e-12)
    reducer.remove()
