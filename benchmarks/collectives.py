"""Differentiable collectives against raw mpi4py and torch.distributed (gloo), side by side in one run.

    python benchmarks/collectives.py            # relaunches itself under mpiexec -n 2
    mpiexec -n 2 python benchmarks/collectives.py [--quick] [--no-validation]

For allreduce, broadcast and allgather of float32 messages from 1 KB to 64 MB it times, interleaved in one run:

- forward: ``ours`` (mpistrategy's op writing into ``out=``, the same preallocated buffers as mpi4py's),
  ``mpi4py`` (the same MPI call on those buffers), ``gloo`` (torch.distributed, in place), and for reference
  ``new`` (mpistrategy's op returning a new tensor: the cost of a fresh result), ``no-val`` (``ours`` with
  the cross-rank argument validation switched off: the cost of that check) and ``floor``: ``mpi4py`` plus the
  one small message each of our ops sends first (the 16-byte allreduce of the argument check; for broadcast the
  same allreduce carries the header that tells receivers the shape and dtype), the least any op with those
  guarantees can cost;
- forward+backward: ``ours`` (the autograd op, ``y.backward(g)``), ``mpi4py`` (the forward and the adjoint
  collective by hand into preallocated buffers), ``gloo`` (torch.distributed.nn.functional), and for reference
  ``floor``: a bare autograd.Function around the same mpi4py calls writing into fresh ``torch.empty`` tensors
  (autograd must return new tensors; no checks, no metadata), what a plain autograd wrapper costs. It bounds
  what torch's engine adds, not our cost: where recycled result memory pays (our receive pool), ours is faster.

For allreduce, more contenders show the node-local shared-memory allreduce (:mod:`mpistrategy.comm.shm`):
``shm`` (ours with shared memory forced on, at every size, on the same private buffers, which it copies in) and
``ours_mpi`` (ours with it off: MPI's allreduce); ``ours`` itself runs in the default mode, shared memory from the
size threshold on. In the forward, ``shm_window`` reduces a tensor that lives in a shared segment in place, as
mpi_ad's gradient buckets do (no copy in), against ``mpi4py_window``, MPI's in-place allreduce of the same tensor.

Prints medians per call and, for each ratio, the median over repeats of the ratio within a repeat (the
contenders run back to back in every repeat, in a shuffled order), and checks the targets: at >= 1 MB ours within
5% of mpi4py (or faster) and >= 1.25x faster than gloo; at 1 KB ours adds <= 20 µs per forward call over mpi4py;
the shared-memory allreduce >= 1.5x faster than mpi4py's from 1 MB on, and ours (default mode) never slower than
ours with shared memory off (within 5%, the noise of one run) at any size. It also prints ``ours/floor``
(mpistrategy's own cost) and ``floor/mpi4py``: for the forward, what the small message costs; for
forward+backward, what torch's autograd engine and fresh result tensors cost. Writes
benchmarks/results/collectives.{json,png} (``collectives_np<ranks>`` for other rank counts than 2).

    python benchmarks/collectives.py --ranks 4 --ops allreduce     # the shared-memory allreduce at 4 ranks
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _launch import (  # noqa: E402
    add_results_argument,
    ensure_mpi,
    init_gloo,
    integer_in,
    paired_ratio,
    results_of,
    save,
    time_interleaved,
)

SIZES = [1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26]
TARGET_LARGE_VS_MPI4PY = 1.05
TARGET_GLOO_SPEEDUP = 1.25
TARGET_SMALL_OVERHEAD_US = 20.0
TARGET_SHM_SPEEDUP = 1.5
TARGET_AUTO_VS_MPI_PATH = 1.05
OPS = ("allreduce", "broadcast", "allgather")


def _timings(op: str, nbytes: int, backward: bool, comm, quick: bool) -> dict[str, float]:
    import torch.distributed as dist
    import torch.distributed.nn.functional as dnn
    from mpi4py import MPI

    import mpistrategy as ms

    size, rank = comm.Get_size(), comm.Get_rank()
    x = torch.randn(nbytes // 4)
    window = _shared_buffer(x, comm) if op == "allreduce" and not backward else None
    grad = torch.randn(x.numel() * (size if op == "allgather" else 1))
    out = torch.empty_like(grad)
    back = torch.empty_like(x)
    xg = x.clone().requires_grad_(True)

    def ours():
        if backward:
            if op == "allreduce":
                y = ms.allreduce(xg)
            elif op == "broadcast":
                y = ms.broadcast(xg if rank == 0 else None, root=0)
            else:
                y = ms.allgather(xg)
            xg.grad = None  # as zero_grad(set_to_none=True) does: the gradient is stored, not added
            y.backward(grad)
        elif op == "allreduce":
            ms.allreduce(x, out=out)
        elif op == "broadcast":
            ms.broadcast(out if rank == 0 else None, root=0, out=out)
        else:
            ms.allgather(x, out=out)

    def ours_new():
        if op == "allreduce":
            ms.allreduce(x)
        elif op == "broadcast":
            ms.broadcast(x if rank == 0 else None, root=0)
        else:
            ms.allgather(x)

    def mpi4py():
        if op == "allreduce":
            comm.Allreduce(x.numpy(), out.numpy())
            if backward:
                comm.Allreduce(grad.numpy(), back.numpy())
        elif op == "broadcast":
            comm.Bcast(out.numpy(), root=0)
            if backward:
                comm.Reduce(grad.numpy(), back.numpy() if rank == 0 else None, op=MPI.SUM, root=0)
        else:
            comm.Allgather(x.numpy(), out.numpy())
            if backward:
                comm.Reduce_scatter(grad.numpy(), back.numpy(), [back.numel()] * size)

    def gloo():
        if not backward:
            if op == "allreduce":
                dist.all_reduce(out)
            elif op == "broadcast":
                dist.broadcast(out, src=0)
            else:
                dist.all_gather_into_tensor(out, x)
            return
        if op == "allreduce":
            y = dnn.all_reduce(xg)
        elif op == "broadcast":
            y = dnn.broadcast(xg, src=0)
        else:
            y = torch.cat(dnn.all_gather(xg))
        xg.grad = None
        y.backward(grad)

    validated = ms.validation_enabled()
    if backward:
        floor_op = _minimal_autograd_op(op, comm, x.numel())
        anchor = torch.empty(0, requires_grad=True)

        def floor():
            y = floor_op.apply(xg if rank == 0 or op != "broadcast" else anchor)
            xg.grad = None
            anchor.grad = None
            y.backward(grad)

    else:
        floor = _minimal_forward(op, comm, validated, mpi4py)

    calls = (100 if nbytes <= 1 << 16 else (20 if nbytes <= 1 << 22 else 4)) // (5 if quick else 1) or 1
    repeats = 5 if quick else (31 if nbytes <= 1 << 22 else 15)

    def ours_unchecked():
        with ms.validation(False):
            ours()

    def shm():
        with ms.shared_memory("on"):
            ours()

    def ours_mpi():
        with ms.shared_memory("off"):
            ours()

    runs = {"ours": ours, "mpi4py": mpi4py, "gloo": gloo, "floor": floor}
    if op == "allreduce":
        runs["shm"], runs["ours_mpi"] = shm, ours_mpi
    if window is not None:

        def shm_window():
            with ms.shared_memory("on"):
                ms.allreduce(window, out=window)

        def mpi4py_window():
            comm.Allreduce(MPI.IN_PLACE, window.numpy())

        runs["shm_window"], runs["mpi4py_window"] = shm_window, mpi4py_window
    if not backward:
        runs["ours_new"] = ours_new
        if validated:
            runs["ours_unchecked"] = ours_unchecked
    samples = time_interleaved(runs, repeats, calls, comm.Barrier)
    timings = {name: statistics.median(values) for name, values in samples.items()}
    timings["ours/mpi4py"] = paired_ratio(samples, "ours", "mpi4py")
    timings["gloo/ours"] = paired_ratio(samples, "gloo", "ours")
    timings["ours/floor"] = paired_ratio(samples, "ours", "floor")
    timings["floor/mpi4py"] = paired_ratio(samples, "floor", "mpi4py")
    if "ours_unchecked" in samples:
        timings["no-val/mpi4py"] = paired_ratio(samples, "ours_unchecked", "mpi4py")
    if "shm" in samples:
        timings["mpi4py/shm"] = paired_ratio(samples, "mpi4py", "shm")
        timings["ours/ours_mpi"] = paired_ratio(samples, "ours", "ours_mpi")
    if "shm_window" in samples:
        timings["mpi4py/shm_window"] = paired_ratio(samples, "mpi4py_window", "shm_window")
    return timings


def _shared_buffer(like: torch.Tensor, comm) -> torch.Tensor:
    """A copy of ``like`` in a shared-memory segment, as mpi_ad's gradient buckets are (every rank of ``comm``
    shares this machine's memory: the benchmark runs on one machine)."""
    from mpistrategy.comm.shm_window import allocate

    segment = allocate(like.numel() * like.element_size(), comm)
    return segment.typed(segment.rank, 0, like.numel(), like.dtype).copy_(like)


