"""The processes of an ``mpiexec`` job a test started, found by a marker in their environment.

MPICH's launcher starts its proxy and the ranks in sessions of their own, so neither the job's process group nor
its session holds them (a rank left behind by a hung ``mpiexec`` survives a kill of the group). Every process of
the job inherits the launcher's environment, and with it the marker :func:`mark` put there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

#: the environment variable that marks a job's processes
JOB_ENV = "MPISTRATEGY_TEST_JOB"


def mark(environ: dict[str, str]) -> str:
    """Put a marker unique to one job into ``environ`` (the job's environment) and return it."""
    marker = f"{os.getpid()}-{time.monotonic_ns()}"
    environ[JOB_ENV] = marker
    return marker


def pids(marker: str) -> list[int]:
    """The running processes whose environment carries ``marker``."""
    entry = f"{JOB_ENV}={marker}".encode()
    found = []
    for process in Path("/proc").iterdir():
        if process.name.isdigit():
            try:
                environ = (process / "environ").read_bytes()
            except OSError:  # ended meanwhile, or not ours to read
                continue
            if entry in environ.split(b"\0"):
                found.append(int(process.name))
    return sorted(found)


def listing(marker: str) -> str:
    """The job's processes, one line each under a header: pid, parent, session, state, seconds running, the
    kernel function each waits in, its command line; empty if none is left."""
    running = pids(marker)
    if not running:
        return ""
    columns = "pid,ppid,sid,stat,etimes,wchan:24,args"
    result = subprocess.run(["ps", "-o", columns, "-p", ",".join(map(str, running))], capture_output=True, text=True)
    return result.stdout.strip()


def kill(marker: str) -> None:
    """SIGKILL every process of the job."""
    for pid in pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
