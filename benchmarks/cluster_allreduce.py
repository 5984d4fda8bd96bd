"""A float32 allreduce at 4 ranks: 2 emulated nodes of 2 over unshaped, 10 Gbit/s and 1 Gbit/s links, against 4
ranks on one node (needs root; see cluster.py).

    python benchmarks/cluster_allreduce.py [--mb 40] [--rounds 5] [--calls 5] [--rates unshaped,10gbit,1gbit] [--quick]

One emulated cluster of 2 nodes serves every contender: the links are reshaped between jobs and the one-node
contender runs its 4 ranks in node 0. Every round runs each contender once as its own MPI job, in a new (seeded)
order; a job does one warm-up allreduce and then ``--calls`` timed ones (barrier, allreduce; the slowest rank's
time) and reports their median. The links' byte counters are read around each job. Reported per contender: the
median over rounds of the job medians (and their range), the algorithm bandwidth ``8 * bytes / time``, the ratio to
one node (the median over rounds of the ratio within a round), and the bytes each node's link sent per allreduce
(job total / allreduces; MPI's start-up adds a few KB).
Writes benchmarks/results/cluster_allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import add_results_argument, integer_in, paired_ratios, positive_float, quick_defaults, results_of, save  # noqa: E402
from cluster import EmulatedCluster, parse_rate  # noqa: E402

RANKS = 4
REFERENCE = "one node"
DEFAULT_RATES = "unshaped,10gbit,1gbit"
RESULT_PREFIX = "ALLREDUCE_SECONDS "


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=positive_float, default=40.0, help="allreduce size in MB (10^6 bytes), float32")
    parser.add_argument(
        "--rounds", type=integer_in(1), default=5, help="interleaved rounds (one job per contender each)"
    )
    parser.add_argument("--calls", type=integer_in(1), default=5, help="timed allreduces per job")
    parser.add_argument("--rates", default=DEFAULT_RATES, help=f"link rates of the 2x2 contenders ({DEFAULT_RATES})")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 calls of 4 MB (a smoke run)")
    add_results_argument(parser, "the JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.results = results_of(args)
    quick_defaults(parser, args, mb=4.0, rounds=1, calls=2)
    elements = int(args.mb * 1e6) // 4
    if args.worker:
        _worker(elements, args.calls)
        return
    rates = args.rates.split(",")
    for rate in rates:
        try:
            parse_rate(rate)
        except ValueError as error:
            parser.error(str(error))
    # name: (nodes used, ranks per node, link rate)
    contenders = {REFERENCE: (1, RANKS, None), **{f"2x2 {rate}": (2, 2, rate) for rate in rates}}
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    sent: dict[str, list[list[float]]] = {name: [] for name in contenders}
    order = list(contenders)
    shuffler = random.Random(0)
    with EmulatedCluster(nodes=2, rate=None) as cluster:
        print(cluster.describe(), file=sys.stderr, flush=True)
        for _ in range(args.rounds):
            shuffler.shuffle(order)
            for name in order:
                nodes, ranks_per_node, rate = contenders[name]
                cluster.shape(rate)
                before = cluster.link_bytes()
                done = cluster.run(
                    [sys.executable, __file__, "--worker", "--mb", str(args.mb), "--calls", str(args.calls)],
                    ranks_per_node,
                    nodes=nodes,
                    timeout=600,
                    capture_output=True,
                )
                if done.returncode != 0:
                    sys.exit(f"{name}: the job failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
                after = cluster.link_bytes()
                seconds[name].append(_job_seconds(done.stdout))
                sent[name].append([(b - a).sent / (args.calls + 1) for a, b in zip(before, after, strict=True)])
    payload = _summary(seconds, sent, elements * 4)
    payload.update(mb=args.mb, ranks=RANKS, rounds=args.rounds, calls=args.calls)
    path = save("cluster_allreduce", payload, args.results)
    _print_table(payload)
    print(f"wrote {path}")


def _worker(elements: int, calls: int) -> None:
    """In every rank: one warm-up allreduce, then ``calls`` timed ones; rank 0 prints the slowest rank's seconds."""
    import numpy as np
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    send, receive = np.ones(elements, dtype=np.float32), np.empty(elements, dtype=np.float32)
    world.Allreduce(send, receive)
    samples = []
    for _ in range(calls):
        world.Barrier()
        start = time.perf_counter()
        world.Allreduce(send, receive)
        samples.append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    if receive[0] != world.Get_size():
        raise SystemExit(f"allreduce gave {receive[0]}, expected {world.Get_size()}")
    if world.Get_rank() == 0:
        print(RESULT_PREFIX + json.dumps(samples), flush=True)


def _job_seconds(stdout: str) -> float:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return statistics.median(json.loads(lines[-1].removeprefix(RESULT_PREFIX)))


def _summary(seconds: dict[str, list[float]], sent: dict[str, list[list[float]]], nbytes: int) -> dict:
    contenders = {}
    for name, times in seconds.items():
        median = statistics.median(times)
        contenders[name] = {
            "median_ms": median * 1e3,
            "range_ms": [min(times) * 1e3, max(times) * 1e3],
            "algbw_gbit_per_s": nbytes * 8 / median / 1e9,
            "vs_one_node": statistics.median(paired_ratios(seconds, name, REFERENCE)),
            "sent_mb_per_allreduce": [statistics.median(per_node) / 1e6 for per_node in zip(*sent[name], strict=True)],
            "rounds_ms": [t * 1e3 for t in times],
        }
    return {"bytes": nbytes, "contenders": contenders}


def _print_table(payload: dict) -> None:
    print(f"{payload['mb']:g} MB float32 allreduce, {payload['ranks']} ranks, median of {payload['rounds']} rounds")
    print(f"{'contender':<14} {'ms':>8} {'range ms':>17} {'Gbit/s':>7} {'x one node':>10}  MB sent per node")
    for name, row in payload["contenders"].items():
        low, high = row["range_ms"]
        sent = " ".join(f"{mb:.1f}" for mb in row["sent_mb_per_allreduce"])
        print(
            f"{name:<14} {row['median_ms']:8.1f} {low:8.1f}-{high:<8.1f} {row['algbw_gbit_per_s']:7.2f} "
            f"{row['vs_one_node']:10.2f}  {sent}"
        )


if __name__ == "__main__":
    main()
