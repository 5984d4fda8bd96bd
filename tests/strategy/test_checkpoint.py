"""Checkpoints: written atomically and sealed by rank 0, verified and loaded on every rank; resuming continues the
same trajectory, after a stop signal in the middle of an epoch too (bit for bit); corrupt files are refused on
every rank."""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from mpistrategy.aggregation import GradBucket, MeanAggregator
from mpistrategy.strategy import checkpoint_files, checkpoints
from mpistrategy.strategy.checkpoint_files import SEAL_PREFIX, CorruptCheckpointError
from mpistrategy.strategy.mpi_ad import CHECKPOINT_KEY, MPIADStrategy
from mpistrategy.strategy.resumable import CountedLoader, ResumableLoader, make_resumable, unwrapped
from tests.strategy.helpers import (
    COMM,
    RANK,
    SIZE,
    Regressor,
    assert_same_on_all_ranks,
    flat_parameters,
    loader,
    mlp,
    regression_data,
    shared_tmpdir,
    trainer,
)
from tests.strategy.resume import (
    assert_same_training_state,
    fit_noisy,
    fit_with_epoch_checkpoints,
    stop_then_resume,
)


class CountingMean(MeanAggregator):
    """The mean, plus a counter that must survive checkpoints (a stand-in for real aggregator state)."""

    def __init__(self) -> None:
        self.combined = 0

    def start(self, bucket: GradBucket) -> Any:
        self.combined += 1
        return super().start(bucket)

    def state_dict(self) -> dict[str, Any]:
        return {"combined": self.combined}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.combined = state["combined"]


def _fit(directory: str, epochs: int, seed: int, ckpt_path: str | None = None) -> tuple[Regressor, CountingMean]:
    aggregator = CountingMean()
    return fit_with_epoch_checkpoints(aggregator, directory, epochs, seed, ckpt_path), aggregator


