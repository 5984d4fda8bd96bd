"""The tensor-parallel and pipeline recipes equal their single-process twins (forward, gradients, training)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from mpistrategy.recipes.data import load_digits_split
from mpistrategy.recipes.pipeline import PipelineMLP
from mpistrategy.recipes.tensor_parallel import TensorParallelMLP

ATOL = 1e-5


def _batch(n: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x_train, y_train, _, _ = load_digits_split()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(x_train), generator=g)[:n]
    return x_train[idx], y_train[idx]


def _dense_linears(model: nn.Sequential) -> list[nn.Linear]:
    return [m for m in model if isinstance(m, nn.Linear)]


def _assert_dense_equal(got: nn.Sequential, want: nn.Sequential, atol: float = ATOL) -> None:
    for a, b in zip(_dense_linears(got), _dense_linears(want), strict=True):
        torch.testing.assert_close(a.weight, b.weight, atol=atol, rtol=1e-5)
        torch.testing.assert_close(a.bias, b.bias, atol=atol, rtol=1e-5)


@pytest.mark.mpi(ranks=(2, 4), timeout=120)
@pytest.mark.parametrize("depth", [1, 2])
def test_tensor_parallel_mlp_matches_the_dense_model(depth: int) -> None:
    torch.manual_seed(0)
    dense = TensorParallelMLP.dense_twin(64, 32, depth, 10)
    tp = TensorParallelMLP.from_dense(dense)
    _assert_dense_equal(tp.to_dense(), dense, atol=0)
    x, y = _batch()

    # Forward and every gradient (the TP grads are the dense grads' slices).
    dense_logits, tp_logits = dense(x), tp(x)
    torch.testing.assert_close(tp_logits, dense_logits, atol=ATOL, rtol=1e-5)
    F.cross_entropy(dense_logits, y).backward()
    F.cross_entropy(tp_logits, y).backward()
    for layer, linear in zip(tp.parallel_layers(), _dense_linears(dense), strict=True):
        rows = getattr(layer, "rows", slice(None))
        cols = getattr(layer, "columns", slice(None))
        torch.testing.assert_close(layer.weight.grad, linear.weight.grad[rows][:, cols], atol=ATOL, rtol=1e-5)
        bias_slice = rows if hasattr(layer, "rows") else slice(None)
        torch.testing.assert_close(layer.bias.grad, linear.bias.grad[bias_slice], atol=ATOL, rtol=1e-5)

    # Ten SGD steps with momentum on different batches: same weights as the dense model.
    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.1, momentum=0.9)
    opt_tp = torch.optim.SGD(tp.parameters(), lr=0.1, momentum=0.9)
    for step in range(10):
        xb, yb = _batch(seed=step + 1)
        for model, opt in ((dense, opt_dense), (tp, opt_tp)):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    _assert_dense_equal(tp.to_dense(), dense, atol=1e-4)


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_pipeline_mlp_matches_the_dense_model(micro_batches: int) -> None:
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    dense = PipelineMLP.dense_twin(64, 32, 2, 10, comm.size)
    pipe = PipelineMLP(64, 32, 2, 10, dense=dense)
    _assert_dense_equal(pipe.to_dense(), dense, atol=0)
    x, y = _batch()

    dense_logits = dense(x)
    dense_loss = F.cross_entropy(dense_logits, y)
    dense_loss.backward()
    loss, logits = pipe.forward_backward_loss(x, y, micro_batches)
    loss.backward()
    if pipe.last:
        torch.testing.assert_close(logits, dense_logits, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(loss, dense_loss, atol=ATOL, rtol=1e-5)
    else:
        assert logits is None and float(loss) == 0.0
    k = 2
    mine = _dense_linears(dense)[comm.rank * k : (comm.rank + 1) * k]
    for got, want in zip([m for m in pipe.stage if isinstance(m, nn.Linear)], mine, strict=True):
        torch.testing.assert_close(got.weight.grad, want.weight.grad, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(got.bias.grad, want.bias.grad, atol=ATOL, rtol=1e-5)

    opt_dense = torch.optim.SGD(dense.parameters(), lr=0.1, momentum=0.9)
    opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step in range(10):
        xb, yb = _batch(seed=step + 1)
        opt_dense.zero_grad()
        F.cross_entropy(dense(xb), yb).backward()
        opt_dense.step()
        opt_pipe.zero_grad()
        pipe.forward_backward_loss(xb, yb, micro_batches)[0].backward()
        opt_pipe.step()
    _assert_dense_equal(pipe.to_dense(), dense, atol=1e-4)
    # Inference: logits on the last stage only.
    with torch.no_grad():
        out = pipe(x, micro_batches)
        if pipe.last:
            torch.testing.assert_close(out, dense(x), atol=1e-4, rtol=1e-5)
        else:
            assert out is None


def test_tensor_parallel_rejects_indivisible_sizes() -> None:
    from mpistrategy.recipes.tensor_parallel import ColumnParallelLinear, _split

    assert ColumnParallelLinear(8, 6, MPI.COMM_SELF).local_out == 6  # one rank: anything divides
    with pytest.raises(ValueError, match="divisible by the number of tensor-parallel ranks"):
        _split(6, 4, "hidden")


def _reference_training(depth: int, hidden: int, steps: int, batch_size: int) -> nn.Sequential:
    """The single-process equivalent: MLPClassifier's net, the same seed, batches and SGD steps, a plain loop."""
    import lightning as L

    from mpistrategy.recipes.data import DigitsDataModule
    from mpistrategy.recipes.models import MLPClassifier

    L.seed_everything(0, verbose=False)
    model = MLPClassifier(64, hidden, depth, 10)
    data = DigitsDataModule(batch_size=batch_size, same_batches_on_all_ranks=True)
    data.setup("fit")
    loader = data.train_dataloader()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    done, epoch = 0, 0
    while done < steps:
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    return model.net


