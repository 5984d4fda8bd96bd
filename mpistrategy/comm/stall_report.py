"""The stall watchdog's report: what every rank prints when a stall, uneven training data or a call made on some
ranks only is found (:mod:`mpistrategy.comm.watchdog` finds them and gathers the ranks' states)."""

from __future__ import annotations

from typing import Any

from mpistrategy.comm import calls
from mpistrategy.comm.errors import by_rank

#: the exit code of a rank ended by the watchdog (EX_PROTOCOL of sysexits.h is 76; 86 is mpistrategy's own)
STALL_EXIT_CODE = 86


def counted(counts: dict[str, int], started: int = 0) -> str:
    """A rank's batches of a pass as the uneven-data report gives them."""
    parts = []
    if "ended" in counts:
        parts.append(f"its data ended after {counts['ended']}")
    if "planned" in counts:
        parts.append(f"{counts['planned']} planned")
    if started and started > min(counts.values(), default=0):
        parts.append(f"started batch {started}")
    return ", ".join(parts) or f"started batch {started}"


def _ago(state: dict[str, Any], call: dict[str, Any]) -> float:
    return state["time"] - call["started"]


def format_report(
    trigger: dict[str, Any],
    states: dict[int, dict[str, Any]],
    size: int,
    rank: int,
    timeout: float,
    action: str,
    record: str = "",
) -> str:
    """The stall report as rank ``rank`` prints it: which ranks have not arrived, every rank's last collective, and
    this rank's stack; then ``record``, the line that says where its flight record is."""
    call = trigger["call"]
    if call is not None:
        waited_in = f"{call['call']} (call #{call['count']} on its communicator) at {call['site']}"
        members = [int(r) for r in call["members"]]
        missing = [
            other
            for other in members
            if other in states and states[other]["counts"].get(call["key"], 0) < call["count"]
        ]
    else:
        last = trigger["last"]
        after = "" if last is None else f"; its last collective: {last['call']} #{last['count']} at {last['site']}"
        waited_in, members, missing = f"{trigger['where']}{after}", list(range(size)), []
    silent = [other for other in range(size) if other not in states]
    uneven = trigger.get("uneven")
    if uneven is not None:
        lines = [
            f"[mpistrategy] uneven training data (found on rank {trigger['rank']}, reported on rank {rank}): "
            + uneven_batches(uneven["epoch"], uneven["counts"])
        ]
    elif trigger.get("skipped") is not None:
        lines = [_skipped_call(trigger["skipped"], trigger["rank"], rank)]
    elif trigger.get("crossed") is not None:
        lines = [_crossed_wait(trigger, rank)]
    elif trigger.get("waiting_for_ended") is not None:
        lines = [_waiting_for_ended(trigger, rank, waited_in)]
    else:
        lines = [
            f"[mpistrategy] stall (reported on rank {rank}): rank {trigger['rank']} has waited "
            f"{trigger['waited']:.1f} s in {waited_in} (MPISTRATEGY_STALL_TIMEOUT={timeout:g} s)."
        ]
    lines += _unequal_entries(states)
    uneven_passes = calls.explain_phases({other: state.get("phase") for other, state in states.items()})
    if uneven_passes is not None:
        lines.append(f"  {uneven_passes}")
    if missing:
        lines.append(f"  not arrived: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    if silent:
        lines.append(
            f"  did not answer: rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} (gone, or "
            "holding the GIL in a C call: its watchdog thread cannot run)"
        )
    for other in range(size):
        state = states.get(other)
        if state is None:
            lines.append(f"  rank {other}: did not answer")
            continue
        where = f"{state['host']}, pid {state['pid']}"
        current, last = state["current"], state["last"]
        if state.get("ended") is not None:
            text = f"ended its script {state['time'] - state['ended']:.1f} s ago, waiting at exit for the others"
            if last is not None:
                text += f"; its last collective: {last['call']} #{last['count']} at {last['site']}"
        elif state["inside"] and current is not None:
            text = f"waiting {_ago(state, current):.1f} s in {current['call']} #{current['count']} at {current['site']}"
        elif state["inside"]:
            text = f"waiting in {state['where']}"
            if last is not None:
                text += f"; its last collective: {last['call']} #{last['count']} at {last['site']}"
                text += f", entered {_ago(state, last):.1f} s ago"
        elif last is not None:
            text = (
                f"not in a collective, now at {state['now']}; last entered {last['call']} #{last['count']} at "
                f"{last['site']} {_ago(state, last):.1f} s ago"
            )
        else:
            text = f"not in a collective, now at {state['now']}; has entered none yet"
        lines.append(f"  rank {other} ({where}): {text}")
    own = states.get(rank)
    if own is not None:
        for name, stack in own["stacks"].items():
            lines.append(f"[mpistrategy] rank {rank}'s stack ({name}), innermost last:")
            lines.append(stack.rstrip("\n"))
    if record:
        lines.append(record.rstrip("\n"))
    if action == "abort":
        lines.append(
            f"[mpistrategy] rank {rank} ends with exit code {STALL_EXIT_CODE} (stall watchdog; "
            "MPISTRATEGY_STALL_ACTION=warn only reports)."
        )
    return "\n".join(lines) + "\n"


def _position(at: Any) -> str:
    if at is None:
        return ""
    (fit, epoch), batch = at
    return f", in epoch {epoch} at batch_idx {batch - 1}" + (f" (fit #{fit + 1})" if fit else "")


def _skipped_call(skipped: dict[str, Any], found_on: int, rank: int) -> str:
    """The first line of the report of a call that some ranks made and others went on without."""
    went_on = skipped["went_on"]
    if went_on["ended"]:
        instead = "ended its script"
    elif went_on["waiting"] is not None:
        waited, call, where = went_on["waiting"]
        inside = where if call is None else f"{call['call']} #{call['count']} at {call['site']}"
        instead = f"has waited {waited:.1f} s in {inside}"
    else:
        (_, epoch), batch = went_on["at"]
        instead = f"went on to batch_idx {batch - 1} of epoch {epoch}"
    return (
        f"[mpistrategy] {skipped['name']} called on some ranks only (found on rank {found_on}, reported on rank "
        f"{rank}): rank {skipped['rank']} called it (its call #{skipped['count']}) at {skipped['site']}"
        f"{_position(skipped['at'])}; rank {went_on['rank']} {instead} without it ({skipped['entered']} such calls "
        "there). "
        f"{skipped['name']} is collective: {skipped['advice']}"
    )


def _on(call: dict[str, Any], other: dict[str, Any]) -> str:
    members = ", ".join(map(str, call["members"]))
    same = "another " if call["members"] == other["members"] else "a "
    return f"{call['call']} #{call['count']} at {call['site']} (on {same}communicator of world ranks {members})"


def _crossed_wait(trigger: dict[str, Any], rank: int) -> str:
    """The first line of the report of two ranks waiting in collectives on different communicators, each in the
    other's."""
    mine, theirs, peer = trigger["call"], trigger["crossed"]["call"], trigger["crossed"]["rank"]
    first, second = sorted([(trigger["rank"], mine, theirs), (peer, theirs, mine)], key=lambda item: item[0])
    return (
        f"[mpistrategy] ranks wait for each other in different collectives (found on rank {trigger['rank']}, "
        f"reported on rank {rank}): rank {first[0]} waits in {_on(first[1], first[2])}, which rank {second[0]} has "
        f"not entered; rank {second[0]} waits in {_on(second[1], first[1])}, which rank {first[0]} has not entered. "
        "Neither call can complete: every rank must make the same collective calls in the same order (a call made "
        "under a rank condition, such as `if trainer.is_global_zero:`, or a branch on data that differs between "
        "ranks, is missing on the others)."
    )


def _waiting_for_ended(trigger: dict[str, Any], rank: int, waited_in: str) -> str:
    """The first line of the report of a rank waiting in a collective for ranks that have ended their script."""
    gone = trigger["waiting_for_ended"]
    names, their = f"rank{'s' if gone[1:] else ''} {', '.join(map(str, gone))}", "their" if gone[1:] else "its"
    return (
        f"[mpistrategy] rank {trigger['rank']} waits for {names}, which ended {their} script (found on rank "
        f"{trigger['rank']}, reported on rank {rank}): it has waited {trigger['waited']:.1f} s in {waited_in}. It "
        f"made a collective call that {names} did not make before ending (a batch or backward pass more: data that "
        "differs between ranks, or a call under a rank condition). Give every rank the same number of batches and "
        "the same collective calls."
    )


def _unequal_entries(states: dict[int, dict[str, Any]]) -> list[str]:
    """Lines naming the calls every rank must make that the ranks have entered different numbers of times."""
    names = sorted({name for state in states.values() for name in state.get("entered", {})})
    lines = []
    for name in names:
        entries = {other: state.get("entered", {}).get(name, 0) for other, state in sorted(states.items())}
        if len(set(entries.values())) > 1:
            told = by_rank(entries)
            lines.append(f"  {name}, a call every rank must make, was entered unequally ({told})")
    return lines


def uneven_batches(epoch: int, counts: dict[int, Any]) -> str:
    """Why ranks whose training data of ``epoch`` has different numbers of batches (``counts``, by rank) cannot
    train together, and the fix."""
    listing = by_rank(counts)
    return (
        f"the ranks' training data of epoch {epoch} has different numbers of batches ({listing}), so the ranks no "
        "longer run the same collectives (the longer ones wait for ranks that will not take part, or pair theirs "
        "with the next epoch's). Give every rank the same number of batches per epoch: split an IterableDataset "
        "evenly over the ranks (the remainder dropped), keep Lightning's DistributedSampler for a map-style dataset "
        "(use_distributed_sampler=True), or cap the epoch with limit_train_batches."
    )
