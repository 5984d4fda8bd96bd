"""Where mpi_ad's gradient synchronisation spends a step on a GPU: its reducer (bucketed, staged through host mirrors
where MPI cannot read device memory) in a plain training loop on the GPU benchmark's encoder, one MPI job.

    python benchmarks/gpu_staging.py                   # CUDA, 2 ranks; writes results/gpu_staging.json
    python benchmarks/gpu_staging.py --caps 25 100 --shared-memory auto off
    python benchmarks/gpu_staging.py --device cpu --quick --results /tmp/staging-smoke
                                                       # the same code on the CPU, a 14,058-parameter encoder unless
                                                       # the shape is given (no mirrors: a check of the script)

For every configuration (a bucket cap in MB and a shared-memory mode, ``auto`` or ``off``), a fresh reducer over
the model; per step, after ``--warmup`` steps, medians over ``--steps`` (ms):

- ``alone``: a step without synchronisation (zero_grad, forward, backward, optimizer step);
- ``step``: the same with the reducer (prepare, forward, backward, wait, step), a device synchronisation at both
  ends;
- ``backward_returned`` and ``wait_returned``: when ``backward()`` and the reducer's ``wait()`` return, from the
  step's start, on the host clock: what the host thread does while the device works (kernels are queued, not run,
  when backward returns);
- the parts of staging one after another, a device synchronisation after each: ``device_to_host`` (every bucket
  into its mirror), ``host_sums`` (the mean of every mirror over the ranks, as the aggregator does it),
  ``host_to_device``;
- ``hidden = 1 - (step - alone) / (device_to_host + host_sums + host_to_device)``: the share of those serial parts
  that the staged step does not add to training alone (1: all behind compute; 0: no better than in series).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import (  # noqa: E402
    CPU_SMOKE_ENCODER,
    RESULTS,
    add_encoder_arguments,
    encoder_record,
    quick_defaults,
    run_under_mpi,
    save,
    writable_directory,
)

PARTS = ("device_to_host", "host_sums", "host_to_device")
TIMES = ("alone", "step", "backward_returned", "wait_returned", *PARTS)


def main() -> None:
    args = _arguments()
    from mpi4py import MPI

    if not os.environ.get("MPISTRATEGY_BENCH_CHILD") and MPI.COMM_WORLD.Get_size() == 1 and args.ranks > 1:
        sys.exit(run_under_mpi(args.ranks))
    record = _job(args)
    if record is not None:
        path = save("gpu_staging", record, args.results)
        _print(record)
        print(f"wrote {path}")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the model trains")
    parser.add_argument("--ranks", type=int, default=2, help="MPI ranks (they share the GPUs there are)")
    parser.add_argument("--caps", type=float, nargs="+", default=[25.0], help="bucket caps in MB")
    parser.add_argument("--shared-memory", nargs="+", choices=("auto", "off"), default=["auto", "off"])
    add_encoder_arguments(parser)
    parser.add_argument("--steps", type=int, default=10, help="steps measured per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped first")
    parser.add_argument(
        "--quick", action="store_true", help="3 steps after 1 dropped; with --device cpu a 1-layer encoder"
    )
    parser.add_argument(
        "--results", type=writable_directory, help="where to write gpu_staging.json (on CUDA by default results/)"
    )
    args = parser.parse_args()
    quick_defaults(parser, args, steps=3, warmup=1, **(CPU_SMOKE_ENCODER if args.device == "cpu" else {}))
    if args.device == "cpu" and args.results is None:
        parser.error("--device cpu: give --results DIR (benchmarks/results holds GPU figures only)")
    if min(args.steps, args.ranks, *args.caps) <= 0 or args.warmup < 0:
        parser.error("--steps, --ranks and --caps must be positive, --warmup at least 0")
    args.results = args.results or RESULTS
    return args


def _job(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every configuration in turn; rank 0 returns the record."""
    from _gpu_contenders import Workload, device_name, rank_device, versions
    from mpi4py import MPI

    from mpistrategy.comm.shm import shared_memory

    comm = MPI.COMM_WORLD
    device = rank_device(args.device)
    workload = Workload(args.layers, args.d_model, args.heads, args.seq, args.batch, "bf16-mixed", device)
    configurations = []
    for cap in args.caps:
        for mode in args.shared_memory:
            with shared_memory(mode):
                times, layout = _measure(workload, cap, args)
            medians = comm.gather({name: statistics.median(values) for name, values in times.items()}, root=0)
            if comm.rank == 0:
                slowest = {name: max(rank[name] for rank in medians) for name in TIMES}
                configurations.append({"bucket_cap_mb": cap, "shared_memory": mode, **layout, "ms": slowest})
    if comm.rank != 0:
        return None
    for configuration in configurations:
        ms = configuration["ms"]
        serial = sum(ms[part] for part in PARTS)
        configuration["hidden"] = 1 - (ms["step"] - ms["alone"]) / serial if serial > 0 else None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device_name": device_name(device),
        "ranks": comm.size,
        "model": encoder_record(args, configurations[0]["parameters"] if configurations else 0),
        "precision": "bf16-mixed",
        "steps": args.steps,
        "warmup": args.warmup,
        "versions": versions(),
        "configurations": configurations,
        "note": "ms: the slowest rank's median per quantity",
    }