@pytest.mark.mpi(ranks=(2, 3), timeout=90)
def test_resume_continues_the_same_trajectory() -> None:
    directory = shared_tmpdir()
    straight, straight_aggregator = _fit(directory, epochs=3, seed=1)
    first = os.path.join(directory, "epoch=0.ckpt")
    assert os.path.exists(first)
    assert not [name for name in os.listdir(directory) if ".tmp" in name], "temporary files were left behind"
    saved = torch.load(first, weights_only=True)  # a normal checkpoint, also for the strict loader
    assert saved[CHECKPOINT_KEY]["aggregator"] == {"combined": straight_aggregator.combined // 3}
    assert saved[CHECKPOINT_KEY]["sync"] == {"name": "flat", "state": {}}
    assert saved[CHECKPOINT_KEY]["world_size"] == SIZE and len(saved[CHECKPOINT_KEY]["random_state"]) == SIZE
    with zipfile.ZipFile(first) as archive:
        assert archive.comment.startswith(SEAL_PREFIX) and len(archive.comment) == len(SEAL_PREFIX) + 64

    resumed, resumed_aggregator = _fit(shared_tmpdir(), epochs=3, seed=99, ckpt_path=first)  # other init
    assert_same_on_all_ranks(flat_parameters(resumed), "resumed parameters")
    torch.testing.assert_close(flat_parameters(resumed), flat_parameters(straight), rtol=0, atol=0)
    assert resumed_aggregator.combined == straight_aggregator.combined


@pytest.mark.mpi(ranks=(2,), timeout=60)
def test_checkpoint_only_rank_zero_can_see_is_broadcast(monkeypatch: pytest.MonkeyPatch) -> None:
    directory = shared_tmpdir()
    _fit(directory, epochs=1, seed=3)
    path = os.path.join(directory, "epoch=0.ckpt")
    mine = _per_rank_view(monkeypatch, path if RANK == 0 else None)
    strategy = trainer().strategy
    checkpoint = strategy.load_checkpoint(mine)
    reference = COMM.bcast(torch.load(path, weights_only=False)["state_dict"] if RANK == 0 else None, root=0)
    for key, value in reference.items():
        torch.testing.assert_close(checkpoint["state_dict"][key], value)


# --- a stop signal in the middle of an epoch, then resume: bit for bit the uninterrupted run ------------------------

BATCHES_PER_EPOCH = 6  # per rank
EPOCHS = 3


@functools.cache
def _uninterrupted(accumulate: int) -> tuple[L.LightningModule, L.Trainer]:
    model, fit, code = fit_noisy(shared_tmpdir(), EPOCHS, BATCHES_PER_EPOCH, accumulate=accumulate)
    assert code is None and fit.global_step == EPOCHS * BATCHES_PER_EPOCH // accumulate
    return model, fit


@pytest.mark.mpi(ranks=(2, 3), timeout=240)
@pytest.mark.parametrize(
    ("signum", "signal_step", "accumulate"),
    [
        (signal.SIGUSR1, 7, 1),  # stops before batch 2 of epoch 1
        (signal.SIGTERM, 9, 1),  # stops before batch 4 of epoch 1
        (signal.SIGUSR1, 5, 1),  # stops before the first batch of epoch 1
        (signal.SIGTERM, 4, 2),  # gradient accumulation: stops before batch 4 (of 6) of epoch 1, a step boundary
    ],
    ids=["SIGUSR1-mid-epoch", "SIGTERM-mid-epoch", "SIGUSR1-epoch-start", "SIGTERM-accumulating"],
)
def test_stop_mid_epoch_then_resume_ends_bit_identical_to_an_uninterrupted_run(
    signum: int, signal_step: int, accumulate: int
) -> None:
    reference = _uninterrupted(accumulate)
    resumed = stop_then_resume(
        shared_tmpdir(), signum, signal_step, epochs=EPOCHS, batches_per_epoch=BATCHES_PER_EPOCH, accumulate=accumulate
    )
    assert_same_training_state(resumed, reference)


class LookAtABatchOnRankZero(L.Callback):
    """Rank 0 alone reads a batch of ``trainer.train_dataloader`` (as one would to log it) at every epoch start and
    after every batch, its random state kept (the DataLoader's iterator draws a seed from torch's generator)."""

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._look(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._look(trainer)

    def _look(self, trainer: L.Trainer) -> None:
        if RANK == 0:
            with torch.random.fork_rng():
                next(iter(trainer.train_dataloader))


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_a_look_at_the_training_loader_on_rank_zero_changes_neither_training_nor_its_resume() -> None:
    """Stopped in the middle of epoch 1 and resumed, with rank 0 reading batches of the training loader all along:
    bit for bit the uninterrupted run without the looks (no hook ran on rank 0 alone, the position stayed)."""
    reference = _uninterrupted(1)
    resumed = stop_then_resume(
        shared_tmpdir(),
        signal.SIGUSR1,
        7,
        callbacks=(LookAtABatchOnRankZero(),),
        epochs=EPOCHS,
        batches_per_epoch=BATCHES_PER_EPOCH,
    )
    assert_same_training_state(resumed, reference)


#: how the end of an epoch comes: Trainer options, and the optimizer steps of an epoch
EPOCH_ENDS = {
    "by ModelCheckpoint": ({}, BATCHES_PER_EPOCH),
    "by ModelCheckpoint after the validation of the epoch's second half": (
        {"val_check_interval": 0.5, "validate": True},
        BATCHES_PER_EPOCH,
    ),
    "by ModelCheckpoint with limit_train_batches": ({"limit_train_batches": 0.5}, BATCHES_PER_EPOCH // 2),
    # every rank reads all the data in an order of its own (a RandomSampler drawing from torch's generator)
    "by ModelCheckpoint, a loader that cannot be resumed": (
        {"use_distributed_sampler": False},
        BATCHES_PER_EPOCH * SIZE,
    ),
    "after fit": ({}, BATCHES_PER_EPOCH),
}


@pytest.mark.mpi(ranks=(2, 3), timeout=300)
@pytest.mark.parametrize("saved", EPOCH_ENDS)
def test_a_checkpoint_of_an_epoch_end_resumes_bit_identical_to_an_uninterrupted_run(saved: str) -> None:
    """Saved at the end of epoch 1 (dropout and the loss scale draw from every generator): each rank's random
    state is restored just before the next epoch's dataloader draws its seed, as in the uninterrupted run, also
    where Lightning restarts the finished epoch first (a validation in the middle of the epoch) or ends epochs
    early (``limit_train_batches``)."""
    directory = shared_tmpdir()
    options, steps = EPOCH_ENDS[saved]
    if saved == "after fit":
        _, first, _ = fit_noisy(directory, EPOCHS - 1, BATCHES_PER_EPOCH)
        path = os.path.join(directory, "after_fit.ckpt")
        first.save_checkpoint(path)
        reference = _uninterrupted(1)
    else:
        every_save = ModelCheckpoint(dirpath=directory, save_top_k=-1, filename="{epoch}-{step}")
        model, fit, _ = fit_noisy(
            directory, EPOCHS, BATCHES_PER_EPOCH, callbacks=(every_save,), enable_checkpointing=True, **options
        )
        reference = (model, fit)
        path = os.path.join(directory, f"epoch={EPOCHS - 2}-step={steps * (EPOCHS - 1)}.ckpt")
    model, fit, code = fit_noisy(directory, EPOCHS, BATCHES_PER_EPOCH, ckpt_path=path, **options)
    assert code is None
    assert_same_training_state((model, fit), reference)


# --- the resumable loader on its own (one process) ------------------------------------------------------------------


def _sharded_loader(replicas: int, rank: int, samples: int = 40, batch: int = 3) -> DataLoader:
    dataset = TensorDataset(torch.arange(samples))
    return DataLoader(dataset, batch_size=batch, sampler=DistributedSampler(dataset, replicas, rank, seed=4))


def _training_pass(wrapper: object) -> Iterator[Any]:
    """A pass over a training loader wrapper as Lightning's training loop makes it (through its CombinedLoader)."""
    return (batch for batch, _, _ in CombinedLoader(wrapper))


class _Draws(Regressor):
    """Draws from torch's generator in ``on_train_epoch_start`` and in every training step, and keeps the draws."""

    def __init__(self) -> None:
        super().__init__(mlp(seed=4), lr=0.1)
        self.draws: list[tuple[str, float]] = []

    def on_train_epoch_start(self) -> None:
        self.draws.append(("epoch", torch.rand(1).item()))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.draws.append(("step", torch.rand(1).item()))
        return super().training_step(batch, batch_idx)


@pytest.mark.mpi(ranks=(2, 3), timeout=60)
@pytest.mark.parametrize("workers", [0, 1])
def test_the_random_draws_around_the_training_loader_come_in_lightnings_order(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As without the wrapper (and under DDP): the first epoch's DataLoader iterator, which draws its base seed
    from torch's generator, is made before ``on_train_epoch_start``, a later epoch's after it; and a second ``fit``
    of the same Trainer goes on from where the generator is."""
    for variable in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):  # left by an earlier seed_everything: fit would reseed
        monkeypatch.delenv(variable, raising=False)
    model = _Draws()
    torch.manual_seed(7)
    fit = trainer(max_epochs=2)
    fit.fit(model, loader(regression_data(SIZE * 8), 4, num_workers=workers))
    fit.fit_loop.max_epochs = 3
    fit.fit(model, loader(regression_data(SIZE * 8), 4, num_workers=workers))

    generator = torch.Generator().manual_seed(7)

    def base_seed() -> None:
        torch.empty((), dtype=torch.int64).random_(generator=generator)

    def draws(kind: str, count: int = 1) -> list[tuple[str, float]]:
        return [(kind, torch.rand(1, generator=generator).item()) for _ in range(count)]

    base_seed()  # the first fit: its first epoch's iterator, made while Lightning sets up the data
    expected = draws("epoch") + draws("step", 2) + draws("epoch")
    base_seed()  # the second epoch's iterator, made by the epoch loop
    expected += draws("step", 2)
    base_seed()  # the second fit: the new loader's iterator while setting up (never read), then the epoch loop's
    expected += draws("epoch")
    base_seed()
    expected += draws("step", 2)
    assert model.draws == expected


def test_resumable_loader_continues_the_epoch_after_the_batches_done() -> None:
    reference = make_resumable(_sharded_loader(2, 1), lambda: None)
    assert reference is not None
    reference.sampler.set_epoch(3)
    order = [batch[0].tolist() for batch in _training_pass(reference)]
    assert len(order) == len(reference) == 7
    stopped = _training_pass(reference)
    for _ in range(4):
        next(stopped)
    state = reference.state_dict()
    assert state == {"epoch": 3, "batches": 4, "num_batches": 7, "num_replicas": 2}

    resumed = make_resumable(_sharded_loader(2, 1), lambda: None)
    assert resumed is not None
    resumed.load_state_dict(state)
    assert [batch[0].tolist() for batch in _training_pass(resumed)] == order[4:]
    assert resumed.state_dict()["batches"] == 7
    resumed.sampler.set_epoch(4)  # the next epoch is whole again
    assert len(list(_training_pass(resumed))) == 7


def test_resumable_loader_on_another_number_of_ranks_restarts_the_epoch_with_a_warning(caplog) -> None:
    saved = make_resumable(_sharded_loader(3, 0), lambda: None)
    assert saved is not None
    iterator = _training_pass(saved)
    next(iterator)
    next(iterator)
    resumed = make_resumable(_sharded_loader(2, 0), lambda: None)
    assert resumed is not None
    resumed.load_state_dict(saved.state_dict())
    with caplog.at_level(logging.WARNING):
        batches = list(_training_pass(resumed))
    assert len(batches) == len(resumed) == 7
    assert "3 ranks" in caplog.text and "this run has 2 ranks" in caplog.text and "cannot continue" in caplog.text


def test_only_loaders_with_a_distributed_order_become_resumable() -> None:
    dataset = TensorDataset(torch.arange(10))
    assert make_resumable(DataLoader(dataset, batch_size=2, shuffle=True), lambda: None) is None
    unbatched = DataLoader(dataset, batch_size=None, sampler=DistributedSampler(dataset, 2, 0))
    assert make_resumable(unbatched, lambda: None) is None
    assert make_resumable(_sharded_loader(2, 0), lambda: None) is not None


def test_training_loader_wrappers_count_each_pass_and_forward_attribute_writes() -> None:
    """Both wrappers report a pass's number of batches once its data ended (a resumed pass: the batches it read),
    and an attribute Lightning sets on the wrapper (``worker_init_fn`` under ``seed_everything(workers=True)``)
    reaches the DataLoader that starts the workers."""
    ends: list[int] = []
    resumable = make_resumable(_sharded_loader(2, 1), lambda: None, lambda: None, ends.append)
    assert resumable is not None
    state = resumable.state_dict() | {"batches": 3}
    assert len(list(_training_pass(resumable))) == 7
    resumable.load_state_dict(state)
    assert len(list(_training_pass(resumable))) == 4
    stream = CountedLoader(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), lambda: None, ends.append)
    assert [len(batch[0]) for batch in _training_pass(stream)] == [4, 4, 2]
    assert ends == [7, 4, 3]

    def seeding(worker: int) -> None:
        return None

    for wrapper in (resumable, stream):
        wrapper.worker_init_fn = seeding
        assert unwrapped(wrapper).worker_init_fn is seeding and wrapper.worker_init_fn is seeding


def test_other_readers_of_a_training_loader_neither_move_its_position_nor_run_its_hooks() -> None:
    """A look at ``trainer.train_dataloader`` outside the training loop (on rank 0 only, say) is the loader's own
    iteration: the recorded position, a pending resume and the hooks (which may be collective) are the loop's."""
    calls: list[str] = []
    resumable = make_resumable(
        _sharded_loader(2, 1), lambda: calls.append("batch"), lambda: calls.append("pass"), calls.append
    )
    assert resumable is not None
    reference = [batch[0].tolist() for batch in _training_pass(make_resumable(_sharded_loader(2, 1), lambda: None))]
    resumable.load_state_dict(resumable.state_dict() | {"batches": 3})
    looked_at = [batch[0].tolist() for batch in resumable]
    assert looked_at == reference and calls == [] and resumable.state_dict()["batches"] == 0
    passing = _training_pass(resumable)
    assert next(passing)[0].tolist() == reference[3]
    assert next(iter(resumable))[0].tolist() == reference[0]  # a look in the middle of the pass
    assert [batch[0].tolist() for batch in passing] == reference[4:]
    assert resumable.state_dict()["batches"] == 7 and calls == ["pass"] + ["batch"] * 5 + [4]
    stream = CountedLoader(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), lambda: calls.append("pass"))
    calls.clear()
    assert [len(batch[0]) for batch in stream] == [4, 4, 2] and calls == []


def test_training_loader_wrappers_pass_for_the_loader_in_isinstance_and_copies() -> None:
    """``isinstance(trainer.train_dataloader, DataLoader)`` holds under the wrappers, and a copy or a pickle of one
    is a copy of its loader alone, without the training loop's hooks."""
    calls: list[str] = []
    resumable = make_resumable(_sharded_loader(2, 1), lambda: calls.append("batch"))
    stream = CountedLoader(DataLoader(TensorDataset(torch.arange(10)), batch_size=4), lambda: calls.append("pass"))
    passes = CountedLoader([[1, 2], [3]], lambda: calls.append("pass"))
    assert isinstance(resumable, DataLoader) and isinstance(stream, DataLoader) and isinstance(passes, list)
    assert isinstance(resumable, ResumableLoader) and isinstance(stream, CountedLoader)
    for wrapper in (resumable, stream):
        for copied in (copy.copy(wrapper), copy.deepcopy(wrapper), pickle.loads(pickle.dumps(wrapper))):
            assert type(copied) is DataLoader and len(copied) == len(wrapper)
            assert [len(batch[0]) for batch in _training_pass(copied)] == [len(b[0]) for b in unwrapped(wrapper)]
    assert calls == []


# --- corrupt checkpoints ----------------------------------------------------------------------------------------------


@functools.cache
def _sound_checkpoints() -> tuple[str, str]:
    """Two sound checkpoints of a short run (epoch 0, then epoch 1), in a folder of their own."""
    directory = shared_tmpdir()
    _fit(directory, epochs=2, seed=2)
    return os.path.join(directory, "epoch=0.ckpt"), os.path.join(directory, "epoch=1.ckpt")


def _tensor_data(path: str | os.PathLike) -> tuple[int, int]:
    """Offset and size of the bytes of the first tensor stored in the checkpoint at ``path``."""
    with zipfile.ZipFile(path) as archive:
        entry = next(info for info in archive.infolist() if "/data/" in info.filename and info.file_size)
    with open(path, "rb") as handle:
        handle.seek(entry.header_offset + 26)  # the local header's name and extra-field lengths
        name_length, extra_length = struct.unpack("<HH", handle.read(4))
    return entry.header_offset + 30 + name_length + extra_length, entry.file_size


def _corrupt_copy(kind: str) -> str:
    """A damaged copy of the newest sound checkpoint, next to it (written by rank 0)."""
    _, newest = _sound_checkpoints()
    path = os.path.join(os.path.dirname(newest), f"{kind}.ckpt")
    if RANK == 0:
        content = bytearray(open(newest, "rb").read())
        if kind == "bit-flips":
            start, size = _tensor_data(newest)
            for offset in (0, size // 2, size - 1):
                content[start + offset] ^= 0x10  # inside the tensor data; the zip structure stays intact
        elif kind == "truncated":
            content = content[:-100]
        elif kind == "zeros":  # a write lost in a crash: the file's length, none of its bytes
            content = bytearray(len(content))
        elif kind == "random":  # overwritten: torch's loader takes it for its legacy tar format and suggests unpickling
            content = bytearray(b"?" + bytes(torch.randint(0, 256, (len(content),), dtype=torch.uint8).tolist()))
        else:
            content = bytearray()
        with open(path, "wb") as handle:
            handle.write(content)
    COMM.Barrier()
    return path


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
@pytest.mark.parametrize("kind", ["bit-flips", "truncated", "empty", "zeros", "random"])
def test_a_corrupt_checkpoint_is_refused_on_every_rank_naming_an_older_sound_one(kind: str) -> None:
    """Each damage is named, and the checkpoint offered instead is the newest older one that passes the check (not
    one of the damaged copies beside it: a file that is no zip archive cannot be checked, so it is never offered)."""
    path = _corrupt_copy(kind)
    _, newest = _sound_checkpoints()
    if kind == "bit-flips":
        torch.load(path, weights_only=True)  # what the seal catches: torch itself loads the damaged data
    fit = trainer(strategy=MPIADStrategy(), max_epochs=3)
    with pytest.raises(CorruptCheckpointError) as refused:
        fit.fit(Regressor(mlp(seed=2)), loader(regression_data(SIZE * 12), 4), ckpt_path=path)
    message = str(refused.value)
    assert f"Checkpoint {path} is corrupt" in message
    expected = {
        "bit-flips": "do not match the SHA-256",
        "truncated": "ends early",
        "empty": "empty (0 bytes)",
        "zeros": "its first 4096 bytes are all zero",
        "random": "it is neither a zip archive nor a pickle (its first bytes are 3f ",
    }[kind]
    assert expected in message
    assert f"passes the check: {newest}" in message
    assert_same_on_all_ranks(torch.tensor([len(message)]), "the error message")


def _per_rank_view(monkeypatch: pytest.MonkeyPatch, source: str | None) -> str:
    """One path that names another file on each rank, as a node-local folder would: ``/proc/self/cwd/view.ckpt``,
    with this rank's working folder holding a copy of ``source`` there (nothing where ``source`` is ``None``)."""
    folder = os.path.join(shared_tmpdir(), f"rank{RANK}")
    os.makedirs(folder)
    if source is not None:
        shutil.copyfile(source, os.path.join(folder, "view.ckpt"))
    monkeypatch.chdir(folder)
    COMM.Barrier()
    return "/proc/self/cwd/view.ckpt"


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_a_checkpoint_corrupt_on_one_rank_only_is_refused_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    corrupt = _corrupt_copy("bit-flips")
    _, newest = _sound_checkpoints()
    path = _per_rank_view(monkeypatch, corrupt if RANK == SIZE - 1 else newest)  # the last rank's node saw damage
    fit = trainer(strategy=MPIADStrategy(), max_epochs=3)
    with pytest.raises(CorruptCheckpointError, match=f"found on rank\\(s\\) \\[{SIZE - 1}\\]"):
        fit.fit(Regressor(mlp(seed=2)), loader(regression_data(SIZE * 12), 4), ckpt_path=path)


def _flat_weights(checkpoint: dict[str, Any]) -> torch.Tensor:
    return torch.cat([tensor.flatten() for tensor in checkpoint["state_dict"].values()])


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_a_checkpoint_only_some_ranks_see_is_read_by_the_lowest_of_them_and_sent_to_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    corrupt = _corrupt_copy("bit-flips")
    _, newest = _sound_checkpoints()
    path = _per_rank_view(monkeypatch, None if RANK == 0 else newest)  # rank 0's node does not have the file
    loaded_here: list[str] = []

    def load(where: str) -> dict[str, Any]:
        loaded_here.append(where)
        return torch.load(where, weights_only=False)

    checkpoint = checkpoints.read(path, load, COMM)
    assert COMM.allgather(len(loaded_here)) == [0, 1] + [0] * (SIZE - 2)  # rank 1 read it, the others received it
    assert checkpoint["global_step"] == torch.load(newest, weights_only=False)["global_step"] > 0
    assert_same_on_all_ranks(_flat_weights(checkpoint), "the checkpoint's weights")

    COMM.Barrier()
    if RANK == 1:
        shutil.copyfile(corrupt, path)  # the one rank that reads it sees a damaged file
    COMM.Barrier()
    with pytest.raises(CorruptCheckpointError) as refused:
        checkpoints.read(path, load, COMM)
    assert f"Checkpoint {path} is corrupt: its contents do not match the SHA-256" in str(refused.value)
    assert "found on rank" not in str(refused.value)  # only rank 1 checked a file: no other rank's file passed


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_different_checkpoint_paths_on_the_ranks_are_refused_on_every_rank_naming_each() -> None:
    first, newest = _sound_checkpoints()
    fit = trainer(strategy=MPIADStrategy(), max_epochs=3)
    mine = first if RANK == 0 else newest
    with pytest.raises(ValueError, match="Pass the same ckpt_path on every rank") as refused:
        fit.fit(Regressor(mlp(seed=2)), loader(regression_data(SIZE * 12), 4), ckpt_path=mine)
    others = list(range(1, SIZE))
    assert f"rank(s) [0]: {first}; rank(s) {others}: {newest}" in str(refused.value)
    # The same file spelled differently on each rank (relative, file://) is one checkpoint.
    spelling = os.path.relpath(newest) if RANK == 0 else f"file://{newest}"
    checkpoint = checkpoints.read(spelling, lambda where: torch.load(where.removeprefix("file://")), COMM)
    assert checkpoint["epoch"] == torch.load(newest, weights_only=False)["epoch"] == 1


@pytest.mark.mpi(ranks=(2, 3), timeout=180)
@pytest.mark.parametrize("given_on", [0, -1])
def test_a_checkpoint_path_given_to_one_rank_only_is_refused_on_every_rank(given_on: int) -> None:
    """The ranks given no ``ckpt_path`` (which Lightning does not ask to read) meet the reading rank's exchange of
    paths at setup: ``fit`` and ``predict`` raise the same ``ValueError`` on every rank, and the next ``fit`` (no
    path anywhere) trains in step."""
    _, newest = _sound_checkpoints()
    reader = given_on % SIZE
    others = [rank for rank in range(SIZE) if rank != reader]
    path = newest if RANK == reader else None
    groups = [f"rank(s) [{reader}]: {newest}", f"rank(s) {others}: no ckpt_path"]  # in the order of their first rank
    named = "; ".join(groups if reader == 0 else groups[::-1])
    data = loader(regression_data(SIZE * 12), 4)
    for run in ("fit", "predict"):
        model = Regressor(mlp(seed=2))
        with pytest.raises(ValueError, match="Pass the same ckpt_path on every rank") as refused:
            getattr(trainer(strategy=MPIADStrategy(), max_epochs=3), run)(model, data, ckpt_path=path)
        assert f"({named})" in str(refused.value)
    model = Regressor(mlp(seed=2))
    trainer(strategy=MPIADStrategy(), max_epochs=1).fit(model, data)
    assert_same_on_all_ranks(flat_parameters(model), "the parameters after the next fit")


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_a_checkpoint_no_rank_sees_raises_file_not_found_on_every_rank() -> None:
    path = os.path.join(shared_tmpdir(), "missing.ckpt")
    fit = trainer(strategy=MPIADStrategy(), max_epochs=3)
    with pytest.raises(FileNotFoundError) as refused:
        fit.fit(Regressor(mlp(seed=2)), loader(regression_data(SIZE * 12), 4), ckpt_path=path)
    assert str(refused.value) == f"Checkpoint file not found: {path} (none of the {SIZE} ranks sees it)"


@pytest.mark.mpi(ranks=(2, 3), timeout=120)
def test_a_checkpoint_path_that_is_a_directory_raises_is_a_directory_on_every_rank() -> None:
    """As under DDP (what ``open`` raises), not as a damaged checkpoint."""
    path = shared_tmpdir()
    fit = trainer(strategy=MPIADStrategy(), max_epochs=3)
    with pytest.raises(IsADirectoryError) as refused:
        fit.fit(Regressor(mlp(seed=2)), loader(regression_data(SIZE * 12), 4), ckpt_path=path)
    assert str(refused.value) == f"[Errno 21] Is a directory: {path!r}"


def test_an_interrupted_write_leaves_the_previous_file_and_no_temporary(tmp_path) -> None:
    path = str(tmp_path / "last.ckpt")
    checkpoint_files.write_atomically(path, lambda temporary: torch.save({"step": 1}, temporary))
    assert checkpoint_files.find_problem(path) is None

    def fail_halfway(temporary: str) -> None:
        with open(temporary, "wb") as handle:
            handle.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint_files.write_atomically(path, fail_halfway)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_a_write_killed_before_its_rename_leaves_a_temporary_that_the_next_write_removes(tmp_path) -> None:
    """SIGKILL in the middle of a write (a preemption) keeps the previous file and leaves the temporary; the next
    write of that file removes it, and leaves alone a temporary being written meanwhile and those of other files."""
    path = tmp_path / "last.ckpt"
    checkpoint_files.write_atomically(str(path), lambda temporary: torch.save({"step": 1}, temporary))
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from mpistrategy.strategy import checkpoint_files\n"
            "def write(temporary):\n    open(temporary, 'wb').write(b'PK' * 1000); print('writing', flush=True); "
            "time.sleep(60)\n"
            f"checkpoint_files.write_atomically({str(path)!r}, write)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None and writer.stdout.readline() == "writing\n"
    writer.kill()
    writer.wait()
    (abandoned,) = [name for name in os.listdir(tmp_path) if name.startswith(".last.ckpt.tmp-")]
    other = tmp_path / ".other.ckpt.tmp-1-abc"
    other.write_bytes(b"another file's temporary")
    os.utime(other, (0, 0))
    concurrent = tmp_path / ".last.ckpt.tmp-1-def"

    def write(temporary: str) -> None:
        concurrent.write_bytes(b"written while this write runs")
        torch.save({"step": 2}, temporary)

    checkpoint_files.write_atomically(str(path), write)
    assert sorted(os.listdir(tmp_path)) == sorted(["last.ckpt", other.name, concurrent.name]), abandoned
    assert torch.load(path, weights_only=True) == {"step": 2}


def test_a_link_planted_in_a_shared_folder_is_not_written_through(tmp_path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: anyone can create names in it
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours")
    path = shared / "last.ckpt"
    os.symlink(victim, shared / f".last.ckpt.tmp-{os.getpid()}")  # a guessable temporary name
    umask = os.umask(0o022)
    try:
        checkpoint_files.write_atomically(str(path), lambda temporary: torch.save({"step": 2}, temporary))
    finally:
        os.umask(umask)
    assert victim.read_bytes() == b"not yours"
    assert torch.load(path, weights_only=True) == {"step": 2} and checkpoint_files.find_problem(str(path)) is None
    assert not path.is_symlink() and (path.stat().st_mode & 0o777) == 0o644  # the mode the umask gives


def test_a_torch_checkpoint_without_a_seal_is_checked_by_its_crc(tmp_path) -> None:
    path = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.arange(1000.0)}, path)
    assert checkpoint_files.find_problem(str(path)) is None
    content = bytearray(path.read_bytes())
    start, _ = _tensor_data(path)
    content[start + 7] ^= 0x01
    path.write_bytes(bytes(content))
    assert "CRC-32" in (checkpoint_files.find_problem(str(path)) or "")
