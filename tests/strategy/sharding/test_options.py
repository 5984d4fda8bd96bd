"""``shard=`` that cannot run fails with an error naming the problem and the fix, on every rank, and no rank hangs:
an unknown mode, a sync mode or aggregator it cannot run with, uneven nodes for hierarchical stage 2, ranks given
different values, and a wrong value on one rank only (which ends the job)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from mpistrategy.aggregation import TopK
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import SyncConfigurationError
from tests.external_job import OUTER_RUN_ONLY, run_mpi_job
from tests.strategy.helpers import (
    COMM,
    ONE_RANK_OPTION_JOB,
    RANK,
    SIZE,
    Regressor,
    loader,
    mlp,
    regression_data,
    trainer,
)


def _fit(strategy: MPIADStrategy) -> None:
    trainer(strategy=strategy, max_steps=2).fit(Regressor(mlp()), loader(regression_data(SIZE * 8), 4))


def _still_in_step() -> None:
    assert COMM.allreduce(RANK) == SIZE * (SIZE - 1) // 2


@pytest.mark.mpi(ranks=(3,), timeout=120)
def test_an_unknown_mode_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"shard='bogus' is not a shard mode; use 'optimizer', 'gradients'"):
        MPIADStrategy(shard="bogus")
    with pytest.raises(ValueError, match="data_parallel=False keeps no replicas"):
        MPIADStrategy(shard="optimizer", data_parallel=False)
    _still_in_step()


@pytest.mark.mpi(ranks=(3,), timeout=120)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shard": "optimizer", "sync": "local_sgd"}, r"sync mode 'local_sgd' keeps replicas that differ"),
        ({"shard": "gradients", "sync": "daso"}, r"sync mode 'daso' keeps replicas that differ"),
        ({"shard": "gradients", "aggregator": TopK(density=0.1)}, r"aggregator is TopK.*or shard='optimizer'"),
        ({"shard": "gradients", "sync": "hierarchical", "ranks_per_node": 2}, r"the nodes have \[2, 1\] ranks"),
    ],
    ids=["local_sgd", "daso", "compressor", "uneven-nodes"],
)
def test_a_configuration_it_cannot_run_fails_on_every_rank(options: dict, message: str) -> None:
    with pytest.raises(SyncConfigurationError, match=message):
        _fit(MPIADStrategy(**options))
    _still_in_step()


@pytest.mark.mpi(ranks=(3,), timeout=120)
def test_ranks_given_different_modes_fail_together() -> None:
    with pytest.raises(SyncConfigurationError, match=r"rank 0: 'gradients'; ranks 1-2: None"):
        _fit(MPIADStrategy(shard="gradients" if RANK == 0 else None))
    _still_in_step()


GROUP_ON_ONE_RANK_JOB = Path(__file__).parent / "scripts" / "group_on_one_rank_job.py"


@OUTER_RUN_ONLY
def test_an_unknown_mode_on_one_rank_only_ends_the_job() -> None:
    start = time.time()
    code, output, ended = run_mpi_job(ONE_RANK_OPTION_JOB, 3, "shard", '"optimizer"', '"bogus"', timeout=300)
    assert code != 0, output[-3000:]
    assert "shard='bogus' is not a shard mode" in output and "[mpistrategy] rank 1 of 3" in output, output[-3000:]
    assert ended - start < 280


class _Optimized(Regressor):
    """A regressor whose optimizer is ``kind``: one that cannot step a shard, or AdamW over a tensor the model does
    not hold, or AdamW that gains a parameter group at the second step."""

    def __init__(self, kind: str) -> None:
        super().__init__(mlp())
        self.kind = kind
        self.extra = torch.zeros(2, requires_grad=True)  # not an nn.Parameter: not the model's

    def training_step(self, batch, batch_idx):
        if self.kind == "add_param_group" and batch_idx == 1:
            self.optimizers().optimizer.add_param_group({"params": [self.extra], "lr": 0.01})
        return super().training_step(batch, batch_idx) + self.extra.square().sum()

    def configure_optimizers(self):
        if self.kind == "lbfgs":
            return torch.optim.LBFGS(self.parameters())
        if self.kind == "adafactor":
            return torch.optim.Adafactor(self.parameters())
        if self.kind == "foreign":
            return torch.optim.AdamW([*self.parameters(), self.extra])
        return torch.optim.AdamW(self.parameters())


@pytest.mark.mpi(ranks=(3,), timeout=180)
@pytest.mark.parametrize(
    ("shard", "kind", "message"),
    [
        ("gradients", "lbfgs", r"LBFGS cannot step a shard of the parameters: its step reads the whole gradient"),
        ("optimizer", "adafactor", r"Adafactor cannot step a shard.*factors the second moment.*or shard=None"),
        ("optimizer", "foreign", r"steps 1 tensor\(s\) that are not parameters of the model.*nn.Parameter"),
        ("gradients", "add_param_group", r"AdamW has 2 parameter groups, 1 when it was sharded.*add_param_group"),
        ("optimizer", "add_param_group", r"AdamW has 2 parameter groups, 1 when it was sharded.*add_param_group"),
    ],
)
def test_an_optimizer_that_cannot_step_a_shard_is_refused_on_every_rank(shard: str, kind: str, message: str) -> None:
    """Each of these would train wrongly without a word if sharded (LBFGS would not move under stage 2, Adafactor's
    and a foreign tensor's updates would differ from flat mpi_ad's, a group added while training would not be
    averaged under stage 2)."""
    with pytest.raises(ValueError, match=message):
        trainer(strategy=MPIADStrategy(shard=shard), max_steps=3).fit(
            _Optimized(kind), loader(regression_data(SIZE * 8), 4)
        )
    _still_in_step()


@OUTER_RUN_ONLY
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_a_group_added_on_one_rank_only_ends_the_job_with_its_error(shard: str) -> None:
    """Rank 1 alone adds a parameter group: the job ends (non-zero, rank 1's error and traceback printed) long before
    the stall timeout, no rank waiting in the allgather of the parameters."""
    start = time.time()
    code, output, ended = run_mpi_job(GROUP_ON_ONE_RANK_JOB, 3, shard, timeout=300)
    assert code != 0 and "FINISHED" not in output, output[-3000:]
    assert "AdamW has 2 parameter groups, 1 when it was sharded" in output, output[-3000:]
    assert "[mpistrategy] rank 1 of 3" in output, output[-3000:]
    assert ended - start < 150, output[-3000:]


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("on_rank_zero_only", [False, True])
def test_a_finetuning_callback_is_refused_at_setup_on_every_rank(on_rank_zero_only: bool) -> None:
    """Also when rank 0 alone has the callback: the others raise naming rank 0's error, none waits."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    model = Regressor(mlp())
    model.backbone = model.net  # what BackboneFinetuning freezes, then unfreezes into a new parameter group
    callbacks = [BackboneFinetuning()] if RANK == 0 or not on_rank_zero_only else []
    message = r"the callback BackboneFinetuning adds parameter groups"
    with pytest.raises(ValueError, match=message if callbacks else rf"rank 0.*{message}"):
        trainer(strategy=MPIADStrategy(shard="optimizer"), max_steps=2, callbacks=callbacks).fit(
            model, loader(regression_data(SIZE * 8), 4)
        )
    _still_in_step()


class _OwnClipping(Regressor):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


@pytest.mark.mpi(ranks=(2,), timeout=120)
@pytest.mark.parametrize("shard", ["optimizer", "gradients"])
def test_an_own_clipping_hook_under_stage_two_is_warned_of_once(shard: str, caplog: pytest.LogCaptureFixture) -> None:
    """Under stage 2 parameters hold no ``.grad`` after backward: a hook that clipped them itself would clip nothing."""
    with caplog.at_level("WARNING", logger="mpistrategy"):
        trainer(strategy=MPIADStrategy(shard=shard), max_steps=1).fit(
            _OwnClipping(mlp()), loader(regression_data(SIZE * 8), 4)
        )
    warned = [r for r in caplog.records if "configure_gradient_clipping must clip through" in r.getMessage()]
    assert len(warned) == (1 if shard == "gradients" and RANK == 0 else 0)
