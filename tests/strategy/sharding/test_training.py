"""ZeRO stages 1 and 2 against flat mpi_ad, after 20 AdamW steps with gradient clipping and accumulation: the same
parameters and optimizer state (float32, to 1e-6), and the memory each rank holds, measured from its tensors.

The model has a frozen layer, a parameter no rank uses and a head only rank 0 uses; the shards are uneven at 3
ranks. Hierarchical sync runs on virtual nodes of 2 ranks (at 3 ranks: nodes of 2 and 1).
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import TensorDataset

from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.mpi_resources import free_context_ids
from tests.strategy.helpers import SIZE, assert_same_on_all_ranks, epoch_order, loader, trainer
from tests.strategy.sharding.helpers import BATCH, BUCKET_CAP_MB, DeepNet, data, fit, parameter_vector

MODES = ("optimizer", "gradients")
TOLERANCE = {"rtol": 0, "atol": 1e-6}


def _assert_same_state(got: dict | None, want: dict | None) -> None:
    if want is None:
        return
    assert got is not None and sorted(got["state"]) == sorted(want["state"])
    for index, values in want["state"].items():
        assert sorted(got["state"][index]) == sorted(values)
        for key, value in values.items():
            torch.testing.assert_close(got["state"][index][key], value, **TOLERANCE, msg=f"{key} of parameter {index}")
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=240)
@pytest.mark.parametrize("shard", MODES)
def test_sharded_training_equals_flat(shard: str) -> None:
    flat, sharded = fit(None), fit(shard)
    assert not torch.equal(flat.params, parameter_vector(DeepNet())), "training did not move the parameters"
    torch.testing.assert_close(sharded.params, flat.params, **TOLERANCE)
    assert_same_on_all_ranks(sharded.params, "parameters")
    _assert_same_state(sharded.optimizer_state, flat.optimizer_state)
    if flat.optimizer_state is not None:  # the unused parameter and the frozen layer never got state
        assert len(flat.optimizer_state["state"]) == len(list(DeepNet().parameters())) - 4


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=240)
@pytest.mark.parametrize("shard", MODES)
def test_optimizer_state_per_rank_is_a_shard_of_flat(shard: str) -> None:
    flat, sharded = fit(None), fit(shard)
    assert flat.optimizer_state_bytes > 0 and sharded.shards == SIZE
    assert sharded.optimizer_state_bytes <= flat.optimizer_state_bytes / SIZE * 1.01


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=240)
def test_stage_two_holds_a_gradient_shard_and_at_most_one_bucket_and_its_block() -> None:
    flat, stage_one, stage_two = fit(None), fit("optimizer"), fit("gradients")
    gradients = sum(p.numel() * p.element_size() for p in DeepNet().parameters() if p.requires_grad)
    assert flat.peak_grad_bytes >= gradients and stage_one.peak_grad_bytes >= gradients
    # the shard, one bucket, and while a pass adds to the shard (accumulation) the block received of one bucket
    bound = gradients / SIZE + 2 * BUCKET_CAP_MB * 1024 * 1024
    assert stage_two.peak_grad_bytes <= bound, f"{stage_two.peak_grad_bytes} bytes > {bound}"
    assert stage_two.grad_bytes_after_backward <= gradients / SIZE + 64


@pytest.mark.mpi(ranks=(4,), timeout=240)
@pytest.mark.parametrize("sync", ["flat", "hierarchical"])
@pytest.mark.parametrize("shard", MODES)
def test_fits_in_one_process_leave_nothing_allocated(shard: str, sync: str) -> None:
    """A sweep's fits in one process: after the first (which builds what the process keeps: topology, shard
    groups), each fit frees what it allocated (shared-memory gradient buckets, which stage 1's pieces view, and
    their MPI windows), so the free context ids stay the same; the optimizer state stays, for a checkpoint."""
    free = []
    for _ in range(3):
        strategy = MPIADStrategy(shard=shard, sync=sync, ranks_per_node=2, bucket_cap_mb=BUCKET_CAP_MB)
        run = trainer(strategy=strategy, max_steps=2)
        run.fit(DeepNet(), loader(data(2, 1), BATCH))
        free.append(free_context_ids())
    assert free[1] == free[0] and free[2] == free[0], f"free context ids after each fit: {free}"
    whole = strategy.consolidated_optimizer_state(run.optimizers[0])
    assert whole is None or len(whole["state"]) == len(list(DeepNet().parameters())) - 4


@pytest.mark.mpi(ranks=(4,), timeout=240)
@pytest.mark.parametrize("shard", MODES)
def test_sharded_inside_nodes_under_hierarchical_sync_equals_flat(shard: str) -> None:
    """4 ranks as 2 nodes of 2: each node splits one copy of the state in two."""
    flat, sharded = fit(None), fit(shard, sync="hierarchical")
    torch.testing.assert_close(sharded.params, flat.params, **TOLERANCE)
    assert_same_on_all_ranks(sharded.params, "parameters")
    _assert_same_state(sharded.optimizer_state, flat.optimizer_state)
    assert sharded.shards == 2
    assert sharded.optimizer_state_bytes <= flat.optimizer_state_bytes / 2 * 1.01


class _UnusedHead(L.LightningModule):
    """AdamW over a used layer and an unused head that fills the last rank's whole shard (a rank whose pieces get
    no gradient), trained with a GradScaler; at step 2 the first rank's gradient overflows."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 2)
        self.unused_head = nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        if batch_idx == 2 and self.global_rank == 0:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.mpi(ranks=(2,), timeout=240)
