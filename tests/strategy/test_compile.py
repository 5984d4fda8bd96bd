"""torch.compile with mpi_ad. Lightning's Trainer refuses ``fit(torch.compile(model))`` for strategies outside its
own list, so the way in is compiling inside the LightningModule (``self.net = torch.compile(self.net)``): trained
under mpi_ad it equals eager. Fabric takes compiled modules itself: ``fabric.setup(torch.compile(model))`` equals
eager too."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.fabric.helpers import launched
from tests.strategy.helpers import RANK, flat_parameters, loader, trainer

STEPS = 4
TOLERANCE = dict(rtol=1e-6, atol=1e-6)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


class Regressor(L.LightningModule):
    """MSE regression with AdamW; ``compiled`` compiles the network inside the module."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        self.net = torch.compile(_net()) if compiled else _net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 2, generator=g))


def _compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_module_compiled_inside_the_lightning_module_trains_as_eager() -> None:
    trained = {}
    for compiled in (False, True):
        model = Regressor(compiled)
        trainer(max_steps=STEPS).fit(model, loader(_data(), 4))
        trained[compiled] = flat_parameters(model)
    assert _compiled_graphs() > 0, "nothing was compiled"
    assert not torch.equal(trained[False], flat_parameters(_net())), "eager did not train"
    torch.testing.assert_close(trained[True], trained[False], **TOLERANCE)

    with pytest.raises(RuntimeError, match="Using a compiled model is incompatible with the current strategy"):
        trainer(max_steps=1).fit(torch.compile(Regressor(False)), loader(_data(), 4))


@pytest.mark.mpi(ranks=(2,), timeout=300)
def test_fabric_sets_up_a_compiled_module_that_trains_as_eager() -> None:
    fabric = launched()
    trained = {}
    for compiled in (False, True):
        net = _net()
        model, optimizer = fabric.setup(torch.compile(net) if compiled else net, torch.optim.AdamW(net.parameters()))
        g = torch.Generator().manual_seed(RANK)
        for _ in range(STEPS):
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        trained[compiled] = flat_parameters(model)
    assert type(model._forward_module).__name__ == "OptimizedModule"
    torch.testing.assert_close(trained[True], trained[False], **TOLERANCE)
