"""The flight recorder: each rank's last collectives as JSON, written on a stall, an abort or a signal; and
``mpistrategy-flight``, the command that compares the ranks' records and names the first divergence.

Each rank keeps its last ``MPISTRATEGY_FLIGHT_RECORDS`` (256) collectives in the call log
(:mod:`mpistrategy.comm.calls`): op, arguments (dtype, shape, op, root, ...), the communicator's members, the call's
number on it, call site, start time and duration. :func:`dump` writes them to ``<directory>/rank<r>.json``
(atomically) with the reason: the stall watchdog (with every rank's state), an abort on an exception or a
``CommunicationError`` that ends the rank (:mod:`mpistrategy.strategy.failures`), SIGUSR1 (the process goes on;
installed when mpistrategy is imported, unless the program has a handler of its own) and the strategy's coordinated
stop on SIGTERM or SIGUSR1. The directory is ``MPISTRATEGY_FLIGHT_DIR``, or :func:`set_flight_directory`, default
``./mpistrategy_flight`` (``./mpistrategy_flight/slurm-<job id>`` in a SLURM job: jobs submitted from one folder
keep theirs apart). Each record names its MPI job (:func:`identify_job`, agreed when mpistrategy is imported).

``mpistrategy-flight DIR`` reads every ``rank*.json`` in ``DIR``, keeps those of the newest job (a record left by an
earlier job of more ranks is named and left out) and, per communicator, walks the calls that every rank still
holds in order of their number: the first number at which ranks called different ops or arguments, or that some
ranks never reached, is the divergence it prints, with each rank's call and site.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from mpi4py import MPI

from mpistrategy.comm import calls


def _default_directory() -> str:
    job = os.environ.get("SLURM_JOB_ID", "")
    return os.environ.get("MPISTRATEGY_FLIGHT_DIR", "") or os.path.join(
        "mpistrategy_flight", f"slurm-{job}" if job else ""
    )


_directory = _default_directory()
_job = f"{socket.gethostname()}-{os.getpid()}"


def identify_job(comm: MPI.Intracomm) -> None:
    """Name this MPI job in the flight records: rank 0's host, pid and start time (collective over ``comm``)."""
    global _job
    _job = comm.bcast(f"{socket.gethostname()}-{os.getpid()}-{time.time():.0f}" if comm.Get_rank() == 0 else None)


def set_flight_directory(path: str | os.PathLike[str]) -> None:
    """Write flight records into ``path`` (created when a record is written)."""
    global _directory
    _directory = os.fspath(path)


def flight_directory() -> Path:
    """Where flight records are written."""
    return Path(_directory)