@pytest.mark.parametrize("shard", MODES)
def test_a_grad_scaler_with_a_rank_whose_shard_gets_no_gradient_trains_as_flat(shard: str) -> None:
    """The last rank's pieces (the unused head) never get a gradient: its GradScaler takes the ranks' agreed
    overflow (the step at which rank 0 overflows is skipped on every rank) and trains as flat mpi_ad, with the same
    scale on every rank (without the agreed answer, its scaler would refuse to step: "No inf checks were
    recorded")."""
    results = []
    for mode in (None, shard):
        model = _UnusedHead()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        generator = torch.Generator().manual_seed(1)
        data = TensorDataset(
            torch.randn(SIZE * 24, 8, generator=generator), torch.randn(SIZE * 24, 2, generator=generator)
        )
        trainer(
            strategy=MPIADStrategy(shard=mode), max_steps=5, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
        ).fit(model, loader(data, 4))
        results.append((parameter_vector(model), scaler.get_scale()))
    (flat, flat_scale), (sharded, sharded_scale) = results
    torch.testing.assert_close(sharded, flat, rtol=0, atol=1e-6)
    assert sharded_scale == flat_scale == 2.0**9  # halved once, at the skipped step
    assert_same_on_all_ranks(torch.tensor([sharded_scale]), "the scale")


class _WithTemperature(L.LightningModule):
    """A regression net scaled by a temperature that no optimizer steps: the user updates it from its averaged
    ``.grad`` before each step (``shared`` by every rank; ``own`` only on rank 0, the others' gradient zero)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2)).double()
        self.shared = nn.Parameter(torch.ones(1, dtype=torch.float64))
        self.own = nn.Parameter(torch.ones(2, dtype=torch.float64))
        self.grads: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x) * self.shared
        if self.global_rank == 0:
            out = out + self.own
        return nn.functional.mse_loss(out, y)

    def on_before_optimizer_step(self, optimizer) -> None:
        self.grads.append(torch.cat([self.shared.grad, self.own.grad]))
        with torch.no_grad():
            self.shared -= 0.1 * self.shared.grad
            self.own -= 0.1 * self.own.grad
        self.shared.grad = self.own.grad = None

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=0.01)


@pytest.mark.mpi(ranks=(2, 3), timeout=240)
def test_stage_two_averages_the_gradients_of_parameters_no_optimizer_steps() -> None:
    """As flat mpi_ad: the same averaged ``.grad`` on every rank (rank 0's own parameter averaged with the others'
    zeros), so the user's updates keep the replicas equal."""
    runs = {}
    for shard in (None, "gradients"):
        model = _WithTemperature()
        torch.manual_seed(1)
        data = TensorDataset(torch.randn(SIZE * 16, 6, dtype=torch.float64), torch.randn(SIZE * 16, 2).double())
        trainer(strategy=MPIADStrategy(shard=shard), max_steps=4).fit(model, loader(data, 4))
        runs[shard] = model
    flat, sharded = runs[None], runs["gradients"]
    assert len(sharded.grads) == 4 and bool(sharded.grads[0][1:].abs().sum() > 0)
    for got, want in zip(sharded.grads, flat.grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([sharded.shared, sharded.own]), torch.cat([flat.shared, flat.own]))
    assert_same_on_all_ranks(torch.cat([sharded.shared, sharded.own]).detach())
    torch.testing.assert_close(parameter_vector(sharded.net), parameter_vector(flat.net), rtol=0, atol=1e-12)


