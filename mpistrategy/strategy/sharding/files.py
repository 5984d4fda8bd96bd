"""Shard files: each rank's part of the sharded optimizer state, saved beside a checkpoint.

A checkpoint ``run/epoch=1.ckpt`` written with sharded optimizers has a folder ``run/epoch=1.ckpt.shards/`` with
one file per shard, ``<token>-part<m>-shard<r>-of<N>.pt`` (``m``: the model, Fabric can save several), written by
the rank holding shard ``r`` (under hierarchical sync: the ranks of the node of rank 0), atomically and sealed
with a SHA-256 as the checkpoint itself is (:mod:`~mpistrategy.strategy.checkpoint_files`). The checkpoint file
is written after every shard file, and names them by their ``token`` (new for every save): the checkpoint file's
atomic rename commits the save, and a shard file never belongs to another save of the same name (the previous
save's files are removed after the commit). Reading verifies each file before loading it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from mpistrategy.strategy import checkpoint_files

SUFFIX = ".shards"


def directory_of(checkpoint_path: str) -> str:
    """The folder of the shard files of the checkpoint at ``checkpoint_path`` (beside it, through links; a
    ``file://`` URL names a local path). Shard files are written by many ranks with local file operations: a remote
    URL raises a ``ValueError`` naming the alternatives (the same on every rank, which all save to one path)."""
    if checkpoint_files.is_remote(checkpoint_path):
        raise ValueError(
            f"shard= writes each rank's optimizer shard to files beside the checkpoint, on a file system every rank "
            f"mounts, but {checkpoint_path!r} is a remote URL; save sharded checkpoints to a shared path and copy "
            "the checkpoint with its .shards folder, or train without shard= for remote checkpoints."
        )
    return os.path.realpath(checkpoint_files.local_path(checkpoint_path)) + SUFFIX


def file_name(token: str, part: int, shard: int, shards: int) -> str:
    """The name of shard ``shard`` of ``shards`` of the save ``token`` (``part``: which model's optimizers)."""
    return f"{token}-part{part}-shard{shard:05d}-of{shards:05d}.pt"


def write(directory: str, name: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``directory/name`` atomically, sealed (see the module docstring)."""
    checkpoint_files.write_atomically(os.path.join(directory, name), lambda temporary: torch.save(payload, temporary))


def read(directory: str, name: str) -> dict[str, Any]:
    """The verified contents of ``directory/name``; raises
    :class:`~mpistrategy.strategy.checkpoint_files.CorruptCheckpointError` for a damaged or missing file."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise checkpoint_files.CorruptCheckpointError(
            f"Checkpoint shard {path} is missing: the checkpoint names it, so its shard folder is incomplete (copy "
            "the folder with the checkpoint, or resume from a checkpoint whose shards are all there)."
        )
    checkpoint_files.verify(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def remove_other_saves(directory: str, token: str) -> None:
    """Remove the files of earlier saves (other tokens) from ``directory``."""
    for path in Path(directory).glob("*-shard*-of*.pt"):
        if not path.name.startswith(f"{token}-"):
            path.unlink(missing_ok=True)


def remove(checkpoint_path: str) -> None:
    """Remove the shard folder of the checkpoint at ``checkpoint_path``, if it has one."""
    if not checkpoint_files.is_remote(checkpoint_path):
        shutil.rmtree(directory_of(checkpoint_path), ignore_errors=True)
