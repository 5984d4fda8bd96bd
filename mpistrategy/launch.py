"""Starting an MPI job from a Python process (the test harness, the benchmarks): the launcher command and an
environment that carries none of the parent job's launcher variables."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

MPIEXEC_ENV = "MPISTRATEGY_MPIEXEC"
MPIEXEC_ARGS_ENV = "MPISTRATEGY_MPIEXEC_ARGS"

# What a launcher gives its processes: a child job started from one of them must not inherit it, or its ranks
# would try to join the parent's job.
LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "OMPI_")
LAUNCHER_NAMES = frozenset({"MPI_LOCALRANKID", "MPI_LOCALNRANKS"})


def mpiexec_command() -> list[str]:
    """The launcher and its extra arguments: ``$MPISTRATEGY_MPIEXEC`` (plus ``$MPISTRATEGY_MPIEXEC_ARGS``), else
    the mpiexec beside this Python (the MPICH wheel's, in a venv), else the one on PATH."""
    return [os.environ.get(MPIEXEC_ENV) or _default_mpiexec(), *shlex.split(os.environ.get(MPIEXEC_ARGS_ENV, ""))]


def _default_mpiexec() -> str:
    sibling = Path(sys.executable).with_name("mpiexec")
    if os.access(sibling, os.X_OK):
        return str(sibling)
    return shutil.which("mpiexec") or "mpiexec"


def without_launcher_variables(environ: Mapping[str, str], extra_prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    """``environ`` without the variables a launcher set for this process (and any starting with ``extra_prefixes``)."""
    prefixes = LAUNCHER_PREFIXES + extra_prefixes
    return {key: value for key, value in environ.items() if not key.startswith(prefixes) and key not in LAUNCHER_NAMES}