class _Adversarial(L.LightningModule):
    """Manual optimization as in a GAN: a critic step (Adam) on the generator's detached output, then a generator
    step (SGD with momentum) through the critic, each inside ``toggle_optimizer``. ``late_toggle``: the generator's
    step toggles after its forward pass (the critic's parameters are frozen once its graph exists)."""

    def __init__(self, late_toggle: bool = False, torch_optimizers: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.late_toggle = late_toggle
        self.torch_optimizers = torch_optimizers
        self.generator, self.critic = _adversaries()

    def training_step(self, batch, batch_idx):
        x, y = batch
        generator_optimizer, critic_optimizer = self.optimizers(use_pl_optimizer=not self.torch_optimizers)
        self.toggle_optimizer(critic_optimizer)
        self.manual_backward(_critic_loss(self.critic, self.generator, x, y))
        critic_optimizer.step()
        critic_optimizer.zero_grad()
        self.untoggle_optimizer(critic_optimizer)
        if not self.late_toggle:
            self.toggle_optimizer(generator_optimizer)
        loss = _generator_loss(self.critic, self.generator, x, y)
        if self.late_toggle:
            self.toggle_optimizer(generator_optimizer)
        self.manual_backward(loss)
        generator_optimizer.step()
        generator_optimizer.zero_grad()
        self.untoggle_optimizer(generator_optimizer)

    def configure_optimizers(self):
        return _adversarial_optimizers(self.generator, self.critic)


def _adversaries() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(3)
    generator = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6)).double()
    critic = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)).double()
    return generator, critic


def _adversarial_optimizers(generator: nn.Module, critic: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(generator.parameters(), lr=0.05, momentum=0.9), torch.optim.Adam(critic.parameters())]