def _minimal_forward(op: str, comm, validated: bool, mpi4py) -> Callable[[], None]:
    """The least a forward of ``op`` with mpistrategy's guarantees can cost: the bare mpi4py call (``mpi4py``)
    after the one small message our op sends first: with validation on, the MAX allreduce of the cross-rank
    argument check (two int64; for broadcast 18, the check and the header that tells receivers the root's shape
    and dtype); with validation off, nothing, but for broadcast a broadcast of the header. The ``floor``
    contender of the forward."""
    from mpi4py import MPI

    from mpistrategy.comm.metadata import HEADER_LENGTH

    header = bytearray(HEADER_LENGTH * 8)
    extremes = np.zeros(2 + (1 + HEADER_LENGTH if op == "broadcast" else 0), dtype=np.int64)

    def floor():
        if validated:
            comm.Allreduce(MPI.IN_PLACE, extremes, op=MPI.MAX)
        elif op == "broadcast":
            comm.Bcast([header, MPI.BYTE], root=0)
        mpi4py()

    return floor


def _minimal_autograd_op(op: str, comm, numel: int) -> type[torch.autograd.Function]:
    """A plain differentiable version of ``op``: an autograd.Function whose forward and backward are the bare
    mpi4py calls into fresh ``torch.empty`` tensors (autograd returns new tensors; no checks, no metadata). The
    ``floor`` contender of forward+backward: ``ours/floor`` is mpistrategy's own cost, ``floor/mpi4py`` torch's."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()

    class Allreduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            result = torch.empty_like(tensor)
            comm.Allreduce(tensor.numpy(), result.numpy())
            return result

        @staticmethod
        def backward(ctx, grad):
            return Allreduce.forward(ctx, grad)

    class Broadcast(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            result = tensor.detach() if rank == 0 else torch.empty(numel)
            comm.Bcast(result.numpy(), root=0)
            return result

        @staticmethod
        def backward(ctx, grad):
            total = torch.empty_like(grad) if rank == 0 else None
            comm.Reduce(grad.numpy(), None if total is None else total.numpy(), op=MPI.SUM, root=0)
            return total if rank == 0 else torch.empty(0)

    class Allgather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, tensor):
            result = torch.empty(tensor.numel() * size)
            comm.Allgather(tensor.numpy(), result.numpy())
            return result

        @staticmethod
        def backward(ctx, grad):
            block = torch.empty(grad.numel() // size)
            comm.Reduce_scatter(grad.numpy(), block.numpy(), [block.numel()] * size)
            return block

    return {"allreduce": Allreduce, "broadcast": Broadcast, "allgather": Allgather}[op]


def _plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["op"], r["backward"]) for r in rows})
    columns = len({op for op, _ in panels})
    fig, axes = plt.subplots(2, columns, figsize=(4.7 * columns, 7), sharex=True, squeeze=False)
    for ax, (op, backward) in zip(axes.T.flat, panels, strict=True):
        picked = [r for r in rows if r["op"] == op and r["backward"] == backward]
        for impl in ("ours", "ours_new", "mpi4py", "gloo", "shm", "ours_mpi", "shm_window", "mpi4py_window"):
            if impl in picked[0]:
                ax.loglog([r["bytes"] for r in picked], [r[impl] * 1e6 for r in picked], marker="o", label=impl)
        ax.set_title(f"{op} {'forward+backward' if backward else 'forward'}")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("median µs per call")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes, repeats and calls (a smoke run)")
    parser.add_argument("--no-validation", action="store_true", help="switch off the cross-rank agreement checks")
    parser.add_argument("--ranks", type=integer_in(2), default=2, help="MPI ranks (default 2)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="the ops to time")
    parser.add_argument("--sizes", type=integer_in(1), nargs="+", help="message sizes in bytes (default 1 KB .. 64 MB)")
    add_results_argument(parser, "the JSON and PNG")
    args = parser.parse_args()
    args.results = results_of(args)
    ensure_mpi(args.ranks)

    from mpi4py import MPI

    import mpistrategy as ms
    from mpistrategy.comm.shm import min_bytes

    comm = MPI.COMM_WORLD
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.nn's deprecation notices
    ms.set_validation(not args.no_validation)
    torch.set_num_threads(1)
    init_gloo()
    sizes = args.sizes or ([1 << 10, 1 << 20, 1 << 24] if args.quick else SIZES)
    rows = []
    header = (
        f"{'op':<10}{'mode':<9}{'size':>9}{'ours µs':>12}{'mpi4py µs':>12}{'gloo µs':>12}{'new µs':>10}"
        f"{'no-val µs':>11}{'floor µs':>10}{'ours/mpi4py':>13}{'gloo/ours':>11}{'ours/floor':>12}"
    )
    if comm.rank == 0:
        print(f"{comm.size} ranks, validation {'on' if ms.validation_enabled() else 'off'}\n{header}", flush=True)
    for op in args.ops:
        for backward in (False, True):
            for nbytes in sizes:
                t = _timings(op, nbytes, backward, comm, args.quick)
                row = {"op": op, "backward": backward, "bytes": nbytes, **t}
                rows.append(row)
                if comm.rank == 0:
                    mode = "fwd+bwd" if backward else "fwd"
                    extra = "".join(
                        f"{t[name] * 1e6:>{width}.1f}" if name in t else f"{'-':>{width}}"
                        for name, width in (("ours_new", 10), ("ours_unchecked", 11), ("floor", 10))
                    )
                    shared = (
                        f"   shm {t['shm'] * 1e6:.1f} µs, mpi4py/shm {t['mpi4py/shm']:.2f}, ours/ours_mpi "
                        f"{t['ours/ours_mpi']:.3f}"
                        if "shm" in t
                        else ""
                    )
                    if "shm_window" in t:
                        shared += (
                            f"; in a shared buffer: shm {t['shm_window'] * 1e6:.1f} µs, mpi4py "
                            f"{t['mpi4py_window'] * 1e6:.1f} µs, ratio {t['mpi4py/shm_window']:.2f}"
                        )
                    print(
                        f"{op:<10}{mode:<9}{_human(nbytes):>9}{t['ours'] * 1e6:>12.1f}{t['mpi4py'] * 1e6:>12.1f}"
                        f"{t['gloo'] * 1e6:>12.1f}{extra}{t['ours/mpi4py']:>13.3f}{t['gloo/ours']:>11.2f}"
                        f"{t['ours/floor']:>12.3f}{shared}",
                        flush=True,
                    )
    if comm.rank == 0:
        _summarise(rows)
        payload = {
            "ranks": comm.size,
            "validation": ms.validation_enabled(),
            "load_average": os.getloadavg(),
            "shm_min_bytes": {"private": min_bytes(comm.size), "shared": min_bytes(comm.size, shared=True)},
            "rows": rows,
        }
        path = save("collectives" if comm.size == 2 else f"collectives_np{comm.size}", payload, args.results)
        _plot(rows, path.with_suffix(".png"))
        print(f"results: {path} and {path.with_suffix('.png')}")


def _summarise(rows: list[dict]) -> None:
    print(f"\nsummary (targets in brackets), load average {os.getloadavg()[0]:.2f}:")
    for backward in (False, True):
        mode = "forward+backward" if backward else "forward"
        picked = [r for r in rows if r["backward"] == backward]
        _summarise_shm(mode, [r for r in picked if "mpi4py/shm" in r])
        large = [r for r in picked if r["bytes"] >= 1 << 20]
        if not large:
            continue
        worst_mpi = max(large, key=lambda r: r["ours/mpi4py"])
        worst_gloo = min(large, key=lambda r: r["gloo/ours"])
        print(
            f"  {mode}, >= 1 MB: worst ours/mpi4py {worst_mpi['ours/mpi4py']:.3f} "
            f"({worst_mpi['op']} {_human(worst_mpi['bytes'])}) [<= {TARGET_LARGE_VS_MPI4PY}]; "
            f"worst gloo/ours {worst_gloo['gloo/ours']:.2f}x "
            f"({worst_gloo['op']} {_human(worst_gloo['bytes'])}) [>= {TARGET_GLOO_SPEEDUP}x]"
        )
        small = [r for r in picked if r["bytes"] == 1 << 10] or [min(picked, key=lambda r: r["bytes"])]
        worst_small = max(small, key=lambda r: r["ours"] - r["mpi4py"])
        added = (worst_small["ours"] - worst_small["mpi4py"]) * 1e6
        floor_added = (worst_small["floor"] - worst_small["mpi4py"]) * 1e6
        target = "" if backward else f" [<= {TARGET_SMALL_OVERHEAD_US} µs]"
        print(
            f"  {mode}, 1 KB: worst added latency {added:.1f} µs ({worst_small['op']}){target}, of which the "
            f"floor adds {floor_added:.1f} µs"
        )
        worst_floor = max(large, key=lambda r: r["ours/floor"])
        floor_share = max(large, key=lambda r: r["floor/mpi4py"])
        what = "autograd's engine and fresh tensors" if backward else "the small message (check or header)"
        print(
            f"  {mode}, >= 1 MB: worst ours/floor {worst_floor['ours/floor']:.3f} ({worst_floor['op']} "
            f"{_human(worst_floor['bytes'])}): our own cost; worst floor/mpi4py {floor_share['floor/mpi4py']:.3f} "
            f"({floor_share['op']} {_human(floor_share['bytes'])}): what {what} cost"
        )
        if "no-val/mpi4py" in large[0]:
            worst = max(large, key=lambda r: r["no-val/mpi4py"])
            print(
                f"  {mode}, >= 1 MB, validation off: worst ours/mpi4py "
                f"{worst['no-val/mpi4py']:.3f} ({worst['op']} {_human(worst['bytes'])})"
            )


def _summarise_shm(mode: str, rows: list[dict]) -> None:
    """The shared-memory allreduce against mpi4py from 1 MB on, and the default mode against the MPI path."""
    large = [r for r in rows if r["bytes"] >= 1 << 20]
    for key, buffers in (("mpi4py/shm", "private buffers, copied in"), ("mpi4py/shm_window", "in a shared buffer")):
        measured = [r for r in large if key in r]
        if measured:
            worst = min(measured, key=lambda r: r[key])
            print(
                f"  allreduce {mode}, >= 1 MB, {buffers}: shared memory at worst {worst[key]:.2f}x faster than "
                f"mpi4py on the same buffers ({_human(worst['bytes'])}) [>= {TARGET_SHM_SPEEDUP}x]"
            )
    if rows:
        worst = max(rows, key=lambda r: r["ours/ours_mpi"])
        print(
            f"  allreduce {mode}, every size: ours (default mode) at worst {worst['ours/ours_mpi']:.3f}x ours "
            f"with shared memory off ({_human(worst['bytes'])}) [<= {TARGET_AUTO_VS_MPI_PATH}]"
        )


def _human(nbytes: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    main()
