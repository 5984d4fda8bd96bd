"""Checkpoints of sharded optimizers: each rank saves its shard, loading re-shards, ``consolidate`` makes them plain.

In the checkpoint file, a sharded optimizer's entry (``optimizer_states[i]`` for the Trainer, the optimizer's key
for Fabric) is a *manifest* instead of ``optimizer.state_dict()``: the groups' hyperparameters with the indices of
their parameters (as ``state_dict()`` gives them), the parameters' shapes, and under :data:`KEY` the save's token,
the number of shards, the shard files' names and which elements of which parameters each file holds. The state
itself is in the shard files (:mod:`~mpistrategy.strategy.sharding.files`), one per shard, each holding the
state of every piece of its shard (:mod:`~mpistrategy.strategy.sharding.state`).

Loading gives each piece of the loading run its state, whatever the number of shards either run has: each rank
reads only the files that hold elements of its pieces. A plain ``state_dict()`` (an unsharded checkpoint) loads
the same way into a sharded run; a manifest loads into an unsharded ``mpi_ad`` run through :func:`consolidate_manifest`.
:func:`consolidate` turns a sharded checkpoint into a plain one (for inference, or any other strategy).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import torch
from mpi4py import MPI

from mpistrategy.strategy import checkpoints, failures
from mpistrategy.strategy.checkpoint_files import CorruptCheckpointError, verify, write_atomically
from mpistrategy.strategy.sharding import files
from mpistrategy.strategy.sharding.group import ShardGroup
from mpistrategy.strategy.sharding.optimizer import ShardedOptimizer, unwrapped
from mpistrategy.strategy.sharding.state import SavedPiece, assemble, whole_states

#: the key of a manifest (and its value in a placeholder before the shards are written)
KEY = "mpistrategy_sharded"
FORMAT = 1

#: one shard's pieces of one optimizer: (parameter index, start, stop) each
PieceList = list[tuple[int, int, int]]


def is_manifest(state: Any) -> bool:
    """Whether an optimizer's entry in a checkpoint is a sharded optimizer's manifest."""
    return isinstance(state, dict) and isinstance(state.get(KEY), dict)


def placeholder() -> dict[str, Any]:
    """What stands for a sharded optimizer's state until its shards are written (:func:`save`)."""
    return {KEY: None}


# ---------------------------------------------------------------------------------------------------- saving


def new_token(control: MPI.Intracomm) -> str:
    """Collective: the same new token on every rank, naming one save's shard files."""
    return control.bcast(secrets.token_hex(8) if control.Get_rank() == 0 else None, root=0)


def save(
    path: str,
    optimizers: Sequence[ShardedOptimizer],
    group: ShardGroup,
    control: MPI.Intracomm,
    token: str,
    part: int = 0,
) -> list[Any]:
    """Collective: the ranks of the copy of the state that rank 0 holds write their shard files of save ``token``
    beside ``path`` (``part``: which model's); returns the optimizers' manifests (complete on rank 0, ``None``
    elsewhere). A failed write raises on every rank."""
    directory = files.directory_of(path)
    error: Exception | None = None
    pieces: list[PieceList] | None = None
    if group.writes_checkpoint:
        records = [_shard_record(sharded) for sharded in optimizers]
        pieces = [record["pieces"] for record in records]
        payload = {"format": FORMAT, "token": token, "shard": group.rank, "shards": group.size, "optimizers": records}
        try:
            files.write(directory, files.file_name(token, part, group.rank, group.size), payload)
        except Exception as problem:  # noqa: BLE001 - every rank must learn of it before anyone raises
            error = problem
    failures.raise_together(error, control, "writing the optimizer shards")
    tables = control.gather((group.rank, pieces) if group.writes_checkpoint else None, root=0)
    if tables is None:
        return [None] * len(optimizers)
    by_shard = dict(entry for entry in tables if entry is not None)
    return [
        _manifest(sharded, number, token, part, group.size, [by_shard[shard][number] for shard in range(group.size)])
        for number, sharded in enumerate(optimizers)
    ]


def _shard_record(sharded: ShardedOptimizer) -> dict[str, Any]:
    entries = sharded.shard_state()
    return {"pieces": [(index, start, stop) for index, start, stop, _ in entries], "state": [s for *_, s in entries]}


def _manifest(
    sharded: ShardedOptimizer, number: int, token: str, part: int, shards: int, pieces: list[PieceList]
) -> dict[str, Any]:
    names = [files.file_name(token, part, shard, shards) for shard in range(shards)]
    layout = {"format": FORMAT, "token": token, "optimizer": number, "shards": shards, "files": names, "pieces": pieces}
    return {KEY: layout, "param_groups": sharded.param_groups(), "shapes": [list(shape) for shape in sharded.shapes]}


