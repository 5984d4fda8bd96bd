"""Bytes sent per step, by scope, as the strategy logs them: the inter-node bytes fall by the skip factor."""

from __future__ import annotations

import csv
import os

import pytest
from lightning.pytorch.loggers import CSVLogger

from mpistrategy.aggregation import MeanAggregator, TopK
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.sync import DASO, FlatSync, HierarchicalLocalSGD, HierarchicalSync, LocalSGD
from tests.strategy.helpers import RANK, SIZE, Regressor, loader, mlp, regression_data, shared_tmpdir, trainer

STEPS = 16
PER_RANK_BATCH = 4


def _logged(sync, folder: str, aggregator=None, ranks_per_node: int = 2) -> tuple[list[dict[str, float]], int, object]:
    """Fit ``STEPS`` steps as nodes of ``ranks_per_node`` (``aggregator`` combines the step across nodes); rank 0's
    logged comm/ rows, the model's bytes, the traffic counter."""
    data = regression_data(SIZE * PER_RANK_BATCH * STEPS)
    model = Regressor(mlp(seed=4), lr=0.05)
    strategy = MPIADStrategy(sync=sync, aggregator=aggregator or MeanAggregator(), ranks_per_node=ranks_per_node)
    logger = CSVLogger(folder, name=f"{type(sync).__name__}{ranks_per_node}", version=0)
    trainer(strategy=strategy, max_steps=STEPS, logger=logger, log_every_n_steps=1).fit(
        model, loader(data, PER_RANK_BATCH)
    )
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows: list[dict[str, float]] = []
    if RANK == 0:
        with open(os.path.join(logger.log_dir, "metrics.csv")) as handle:
            for row in csv.DictReader(handle):
                if row.get("comm/bytes_per_step"):
                    rows.append({k: float(v) for k, v in row.items() if k.startswith("comm/") and v})
    return rows, model_bytes, strategy.traffic


@pytest.mark.mpi(ranks=(4,), timeout=240)
def test_inter_node_bytes_fall_by_the_skip_factor() -> None:
    folder = shared_tmpdir()
    flat, model_bytes, _ = _logged(FlatSync(), folder)
    hierarchical, _, _ = _logged(HierarchicalSync(), folder)
    local, _, local_traffic = _logged(LocalSGD(period=4), folder)
    hier_local, _, _ = _logged(HierarchicalLocalSGD(period=4), folder)
    compressed, _, _ = _logged(HierarchicalSync(), folder, aggregator=TopK(density=0.01))
    daso, _, _ = _logged(DASO(warmup_epochs=0, cooldown_epochs=0, global_skip=4, downcast=None), folder)
    if RANK != 0:
        return
    assert len(flat) == STEPS
    inter = {
        name: sum(r["comm/inter_node_bytes_per_step"] for r in rows)
        for name, rows in [("flat", flat), ("hierarchical", hierarchical), ("local", local), ("hl", hier_local)]
    }
    # flat: every rank sends its gradients over the world every step; rank 0 is a node leader
    assert inter["flat"] == STEPS * model_bytes
    assert all(r["comm/node_bytes_per_step"] == 0 for r in flat)
    # hierarchical: the leader sends one copy per step across nodes, and its gradients inside the node
    assert inter["hierarchical"] == STEPS * model_bytes
    assert sum(r["comm/node_bytes_per_step"] for r in hierarchical) == STEPS * model_bytes
    # every 4 steps one model: a quarter of flat's inter-node bytes
    assert inter["local"] == inter["flat"] / 4 == local_traffic.total_inter_node
    assert inter["hl"] == inter["flat"] / 4
    # DASO, one epoch of 16 steps, global_skip 4: sends at steps 0, 4, 8, 12 and a blocking average at the end
    daso_inter = sum(r["comm/inter_node_bytes_per_step"] for r in daso)
    assert daso_inter == 5 * model_bytes
    assert daso_inter <= inter["flat"] / 3

    # top-k on the leaders' step: the node step stays dense, each leader sends k = 1 (index, value) pair per bucket
    assert sum(r["comm/node_bytes_per_step"] for r in compressed) == STEPS * model_bytes
    pair = 4 + 8  # int32 index, float64 value
    inter_compressed = sum(r["comm/inter_node_bytes_per_step"] for r in compressed)
    assert STEPS * pair <= inter_compressed <= STEPS * 4 * (pair + 14)
    assert inter_compressed < inter["hierarchical"] / 4


@pytest.mark.mpi(ranks=(3,), timeout=240)
def test_nodes_of_one_rank_count_no_node_bytes() -> None:
    """With one rank per node nothing travels inside a node: the node step and the node sum send nothing."""
    folder = shared_tmpdir()
    hierarchical, model_bytes, _ = _logged(HierarchicalSync(), folder, ranks_per_node=1)
    daso, _, _ = _logged(DASO(warmup_epochs=0, cooldown_epochs=0, global_skip=4, downcast=None), folder, None, 1)
    if RANK != 0:
        return
    assert sum(r["comm/node_bytes_per_step"] for r in hierarchical + daso) == 0
    assert sum(r["comm/inter_node_bytes_per_step"] for r in hierarchical) == STEPS * model_bytes
    assert sum(r["comm/inter_node_bytes_per_step"] for r in daso) == 5 * model_bytes


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_one_node_counts_its_gradients_once_per_step() -> None:
    """On one node the node leaders' step is a one-rank operation: only the node step sends."""
    rows, model_bytes, _ = _logged(HierarchicalSync(), shared_tmpdir())
    if RANK == 0:
        assert sum(r["comm/node_bytes_per_step"] for r in rows) == STEPS * model_bytes
        assert sum(r["comm/inter_node_bytes_per_step"] for r in rows) == 0