def _critic_loss(critic: nn.Module, generator: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(critic(generator(x).detach()), y)


def _generator_loss(critic: nn.Module, generator: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -nn.functional.mse_loss(critic(generator(x)), y)


@pytest.mark.mpi(ranks=(2, 3), timeout=240)
@pytest.mark.parametrize(("late_toggle", "torch_optimizers"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("shard", [None, *MODES])
def test_manual_optimization_with_toggled_optimizers_equals_one_process(
    shard: str | None, late_toggle: bool, torch_optimizers: bool
) -> None:
    """Each step moves only the toggled optimizer's parameters, with the gradient of the whole batch: the toggles
    act on the model's parameters also when the optimizers step shards, and a layer frozen after its forward pass
    leaves the others' gradients averaged. ``torch_optimizers``: the steps are made on the torch optimizers
    themselves (``self.optimizers(use_pl_optimizer=False)``), past the strategy: their updated shards still reach
    every rank."""
    torch.manual_seed(4)
    x, y = torch.randn(SIZE * 12, 6, dtype=torch.float64), torch.randn(SIZE * 12, 2, dtype=torch.float64)
    model = _Adversarial(late_toggle, torch_optimizers)
    trainer(strategy=MPIADStrategy(shard=shard), max_epochs=1).fit(model, loader(TensorDataset(x, y), 4))

    generator, critic = _adversaries()
    generator_optimizer, critic_optimizer = _adversarial_optimizers(generator, critic)
    x, y = epoch_order(TensorDataset(x, y)).tensors
    for step in range(3):  # the step's batches of every rank together
        rows = slice(step * SIZE * 4, (step + 1) * SIZE * 4)
        critic_optimizer.zero_grad()
        _critic_loss(critic, generator, x[rows], y[rows]).backward()
        critic_optimizer.step()
        generator_optimizer.zero_grad()
        critic.requires_grad_(False)
        _generator_loss(critic, generator, x[rows], y[rows]).backward()
        critic.requires_grad_(True)
        generator_optimizer.step()
    for got, want in ((model.generator, generator), (model.critic, critic)):
        torch.testing.assert_close(parameter_vector(got), parameter_vector(want), rtol=0, atol=1e-10)


class _ReplacedGradients(L.LightningModule):
    """AdamW under a step-wise learning-rate schedule, whose ``on_before_optimizer_step`` replaces ``.grad`` as
    torch code does: the first layer skipped every other step (``None``), the last layer's gradient halved into a
    new tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 2)).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        if self.global_step % 2 == 0:
            self.net[0].weight.grad = None
        self.net[2].weight.grad = self.net[2].weight.grad * 0.5

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]


def _replaced_gradients_in_one_process(dataset: TensorDataset, steps: int, clip: str) -> torch.Tensor:
    """:class:`_ReplacedGradients` trained by hand in one process on the whole batch of every step."""
    model = _ReplacedGradients()
    (optimizer,), _ = model.configure_optimizers()
    ordered = epoch_order(dataset)
    for step in range(steps):
        x, y = (t[step * SIZE * 4 : (step + 1) * SIZE * 4] for t in ordered.tensors)
        optimizer.zero_grad()
        nn.functional.mse_loss(model.net(x), y).backward()
        if step % 2 == 0:
            model.net[0].weight.grad = None
        model.net[2].weight.grad = model.net[2].weight.grad * 0.5
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
        optimizer.step()
    return parameter_vector(model.net)


@pytest.mark.mpi(ranks=(2, 3), timeout=240)
@pytest.mark.parametrize("shard", [None, "optimizer"])
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_the_step_uses_the_gradients_a_hook_put_in_place_of_backwards(clip: str, shard: str | None) -> None:
    """The step, and clipping after the hook, use the ``.grad`` the parameters hold then (as torch's optimizers
    do), not the one backward produced: also under ``shard="optimizer"``, whose pieces view the gradients."""
    torch.manual_seed(1)
    dataset = TensorDataset(torch.randn(SIZE * 24, 6, dtype=torch.float64), torch.randn(SIZE * 24, 2).double())
    model = _ReplacedGradients()
    trainer(strategy=MPIADStrategy(shard=shard), max_steps=6, gradient_clip_val=0.05, gradient_clip_algorithm=clip).fit(
        model, loader(dataset, 4)
    )
    want = _replaced_gradients_in_one_process(dataset, 6, clip)
    assert not torch.equal(want, parameter_vector(_ReplacedGradients().net)), "training did not move"
    torch.testing.assert_close(parameter_vector(model.net), want, rtol=0, atol=1e-12)


def _hook_gradients(net: nn.Module) -> None:
    """Hooks that edit gradients as they are accumulated: one replaces the first layer's, one scales the last
    layer's in place."""

    def replace(param: torch.Tensor) -> None:
        param.grad = param.grad * 2

    def scale(param: torch.Tensor) -> None:
        param.grad.mul_(0.5)

    net[0].weight.register_post_accumulate_grad_hook(replace)
    net[2].weight.register_post_accumulate_grad_hook(scale)


class _HookedGradients(_ReplacedGradients):
    """Gradient hooks registered once training starts, after the strategy set its own up."""

    def on_before_optimizer_step(self, optimizer):
        pass

    def on_train_start(self):
        _hook_gradients(self.net)


@pytest.mark.mpi(ranks=(2, 3), timeout=240)
@pytest.mark.parametrize("shard", [None, *MODES])
def test_gradient_hooks_registered_after_setup_run_before_the_average(shard: str | None) -> None:
    """A ``register_post_accumulate_grad_hook`` of the user's added after the strategy's edits the gradient before
    its bucket is averaged (one bucket per parameter: each starts during backward), as in one process."""
    torch.manual_seed(1)
    dataset = TensorDataset(torch.randn(SIZE * 24, 6, dtype=torch.float64), torch.randn(SIZE * 24, 2).double())
    model = _HookedGradients()
    strategy = MPIADStrategy(shard=shard, bucket_cap_mb=1e-4, own_bucket_mb=1e-4)
    trainer(strategy=strategy, max_steps=4).fit(model, loader(dataset, 4))

    reference = _ReplacedGradients()
    _hook_gradients(reference.net)
    (optimizer,), _ = reference.configure_optimizers()
    ordered = epoch_order(dataset)
    for step in range(4):
        x, y = (t[step * SIZE * 4 : (step + 1) * SIZE * 4] for t in ordered.tensors)
        optimizer.zero_grad()
        nn.functional.mse_loss(reference.net(x), y).backward()
        optimizer.step()
    torch.testing.assert_close(parameter_vector(model.net), parameter_vector(reference.net), rtol=0, atol=1e-12)
