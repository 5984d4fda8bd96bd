"""Checkpoint state that differs between ranks: gathered to world rank 0, handed back to each rank when loading.

Error-feedback residuals and per-rank random generators differ between ranks, and a checkpoint is written by world
rank 0 alone. :func:`gather_rank_states` is a collective over the communicator the aggregator combines over (every
rank of it calls ``state_dict``, as the strategy does when it saves): the whole world for flat averaging, the node
leaders when a hierarchical sync mode compresses only the step between nodes. Its rank 0 is world rank 0 in both
cases, and it returns, keyed by world rank::

    {"scheme": "topk", "world_size": 4, "ranks": {0: {...}, 2: {...}}}

on that rank, and on every other rank the same with only its own entry (enough to restore it on that rank).
:func:`own_rank_state` picks a rank's entry back out of a loaded checkpoint, after checking that it was written
by the same scheme with the same number of ranks.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI


def gather_rank_states(
    scheme: str, local: dict[str, Any], comm: MPI.Intracomm, world_rank: int, world_size: int
) -> dict[str, Any]:
    """Collective over ``comm``: every member's ``local`` state, gathered to its rank 0 and keyed by world rank
    (see the module docstring)."""
    if comm.Get_size() == 1:
        everyone: list[tuple[int, dict[str, Any]]] | None = [(world_rank, local)]
    else:
        everyone = comm.gather((world_rank, local), root=0)  # None off rank 0
    ranks = dict(everyone) if everyone is not None else {world_rank: local}
    return {"scheme": scheme, "world_size": world_size, "ranks": ranks}


def own_rank_state(scheme: str, state: dict[str, Any], rank: int, size: int) -> dict[str, Any]:
    """The entry of world rank ``rank`` in ``state`` (from :func:`gather_rank_states`), for a run of ``size`` ranks.

    Raises ``ValueError`` when ``state`` is not such a state, belongs to another scheme, was written by a run with
    another number of ranks (per-rank residuals cannot be split or merged), or lacks this rank's entry.
    """
    if not isinstance(state, dict) or not {"scheme", "world_size", "ranks"} <= set(state):
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{scheme}: expected the state returned by state_dict() (keys 'scheme', 'world_size', 'ranks'), got {keys}."
        )
    if state["scheme"] != scheme:
        raise ValueError(
            f"{scheme}: the checkpoint holds the state of the {state['scheme']!r} aggregation scheme; resume with "
            f"that scheme, or drop the aggregator state (checkpoint['mpistrategy']) to start {scheme!r} afresh."
        )
    if state["world_size"] != size:
        raise ValueError(
            f"{scheme}: the checkpoint holds per-rank compression state (error feedback, generators) of "
            f"{state['world_size']} ranks, but this run has {size}; resume with {state['world_size']} ranks, or drop "
            "the aggregator state (checkpoint['mpistrategy']) to restart compression with empty memories."
        )
    ranks = state["ranks"]
    if rank not in ranks:
        raise ValueError(
            f"{scheme}: this state holds the entries of ranks {sorted(ranks)} but not of rank {rank}: load the "
            "state_dict() of world rank 0 (the one a checkpoint stores), which holds every rank's entry."
        )
    return ranks[rank]
