"""mpi_ad on a GPU: the Lightning strategy against Lightning's DDP, a hand-written staged MPI loop and the floors
without synchronisation, on a transformer encoder; one MPI job per rank count, all contenders in each job.

    python benchmarks/gpu.py                        # on CUDA: 2 ranks, then 1 rank; writes results/gpu.json, .png
    python benchmarks/gpu.py --ranks 2 --precision 32-true --layers 4
    python benchmarks/gpu.py --aggregation powersgd # mpi_ad with a compressor; writes results/gpu_powersgd.json
    python benchmarks/gpu.py --device cpu --quick --results /tmp/gpu-smoke
                                                    # the same code on the CPU (a 14,058-parameter encoder unless
                                                    # the shape is given): checks the benchmark, not the GPU
    benchmarks/gpu_run.sh                           # on a GPU machine: install, this benchmark, tests/gpu

Ranks take ``cuda:<rank on the machine mod visible GPUs>``: with fewer GPUs than ranks they share one. The model
(defaults: 8 layers, d_model 1024, 16 heads, feed-forward 4096, 100.8 M parameters, 403 MB of float32 gradients)
is a token embedding, ``nn.TransformerEncoder`` and a linear head to 10 classes, trained with cross-entropy and SGD
(lr 0.01, momentum 0.9) on synthetic tokens, batch ``--batch`` x ``--seq`` tokens per rank, in ``--precision``.
Contenders (the same model, data, optimizer and steps; see ``_gpu_contenders.py``):

- ``mpi_ad``: ``Trainer(strategy="mpi_ad", accelerator="gpu")`` (ranks sharing one GPU average the buckets in
  each other's device memory), or with ``--aggregation NAME`` the compressing scheme of that name (its defaults);
- ``mpi_ad_host``: the same with every CUDA bucket through its pinned host mirror (``MPISTRATEGY_CUDA_IPC=0``: what
  ranks on GPUs that cannot map each other's memory, or on different nodes, get);
- ``ddp``: ``Trainer(strategy=DDPStrategy(...))`` over NCCL when every rank has a GPU of its own, over gloo when
  ranks share one (NCCL refuses two ranks on one GPU); every rank is presented to Lightning as a node of one
  process, so that ranks sharing a GPU each find their device; its process group is destroyed after each round;
- ``hand``: a plain loop: backward; one ``torch.cat`` of the gradients into a flat device buffer; a copy into a
  pinned host buffer; ``MPI.Allreduce`` in place; a copy back; the mean into every ``.grad``; step. Its phases
  are timed too: ``device_to_host``, ``mpi``, ``host_to_device`` (each ended by a device synchronisation);
- the floors, with no synchronisation (every rank trains alone, side by side with the others): ``local`` (the
  plain loop) and ``lightning_local`` (Lightning's single-device strategy on this rank's device).

A step is timed from one step boundary to the next, with ``torch.cuda.synchronize()`` at each boundary: for the
Trainers between consecutive ``on_train_batch_start``, for the loops around each iteration (data loading and
every hook included). The contenders run in interleaved rounds, in a new seeded order every round; a first whole
round warms up (kernels, cuBLAS workspaces, the caching allocator) and is dropped, and so are the first
``--warmup`` steps of every round. Per contender: the median over rounds of the round's median step. Ratios:
the median over rounds of the per-round ratio (and its range). Also reported:

- ``sync_ms``: the synchronisation a contender adds to training alone, per step: ``mpi_ad - lightning_local``,
  ``ddp - lightning_local``, ``hand - local`` (medians of the per-round differences);
- ``hidden``: ``1 - (mpi_ad - lightning_local) / (hand - local)``, the share of the serial staging's cost that
  mpi_ad does not add to its step: 0 when it costs what staging after backward costs, 1 when synchronisation is
  entirely hidden behind compute, negative when it costs more (median over rounds; none where the hand loop is no
  slower than ``local``);
- peak GPU memory per rank and contender: ``torch.cuda.max_memory_allocated``, reset before each contender's
  round, the maximum over rounds.

Writes ``gpu.json`` and ``gpu.png`` (``gpu_<scheme>.*`` with a compressor, whose runs the targets do not cover) to
``--results``: by default ``benchmarks/results`` on CUDA; a CPU run must name a directory, so that it never replaces
GPU figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import (  # noqa: E402
    CPU_SMOKE_ENCODER,
    RESULTS,
    add_encoder_arguments,
    encoder_record,
    paired_range,
    quick_defaults,
    run_under_mpi,
    save,
    writable_directory,
)

CONTENDERS = ("mpi_ad", "mpi_ad_host", "ddp", "hand", "local", "lightning_local")
RATIOS = (
    ("mpi_ad", "hand"),
    ("mpi_ad_host", "hand"),
    ("mpi_ad", "ddp"),
    ("mpi_ad", "lightning_local"),
    ("lightning_local", "ddp"),
    ("local", "hand"),
)
# target: (bound on the ratio, the rank count it is set for); the setting: one H100 shared by the ranks, the
# default model and precision
TARGETS = {
    "mpi_ad/hand": (0.75, 2),
    "mpi_ad/ddp": (0.6, 2),
    "mpi_ad/lightning_local": (1.02, 1),
    "peak_memory mpi_ad/ddp": (1.0, 2),
}
TARGET_SETTING = "one NVIDIA H100 shared by the ranks, 8 layers, d_model 1024, 16 heads, 16 x 256 tokens, bf16-mixed"
GIB = 2**30
CHILD = "MPISTRATEGY_BENCH_CHILD"


def main() -> None:
    args = _arguments()
    from mpi4py import MPI

    if os.environ.get(CHILD) or MPI.COMM_WORLD.Get_size() > 1:
        result = _job(args)
        if result is not None and args.part is not None:
            args.part.write_text(json.dumps(result))
        elif result is not None:
            _write([result], args)
        return
    with tempfile.TemporaryDirectory() as directory:
        parts = []
        for ranks in args.ranks:
            part = Path(directory) / f"{ranks}.json"
            code = run_under_mpi(ranks, "--ranks", str(ranks), "--part", str(part))
            if code != 0:
                sys.exit(f"the {ranks}-rank job failed (exit code {code})")
            parts.append(json.loads(part.read_text()))
    _write(parts, args)


def _arguments() -> argparse.Namespace:
    from mpistrategy.aggregation import SCHEMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the models train")
    parser.add_argument("--ranks", type=_rank_counts, default=[2, 1], help="MPI jobs to run, e.g. 2,1 (default)")
    add_encoder_arguments(parser)
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true", "16-mixed"), default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=15, help="steps per round and contender")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of every round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds kept (after one warm-up round)")
    parser.add_argument(
        "--quick", action="store_true", help="2 rounds of 6 steps, 2 dropped; with --device cpu a 1-layer encoder"
    )
    parser.add_argument(
        "--aggregation", choices=SCHEMES, default="mean", help="how mpi_ad combines gradients (default: the mean)"
    )
    parser.add_argument(
        "--results",
        type=writable_directory,
        help="where to write gpu.json and gpu.png (on CUDA by default benchmarks/results)",
    )
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    quick_defaults(parser, args, steps=6, warmup=2, rounds=2, **(CPU_SMOKE_ENCODER if args.device == "cpu" else {}))
    problems = _problems(args)
    if problems:
        parser.error("; ".join(problems))
    if args.results is None:
        args.results = RESULTS
    return args


def _rank_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rank counts such as 2,1, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"rank counts must be positive, got {text!r}")
    return counts


def _problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the arguments, each with its fix."""
    problems = []
    if args.device == "cuda" and not _cuda_available():
        problems.append("--device cuda: this torch sees no CUDA device (run on a GPU machine, or --device cpu)")
    if args.device == "cpu" and args.results is None:
        problems.append("--device cpu: give --results DIR (benchmarks/results holds GPU figures only)")
    if args.device == "cpu" and args.precision == "16-mixed":
        problems.append("--precision 16-mixed trains on CUDA only: use bf16-mixed or 32-true on the CPU")
    if args.d_model % args.heads:
        problems.append(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if min(args.layers, args.d_model, args.heads, args.seq, args.batch, args.rounds) < 1:
        problems.append("--layers, --d-model, --heads, --seq, --batch and --rounds must be positive")
    if not 0 <= args.warmup < args.steps:
        problems.append(f"--warmup {args.warmup} must be at least 0 and less than --steps {args.steps}")
    return problems


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --------------------------------------------------------------------------------------------- one MPI job


def _job(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every contender in interleaved rounds at this job's rank count; rank 0 returns the run's record."""
    import logging
    import warnings

    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    threads = max(1, len(os.sched_getaffinity(0)) // comm.size)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    from _gpu_contenders import (
        Workload,
        device_name,
        no_sync,
        plain_run,
        rank_device,
        staged_allreduce,
        trainer_run,
        versions,
    )

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)  # after Lightning's import, which sets it

    device = rank_device(args.device)
    workload = Workload(args.layers, args.d_model, args.heads, args.seq, args.batch, args.precision, device)
    gpus = comm.allgather(str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None)
    share = device.type == "cuda" and len(set(gpus)) < len(gpus)
    ddp_backend = "nccl" if device.type == "cuda" and not share and torch.distributed.is_nccl_available() else "gloo"
    contenders = {
        "mpi_ad": trainer_run("mpi_ad", workload, ddp_backend, args.aggregation),
        "mpi_ad_host": trainer_run("mpi_ad_host", workload, ddp_backend, args.aggregation),
        "ddp": trainer_run("ddp", workload, ddp_backend),
        "hand": plain_run(workload, staged_allreduce(workload)),
        "local": plain_run(workload, no_sync),
        "lightning_local": trainer_run("lightning_local", workload, ddp_backend),
    }
    rounds, phases, peaks = _measure(contenders, args, device, comm)
    meta = torch.device("meta")  # counts the parameters without allocating them
    peaks_per_rank = comm.gather(peaks, root=0)
    if comm.rank != 0:
        return None
    run = {
        "ranks": comm.size,
        "device_name": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks_share_gpu": share,
        "ddp_backend": ddp_backend,
        "aggregation": args.aggregation,
        "threads_per_rank": threads,
        "parameters": sum(p.numel() for p in dataclasses.replace(workload, device=meta).model().parameters()),
        "versions": versions(),
        **_summary(rounds, phases, peaks_per_rank if device.type == "cuda" else None),
    }
    _print_run(run, args)
    return run


def _measure(contenders: dict, args: argparse.Namespace, device, comm) -> tuple[list, dict, dict]:
    """Interleaved rounds (a first warm-up round dropped): per kept round each contender's median ms/step, the
    hand loop's median ms per phase; per contender this rank's peak GPU memory in GiB (0 off CUDA)."""
    rounds: list[dict[str, float]] = []
    phases: dict[str, list[float]] = {}
    peaks = dict.fromkeys(contenders, 0.0)
    order = list(contenders.items())
    shuffler = random.Random(0)  # the same order on every rank
    for number in range(args.rounds + 1):
        shuffler.shuffle(order)  # so that no contender always runs after the same one
        record = {}
        for name, run in order:
            _release_memory(device)
            comm.Barrier()
            times = run(args.steps)
            peaks[name] = max(peaks[name], _peak_gib(device))
            medians = {key: statistics.median(values[args.warmup :]) * 1e3 for key, values in times.items()}
            record[name] = medians.pop("step")
            if number > 0:
                for phase, value in medians.items():
                    phases.setdefault(phase, []).append(value)
        if number > 0:
            rounds.append(record)
    return comm.bcast(rounds, root=0), comm.bcast(phases, root=0), peaks


def _release_memory(device) -> None:
    """Free what the last contender left (Lightning's reference cycles) and restart the peak count."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device) -> float:
    import torch

    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0


# --------------------------------------------------------------------------------------------- summary


def _summary(rounds: list[dict[str, float]], phases: dict[str, list[float]], peaks: list | None) -> dict[str, Any]:
    """Medians, paired ratios, synchronisation costs, the hand loop's phases and the peak memory of one run."""
    ratios = {}
    for name, reference in RATIOS:
        median, low, high = paired_range(rounds, name, reference)
        ratios[f"{name}/{reference}"] = {"median": median, "min": low, "max": high}
    sync = {
        "mpi_ad": statistics.median(r["mpi_ad"] - r["lightning_local"] for r in rounds),
        "mpi_ad_host": statistics.median(r["mpi_ad_host"] - r["lightning_local"] for r in rounds),
        "ddp": statistics.median(r["ddp"] - r["lightning_local"] for r in rounds),
        "hand": statistics.median(r["hand"] - r["local"] for r in rounds),
    }
    hidden = [
        1 - (r["mpi_ad"] - r["lightning_local"]) / (r["hand"] - r["local"]) for r in rounds if r["hand"] > r["local"]
    ]
    memory = None
    if peaks is not None:
        per_rank = {name: [rank[name] for rank in peaks] for name in CONTENDERS}
        memory = {"peak_gib_per_rank": per_rank, "mpi_ad/ddp": max(per_rank["mpi_ad"]) / max(per_rank["ddp"])}
    return {
        "rounds": rounds,
        "median_ms_per_step": {name: statistics.median(r[name] for r in rounds) for name in CONTENDERS},
        "range_ms_per_step": {
            name: [min(r[name] for r in rounds), max(r[name] for r in rounds)] for name in CONTENDERS
        },
        "ratios": ratios,
        "sync_ms": sync,
        "hand_phases_ms": {phase: statistics.median(values) for phase, values in phases.items()},
        "hidden": statistics.median(hidden) if hidden else None,
        "memory": memory,
    }


def _verdict(key: str, value: float, ranks: int, on_cuda: bool, aggregation: str) -> str:
    """``target <= bound: met / MISSED`` where the target is set for this run (on CUDA, at its rank count, with
    the mean)."""
    if key not in TARGETS:
        return ""
    bound, target_ranks = TARGETS[key]
    if aggregation != "mean":
        return f"(target <= {bound} is set for the mean)"
    if not on_cuda or ranks != target_ranks:
        return f"(target <= {bound} is set for {target_ranks} rank(s) on a GPU)"
    return f"target <= {bound}: {'met' if value <= bound else 'MISSED'}"


def _print_run(run: dict[str, Any], args: argparse.Namespace) -> None:
    on_cuda = args.device == "cuda"
    print(
        f"\nGPU benchmark on {run['device_name']}, {run['ranks']} rank(s)"
        f"{' sharing one GPU' if run['ranks_share_gpu'] else ''}, DDP over {run['ddp_backend']}, mpi_ad "
        f"aggregation {run['aggregation']}, {run['date']}"
    )
    print(
        f"encoder {args.layers} layers, d_model {args.d_model}, {args.heads} heads, {run['parameters'] / 1e6:.1f} M "
        f"parameters, batch {args.batch} x {args.seq} tokens per rank, {args.precision}; {args.rounds} rounds x "
        f"{args.steps} steps ({args.warmup} dropped) after a warm-up round\n"
    )
    memory = run["memory"]
    print(f"{'contender':<16} {'median ms/step':>15} {'range over rounds':>20} {'peak GiB (max rank)':>20}")
    for name in CONTENDERS:
        low, high = run["range_ms_per_step"][name]
        peak = f"{max(memory['peak_gib_per_rank'][name]):.2f}" if memory else "-"
        print(f"{name:<16} {run['median_ms_per_step'][name]:>15.2f} {low:>11.2f} - {high:<7.2f} {peak:>20}")
    print("\nratios: median over rounds of the per-round ratio (min - max)")
    for key, ratio in run["ratios"].items():
        verdict = _verdict(key, ratio["median"], run["ranks"], on_cuda, run["aggregation"])
        print(f"{key:<24} = {ratio['median']:.3f}  ({ratio['min']:.3f} - {ratio['max']:.3f})   {verdict}")
    if memory:
        key = "peak_memory mpi_ad/ddp"
        verdict = _verdict(key, memory["mpi_ad/ddp"], run["ranks"], on_cuda, run["aggregation"])
        print(f"{key:<24} = {memory['mpi_ad/ddp']:.3f}   {verdict}")
    sync, phases = run["sync_ms"], run["hand_phases_ms"]
    print(
        f"\nsynchronisation per step (ms, over training alone): mpi_ad {sync['mpi_ad']:.2f}, mpi_ad_host "
        f"{sync['mpi_ad_host']:.2f}, ddp {sync['ddp']:.2f}, "
        f"hand {sync['hand']:.2f} = device-to-host {phases['device_to_host']:.2f} + MPI {phases['mpi']:.2f} + "
        f"host-to-device {phases['host_to_device']:.2f} + the rest (cat, mean, copies into .grad)"
    )
    hidden = run["hidden"]
    described = "n/a (the hand loop is no slower than local)" if hidden is None else f"{hidden:.2f}"
    print(f"hidden by mpi_ad: 1 - (mpi_ad - lightning_local) / (hand - local) = {described}")


# --------------------------------------------------------------------------------------------- output


def _write(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """gpu.json (every run, the arguments, the targets) and gpu.png, in ``--results`` (``gpu_<scheme>`` with a
    compressor)."""
    payload = {
        "device": args.device,
        "device_name": runs[0]["device_name"],
        "date": runs[0]["date"],
        "model": encoder_record(args, runs[0]["parameters"]),
        "precision": args.precision,
        "aggregation": args.aggregation,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "runs": {str(run["ranks"]): run for run in runs},
        "targets": {key: {"bound": bound, "ranks": ranks} for key, (bound, ranks) in TARGETS.items()},
        "target_setting": TARGET_SETTING,
    }
    path = save("gpu" if args.aggregation == "mean" else f"gpu_{args.aggregation}", payload, args.results)
    _plot(payload, path.with_suffix(".png"))
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


def _plot(payload: dict[str, Any], path: Path) -> None:
    """Per run: a box plot of every contender's per-round median ms/step, and the synchronisation each adds to
    training alone (the hand loop's split into its phases)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(payload["runs"].values())
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.8 * len(runs)), squeeze=False)
    for (times, sync), run in zip(axes, runs, strict=True):
        times.boxplot([[r[name] for r in run["rounds"]] for name in CONTENDERS])
        times.set_xticks(range(1, len(CONTENDERS) + 1), CONTENDERS)
        times.set_ylabel("median ms per step (a point per round)")
        times.set_title(f"{run['ranks']} rank(s), {run['device_name']}, {payload['precision']}", fontsize=10)
        _plot_sync(sync, run)
        for ax in (times, sync):
            ax.grid(True, axis="y", alpha=0.3)
    model = payload["model"]
    fig.suptitle(
        f"encoder {model['layers']} x d {model['d_model']} ({model['parameters'] / 1e6:.1f} M parameters), "
        f"batch {model['batch_per_rank']} x {model['seq']} tokens per rank, {payload['date'][:10]}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_sync(ax, run: dict[str, Any]) -> None:
    phases = run["hand_phases_ms"]
    sync = run["sync_ms"]
    names = ["mpi_ad", "mpi_ad_host", "ddp"]
    ax.bar(names, [sync[name] for name in names], color=["C0", "C5", "C1"])
    bottom = 0.0
    for number, phase in enumerate(("device_to_host", "mpi", "host_to_device")):
        ax.bar(["hand"], [phases[phase]], bottom=bottom, color=f"C{number + 2}", label=phase.replace("_", " "))
        bottom += phases[phase]
    ax.bar(["hand"], [max(0.0, sync["hand"] - bottom)], bottom=bottom, color="C9", label="hand: the rest")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("ms per step over training alone")
    ax.set_title("synchronisation: mpi_ad(_host) and ddp over lightning_local, hand over local", fontsize=10)
    ax.legend(fontsize=8)


if __name__ == "__main__":
    main()