def committed(path: str, token: str | None) -> None:
    """After the checkpoint file at ``path`` is written: remove the shard files of earlier saves of that name (all of
    them for a save without sharded state, ``token`` ``None``: a weights-only save, an unsharded run's)."""
    if token is None:
        files.remove(path)
    else:
        files.remove_other_saves(files.directory_of(path), token)


# ---------------------------------------------------------------------------------------------------- loading


class ShardReader:
    """Reads a checkpoint's shard files on demand, each once (verified), for the manifests of that checkpoint."""

    def __init__(self, checkpoint_path: str) -> None:
        self.directory = files.directory_of(checkpoint_path)
        self._loaded: dict[str, dict[str, Any]] = {}

    def load(self, name: str) -> dict[str, Any]:
        if name not in self._loaded:
            self._loaded[name] = files.read(self.directory, name)
        return self._loaded[name]

    def saved_pieces(self, manifest: dict[str, Any], wanted: set[int] | None) -> dict[int, list[SavedPiece]]:
        """The saved pieces of the manifest's optimizer of the parameters in ``wanted`` (``None``: all), from the
        files that hold some."""
        layout = manifest[KEY]
        optimizer = layout["optimizer"]
        found: dict[int, list[SavedPiece]] = {}
        for name, listed in zip(layout["files"], layout["pieces"], strict=True):
            if wanted is not None and not any(index in wanted for index, _, _ in listed):
                continue
            record = self.load(name)
            if record.get("token") != layout["token"]:
                raise CorruptCheckpointError(
                    f"Checkpoint shard {os.path.join(self.directory, name)} belongs to another save than its "
                    "checkpoint file; resume from a checkpoint whose shard folder was written with it."
                )
            saved = record["optimizers"][optimizer]
            for (index, start, stop), state in zip(saved["pieces"], saved["state"], strict=True):
                if wanted is None or index in wanted:
                    found.setdefault(index, []).append(SavedPiece(start, stop, state))
        return found


def load(sharded: ShardedOptimizer, entry: dict[str, Any], reader: ShardReader | None, control: MPI.Intracomm) -> None:
    """Collective: load a checkpoint's ``entry`` for this optimizer (a manifest read through ``reader``, or a plain
    ``state_dict()``) into ``sharded``'s pieces; a failure on any rank raises on every rank."""
    error: Exception | None = None
    try:
        if is_manifest(entry):
            assert reader is not None, "a manifest is read from its checkpoint's shard files"
            _check_shapes(entry["shapes"], sharded.shapes)
            wanted = {sharded.origin(tensor)[0] for tensor in sharded.pieces}
            saved = reader.saved_pieces(entry, wanted)
            sharded.load(entry["param_groups"], lambda i, a, b: assemble(saved.get(i, []), a, b, f"parameter {i}"))
        else:
            sharded.load_plain(entry)
    except (CorruptCheckpointError, ValueError, KeyError, RuntimeError) as problem:
        error = problem
    failures.raise_together(error, control, "loading the optimizer shards")


def _check_shapes(saved: Sequence[Sequence[int]], current: Sequence[tuple[int, ...]]) -> None:
    if [tuple(shape) for shape in saved] != list(current):
        raise ValueError(
            f"the checkpoint's optimizer steps {len(saved)} parameters of shapes {[list(s) for s in saved][:8]}..., "
            f"this one {len(current)} of shapes {[list(s) for s in current][:8]}...: the model or the optimizer's "
            "parameter groups differ from the run that saved it."
        )


def restore(
    optimizers: Sequence[Any],
    entries: Sequence[Any],
    path: str | None,
    sharded_of: Callable[[Any], ShardedOptimizer | None],
    control: MPI.Intracomm,
) -> list[Any]:
    """Collective: load the checkpoint ``entries`` (read from ``path``) of the ``optimizers`` that are sharded
    (``sharded_of``); returns what the others load with ``load_state_dict`` (``None`` for the sharded ones): their
    entries, a manifest consolidated (every rank reads all its shard files)."""
    reader = ShardReader(path) if path is not None and any(is_manifest(e) for e in entries) else None
    left: list[Any] = []
    for optimizer, entry in zip(optimizers, entries, strict=False):
        sharded = sharded_of(optimizer)
        if sharded is not None:
            load(sharded, entry, reader, control)
            left.append(None)
        elif is_manifest(entry):
            left.append(_consolidated_everywhere(entry, reader, control))
        else:
            left.append(entry)
    return left


