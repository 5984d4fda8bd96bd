"""A small Fabric training loop under mpi_ad that misbehaves on purpose, for tests/fabric/test_failures.py.

Usage: mpiexec -n 3 python fabric_job.py MODE DIRECTORY

MODE: raise (rank 1 raises in its training loop while the others go on to the next collective), usr1 (rank 1 sends
itself SIGUSR1; every rank catches the coordinated stop, saves DIRECTORY/stop.ckpt and exits 75), usr1_raw (the
same, the loop stepping the torch optimizer it gave ``fabric.setup`` instead of the wrapper it got back), mismatch
(every rank all-reduces at step 3, rank 1 a tensor of another shape: every rank raises the collective's error).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from lightning.fabric import Fabric
from torch import nn

import mpistrategy as ms  # registers "mpi_ad"
from mpistrategy.strategy import StopRequested

MODE, DIRECTORY = sys.argv[1], sys.argv[2]
TRIGGER_STEP = 3

fabric = Fabric(strategy="mpi_ad", accelerator="cpu")
fabric.launch()
rank = fabric.global_rank


def mark(what: str) -> None:
    print(f"{what} rank={rank} time={time.time():.3f}", flush=True)


def fail(step: int) -> None:
    mark("FAILING")
    raise RuntimeError(f"boom from rank {rank} at step {step}")


def signal_self(step: int) -> None:
    mark("SIGNALLING")
    os.kill(os.getpid(), signal.SIGUSR1)


def all_reduce_another_shape(step: int) -> None:
    mark("FAILING")
    ms.allreduce(torch.zeros(3 if rank == 1 else 4))


MISBEHAVE = {"raise": fail, "usr1": signal_self, "usr1_raw": signal_self, "mismatch": all_reduce_another_shape}[MODE]


def train_one_step(step: int) -> None:
    if step == TRIGGER_STEP and (rank == 1 or MODE == "mismatch"):
        MISBEHAVE(step)
    x = torch.randn(8, 4)
    fabric.backward(model(x).pow(2).mean())
    (raw if MODE == "usr1_raw" else optimizer).step()
    optimizer.zero_grad()
    time.sleep(0.02)


net = nn.Linear(4, 1)
raw = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
model, optimizer = fabric.setup(net, raw)
step = 0
try:
    for step in range(200):
        train_one_step(step)
except StopRequested as stop:
    print(f"STOPPED rank={rank} step={step} signal={stop.signal_name}", flush=True)
    fabric.save(os.path.join(DIRECTORY, "stop.ckpt"), {"model": model, "optimizer": optimizer, "step": step})
    raise
print(f"FINISHED rank={rank}", flush=True)
