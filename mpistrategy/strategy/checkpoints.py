"""mpi_ad's checkpoints across ranks: what the strategy adds to Lightning's checkpoint, how rank 0 writes it and
how every rank reads it.

Added under ``checkpoint["mpistrategy"]``: the data-parallel engine's state (sync mode, aggregator, replicas) and,
in a training checkpoint (one with loop state, not weights only), ``world_size`` and ``random_state``: every rank's
random state (:mod:`~mpistrategy.strategy.random_state`), gathered to rank 0, a list indexed by rank. The training
loaders' positions in their epoch (:class:`~mpistrategy.strategy.resumable.ResumableLoader`'s state, which Lightning
saves in the fit loop's state) are moved there too, as ``loader_positions``, and back when the file is read: a
Trainer of another strategy, whose DataLoader has no state to take them, loads the checkpoint (and restarts the
interrupted epoch's data) instead of refusing it for more loader states than loaders.

Writing: rank 0, atomically and sealed with a SHA-256 (:mod:`~mpistrategy.strategy.checkpoint_files`) for local
paths; a remote path (an fsspec URL) or an asynchronous checkpoint IO gets the checkpoint as it is.
:func:`write_on_rank_zero` (Fabric's ``save``) also tells every rank whether the write succeeded.

Reading: one allgather exchanges every rank's path and whether it sees the file there (a rank given no path, which
Lightning does not ask to read, makes the same exchange at setup: :func:`check_none_read`). Paths that differ between
ranks (local ones compared by ``os.path.abspath``, remote ones as given) raise a ``ValueError`` naming each rank's
path; a file that no rank sees raises ``FileNotFoundError``. When every rank sees it, every rank verifies and loads
the file it sees, and the ranks agree on the outcome (a second allgather): a corrupt or unreadable file, or a load
that fails on some rank only, raises on every rank. When only some ranks see it, the lowest of them verifies and
loads it and broadcasts the checkpoint (or its failure). Every one of these errors is raised on every rank and
marked so, so that the strategy does not abort and no rank waits.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from mpistrategy.strategy import checkpoint_files, failures, random_state
from mpistrategy.strategy.checkpoint_files import CorruptCheckpointError
from mpistrategy.strategy.resumable import ResumableLoader

log = logging.getLogger(__name__)

KEY = "mpistrategy"
#: where the training loaders' positions are kept in ``checkpoint[KEY]``
LOADER_POSITIONS = "loader_positions"
#: what a rank given no checkpoint path shows in the comparison of the ranks' paths
NO_PATH = "no ckpt_path"
#: how to save right, for the report of a save that some ranks made and others went on without
SAVE_ON_EVERY_RANK = (
    "every rank adds its part (its random state, its optimizer shard) and learns that rank 0 wrote the file. Call "
    "it on every rank, not under `if trainer.is_global_zero:` (rank 0 alone writes the file by itself)."
)
FABRIC_SAVE_ON_EVERY_RANK = (
    "every rank writes its optimizer shard (when sharded) and learns that rank 0 wrote the file. Call it on every "
    "rank, not under `if fabric.is_global_zero:` (rank 0 alone writes the file by itself)."
)

Checkpoint = dict[str, Any]
#: how reading failed on a rank: ("corrupt", what is wrong) or ("error", "ExceptionType: message")
Failure = tuple[str, str]


def add_state(checkpoint: Checkpoint, engine_state: dict[str, Any], comm: MPI.Intracomm) -> None:
    """Collective: put the strategy's state into ``checkpoint`` (complete on rank 0, the writer)."""
    added: dict[str, Any] = dict(engine_state)
    if "loops" in checkpoint:
        added["world_size"] = comm.Get_size()
        added["random_state"] = random_state.gather(random_state.capture(), comm)
    if added:
        checkpoint[KEY] = added
    set_aside_loader_positions(checkpoint)


def set_aside_loader_positions(checkpoint: Checkpoint) -> None:
    """Move the training loaders' positions from the fit loop's state to ``checkpoint[KEY]`` (see the module doc);
    loader states that are not all :class:`~mpistrategy.strategy.resumable.ResumableLoader`'s stay where they are."""
    fit_loop = _fit_loop_state(checkpoint)
    states = fit_loop.get("combined_loader")
    if isinstance(states, list) and states and all(_is_loader_position(state) for state in states):
        checkpoint.setdefault(KEY, {})[LOADER_POSITIONS] = states
        fit_loop["combined_loader"] = []


