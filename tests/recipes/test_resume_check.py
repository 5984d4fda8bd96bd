"""The main job resumes on its own only from a checkpoint this user owns and others may not write (loading one
unpickles it); an explicit ``ckpt_path`` is the user's choice and is taken as given (one process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mpistrategy.recipes.train import resume_checkpoint

AUTOMATIC = OmegaConf.create({"ckpt_path": None, "resume": True})


@pytest.fixture
def last(tmp_path: Path) -> Path:
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    checkpoint.parent.mkdir()
    checkpoint.write_bytes(b"PK\x05\x06" + bytes(18))
    checkpoint.chmod(0o664)
    return checkpoint


def test_a_checkpoint_of_this_user_is_resumed_from(tmp_path: Path, last: Path) -> None:
    assert resume_checkpoint(AUTOMATIC, tmp_path) == str(last)  # a group that may write is the user's own (umask 002)


def test_a_checkpoint_others_may_write_is_refused_with_the_fix(tmp_path: Path, last: Path) -> None:
    last.chmod(0o666)
    with pytest.raises(PermissionError, match=r"Refusing to resume automatically from .*last.ckpt: others may write"):
        resume_checkpoint(AUTOMATIC, tmp_path)
    explicit = OmegaConf.create({"ckpt_path": str(last), "resume": True})
    assert resume_checkpoint(explicit, tmp_path) == str(last)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_checkpoint_of_another_user_is_refused(tmp_path: Path, last: Path) -> None:
    os.chown(last, 65534, 65534)
    with pytest.raises(PermissionError, match=r"owned by uid 65534, not by this user.*ckpt_path=.*resume=false"):
        resume_checkpoint(AUTOMATIC, tmp_path)
