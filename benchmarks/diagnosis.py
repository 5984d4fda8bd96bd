"""What hang and desync diagnosis costs: a 1 KB allreduce and the mpi_ad strategy's training step, with the
diagnosis on and off, side by side in one run.

    python benchmarks/diagnosis.py            # relaunches itself under mpiexec -n 2
    mpiexec -n 2 python benchmarks/diagnosis.py [--quick]

``on``: the defaults, every collective's fingerprint checked across the ranks (validation on) and the stall
watchdog armed (``MPISTRATEGY_STALL_TIMEOUT`` 300 s). ``off``: validation off (``mpistrategy.set_validation``) and
the watchdog disarmed (``mpistrategy.set_stall_timeout(0)``). Both record every call in the call log (the flight
recorder), which is always on; its cost per call (``calls.enter`` + ``calls.leave``) is timed on its own.

The allreduce (256 float32, ``out=`` a preallocated tensor) runs in interleaved blocks of calls; the strategy's step
is timed as in benchmarks/strategy.py (MLP 784-1024-1024-10, batch 64 per rank, ``Trainer(strategy="mpi_ad")``) in
interleaved rounds. Reported: medians, the per-block (per-round) difference or ratio ``on`` vs ``off`` and its
median, against the targets: at most 15 µs more per 1 KB allreduce, at most 1 % more per training step. Writes
benchmarks/results/diagnosis.json.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
import timeit
import warnings

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import add_results_argument, check_timed_steps, ensure_mpi, integer_in, quick_defaults, results_of, save  # noqa: E402

TARGET_ALLREDUCE_US = 15.0
TARGET_STEP_RATIO = 1.01


def _mode(on: bool) -> None:
    import mpistrategy as ms

    ms.set_validation(on)
    ms.set_stall_timeout(300 if on else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--blocks", type=integer_in(1), default=40, help="interleaved blocks of allreduce calls per mode"
    )
    parser.add_argument("--calls", type=integer_in(1), default=500, help="allreduce calls per block")
    parser.add_argument("--rounds", type=integer_in(1), default=10, help="interleaved training rounds per mode")
    parser.add_argument("--steps", type=integer_in(1), default=30, help="training steps per round")
    parser.add_argument("--warmup", type=integer_in(0), default=5, help="steps dropped at the start of every round")
    parser.add_argument("--quick", action="store_true", help="10 blocks, 3 rounds of 20 steps")
    add_results_argument(parser, "the JSON")
    args = parser.parse_args()
    quick_defaults(parser, args, blocks=10, rounds=3, steps=20)
    check_timed_steps(parser, args)
    args.results = results_of(args)
    ensure_mpi(2)

    import torch
    from mpi4py import MPI
    from strategy import BATCH, _trainer_run

    import mpistrategy as ms
    from mpistrategy.comm import calls

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    threads = max(1, len(os.sched_getaffinity(0)) // size)
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    shuffler = random.Random(0)  # the same order on every rank

    x, out = torch.ones(256), torch.empty(256)
    blocks: list[dict[str, float]] = []
    for _ in range(args.blocks):
        block = {}
        for name in shuffler.sample(["on", "off"], 2):
            _mode(name == "on")
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.calls):
                ms.allreduce(x, out=out)
            block[name] = (time.perf_counter() - start) / args.calls * 1e6
        blocks.append(block)

    probe = ms.Communicator(comm.Dup())  # its own counts: no collective runs on it
    log_cost = min(timeit.repeat(lambda: (calls.enter(probe, "probe", (), ""), calls.leave()), number=2000, repeat=5))
    log_cost_us = log_cost / 2000 * 1e6

    run = _trainer_run("mpi_ad")
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        medians = {}
        for name in shuffler.sample(["on", "off"], 2):
            _mode(name == "on")
            comm.Barrier()
            medians[name] = statistics.median(run(args.steps)[args.warmup :]) * 1e3
        rounds.append(medians)
    _mode(True)
    blocks, rounds = comm.bcast((blocks, rounds), root=0)
    if rank != 0:
        return

    allreduce = {name: statistics.median(b[name] for b in blocks) for name in ("on", "off")}
    added = statistics.median(b["on"] - b["off"] for b in blocks)
    steps = {name: statistics.median(r[name] for r in rounds) for name in ("on", "off")}
    ratios = [r["on"] / r["off"] for r in rounds]
    ratio = statistics.median(ratios)
    print(f"\nhang and desync diagnosis, {size} ranks, {threads} torch thread(s) per rank\n")
    print(f"1 KB allreduce ({args.blocks} interleaved blocks x {args.calls} calls), µs per call:")
    print(f"  on {allreduce['on']:.2f}   off {allreduce['off']:.2f}")
    verdict = "met" if added <= TARGET_ALLREDUCE_US else "MISSED"
    print(f"  on - off = {added:.2f} µs (median per block)   target <= {TARGET_ALLREDUCE_US:g} µs: {verdict}")
    print(f"  the call log alone (enter + leave, in every mode): {log_cost_us:.2f} µs per call")
    print(f"\nmpi_ad training step (MLP 784-1024-1024-10, batch {BATCH} per rank, {args.rounds} rounds x {args.steps}")
    print(f"steps, {args.warmup} warm-up), ms per step:")
    print(f"  on {steps['on']:.2f}   off {steps['off']:.2f}")
    verdict = "met" if ratio <= TARGET_STEP_RATIO else "MISSED"
    print(
        f"  on / off = {ratio:.4f}  ({min(ratios):.4f} - {max(ratios):.4f})   target <= {TARGET_STEP_RATIO}: {verdict}"
    )
    path = save(
        "diagnosis",
        {
            "ranks": size,
            "threads_per_rank": threads,
            "allreduce_1kb_us": allreduce,
            "allreduce_added_us": added,
            "call_log_us": log_cost_us,
            "step_ms": steps,
            "step_ratio": ratio,
            "blocks": blocks,
            "rounds": rounds,
            "targets": {"allreduce_added_us": TARGET_ALLREDUCE_US, "step_ratio": TARGET_STEP_RATIO},
        },
        args.results,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
