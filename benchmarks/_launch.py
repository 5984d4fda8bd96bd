"""Shared benchmark plumbing: relaunching under mpiexec, torch.distributed (gloo) setup, timing and output."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
#: where a ``--quick`` run writes without ``--results``: never over the published figures in RESULTS
QUICK_RESULTS = RESULTS / "quick"
# Trainer options of every benchmark run: no logger, progress bar, summary, checkpoint or sanity check
QUIET_TRAINER = dict(
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
    num_sanity_val_steps=0,
)


def integer_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high`` (no upper bound when ``None``)."""

    def parse(text: str) -> int:
        allowed = f"{low} to {high}" if high is not None else f"{low} or more"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer; give {allowed}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; give {allowed}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above zero."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{value} is not a finite number above zero")
    return value


def check_timed_steps(parser, args) -> None:
    """Refuse (argparse's error) ``--steps`` that leave no timed step after the ``--warmup`` ones of a round."""
    if args.steps <= args.warmup:
        parser.error(
            f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}: the first --warmup steps of "
            "every round are dropped, so --steps must be larger"
        )


def writable_directory(text: str) -> Path:
    """An argparse type: a directory that exists or can be made, and can be written to (checked before any work,
    so that a run's figures are not lost at its end)."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot make the directory {text!r}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into the directory {text!r}")
    return path


def quick_defaults(parser, args, **values) -> None:
    """With ``--quick``: set each of ``values`` (option name to value) on ``args``, except the options given on the
    command line, which win."""
    if not getattr(args, "quick", False):
        return
    defaults = {action: action.default for action in parser._actions}
    try:
        for action in defaults:  # parsed again without defaults, argparse itself names what the command line gave
            action.default = argparse.SUPPRESS
        given = vars(parser.parse_args())
    finally:
        for action, default in defaults.items():
            action.default = default
    for name, value in values.items():
        if name not in given:
            setattr(args, name, value)


def add_results_argument(parser, what: str) -> None:
    """``--results DIR``: where to write ``what`` (see :func:`results_of` for the default)."""
    parser.add_argument(
        "--results",
        type=writable_directory,
        help=f"where to write {what} (default benchmarks/results; with --quick, benchmarks/results/quick)",
    )


def results_of(args) -> Path:
    """``--results`` if given; else benchmarks/results, or benchmarks/results/quick for a ``--quick`` run."""
    if args.results is not None:
        return args.results
    return QUICK_RESULTS if getattr(args, "quick", False) else RESULTS


#: the encoder and batch a ``--quick --device cpu`` run of a GPU benchmark takes (14,058 parameters): a check of the
#: benchmark's code in seconds, where the default 100.8M-parameter encoder takes minutes per step on a CPU
CPU_SMOKE_ENCODER = {"layers": 1, "d_model": 32, "heads": 2, "seq": 8, "batch": 4}


def add_encoder_arguments(parser) -> None:
    """The GPU benchmarks' encoder shape and batch as options (defaults: the 100.8M-parameter encoder)."""
    parser.add_argument("--layers", type=int, default=8, help="encoder layers")
    parser.add_argument("--d-model", type=int, default=1024, help="model width (feed-forward: 4x)")
    parser.add_argument("--heads", type=int, default=16, help="attention heads")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank and step")


def encoder_record(args, parameters: int) -> dict:
    """The encoder's shape and batch as the GPU benchmarks' JSON records them."""
    keys = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq}
    return {**keys, "batch_per_rank": args.batch, "parameters": parameters}


