"""Lightning and torchmetrics features over MPI. Each test fails if the feature silently stays per-rank."""

from __future__ import annotations

import functools
import operator
import os
import time
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torchmetrics
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import nn

from mpistrategy.strategy.environment import MPIEnvironment
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from tests.strategy.helpers import (
    COMM,
    RANK,
    SIZE,
    IndexDataset,
    Regressor,
    assert_same_on_all_ranks,
    epoch_order,
    flat_parameters,
    loader,
    mlp,
    reference_sgd,
    regression_data,
    shared_tmpdir,
    trainer,
)

RANK_ZERO_ONLY_AT_IMPORT = rank_zero_only.rank  # read at collection, before any Trainer exists


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_ranks_come_from_mpi() -> None:
    assert RANK_ZERO_ONLY_AT_IMPORT == RANK, "rank_zero_only.rank was not set from MPI at import"
    fit = trainer()
    env = fit.strategy.cluster_environment
    assert isinstance(env, MPIEnvironment)
    assert (fit.global_rank, fit.world_size, fit.local_rank, fit.node_rank) == (RANK, SIZE, RANK, 0)
    assert env.num_nodes() == 1 and env.local_world_size() == SIZE and env.creates_processes_externally
    assert fit.strategy.distributed_sampler_kwargs == {"num_replicas": SIZE, "rank": RANK}
    assert fit._accelerator_connector.is_distributed
    assert rank_zero_only.rank == RANK