def record(reason: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's flight record: who, why, when, and its last collectives (oldest first)."""
    recorded = []
    for call in calls.recent():
        entry = call.as_dict()
        entry["members"] = list(calls.members(call.channel))
        entry["communicator"] = calls.key(call.channel)
        recorded.append(entry)
    return {
        "rank": MPI.COMM_WORLD.Get_rank(),
        "size": MPI.COMM_WORLD.Get_size(),
        "job": _job,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "reason": reason,
        "time": time.time(),
        "in_call": calls.current is not None,
        "calls": recorded,
        **(extra or {}),
    }


def dump(reason: str, extra: dict[str, Any] | None = None) -> Path | None:
    """Write this rank's flight record to ``<directory>/rank<r>.json`` (atomically); its path, or ``None`` when
    it could not be written (a failure to write must not hide the failure being reported)."""
    try:
        directory = flight_directory()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{MPI.COMM_WORLD.Get_rank()}.json"
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(record(reason, extra), file, indent=1, default=str)
        os.replace(temporary, path)
        return path
    except Exception:  # noqa: BLE001
        Path(temporary).unlink(missing_ok=True)
        return None


def where(path: Path | None) -> str:
    """The line that tells where this rank's flight record went and how to compare the ranks' (empty if unwritten)."""
    if path is None:
        return ""
    path = path.resolve()
    rank = MPI.COMM_WORLD.Get_rank()
    return f"[mpistrategy] rank {rank}'s flight record: {path} (compare the ranks': mpistrategy-flight {path.parent})\n"


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    dump(signal.Signals(signum).name)


def install_signal_handler() -> None:
    """Write the flight record on SIGUSR1 and go on, unless the program handles SIGUSR1 itself (main thread only)."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or signal.getsignal(usr1) is not signal.SIG_DFL:
        return
    try:
        signal.signal(usr1, _on_signal)
    except ValueError:  # not the main thread
        pass


# ------------------------------------------------------------------------------------------------------ compare


class FlightRecordError(ValueError):
    """A ``rank*.json`` file that is not a flight record (not JSON, or not what :func:`dump` writes)."""


_RECORD_KEYS = {"rank": int, "size": int, "host": str, "pid": int, "reason": str, "calls": list}
_CALL_KEYS = ("call", "site", "count", "communicator")


def load(directory: Path) -> dict[int, dict[str, Any]]:
    """Every rank's flight record in ``directory``, by rank. Raises :class:`FlightRecordError` naming the first
    file that is not a flight record."""
    records = {}
    for path in sorted(directory.glob("rank*.json")):
        try:
            with path.open(encoding="utf-8") as file:
                found = json.load(file)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FlightRecordError(f"{path}: not a flight record (not JSON: {exc})") from exc
        records[_checked(found, path)["rank"]] = found
    return records


def of_newest_job(records: dict[int, dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """The records of the job that wrote the newest one, and the ranks whose records an earlier job left (a record
    without a job name belongs to no job and is kept)."""
    newest = max(records.values(), key=lambda found: found.get("time", 0.0)).get("job")
    kept = {rank: found for rank, found in records.items() if found.get("job", newest) == newest}
    return kept, sorted(set(records) - set(kept))


def _checked(found: Any, path: Path) -> dict[str, Any]:
    if not isinstance(found, dict):
        raise FlightRecordError(f"{path}: not a flight record (a JSON {type(found).__name__}, not an object)")
    wrong = [key for key, kind in _RECORD_KEYS.items() if not isinstance(found.get(key), kind)]
    if not wrong and any(not isinstance(c, dict) or any(k not in c for k in _CALL_KEYS) for c in found["calls"]):
        wrong = ["calls"]
    if wrong:
        raise FlightRecordError(f"{path}: not a flight record (missing or wrong: {', '.join(wrong)})")
    return found


def _shown(call: dict[str, Any] | None) -> str:
    return "no such call" if call is None else f"{call['call']} at {call['site']}"


def first_divergence(records: dict[int, dict[str, Any]]) -> str | None:
    """The first call, per communicator, at which the ranks' records differ (op and arguments, or missing), as a
    line per communicator; ``None`` when every call all ranks still hold agrees."""
    found = []
    communicators = sorted({call["communicator"] for record in records.values() for call in record["calls"]})
    for communicator in communicators:
        members = [int(rank) for rank in communicator.split("#")[0].split(",")]
        present = [rank for rank in members if rank in records]
        by_rank = {
            rank: {call["count"]: call for call in records[rank]["calls"] if call["communicator"] == communicator}
            for rank in present
        }
        starts = [min(calls_of) for calls_of in by_rank.values() if calls_of]
        ends = [max(calls_of) for calls_of in by_rank.values() if calls_of]
        if not starts:
            continue
        for count in range(max(starts), max(ends) + 1):
            made = {rank: by_rank[rank].get(count) for rank in present}
            kinds = {None if call is None else call["call"] for call in made.values()}
            if len(kinds) > 1:
                listing = "; ".join(f"rank {rank}: {_shown(call)}" for rank, call in made.items())
                behind = [
                    f"rank {rank} stopped at #{max(by_rank[rank], default=0)}"
                    for rank, call in made.items()
                    if call is None
                ]
                note = f" ({', '.join(behind)})" if behind else ""
                found.append(f"communicator of world ranks {list(members)}: call #{count} differs{note}: {listing}")
                break
    return "\n".join(found) if found else None


def summary(records: dict[int, dict[str, Any]]) -> str:
    """One line per rank: why it wrote its record and its last call."""
    lines = []
    for rank, found in sorted(records.items()):
        last = found["calls"][-1] if found["calls"] else None
        state = "inside" if found.get("in_call") else "after"
        lines.append(
            f"rank {rank} ({found['host']}, pid {found['pid']}, {found['reason']}): {len(found['calls'])} calls "
            f"recorded, {state} " + (f"#{last['count']} {_shown(last)}" if last else "none")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``mpistrategy-flight [DIR]``: compare the ranks' flight records in DIR and print the first divergence."""
    parser = argparse.ArgumentParser(
        prog="mpistrategy-flight",
        description="Compare the ranks' flight records (rank*.json) and name the first collective call at which "
        "they diverge.",
    )
    parser.add_argument("directory", nargs="?", default=str(flight_directory()), help="default: %(default)s")
    arguments = parser.parse_args(argv)
    directory = Path(arguments.directory)
    if directory.exists() and not directory.is_dir():
        print(
            f"mpistrategy-flight: {directory} is not a directory (give the folder of the rank*.json files)",
            file=sys.stderr,
        )
        return 2
    try:
        records = load(directory)
    except (FlightRecordError, OSError) as exc:
        print(f"mpistrategy-flight: {exc}", file=sys.stderr)
        return 2
    if not records:
        print(f"no flight records (rank*.json) in {arguments.directory}", file=sys.stderr)
        return 2
    records, earlier = of_newest_job(records)
    if earlier:
        names = ", ".join(f"rank{rank}.json" for rank in earlier)
        print(f"left out {names}: written by an earlier job than the others")
    print(summary(records))
    missing = sorted(set(range(max(found["size"] for found in records.values()))) - set(records))
    if missing:
        print(f"no record from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    divergence = first_divergence(records)
    print(f"first divergence: {divergence}" if divergence else "no divergence in the calls all ranks recorded")
    return 0


if __name__ == "__main__":
    sys.exit(main())