def share_cores(comm) -> int:
    """Give this rank its share of the cores as torch threads (``cpu_count // ranks``, at least 1, also in
    ``OMP_NUM_THREADS``) and quiet Lightning's and Python's warnings; returns the threads per rank."""
    import logging
    import warnings

    import torch

    threads = max(1, len(os.sched_getaffinity(0)) // comm.size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return threads


def ensure_mpi(ranks: int) -> None:
    """Re-run this script under ``mpiexec -n ranks`` unless it already runs inside an MPI job of that size."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == ranks or os.environ.get("MPISTRATEGY_BENCH_CHILD"):
        return
    sys.exit(run_under_mpi(ranks))


def run_under_mpi(ranks: int, *extra_args: str) -> int:
    """Run this script again as an MPI job of ``ranks`` processes (with ``extra_args`` after its own arguments and
    ``MPISTRATEGY_BENCH_CHILD=1`` in its environment); return the job's exit code."""
    from mpistrategy.launch import mpiexec_command, without_launcher_variables

    command = mpiexec_command()
    if shutil.which(command[0]) is None:
        sys.exit(f"{command[0]} not found: install the MPICH wheel (pip install mpich) or a system MPI.")
    env = without_launcher_variables(os.environ)
    env["MPISTRATEGY_BENCH_CHILD"] = "1"
    job = [*command, "-n", str(ranks), sys.executable, *sys.argv, *extra_args]
    return subprocess.call(job, env=env, preexec_fn=end_with_parent)


def end_with_parent() -> None:
    """In a launched ``mpiexec``, before it starts: SIGTERM when this script's process dies, even by SIGKILL
    (Linux ``prctl(PR_SET_PDEATHSIG)``), so that ``mpiexec`` ends its ranks instead of leaving them running."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the ranks end when mpiexec's own process group is killed


def init_gloo() -> None:
    """Start torch.distributed with gloo on the MPI world (rank 0 picks a free port and shares it)."""
    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    port = shared_port(comm)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)


def lightning_environment(comm) -> None:
    """The variables Lightning's LightningEnvironment reads, so that its DDP joins this MPI job's processes (a fresh
    port every time: a benchmark destroys the process group after each DDP round)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(shared_port(comm)),
        LOCAL_RANK=str(comm.rank),
        NODE_RANK="0",
        WORLD_SIZE=str(comm.size),
    )


def shared_port(comm) -> int:
    """A free TCP port on 127.0.0.1, picked by rank 0 of ``comm`` and known to every rank (collective)."""
    port = None
    if comm.rank == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    return comm.bcast(port, root=0)


def time_interleaved(
    runs: dict[str, Callable[[], object]], repeats: int, calls: int, barrier: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds per call of each function in each of ``repeats`` interleaved blocks of ``calls`` calls.

    Every repeat runs the functions in a new order (a seeded shuffle, the same on every rank), so that none
    always follows the same one: a contender that leaves caches cold, memory unmapped or threads busy would
    otherwise always slow down the same successor.
    """
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    order = list(runs.items())
    shuffler = random.Random(0)
    for _ in range(repeats):
        shuffler.shuffle(order)
        for name, run in order:
            barrier()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            samples[name].append((time.perf_counter() - start) / calls)
    return samples


def paired_ratios(samples: dict[str, list[float]], name: str, reference: str) -> list[float]:
    """Per repeat, ``name``'s time divided by ``reference``'s in the same repeat (slow drifts of a shared machine
    hit both alike and cancel)."""
    return [a / b for a, b in zip(samples[name], samples[reference], strict=True)]


def paired_ratio(samples: dict[str, list[float]], name: str, reference: str) -> float:
    """The median of :func:`paired_ratios`."""
    return statistics.median(paired_ratios(samples, name, reference))


def paired_range(rounds: list[dict[str, float]], name: str, reference: str) -> tuple[float, float, float]:
    """Median, min and max over rounds of ``name``'s time divided by ``reference``'s in the same round (``rounds``:
    one ``{contender: time}`` per round)."""
    ratios = paired_ratios({n: [r[n] for r in rounds] for n in (name, reference)}, name, reference)
    return statistics.median(ratios), min(ratios), max(ratios)


def save(name: str, payload: dict, directory: Path = RESULTS) -> Path:
    """Write ``payload`` to ``directory``/<name>.json (default benchmarks/results) and return the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