class _Recorder(L.LightningModule):
    """Logs rank-dependent values with sync_dist and records which samples and gathers each rank saw."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1).double()
        self.seen: list[int] = []
        self.gathered: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, index = batch
        self.seen += index.tolist()
        self.gathered.append(self.all_gather(index))
        self.log("rank_mean", float(RANK), sync_dist=True, on_step=False, on_epoch=True)
        self.log("rank_max", float(RANK), sync_dist=True, reduce_fx="max", on_step=False, on_epoch=True)
        self.log("rank_step", float(RANK), sync_dist=True, on_step=True, on_epoch=False)
        return self.layer(x / 100).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.mpi(ranks=(1, 2, 3), timeout=60)
def test_fit_starts_from_the_seed_of_seed_everything_as_under_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's DDP sets ``seed_everything``'s seed again when it sets up, so the random stream a model with
    dropout draws from at the first step does not depend on what was drawn before ``fit`` (building the model)."""
    for variable in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # seed_everything sets them; the later tests run without
        monkeypatch.setenv(variable, "0")
    L.seed_everything(7, verbose=False)
    seeded = torch.get_rng_state()
    states: list[torch.Tensor] = []

    class AtFitStart(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            states.append(torch.get_rng_state())

    model = Regressor(mlp())  # seeds and draws the global stream
    assert not torch.equal(torch.get_rng_state(), seeded)
    trainer(strategy=MPIADStrategy(), max_steps=1, callbacks=[AtFitStart()]).fit(model, loader(regression_data(8), 4))
    assert torch.equal(states[0], seeded)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_distributed_sampler_sync_dist_and_all_gather_in_module() -> None:
    per_rank, batches = 2, 3
    model = _Recorder()
    fit = trainer(max_epochs=1)
    fit.fit(model, loader(IndexDataset(SIZE * per_rank * batches), per_rank))
    everyone = COMM.allgather(model.seen)
    flat = [i for seen in everyone for i in seen]
    assert sorted(flat) == list(range(SIZE * per_rank * batches)), "ranks did not get disjoint shards"
    expected_mean = (SIZE - 1) / 2
    assert fit.callback_metrics["rank_mean"].item() == pytest.approx(expected_mean)
    assert fit.callback_metrics["rank_max"].item() == SIZE - 1
    assert fit.callback_metrics["rank_step"].item() == pytest.approx(expected_mean)
    for step, gathered in enumerate(model.gathered):
        assert gathered.shape == (SIZE, per_rank)
        assert [g[step * per_rank : (step + 1) * per_rank] for g in everyone] == gathered.tolist()


class _Classifier(L.LightningModule):
    """Rank 0 predicts every label right, the other ranks every label wrong: local accuracies are 1 or 0."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1).double()
        self.accuracy = torchmetrics.classification.BinaryAccuracy()
        self.values = torchmetrics.CatMetric()
        self.own = torchmetrics.SumMetric(distributed_available_fn=lambda: False)  # the user's own: stays local
        self.computed: dict[str, Any] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, index = batch
        labels = index % 2
        predictions = labels if RANK == 0 else 1 - labels
        self.accuracy.update(predictions, labels)
        self.own.update(index.sum())
        self.log("val_acc", self.accuracy, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        self.values.update(torch.arange(RANK + 1, dtype=torch.float32))  # a different length on every rank
        self.computed["values"] = self.values.compute()
        self.computed["own"] = self.own.compute().item()


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_torchmetrics_sync_across_ranks() -> None:
    model = _Classifier()
    fit = trainer()
    fit.validate(model, loader(IndexDataset(SIZE * 4), 2), verbose=False)
    assert fit.callback_metrics["val_acc"].item() == pytest.approx(1 / SIZE), "accuracy was not synced"
    values = model.computed["values"]
    assert sorted(values.tolist()) == sorted(float(i) for r in range(SIZE) for i in range(r + 1))
    mine = float(sum(range(RANK, SIZE * 4, SIZE)))  # the distributed sampler's share of this rank
    assert model.computed["own"] == mine, "a module's metric with its own distributed_available_fn was synced"
    model.values.reset()
    model.values.update(torch.tensor([float(RANK)]))  # after validate returned, as under DDP: still synced
    assert model.values.compute().tolist() == [float(r) for r in range(SIZE)]


class _SumInCallback(L.Callback):
    """A metric held by a callback, not by the module: it syncs under DDP too."""

    def __init__(self) -> None:
        self.total = torchmetrics.SumMetric()
        self.local = torchmetrics.SumMetric(distributed_available_fn=lambda: False)  # the user's own: stays local
        self.computed: dict[str, float] = {}

    def on_validation_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, *args: Any) -> None:
        self.total.update(batch[1].sum())
        self.local.update(batch[1].sum())

    def on_validation_epoch_end(self, trainer: Any, module: Any) -> None:
        self.computed = {"callback": self.total.compute().item(), "local": self.local.compute().item()}


class _MetricMadeEachEpoch(L.LightningModule):
    """Creates its metric in ``on_validation_epoch_start`` (after the strategy's start of the pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1).double()

    def on_validation_epoch_start(self) -> None:
        self.fresh = torchmetrics.SumMetric()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.fresh.update(batch[1].sum())
        self.log("fresh", self.fresh, on_epoch=True, metric_attribute="fresh")


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_torchmetrics_outside_the_module_and_made_in_hooks_sync_as_under_ddp() -> None:
    callback = _SumInCallback()
    fit = trainer(callbacks=[callback])
    fit.validate(_MetricMadeEachEpoch(), loader(IndexDataset(SIZE * 4), 2), verbose=False)
    everything = float(sum(range(SIZE * 4)))
    assert fit.callback_metrics["fresh"].item() == everything, "a metric made in an epoch hook stayed per-rank"
    assert callback.computed["callback"] == everything, "a callback's metric stayed per-rank"
    mine = float(sum(range(RANK, SIZE * 4, SIZE)))  # the distributed sampler's share of this rank
    assert callback.computed["local"] == mine, "a metric with its own distributed_available_fn was synced"


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_all_gather_sync_grads_is_the_adjoint() -> None:
    strategy = trainer().strategy
    x = torch.full((2,), float(RANK + 1), dtype=torch.float64, requires_grad=True)
    gathered = strategy.all_gather(x, sync_grads=True)
    assert gathered.shape == (SIZE, 2)
    assert gathered[:, 0].tolist() == [float(r + 1) for r in range(SIZE)]
    weights = torch.arange(SIZE * 2, dtype=torch.float64).reshape(SIZE, 2) * (RANK + 1)  # differs per rank
    (gathered * weights).sum().backward()
    total_factor = sum(r + 1 for r in range(SIZE))
    expected = torch.arange(SIZE * 2, dtype=torch.float64).reshape(SIZE, 2)[RANK] * total_factor
    torch.testing.assert_close(x.grad, expected)
    plain = strategy.all_gather(x, sync_grads=False)
    assert not plain.requires_grad and torch.equal(plain, gathered.detach())
    scalar = strategy.all_gather(torch.tensor(float(RANK)))
    assert scalar.tolist() == [float(r) for r in range(SIZE)]


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_reduce_broadcast_barrier() -> None:
    from torch.distributed import ReduceOp

    strategy = trainer().strategy
    value = torch.tensor([float(RANK), 1.0])
    assert strategy.reduce(value, reduce_op="sum") is value  # in place, as DDP
    assert value.tolist() == [SIZE * (SIZE - 1) / 2, SIZE]

    def fresh() -> torch.Tensor:
        return torch.tensor([float(RANK), 1.0])

    assert strategy.reduce(fresh()).tolist() == pytest.approx([(SIZE - 1) / 2, 1.0])
    assert strategy.reduce(fresh(), reduce_op="max").tolist() == [SIZE - 1, 1.0]
    assert strategy.reduce(fresh(), reduce_op="min").tolist() == [0.0, 1.0]
    assert strategy.reduce(fresh(), reduce_op=ReduceOp.SUM).tolist() == [SIZE * (SIZE - 1) / 2, SIZE]
    assert strategy.reduce(fresh(), reduce_op=ReduceOp.MAX).tolist() == [SIZE - 1, 1.0]
    assert strategy.reduce(torch.tensor(RANK * 2), reduce_op="mean").item() == (SIZE - 1)  # integer mean
    ranks_plus_one = [float(r + 1) for r in range(SIZE)]
    product = torch.tensor(ranks_plus_one).prod().item()
    assert strategy.reduce(torch.tensor(RANK + 1.0), reduce_op="product").item() == product
    assert strategy.reduce(torch.tensor(RANK + 1.0), reduce_op=ReduceOp.PRODUCT).item() == product
    assert strategy.reduce(torch.tensor(RANK + 1), reduce_op=ReduceOp.BOR).item() == functools.reduce(
        operator.or_, range(1, SIZE + 1)
    )
    flags = torch.tensor([RANK == 0, True, False])  # as DDP: a bool sum is the logical or, a minimum the and
    assert strategy.reduce(flags, reduce_op="sum") is flags and flags.tolist() == [True, True, False]
    flags = torch.tensor([RANK == 0, True, False])
    assert strategy.reduce(flags, reduce_op="min").tolist() == [False, True, False]
    assert strategy.reduce("not a tensor") == "not a tensor"
    obj = {"from": RANK, "tensor": torch.arange(3) * RANK, "nested": [RANK, {"x": "y"}]}
    got = strategy.broadcast(obj, src=SIZE - 1)
    assert got["from"] == SIZE - 1 and got["tensor"].tolist() == [0, SIZE - 1, 2 * (SIZE - 1)]
    marker = os.path.join(shared_tmpdir(), "rank0-was-here")
    if RANK == 0:
        time.sleep(0.5)
        open(marker, "w").close()
    strategy.barrier("test")
    assert os.path.exists(marker), "barrier returned before rank 0 arrived"
    assert strategy.reduce_boolean_decision(RANK == 0, all=False) is True
    assert strategy.reduce_boolean_decision(RANK == 0, all=True) is False


class _Evaluated(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(RANK)  # different on every rank: the strategy must broadcast rank 0's
        self.layer = nn.Linear(4, 1).double()
        self.val_seen: list[int] = []
        self.test_seen: list[int] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_seen += batch[1].tolist()
        self.log("val_rank", float(RANK), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.test_seen += batch[1].tolist()
        self.log("test_rank", float(RANK), sync_dist=True, reduce_fx="sum")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.stack([self.layer(batch[0]).squeeze(1), batch[1].double()], dim=1)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_validate_test_predict() -> None:
    size = SIZE * 6
    data = IndexDataset(size)
    model = _Evaluated()
    fit = trainer()
    fit.validate(model, loader(data, 3), verbose=False)
    assert_same_on_all_ranks(flat_parameters(model), "parameters after broadcast")
    assert fit.callback_metrics["val_rank"].item() == pytest.approx((SIZE - 1) / 2)
    fit.test(model, loader(data, 3), verbose=False)
    assert fit.callback_metrics["test_rank"].item() == 2 * SIZE * (SIZE - 1) / 2  # summed over 2 batches, all ranks
    for seen in (model.val_seen, model.test_seen):
        assert sorted(i for s in COMM.allgather(seen) for i in s) == list(range(size))
    predictions = torch.cat(fit.predict(model, loader(data, 3)))
    everyone = torch.cat(COMM.allgather(predictions))
    assert sorted(everyone[:, 1].long().tolist()) == list(range(size))
    with torch.no_grad():
        expected = model.layer(torch.stack([data[i][0] for i in everyone[:, 1].long().tolist()])).squeeze(1)
    torch.testing.assert_close(everyone[:, 0], expected)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_parameters_and_buffers_broadcast_at_setup() -> None:
    torch.manual_seed(100 + RANK)
    net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    net[1].running_mean.fill_(RANK)
    initial = {k: v.clone() for k, v in net.state_dict().items()}
    rank0 = COMM.bcast(initial, root=0)
    model = Regressor(net)
    fit = trainer(max_steps=0)
    fit.fit(model, loader(regression_data(SIZE * 4), 2))
    for key, value in net.state_dict().items():
        torch.testing.assert_close(value, rank0[key], msg=f"{key} was not broadcast from rank 0")


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_without_data_parallelism_each_rank_keeps_its_own_parameters_and_gradients() -> None:
    """``data_parallel=False`` (models split across ranks): no broadcast at setup, no gradient averaging."""
    data = regression_data(8 * 2)
    model = Regressor(mlp(seed=10 + RANK), lr=0.3)
    fit = trainer(strategy=MPIADStrategy(data_parallel=False), max_steps=2, use_distributed_sampler=False)
    fit.fit(model, loader(data, 8))
    assert fit.strategy.reducer is None
    alone = reference_sgd(mlp(seed=10 + RANK), data, 8, 2, lr=0.3)  # this rank's model trained on its own
    torch.testing.assert_close(flat_parameters(model), flat_parameters(alone), rtol=1e-12, atol=1e-12)
    everyone = COMM.allgather(flat_parameters(model))
    assert not torch.equal(everyone[0], everyone[1]), "the ranks' parameters were synchronised"


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_bf16_mixed_precision_trains_in_sync() -> None:
    data = regression_data(SIZE * 8 * 3)
    net = mlp(seed=3).float()
    model = Regressor(net, lr=0.1)
    fit = trainer(max_steps=3, precision="bf16-mixed")
    fit.fit(model, loader(torch.utils.data.TensorDataset(*(t.float() for t in data.tensors)), 8))
    assert fit.global_step == 3
    assert_same_on_all_ranks(flat_parameters(model), "bf16-mixed parameters")
    reference = reference_sgd(mlp(seed=3), epoch_order(data), SIZE * 8, 3, lr=0.1)
    start = flat_parameters(mlp(seed=3))
    moved, want = flat_parameters(model).double() - start, flat_parameters(reference) - start
    assert torch.linalg.norm(moved - want) < 0.1 * torch.linalg.norm(want), "bf16 training went elsewhere"


class _TwoOptimizers(L.LightningModule):
    """Manual optimization, GAN-style: optimizer 1 updates ``a`` on loss 1 (through ``b``), optimizer 2 updates
    ``b`` on loss 2."""

    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = a, b

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_a, opt_b = self.optimizers()
        loss_a = nn.functional.mse_loss(self.b(self.a(x)), y)
        opt_a.zero_grad()
        self.manual_backward(loss_a)
        opt_a.step()
        loss_b = nn.functional.mse_loss(self.b(self.a(x).detach()), y)
        opt_b.zero_grad()
        self.manual_backward(loss_b)
        self.clip_gradients(opt_b, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt_b.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.a.parameters(), lr=0.3), torch.optim.Adam(self.b.parameters(), lr=0.01)]


def _two_nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh()).double(), nn.Linear(5, 2).double()


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_manual_optimization_two_optimizers_matches_single_process() -> None:
    steps, per_rank = 3, 4
    data = regression_data(SIZE * per_rank * steps)
    a, b = _two_nets()
    model = _TwoOptimizers(a, b)
    trainer(max_epochs=1).fit(model, loader(data, per_rank))

    ra, rb = _two_nets()
    opt_a, opt_b = torch.optim.SGD(ra.parameters(), lr=0.3), torch.optim.Adam(rb.parameters(), lr=0.01)
    x, y = epoch_order(data).tensors
    for step in range(steps):
        block = slice(step * SIZE * per_rank, (step + 1) * SIZE * per_rank)
        xb, yb = x[block], y[block]
        opt_a.zero_grad()
        nn.functional.mse_loss(rb(ra(xb)), yb).backward()
        opt_a.step()
        opt_b.zero_grad()
        nn.functional.mse_loss(rb(ra(xb).detach()), yb).backward()
        torch.nn.utils.clip_grad_norm_(rb.parameters(), 0.05)
        opt_b.step()
    torch.testing.assert_close(flat_parameters(model), torch.cat([flat_parameters(ra), flat_parameters(rb)]))


@pytest.mark.mpi(ranks=(2,), timeout=60)
def test_string_strategy_under_srun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """What srun --ntasks=N sets (no --ntasks-per-node): Lightning's own SLURM path refuses, mpi_ad works."""
    for key, value in {
        "SLURM_NTASKS": str(SIZE),
        "SLURM_PROCID": str(RANK),
        "SLURM_LOCALID": str(RANK),
        "SLURM_NODEID": "0",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_NODELIST": "localhost",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    with pytest.raises(RuntimeError, match="--ntasks"):
        L.Trainer(strategy="ddp", accelerator="cpu", logger=False)
    fit = trainer()
    assert isinstance(fit.strategy.cluster_environment, MPIEnvironment)
    assert (fit.global_rank, fit.world_size) == (RANK, SIZE)


@pytest.mark.mpi(ranks=(2,), timeout=90)
def test_pytorch_lightning_package() -> None:
    import pytorch_lightning as PL

    from mpistrategy.strategy.pytorch_lightning import MPIADStrategy as PLStrategy

    class PLRegressor(PL.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.2)

    data = regression_data(SIZE * 4 * 4)
    model = PLRegressor(mlp(seed=4))
    fit = PL.Trainer(strategy="mpi_ad", max_epochs=1, accumulate_grad_batches=2, **_quiet())
    assert isinstance(fit.strategy, PLStrategy)
    fit.fit(model, loader(data, 4))
    reference = reference_sgd(mlp(seed=4), epoch_order(data), SIZE * 4, 2, lr=0.2, accumulate=2)
    torch.testing.assert_close(flat_parameters(model), flat_parameters(reference), rtol=1e-12, atol=1e-12)


def _quiet() -> dict[str, Any]:
    from tests.strategy.helpers import QUIET

    return dict(QUIET)


class _Validated(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss + RANK * 1e-3, sync_dist=True)  # differs per rank unless synced


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
def test_validation_during_fit_with_checkpoint_and_early_stopping() -> None:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    directory = shared_tmpdir()
    data = regression_data(SIZE * 4 * 4)
    checkpoint = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=1)
    stopping = EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0)  # stops after 2 epochs
    fit = trainer(
        max_epochs=5,
        num_sanity_val_steps=2,
        callbacks=[checkpoint, stopping],
        enable_checkpointing=True,
    )
    model = _Validated(mlp(seed=6), lr=0.1)
    fit.fit(model, loader(data, 4), loader(data, 4))
    assert fit.current_epoch == 2, "early stopping did not act on every rank alike"
    paths = COMM.allgather(checkpoint.best_model_path)
    assert len(set(paths)) == 1 and paths[0].startswith(directory)
    scores = COMM.allgather(float(checkpoint.best_model_score))
    assert len(set(scores)) == 1
    assert_same_on_all_ranks(flat_parameters(model), "parameters")


@pytest.mark.mpi(ranks=(2,), timeout=60)
def test_bf16_true_precision_trains_in_sync() -> None:
    data = regression_data(SIZE * 8 * 2)
    model = Regressor(mlp(seed=3).float(), lr=0.1)
    fit = trainer(max_steps=2, precision="bf16-true")
    fit.fit(model, loader(torch.utils.data.TensorDataset(*(t.float() for t in data.tensors)), 8))
    assert fit.global_step == 2 and next(model.parameters()).dtype == torch.bfloat16
    assert_same_on_all_ranks(flat_parameters(model).float(), "bf16-true parameters")


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
def test_attach_metric_sync_makes_a_modules_metrics_gather_over_mpi() -> None:
    """The way to gather over MPI whatever ``distributed_available_fn`` a metric has (for a job that also
    initialised torch.distributed): every metric inside the module, counted."""
    module = nn.ModuleDict(
        {"sum": torchmetrics.SumMetric(distributed_available_fn=lambda: False), "cat": torchmetrics.CatMetric()}
    )
    strategy = trainer().strategy
    assert strategy.attach_metric_sync(module) == 2
    module["sum"].update(torch.tensor(float(RANK + 1)))
    assert module["sum"].compute().item() == SIZE * (SIZE + 1) / 2