def _restore_loader_positions(checkpoint: Checkpoint) -> None:
    """Put the positions :func:`set_aside_loader_positions` moved back where Lightning's fit loop reads them."""
    positions = checkpoint.get(KEY, {}).pop(LOADER_POSITIONS, None)
    fit_loop = _fit_loop_state(checkpoint)
    if positions and "combined_loader" in fit_loop:
        fit_loop["combined_loader"] = positions


def _fit_loop_state(checkpoint: Checkpoint) -> dict[str, Any]:
    """The fit loop's own state in ``checkpoint`` (an empty dict, not part of it, if it has none)."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})


def _is_loader_position(state: object) -> bool:
    return isinstance(state, dict) and set(state) == set(ResumableLoader.STATE_KEYS)


def write(checkpoint: Checkpoint, filepath: Any, save: Callable[[Checkpoint, Any], None], asynchronous: bool) -> None:
    """Rank 0: ``save(checkpoint, path)`` (the checkpoint IO) to a temporary file, sealed and renamed to
    ``filepath``; straight to ``filepath`` when it is remote or ``asynchronous``."""
    path = os.fspath(filepath)
    if checkpoint_files.is_remote(path) or asynchronous:
        save(checkpoint, filepath)
        return
    checkpoint_files.write_atomically(checkpoint_files.local_path(path), lambda temporary: save(checkpoint, temporary))


def write_on_rank_zero(
    checkpoint: Checkpoint, filepath: Any, save: Callable[[Checkpoint, Any], None], comm: MPI.Intracomm
) -> None:
    """Collective: rank 0 writes ``checkpoint`` as :func:`write` does, and every rank learns the outcome: a failed
    write raises on every rank (the writer's own exception on rank 0, a ``RuntimeError`` naming it elsewhere)."""
    error: Exception | None = None
    if comm.Get_rank() == 0:
        try:
            write(checkpoint, filepath, save, asynchronous=False)
        except Exception as problem:  # noqa: BLE001 - every rank must learn of it before anyone raises
            error = problem
    failure = None if error is None else f"{type(error).__name__}: {error}"
    if comm.Get_size() > 1:
        failure = comm.bcast(failure, root=0)
    if failure is None:
        return
    if error is not None:
        raise failures.mark_raised_on_every_rank(error)
    raise failures.mark_raised_on_every_rank(
        RuntimeError(f"rank 0 could not write the checkpoint {filepath}: {failure}")
    )


def read(checkpoint_path: Any, load: Callable[[Any], Checkpoint], comm: MPI.Intracomm) -> Checkpoint:
    """Collective: the checkpoint, verified and loaded on every rank (see the module doc)."""
    path = os.fspath(checkpoint_path)
    visible = checkpoint_files.is_remote(path) or os.path.exists(checkpoint_files.local_path(path))
    views = [(_identity(path), visible)] if comm.Get_size() == 1 else comm.allgather((_identity(path), visible))
    _raise_if_paths_differ([identity for identity, _ in views])
    seeing = [rank for rank, (_, sees) in enumerate(views) if sees]
    if not seeing:
        where = "" if len(views) == 1 else f" (none of the {len(views)} ranks sees it)"
        raise failures.mark_raised_on_every_rank(FileNotFoundError(f"Checkpoint file not found: {path}{where}"))
    error: Exception | None = None
    if len(seeing) == len(views):
        checkpoint, failure, error = _verify_and_load(path, load)
        failures_by_rank = [failure] if len(views) == 1 else comm.allgather(failure)
    else:
        root = seeing[0]
        checkpoint, failure, error = _verify_and_load(path, load) if comm.Get_rank() == root else (None, None, None)
        checkpoint, failure = comm.bcast((checkpoint, failure), root=root)
        failures_by_rank = [failure if rank == root else None for rank in range(len(views))]
    _raise_if_any_failed(path, failures_by_rank, error, comm, every_rank_checked=len(seeing) == len(views))
    assert checkpoint is not None
    _restore_loader_positions(checkpoint)
    return checkpoint


def check_none_read(comm: MPI.Intracomm, read: bool) -> None:
    """At the setup of a run: collective on the ranks that ``read`` no checkpoint in it, :func:`read`'s first
    exchange with no path, so that ranks given a ``ckpt_path`` (whose exchange this one meets) and this one raise
    together."""
    if not read and comm.Get_size() > 1:
        _raise_if_paths_differ([identity for identity, _ in comm.allgather((NO_PATH, False))])


def _raise_if_paths_differ(identities: list[str]) -> None:
    """Raise on every rank (each rank has every path) if the ranks were given different checkpoints."""
    if len(set(identities)) == 1:
        return
    ranks_by_path: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        ranks_by_path.setdefault(identity, []).append(rank)
    given = "; ".join(f"rank(s) {ranks}: {identity}" for identity, ranks in ranks_by_path.items())
    raise failures.mark_raised_on_every_rank(
        ValueError(
            f"The ranks were given different checkpoint paths ({given}): each would load its own file and the "
            "replicas would differ. Pass the same ckpt_path on every rank."
        )
    )


def _verify_and_load(
    path: str, load: Callable[[Any], Checkpoint]
) -> tuple[Checkpoint | None, Failure | None, Exception | None]:
    if not checkpoint_files.is_remote(path):
        if os.path.isdir(checkpoint_files.local_path(path)):  # not a damaged file: what open() raises, as under DDP
            error = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            return None, ("error", f"IsADirectoryError: {error}"), error
        problem = checkpoint_files.find_problem(checkpoint_files.local_path(path))
        if problem is not None:
            return None, ("corrupt", problem), None
    try:
        return load(path), None, None
    except Exception as error:  # noqa: BLE001 - every rank must learn of it before anyone raises
        problem = None if checkpoint_files.is_remote(path) else checkpoint_files.unrecognised(path)
        if problem is not None:
            return None, ("corrupt", problem), None
        return None, ("error", f"{type(error).__name__}: {error}"), error


def _raise_if_any_failed(
    path: str,
    failures_by_rank: list[Failure | None],
    mine: Exception | None,
    comm: MPI.Intracomm,
    every_rank_checked: bool,
) -> None:
    """Raise on every rank if reading failed on any: a corrupt file as :class:`CorruptCheckpointError` (naming an
    older sound checkpoint, and the ranks that found it when every rank checked its own file and some passed), a
    failed load as the loader's own exception where it happened, else as a ``RuntimeError`` naming the rank."""
    failing = [rank for rank, failure in enumerate(failures_by_rank) if failure is not None]
    if not failing:
        return
    first = failing[0]
    kind, detail = failures_by_rank[first]  # type: ignore[misc]
    if kind == "corrupt":
        message = checkpoint_files.corrupt_message(path, detail, _older_sound_checkpoint(path, first, comm))
        if every_rank_checked and len(failing) < len(failures_by_rank):
            message += (
                f" (found on rank(s) {failing}; the other ranks' file passes: the ranks do not see the same file)"
            )
        raise failures.mark_raised_on_every_rank(CorruptCheckpointError(message))
    if mine is not None:
        raise failures.mark_raised_on_every_rank(mine)
    raise failures.mark_raised_on_every_rank(
        RuntimeError(f"rank {first} could not load the checkpoint {path}: {detail}")
    )


def _older_sound_checkpoint(path: str, finder: int, comm: MPI.Intracomm) -> str | None:
    """Collective: rank ``finder`` looks for an older sound checkpoint next to ``path``; every rank gets its answer."""
    found = None
    if comm.Get_rank() == finder:
        found = checkpoint_files.older_sound_checkpoint(checkpoint_files.local_path(path))
    return found if comm.Get_size() == 1 else comm.bcast(found, root=finder)


def random_state_of(checkpoint: Checkpoint, rank: int, world_size: int) -> random_state.RandomState | None:
    """This rank's random state in ``checkpoint``; ``None`` if there is none or it was saved by another number of
    ranks (then rank 0 warns)."""
    states = checkpoint.get(KEY, {}).get("random_state")
    if states is None:
        return None
    if len(states) == world_size:
        return states[rank]
    if rank == 0:
        log.warning(
            "mpi_ad: the checkpoint holds the random states of %d ranks and this run has %d: they are not restored "
            "(dropout and other random draws continue from this run's seed instead).",
            len(states),
            world_size,
        )
    return None


def saved_at_epoch_end(checkpoint: Checkpoint) -> bool:
    """Whether ``checkpoint`` was saved after the last batch of its epoch (Lightning's loop state says so), before
    the next epoch's training dataloader was iterated."""
    loops = checkpoint.get("loops", {}).get("fit_loop", {})
    return bool(loops.get("epoch_loop.batch_progress", {}).get("is_last_batch", False))


def _identity(path: str) -> str:
    """What the ranks compare: a local path made absolute (each rank's own working folder), a remote one as given."""
    return path if checkpoint_files.is_remote(path) else os.path.abspath(checkpoint_files.local_path(path))
