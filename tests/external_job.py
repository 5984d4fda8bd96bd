"""Tests that start their own ``mpiexec`` job instead of running under the multi-rank harness (to read every rank's
output, exit codes and timing): the marker that keeps them out of MPI jobs, and the runner."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import IO

import pytest

from mpistrategy.comm import flight
from mpistrategy.launch import mpiexec_command
from tests import job_processes
from tests.mpi_harness import NRANKS_ENV, clean_environ

ROOT = Path(__file__).parents[1]

#: for a module whose tests launch their own mpiexec: skipped inside an MPI job, run from the plain (outer) pytest
OUTER_RUN_ONLY = pytest.mark.skipif(
    os.environ.get(NRANKS_ENV) is not None or "PMI_RANK" in os.environ,
    reason="launches its own mpiexec; run from the plain (outer) pytest",
)


class MPIJob:
    """An ``mpiexec -n ranks python script *args`` job started by :func:`start_mpi_job`; ``process`` is
    ``mpiexec`` (send it signals), :meth:`finish` waits for the end."""

    def __init__(self, script: Path, ranks: int, args: tuple[str, ...], env: dict[str, str]) -> None:
        environ = {**clean_environ(), **env}
        environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")])
        self._marker = job_processes.mark(environ)
        command = [*mpiexec_command(), "-n", str(ranks), sys.executable, str(script), *args]
        # The output goes to files: a process that outlives mpiexec cannot hold the test up by keeping a pipe open.
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            command, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL, env=environ, start_new_session=True
        )

    def finish(self, timeout: float) -> tuple[int, str, float]:
        """Wait for ``mpiexec``: its exit code, the job's output (stdout, then stderr) and when ``mpiexec`` exited.

        A job still running after ``timeout`` seconds fails the test with its processes, each with what it waits in
        (found by :mod:`tests.job_processes`); processes left after ``mpiexec`` exited are killed with a warning that
        lists them."""
        with self._out, self._err:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                processes = job_processes.listing(self._marker)
                job_processes.kill(self._marker)
                self.process.wait()
                output = _read(self._out, self._err)[-4000:]
                pytest.fail(f"the job hung (killed after {timeout} s); its processes:\n{processes}\n{output}")
            ended = time.time()
            left = job_processes.listing(self._marker)
            if left:
                job_processes.kill(self._marker)
                warnings.warn(f"processes outlived mpiexec (killed):\n{left}", stacklevel=3)
            return self.process.returncode, _read(self._out, self._err), ended


def start_mpi_job(script: Path, ranks: int, *args: str, **env: str) -> MPIJob:
    """Start ``mpiexec -n ranks python script *args`` in the environment pytest started with (plus ``env``, with
    the repository importable)."""
    return MPIJob(script, ranks, args, env)


def run_mpi_job(script: Path, ranks: int, *args: str, timeout: float, **env: str) -> tuple[int, str, float]:
    """:func:`start_mpi_job`, then :meth:`MPIJob.finish`: the exit code, the output (stdout, then stderr) and when
    ``mpiexec`` exited."""
    return start_mpi_job(script, ranks, *args, **env).finish(timeout)


def _read(*files: IO[bytes]) -> str:
    text = []
    for file in files:
        file.seek(0)
        text.append(file.read().decode(errors="replace"))
    return "".join(text)


def marked_line(script: Path, marker: str) -> str:
    """``<script name>:<line>`` of the line of ``script`` that ends with ``# marker: <marker>``."""
    for number, text in enumerate(script.read_text().splitlines(), start=1):
        if text.endswith(f"# marker: {marker}"):
            return f"{script.name}:{number}"
    raise AssertionError(f"no line of {script} ends with '# marker: {marker}'")


def assert_desync_recorded(directory: Path, ranks: int, reason: str) -> None:
    """Every rank wrote its flight record for the ``CommunicationError`` it ended with (``reason`` matches its
    start), with the calls that led there."""
    records = flight.load(directory)
    assert sorted(records) == list(range(ranks)), sorted(records)
    for record in records.values():
        assert re.match(reason, record["reason"]), record["reason"]
        assert record["calls"], record