def _consolidated_everywhere(manifest: dict[str, Any], reader: ShardReader | None, control: MPI.Intracomm) -> Any:
    plain, error = None, None
    try:
        if reader is None:
            raise CorruptCheckpointError("a sharded optimizer's state was given without its checkpoint's path")
        plain = consolidate_manifest(manifest, reader)
    except (CorruptCheckpointError, ValueError, KeyError) as problem:
        error = problem
    failures.raise_together(error, control, "reading the optimizer shards")
    return plain


def consolidate_manifest(manifest: dict[str, Any], reader: ShardReader) -> dict[str, Any]:
    """The plain ``state_dict()`` of an unsharded optimizer over the same parameters (reads every shard file)."""
    saved = reader.saved_pieces(manifest, None)
    return {"state": whole_states(saved, manifest["shapes"]), "param_groups": manifest["param_groups"]}


def consolidated_state(sharded: ShardedOptimizer, comm: MPI.Intracomm, root: int = 0) -> dict[str, Any] | None:
    """Collective over the shard group ``comm``: the plain ``state_dict()`` of the unsharded optimizer, on its
    rank ``root`` (``None`` elsewhere), gathered from every shard in memory."""
    entries = comm.gather(sharded.shard_state(), root=root)
    if entries is None:
        return None
    saved: dict[int, list[SavedPiece]] = {}
    for shard in entries:
        for index, start, stop, state in shard:
            saved.setdefault(index, []).append(SavedPiece(start, stop, state))
    return {"state": whole_states(saved, sharded.shapes), "param_groups": sharded.param_groups()}


def consolidated_on(
    optimizer: Any, sharded: ShardedOptimizer | None, to: int, control: MPI.Intracomm
) -> dict[str, Any] | None:
    """``optimizer``'s whole ``state_dict()`` on the rank ``to`` of ``control`` (``None`` on the others). Sharded
    (``sharded``), it is gathered from the shard group that holds rank ``to``: only that group's ranks
    communicate (every shard group holds one copy of the state). Unsharded, rank ``to``'s own state."""
    if sharded is None:
        return unwrapped(optimizer).state_dict() if control.Get_rank() == to else None
    world_group, shard_group = control.Get_group(), sharded.comm.Get_group()
    try:
        (root,) = MPI.Group.Translate_ranks(world_group, [to], shard_group)
    finally:
        world_group.Free()
        shard_group.Free()
    if root == MPI.UNDEFINED:
        return None
    return consolidated_state(sharded, sharded.comm, root)


def consolidate(path: str, out: str | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` with every sharded optimizer's manifest replaced by its consolidated, plain
    ``state_dict()`` (one process, no MPI; a damaged file raises :class:`CorruptCheckpointError`): loadable by any
    strategy, or for inference. Written to ``out`` (atomically, sealed) when given. Trainer checkpoints keep their
    ``optimizer_states`` list; in Fabric checkpoints every top-level entry that is a manifest is consolidated.
    The training loader's position in its epoch is set aside where only mpi_ad reads it (another strategy's
    Trainer restarts that epoch's data, as it does with any loader it cannot resume). ``out`` must be another file
    than ``path`` (``ValueError``: writing over the sharded checkpoint would orphan its shard files); a missing
    ``path`` raises ``FileNotFoundError``."""
    verify(path)
    if out is not None and _same_file(path, out):
        raise ValueError(
            f"the output {out} is the checkpoint {path} itself: writing it would replace the sharded checkpoint and "
            f"orphan its shard files ({path}.shards/). Give another output path."
        )
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    reader = ShardReader(path)
    entries = checkpoint.get("optimizer_states")
    if isinstance(entries, list):
        checkpoint["optimizer_states"] = [_plain(entry, reader) for entry in entries]
    consolidate_entries(checkpoint, path, reader)
    checkpoints.set_aside_loader_positions(checkpoint)
    if out is not None:
        write_atomically(out, lambda temporary: torch.save(checkpoint, temporary))
    return checkpoint


def _same_file(path: str, other: str) -> bool:
    """Whether ``other`` names the file at ``path``: another spelling of it, or a link to it."""
    if os.path.realpath(other) == os.path.realpath(path):
        return True
    return os.path.exists(other) and os.path.samefile(path, other)


def consolidate_entries(entries: dict[str, Any], path: str, reader: ShardReader | None = None) -> None:
    """Replace every value of ``entries`` (top-level entries of the checkpoint at ``path``, a Fabric checkpoint's)
    that is a manifest by its consolidated, plain ``state_dict()``, read from the shard files (by ``reader``)."""
    if any(is_manifest(value) for value in entries.values()):
        reader = reader or ShardReader(path)
        for key, value in list(entries.items()):
            entries[key] = _plain(value, reader)


def _plain(entry: Any, reader: ShardReader) -> Any:
    if not is_manifest(entry):
        return entry
    return consolidate_manifest(entry, reader)
