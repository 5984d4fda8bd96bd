"""A small training job that misbehaves on purpose, for tests/strategy/test_failures.py.

Usage: mpiexec -n 3 python failing_job.py MODE DIRECTORY

MODE: raise (rank 1 raises in training_step), kill (rank 1 SIGKILLs itself), os_exit (rank 1 calls os._exit(3)),
os_exit_0 (rank 1 calls os._exit(0)), sigterm_sanity (rank 1 sends itself SIGTERM in the sanity check's validation),
sigterm_setup (rank 1 sends itself SIGTERM in the LightningModule's setup hook), sigterm_after_fit (after a short
fit, rank 1 sends itself SIGTERM: the default action must end it),
raise_outside (rank 1 raises after fit while the others wait in a barrier), raise_everywhere (every rank raises in
training_step at the same batch, then fits again in the same process), raise_everywhere_uncaught (every rank raises
at the same batch and lets the error end the script; each write to stderr is recorded in DIRECTORY/writes<rank>),
signal_at_exit (after a short fit, each rank
sends itself SIGUSR1 and SIGTERM from an exit hook that runs after mpistrategy's), usr1 (rank 1 sends itself SIGUSR1),
usr1_raw (the same in manual optimization stepping the torch optimizer itself, for one epoch),
pids (every rank writes its pid to DIRECTORY and trains slowly, waiting for a signal from outside), resume (continue
from the stop checkpoint), corrupt (resume from DIRECTORY/hpc_ckpt_1.ckpt after rank 0 cut it short).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time

import lightning.pytorch as L
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpistrategy  # noqa: F401

MODE, DIRECTORY = sys.argv[1], sys.argv[2]
RANK = MPI.COMM_WORLD.Get_rank()
TRIGGER_BATCH = 3


def mark(what: str) -> None:
    print(f"{what} rank={RANK} time={time.time():.3f}", flush=True)


class Job(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.automatic_optimization = MODE != "usr1_raw"
        self.raw_steps = 0

    def training_step(self, batch, batch_idx):
        if MODE.startswith("raise_everywhere") and batch_idx == TRIGGER_BATCH and self.trainer.max_steps > 10:
            mark("FAILING")
            raise ValueError(f"every rank at batch {batch_idx}")
        if RANK == 1 and batch_idx == TRIGGER_BATCH and self.current_epoch == 0:
            if MODE == "raise":
                mark("FAILING")
                raise RuntimeError(f"boom from rank {RANK} at batch {batch_idx}")
            if MODE == "kill":
                mark("FAILING")
                os.kill(os.getpid(), signal.SIGKILL)
            if MODE in ("os_exit", "os_exit_0"):
                mark("FAILING")
                os._exit(3 if MODE == "os_exit" else 0)
            if MODE in ("usr1", "usr1_raw"):
                mark("SIGNALLING")
                os.kill(os.getpid(), signal.SIGUSR1)
        if MODE == "pids" and batch_idx == TRIGGER_BATCH and self.current_epoch == 0:
            with open(os.path.join(DIRECTORY, f"pid{RANK}"), "w") as f:
                f.write(str(os.getpid()))
        if MODE in ("pids", "usr1", "usr1_raw"):
            time.sleep(0.02)
        if MODE == "usr1_raw":  # past Lightning's optimizer wrapper: the global step stays 0
            optimizer = self.optimizers(use_pl_optimizer=False)
            optimizer.zero_grad()
            self.manual_backward(self.net(batch[0]).pow(2).mean())
            optimizer.step()
            self.raw_steps += 1
            return None
        return self.net(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        if MODE == "sigterm_sanity" and RANK == 1 and self.trainer.sanity_checking and batch_idx == 0:
            mark("SIGNALLING")
            os.kill(os.getpid(), signal.SIGTERM)
        return self.net(batch[0]).pow(2).mean()

    def setup(self, stage: str) -> None:
        if MODE == "sigterm_setup" and RANK == 1:
            mark("SIGNALLING")
            os.kill(os.getpid(), signal.SIGTERM)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if MODE == "signal_at_exit":  # registered before fit: runs after the exit hooks mpistrategy registers in fit

    @atexit.register
    def _signalled_while_exiting() -> None:
        ignored = all(signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGUSR1, signal.SIGTERM))
        print(f"AT EXIT rank={RANK} ignored={ignored}", flush=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print(f"SURVIVED rank={RANK}", flush=True)


class RecordedWrites:
    """Stderr that also appends each write, as one JSON line, to DIRECTORY/writes<rank>."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with open(os.path.join(DIRECTORY, f"writes{RANK}"), "a") as record:
            record.write(json.dumps(text) + "\n")
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


if MODE == "raise_everywhere_uncaught":
    sys.stderr = RecordedWrites(sys.stderr)
if MODE == "corrupt" and RANK == 0:
    checkpoint = os.path.join(DIRECTORY, "hpc_ckpt_1.ckpt")
    os.truncate(checkpoint, os.path.getsize(checkpoint) - 100)
MPI.COMM_WORLD.Barrier()

data = TensorDataset(torch.randn(3 * 8 * 50, 4))
trainer = L.Trainer(
    strategy="mpi_ad",
    accelerator="cpu",
    max_steps={"resume": 30, "raise_outside": 5, "signal_at_exit": 5, "sigterm_after_fit": 5}.get(MODE, 100_000),
    max_epochs=1 if MODE == "usr1_raw" else -1,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    default_root_dir=DIRECTORY,
)
job = Job()
try:
    validation = DataLoader(data, batch_size=8) if MODE == "sigterm_sanity" else None
    resume = "hpc" if MODE in ("resume", "corrupt") else None
    trainer.fit(job, DataLoader(data, batch_size=8), validation, ckpt_path=resume)
except Exception as error:  # one line per rank (tracebacks of several ranks interleave in the job's output)
    print(f"RAISED rank={RANK} {type(error).__name__}: {str(error).splitlines()[0]}", flush=True)
    if MODE != "raise_everywhere":
        raise
finally:
    print(f"STOPPED rank={RANK} global_step={trainer.global_step} raw_steps={job.raw_steps}", flush=True)
if MODE == "raise_everywhere":  # the ranks are still in step: a second fit trains together
    again = L.Trainer(strategy="mpi_ad", accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)  # fmt: skip
    model = Job()
    again.fit(model, DataLoader(data, batch_size=8))
    print(f"SECOND rank={RANK} step={again.global_step} weight={model.net.weight.sum().item():.10f}", flush=True)
if MODE == "raise_outside":
    if RANK == 1:
        mark("FAILING")
        raise ValueError("outside the trainer on rank 1")
    MPI.COMM_WORLD.Barrier()
if MODE == "sigterm_after_fit" and RANK == 1:
    mark("SIGNALLING")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    print(f"SURVIVED rank={RANK}", flush=True)
