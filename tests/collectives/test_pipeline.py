"""Pipeline parallelism with send/recv: an MLP split into one stage per rank trains exactly like the whole model.

Micro-batches flow forward with ``send``/``recv`` and their gradients flow back through autograd: every stage but
the last calls ``.backward()`` on the Placeholder that ``send`` returned, the last stage on its loss. Every rank
also trains the unsplit model on the same data (same seed) as the reference; after each optimizer step the
stage's parameters and gradients must equal the reference's to 1e-12.
"""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI

import mpistrategy as ms
from mpistrategy.collectives import _p2p_wire, p2p

pytestmark = pytest.mark.mpi(ranks=(2, 3, 4))

COMM = MPI.COMM_WORLD
WIDTHS = (6, 16, 16, 16, 3)  # four Linear layers: a stage per rank at up to 4 ranks
MICRO_BATCHES = 4
MICRO_BATCH_SIZE = 5
STEPS = 3
TOLERANCE = {"rtol": 0.0, "atol": 1e-12}


def _blocks() -> list[torch.nn.Module]:
    """The MLP as a list of blocks (Linear + Tanh, the last Linear alone), float64, seeded identically."""
    torch.manual_seed(0)
    layers = []
    for index, (width_in, width_out) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:], strict=True)):
        linear = torch.nn.Linear(width_in, width_out, dtype=torch.float64)
        last = index == len(WIDTHS) - 2
        layers.append(linear if last else torch.nn.Sequential(linear, torch.nn.Tanh()))
    return layers


def _stage_blocks(count: int, stages: int, stage: int) -> range:
    """Which blocks stage ``stage`` of ``stages`` holds: contiguous, the first stages one longer."""
    base, extra = divmod(count, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    total = MICRO_BATCHES * MICRO_BATCH_SIZE
    inputs = torch.randn(total, WIDTHS[0], dtype=torch.float64, generator=generator)
    targets = torch.randn(total, WIDTHS[-1], dtype=torch.float64, generator=generator)
    return inputs, targets


def _schedule(name: str, stages: int, stage: int) -> list[tuple[str, int]]:
    """The order of forward ("F", k) and backward ("B", k) work on micro-batches k for one stage."""
    forwards = [("F", k) for k in range(MICRO_BATCHES)]
    if name == "gpipe":  # all forwards, then all backwards, last micro-batch first
        return forwards + [("B", k) for k in reversed(range(MICRO_BATCHES))]
    if name == "gpipe, backward order alternating by stage":
        order = range(MICRO_BATCHES) if stage % 2 == 0 else reversed(range(MICRO_BATCHES))
        return forwards + [("B", k) for k in order]
    assert name == "1f1b"  # warm-up forwards, then one forward one backward, then the remaining backwards
    warmup = min(stages - 1 - stage, MICRO_BATCHES)
    steady = [item for k in range(MICRO_BATCHES - warmup) for item in (("F", warmup + k), ("B", k))]
    return forwards[:warmup] + steady + [("B", k) for k in range(MICRO_BATCHES - warmup, MICRO_BATCHES)]


@pytest.mark.parametrize("schedule_name", ["gpipe", "gpipe, backward order alternating by stage", "1f1b"])
def test_pipeline_matches_unsplit_model(schedule_name):
    stages, stage = COMM.Get_size(), COMM.Get_rank()
    first, last = stage == 0, stage == stages - 1

    reference = torch.nn.Sequential(*_blocks())
    mine = _stage_blocks(len(reference), stages, stage)
    model = torch.nn.Sequential(*(copy.deepcopy(reference[index]) for index in mine))
    reference_blocks = [reference[index] for index in mine]

    def optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)

    reference_optimizer, stage_optimizer = optimizer(reference), optimizer(model)

    for step in range(STEPS):
        inputs, targets = _batch(step)

        # Reference: the whole model on the whole batch (the mean loss is the mean of the micro-batch means).
        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(inputs), targets).backward()

        # Pipeline: micro-batch k carries tag k.
        stage_optimizer.zero_grad()
        pending = {}
        for kind, k in _schedule(schedule_name, stages, stage):
            rows = slice(k * MICRO_BATCH_SIZE, (k + 1) * MICRO_BATCH_SIZE)
            if kind == "F":
                activation = inputs[rows] if first else ms.recv(stage - 1, tag=k)
                assert first or activation.requires_grad
                output = model(activation)
                if last:
                    pending[k] = torch.nn.functional.mse_loss(output, targets[rows]) / MICRO_BATCHES
                else:
                    pending[k] = ms.send(output, stage + 1, tag=k)
            else:
                pending.pop(k).backward()
        assert not pending

        for block, reference_block in zip(model, reference_blocks, strict=True):
            for parameter, reference_parameter in zip(block.parameters(), reference_block.parameters(), strict=True):
                torch.testing.assert_close(parameter.grad, reference_parameter.grad, **TOLERANCE)
        reference_optimizer.step()
        stage_optimizer.step()
        for parameter, reference_parameter in zip(
            model.parameters(), (p for b in reference_blocks for p in b.parameters()), strict=True
        ):
            torch.testing.assert_close(parameter, reference_parameter, **TOLERANCE)

    p2p.wait_backward_sends()
    assert not _p2p_wire.arriving
    COMM.Barrier()
