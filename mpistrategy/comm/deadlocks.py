"""Waits the stall watchdog proves endless without its timeout (:mod:`mpistrategy.comm.watchdog` gathers the facts
and raises the alarm; these functions only decide).

- **Crossed waits.** Two ranks that wait in collectives on different communicators, each a member of the other's,
  neither having entered the other's call (a rank that made an ``all_gather`` under ``if trainer.is_global_zero:``
  while the others wait in the gradient sync), wait for each other forever. Each rank that has waited a grace
  period in a call tells the others which call, with its collective counts per communicator; the counts are the
  proof (a peer that has entered this rank's call is only slow, and its wait is still on while this rank has not
  entered the peer's call, which needs it).
- **A wait for a rank that ended.** A rank that has ended its script makes no call any more: a rank waiting in a
  collective of a communicator with it among the members, both the wait and the knowledge of the end older than a
  grace period (a call the ended rank had posted completes within moments), waits forever.
"""

from __future__ import annotations

from typing import Any


def crossed_peer(
    rank: int, mine: dict[str, Any], own_counts: dict[str, int], peer_waits: dict[int, dict[str, Any]]
) -> int | None:
    """The lowest peer whose wait crosses this rank's, else ``None``.

    ``mine``: the call this rank waits in (``key``, ``members``, ``count``, as the watchdog's call state gives it);
    ``own_counts``: this rank's collective calls per communicator key; ``peer_waits``: by rank, the call each peer
    said it waits in (``call``) and its counts (``counts``)."""
    for peer, wait in sorted(peer_waits.items()):
        theirs = wait["call"]
        if (
            theirs["key"] != mine["key"]
            and peer in mine["members"]
            and rank in theirs["members"]
            and wait["counts"].get(mine["key"], 0) < mine["count"]
            and own_counts.get(theirs["key"], 0) < theirs["count"]
        ):
            return peer
    return None


def ended_members(members: tuple[int, ...], ended: dict[int, float], now: float, grace: float) -> list[int]:
    """The ranks among ``members`` known (``ended``: since when, by rank) for longer than ``grace`` seconds to have
    ended their script."""
    return sorted(peer for peer, since in ended.items() if peer in members and now - since > grace)