def _measure(workload: Any, cap: float, args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """This rank's times (ms) per step of one configuration, and the reducer's layout."""
    import torch
    from torch import nn

    from mpistrategy.aggregation import MeanAggregator
    from mpistrategy.comm.topology import topology
    from mpistrategy.strategy.reducer import GradientReducer

    model = workload.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    data = workload.dataset(1, 1).tensors
    tokens, labels = (t.to(workload.device) for t in data)
    reducer = GradientReducer(model, MeanAggregator(), topology(), bucket_cap_mb=cap)
    reducer.attach_optimizer(optimizer)
    mirrors = [mirror for mirror in reducer.memory.mirrors if mirror is not None]
    layout = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "buckets": len(reducer.buckets),
        "mirrored": reducer.stages_through_host,
    }

    def forward_backward() -> None:
        with torch.autocast(workload.device.type, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(tokens), labels)
        loss.backward()

    def step(sync: bool) -> tuple[float, float, float]:
        start = workload.clock()
        optimizer.zero_grad()
        reducer.prepare(sync)
        forward_backward()
        backward_returned = time.perf_counter()
        reducer.wait()
        wait_returned = time.perf_counter()
        optimizer.step()
        end = workload.clock()
        return end - start, backward_returned - start, wait_returned - start

    def parts() -> tuple[float, float, float]:
        pairs = [
            (bucket.buffer, mirror)
            for bucket, mirror in zip(reducer.buckets, reducer.memory.mirrors, strict=True)
            if mirror is not None
        ]
        start = workload.clock()
        for buffer, mirror in pairs:
            mirror.copy_(buffer)
        copied = workload.clock()
        for _, mirror in pairs:
            _mean(mirror)
        summed = workload.clock()
        for buffer, mirror in pairs:
            buffer.copy_(mirror)
        return copied - start, summed - copied, workload.clock() - summed

    times: dict[str, list[float]] = {name: [] for name in TIMES}
    try:
        for index in range(args.warmup + args.steps):
            alone = step(False)[0]
            synchronised = step(True)
            separate = parts() if mirrors else (0.0, 0.0, 0.0)
            if index >= args.warmup:
                for name, seconds in zip(TIMES, (alone, *synchronised, *separate), strict=True):
                    times[name].append(seconds * 1e3)
    finally:
        reducer.remove()
    return times, layout


def _mean(tensor: Any) -> None:
    """The mean over the ranks, in place, through the gradients' communicator (as the reducer's aggregator)."""
    import mpistrategy as ms
    from mpistrategy.comm.topology import topology

    ms.allreduce(tensor, "avg", topology().gradients, out=tensor)


def _print(record: dict[str, Any]) -> None:
    model = record["model"]
    print(
        f"\nstaged gradient synchronisation on {record['device_name']}: {record['ranks']} ranks, "
        f"{model['parameters'] / 1e6:.1f}M parameters, {record['steps']} steps after {record['warmup']} dropped"
    )
    print(f"{'cap MB':>7} {'shm':>5} {'buckets':>8} " + " ".join(f"{name:>17}" for name in TIMES) + f" {'hidden':>7}")
    for c in record["configurations"]:
        hidden = "-" if c["hidden"] is None else f"{c['hidden']:.2f}"
        values = " ".join(f"{c['ms'][name]:17.1f}" for name in TIMES)
        print(f"{c['bucket_cap_mb']:7.1f} {c['shared_memory']:>5} {c['buckets']:8d} {values} {hidden:>7}")


if __name__ == "__main__":
    main()
