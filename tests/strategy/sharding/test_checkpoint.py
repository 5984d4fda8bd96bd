"""Checkpoints of sharded optimizers: a stop and resume ends bit for bit where an uninterrupted run ends; a checkpoint
loads on another number of ranks (re-sharded), also into an unsharded run, with the state ``consolidate`` gives;
damaged shard files are refused on every rank; ``mpistrategy-consolidate`` refuses to write over its input and names
a missing one."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from mpistrategy.strategy import checkpoint_files
from mpistrategy.strategy.checkpoint_files import CorruptCheckpointError
from mpistrategy.strategy.mpi_ad import MPIADStrategy
from mpistrategy.strategy.sharding.checkpoint import KEY, consolidate
from mpistrategy.strategy.sharding.cli import main as consolidate_main
from tests.external_job import OUTER_RUN_ONLY, run_mpi_job
from tests.strategy.helpers import COMM, RANK, loader, shared_tmpdir, trainer
from tests.strategy.resume import assert_same_training_state, fit_noisy, stop_then_resume
from tests.strategy.sharding.helpers import BATCH, DeepNet, data

SCRIPT = Path(__file__).parent / "scripts" / "reshard_job.py"
BATCHES_PER_EPOCH, EPOCHS = 6, 2
MODES = ("optimizer", "gradients")


@pytest.mark.mpi(ranks=(2, 3), timeout=240)
@pytest.mark.parametrize("shard", MODES)
def test_stop_then_resume_ends_bit_identical_to_an_uninterrupted_run(shard: str) -> None:
    options = {"epochs": EPOCHS, "batches_per_epoch": BATCHES_PER_EPOCH, "strategy": lambda: MPIADStrategy(shard=shard)}
    model, fit, code = fit_noisy(shared_tmpdir(), **options)
    assert code is None
    resumed = stop_then_resume(shared_tmpdir(), signal.SIGUSR1, 7, **options)
    assert_same_training_state(resumed, (model, fit))
    directory = resumed[1].default_root_dir
    shards = sorted(os.listdir(os.path.join(directory, "hpc_ckpt_1.ckpt.shards")))
    assert len(shards) == resumed[1].world_size and all(f"-of{resumed[1].world_size:05d}.pt" in n for n in shards)


def _epoch_checkpoints(directory: str) -> None:
    saving = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=1, monitor="step", mode="max")
    fit = trainer(
        strategy=MPIADStrategy(shard="gradients"), max_epochs=3, callbacks=[saving], enable_checkpointing=True
    )
    fit.fit(DeepNet(), loader(data(3, 1), BATCH))


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_a_damaged_or_missing_shard_is_refused_on_every_rank() -> None:
    directory = shared_tmpdir()
    _epoch_checkpoints(directory)
    COMM.Barrier()  # rank 0 removed the replaced checkpoints
    assert sorted(n for n in os.listdir(directory) if not n.startswith(".")) == ["epoch=2.ckpt", "epoch=2.ckpt.shards"]
    shards = os.path.join(directory, "epoch=2.ckpt.shards")
    names = sorted(os.listdir(shards))
    assert len(names) == 2, "the replaced checkpoints' shards were not removed"
    if RANK == 0:
        with open(os.path.join(shards, names[1]), "r+b") as handle:
            handle.seek(100)
            handle.write(b"\0\1\2\3")
    COMM.Barrier()
    resume = trainer(strategy=MPIADStrategy(shard="gradients"), max_epochs=4)
    with pytest.raises((CorruptCheckpointError, RuntimeError), match="corrupt|failed on rank"):
        resume.fit(DeepNet(), loader(data(3, 1), BATCH), ckpt_path=os.path.join(directory, "epoch=2.ckpt"))


def _job(mode: str, shard: str, ranks: int, directory: str) -> None:
    code, output, _ = run_mpi_job(SCRIPT, ranks, mode, shard, directory, timeout=400, OMP_NUM_THREADS="1")
    assert code == 0, f"{mode} at {ranks} ranks failed:\n{output[-6000:]}"


def _assert_same_state(got: dict, want: dict) -> None:
    assert sorted(got["state"]) == sorted(want["state"])
    for index, values in want["state"].items():
        for key, value in values.items():
            assert torch.equal(got["state"][index][key], value), f"{key} of parameter {index}"
    assert [g["lr"] for g in got["param_groups"]] == [g["lr"] for g in want["param_groups"]]


@OUTER_RUN_ONLY
@pytest.mark.parametrize(("saved_at", "loaded_at"), [(2, 3)])
def test_resume_on_another_number_of_ranks_has_the_consolidated_state(
    saved_at: int, loaded_at: int, tmp_path: Path
) -> None:
    """Saved with ``shard='gradients'`` at one number of ranks, loaded at another: sharded (``shard='optimizer'``,
    re-sharded) and unsharded, the restored state is the consolidated one, and both continue alike."""
    directory = str(tmp_path)
    _job("save", "gradients", saved_at, directory)
    consolidated = consolidate(os.path.join(directory, "saved.ckpt"))
    plain = consolidated["optimizer_states"][0]
    named = list(DeepNet().named_parameters())
    in_order = [p for n, p in named if n.endswith("weight")] + [p for n, p in named if n.endswith("bias")]
    assert KEY not in plain and len(plain["state"]) == len(in_order) - 4  # no state: unused and frozen layers
    for index, values in plain["state"].items():
        assert values["exp_avg"].shape == values["exp_avg_sq"].shape == in_order[index].shape
    assert consolidated["loops"]["fit_loop"]["state_dict"]["combined_loader"] == []  # the loader's position
    plain_path = os.path.join(directory, "plain.ckpt")
    consolidate(os.path.join(directory, "saved.ckpt"), plain_path)
    single = trainer(strategy="auto", devices=1, max_steps=consolidated["global_step"] + 1)
    single.fit(DeepNet(), loader(data(3, 1), BATCH), ckpt_path=plain_path)  # a plain Trainer takes it and trains on
    assert single.global_step == consolidated["global_step"] + 1
    _job("load", "optimizer", loaded_at, directory)
    loaded = torch.load(os.path.join(directory, "loaded-optimizer.pt"), weights_only=False)
    _assert_same_state(loaded["restored"], plain)
    _assert_same_state(loaded["restored_unsharded"], plain)
    torch.testing.assert_close(loaded["sharded_params"], loaded["unsharded_params"], rtol=0, atol=1e-6)


@OUTER_RUN_ONLY
def test_a_checkpoint_saved_mid_epoch_resumes_in_a_trainer_of_another_strategy(tmp_path: Path) -> None:
    """An unsharded mpi_ad checkpoint saved at step 6 of a 10-batch epoch: the training loader's position is kept
    under ``checkpoint["mpistrategy"]``, out of the fit loop's state, so a single-process Trainer with a plain
    DataLoader resumes it (it would refuse a loader state it has no loader for) and trains on."""
    directory = str(tmp_path)
    _job("save", "none", 2, directory)
    path = os.path.join(directory, "saved.ckpt")
    saved = torch.load(path, weights_only=False)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == []
    assert saved["mpistrategy"]["loader_positions"] == [
        {"epoch": 0, "batches": 6, "num_batches": 10, "num_replicas": 2}
    ]
    single = trainer(strategy="auto", devices=1, max_steps=saved["global_step"] + 2)
    single.fit(DeepNet(), loader(data(10, 1), BATCH), ckpt_path=path)
    assert single.global_step == saved["global_step"] + 2


def test_consolidate_refuses_to_write_over_its_checkpoint_and_names_a_missing_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "x.ckpt"
    torch.save({"optimizer_states": [{"state": {}, "param_groups": []}]}, path)
    (tmp_path / "x.ckpt.shards").mkdir()
    saved = path.read_bytes()
    monkeypatch.chdir(tmp_path)
    os.symlink(path, tmp_path / "link.ckpt")
    for out in (str(path), "./x.ckpt", "link.ckpt"):  # the file itself, spelled otherwise, through a link
        assert consolidate_main([str(path), out]) == 1
        assert capsys.readouterr().err == (
            f"mpistrategy-consolidate: the output {out} is the checkpoint {path} itself: writing it would replace the "
            f"sharded checkpoint and orphan its shard files ({path}.shards/). Give another output path.\n"
        )
    assert path.read_bytes() == saved and (tmp_path / "link.ckpt").is_symlink()

    assert consolidate_main([str(path), "plain.ckpt"]) == 0  # another file: written, sealed
    assert checkpoint_files.find_problem(str(tmp_path / "plain.ckpt")) is None
    capsys.readouterr()
    missing = str(tmp_path / "missing.ckpt")  # next to sound checkpoints, which have nothing to do with it
    assert consolidate_main([missing, "out.ckpt"]) == 1
    assert capsys.readouterr().err == f"mpistrategy-consolidate: Checkpoint file not found: {missing}\n"
    assert not (tmp_path / "out.ckpt").exists()


@pytest.mark.mpi(ranks=(2,), timeout=240)
def test_a_file_url_keeps_the_shards_beside_the_checkpoint_and_a_remote_one_is_refused() -> None:
    """``file:///...`` names the local path, as for the checkpoint file: the shards go beside it, not into a
    ``./file:`` folder under the working directory; shard files cannot go to a remote file system: every rank says
    so. A weights-only save over a sharded one leaves no shard folder behind."""
    directory = shared_tmpdir()
    fit = trainer(strategy=MPIADStrategy(shard="optimizer"), max_epochs=1)
    fit.fit(DeepNet(), loader(data(2, 1), BATCH))
    path = os.path.join(directory, "sub", "x.ckpt")
    fit.save_checkpoint("file://" + path)
    assert sorted(os.listdir(os.path.join(directory, "sub"))) == ["x.ckpt", "x.ckpt.shards"]
    assert len(os.listdir(path + ".shards")) == COMM.Get_size() and not os.path.exists("file:")
    runs = []
    for given in ("file://" + path, path):
        resumed = DeepNet()
        trainer(strategy=MPIADStrategy(shard="optimizer"), max_epochs=2).fit(
            resumed, loader(data(2, 1), BATCH), ckpt_path=given
        )
        runs.append(torch.cat([p.detach().reshape(-1) for p in resumed.parameters()]))
    assert torch.equal(runs[0], runs[1])
    with pytest.raises(ValueError, match=r"'s3://bucket/x.ckpt' is a remote URL"):
        fit.save_checkpoint("s3://bucket/x.ckpt")
    fit.save_checkpoint(path, weights_only=True)  # over the sharded save: its shard files go with it
    COMM.Barrier()
    assert sorted(os.listdir(os.path.join(directory, "sub"))) == ["x.ckpt"]