def _quiet_trainer(strategy, **options):
    """A CPU Trainer without logger, checkpoints, progress bar, summary and validation."""
    import lightning as L

    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(
        strategy=strategy, accelerator="cpu", num_sanity_val_steps=0, limit_val_batches=0, **quiet, **options
    )


def _fit_model_parallel(module, steps: int, batch_size: int) -> None:

    from mpistrategy.recipes.data import DigitsDataModule
    from mpistrategy.recipes.model_parallel import ModelParallelMPIStrategy

    trainer = _quiet_trainer(ModelParallelMPIStrategy(), max_steps=steps, use_distributed_sampler=False)
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=batch_size, same_batches_on_all_ranks=True))
    assert trainer.global_step == steps


@pytest.mark.mpi(ranks=(2,), timeout=180)
def test_lightning_tensor_parallel_recipe_trains_like_the_single_process_mlp() -> None:
    """Trainer + ModelParallelMPIStrategy on 2 ranks == the dense MLP trained in one process (30 SGD steps,
    crossing an epoch boundary)."""
    from functools import partial

    import lightning as L

    from mpistrategy.recipes.tensor_parallel import TensorParallelMLPClassifier

    steps, batch = 30, 64
    L.seed_everything(0, verbose=False)
    module = TensorParallelMLPClassifier(64, 32, 1, 10, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    _fit_model_parallel(module, steps, batch)
    _assert_dense_equal(module.net.to_dense(), _reference_training(1, 32, steps, batch), atol=1e-4)


@pytest.mark.mpi(ranks=(2,), timeout=180)
def test_lightning_pipeline_recipe_trains_like_the_single_process_mlp() -> None:
    from functools import partial

    import lightning as L

    from mpistrategy.recipes.pipeline import PipelineMLPClassifier

    steps, batch = 30, 64
    L.seed_everything(0, verbose=False)
    module = PipelineMLPClassifier(
        64, 32, 1, 10, micro_batches=2, optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    )
    _fit_model_parallel(module, steps, batch)
    depth = MPI.COMM_WORLD.size * 1 - 1
    _assert_dense_equal(module.net.to_dense(), _reference_training(depth, 32, steps, batch), atol=1e-4)


class _MarkedOnRankZero(nn.Module):
    """A layer that declares its parameters split across the ranks on rank 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)
        self.split_across_ranks = MPI.COMM_WORLD.rank == 0


@pytest.mark.mpi(ranks=(2, 3), timeout=180)
@pytest.mark.parametrize("model", ["tp_mlp", "pipeline_mlp", "marked_on_rank_0"])
def test_data_parallel_mpi_ad_refuses_a_model_split_across_the_ranks(model: str) -> None:
    """Broadcasting rank 0's slices and averaging the gradients would silently train another model: every rank
    raises at setup, naming the split module and the strategy to use, and trains nothing."""
    from functools import partial

    from mpistrategy.recipes.data import DigitsDataModule
    from mpistrategy.recipes.models import MLPClassifier
    from mpistrategy.recipes.pipeline import PipelineMLPClassifier
    from mpistrategy.recipes.tensor_parallel import TensorParallelMLPClassifier
    from mpistrategy.strategy import MPIADStrategy

    sgd = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    if model == "tp_mlp":
        module, named = TensorParallelMLPClassifier(64, 48, 1, 10, optimizer=sgd), "'net.layers.0'"
    elif model == "pipeline_mlp":
        module, named = PipelineMLPClassifier(64, 32, 1, 10, optimizer=sgd), "'net'"
    else:
        module, named = MLPClassifier(64, 32, 1, 10, optimizer=sgd), "'net.marked'"
        module.net.add_module("marked", _MarkedOnRankZero())
    trainer = _quiet_trainer(MPIADStrategy(), max_steps=2)
    with pytest.raises(ValueError, match=r"split_across_ranks = True.*MPIADStrategy\(data_parallel=False\)") as raised:
        trainer.fit(module, datamodule=DigitsDataModule(batch_size=32))
    assert f"rank 0's {named}" in str(raised.value)
    assert trainer.global_step == 0
