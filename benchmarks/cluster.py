"""An emulated multi-node cluster on one machine: every node a network namespace, nodes joined by rate-shaped links
through a switch, MPI ranks inside the nodes (needs root, iproute2 and MPICH's mpiexec).

    python benchmarks/cluster.py --nodes 2 --ranks-per-node 2 --rate 1gbit -- python train.py args
    python benchmarks/cluster.py --cleanup       # only remove the leftovers of runs whose process died

MPI sees separate nodes: ``MPI.COMM_WORLD.Split_type(COMM_TYPE_SHARED)`` groups the ranks of one namespace, so
``mpistrategy.comm.topology.topology()`` reports the emulated nodes with no override; ranks of one node talk through
MPICH's shared memory, ranks of different nodes over TCP through the shaped links (MPICH's UCX transport is
restricted to ``tcp,self``: by default it would reach the other namespaces through shared memory and cross-memory
attach, since they share one kernel, and no byte would cross a link). Every node has its own host name
(``node<k>``) that all nodes resolve, so code that connects to rank 0's host name (torch.distributed, gloo) works.
The network layout and the names are described in ``_netns.py``.

The nodes share this machine's cores, so a job's environment gets ``OMP_NUM_THREADS`` = cores // (all ranks of the
job), at least 1, unless it sets ``OMP_NUM_THREADS`` itself: the torch threads of every rank (mpistrategy and torch
read it) then fit the cores, where a node's share alone (its cores // its ranks) would oversubscribe them.

Python API, for tests and benchmarks that run several jobs on one cluster:

    from benchmarks.cluster import EmulatedCluster

    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        before = cluster.link_bytes()
        cluster.run([sys.executable, "job.py"], ranks_per_node=2, timeout=300, check=True)
        sent = [(after - start).sent for start, after in zip(before, cluster.link_bytes())]
        cluster.shape("10gbit")                   # the same nodes, another link rate, for the next contender

Everything the cluster creates is removed when the ``with`` block ends, also on an exception, Ctrl-C (SIGINT) or
SIGTERM/SIGHUP (turned into ``SystemExit`` while the cluster is up, unless the program installed its own
handlers); a run whose process was killed outright (SIGKILL) is removed by the next cluster that starts. The files
MPICH leaves when a job ends without ``MPI_Finalize`` (shared memory in ``/dev/shm``, Hydra's topology files in
``/tmp``) are removed when :meth:`EmulatedCluster.run` returns.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import IO, Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _netns  # noqa: E402
from _launch import end_with_parent, integer_in  # noqa: E402
from _netns import LinkBytes, NetworkSetupError, Node  # noqa: E402

__all__ = [
    "ClusterUnavailableError",
    "EmulatedCluster",
    "LinkBytes",
    "NetworkSetupError",
    "Node",
    "missing_requirements",
    "parse_rate",
]

LAUNCHER = Path(__file__).resolve().with_name("netns_launcher.sh")
# Keeps MPICH's network module off shared memory and cross-memory attach between namespaces (one kernel), so
# inter-node messages cross the links: UCX (the wheel's default) and libfabric (MPIR_CVAR_CH4_NETMOD=ofi) both
# restricted to TCP over the node's link. Ranks of one node still use MPICH's own shared memory.
TRANSPORT_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": _netns.NODE_DEVICE, "FI_PROVIDER": "tcp"}
UNSHAPED = ("unshaped", "none", "off")
STOP_GRACE_SECONDS = 5.0
_TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)bit$")
_RATE_FACTORS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
# The lowest link rate: below it tc's token bucket cannot hold the 256 KiB burst of _netns.shape (its buffer, in
# time, overflows at about 7.6 kbit/s), so the kernel would shape another bucket than the one asked for.
MIN_RATE_BITS = 8_000

log = logging.getLogger(__name__)


class ClusterUnavailableError(RuntimeError):
    """This machine or process lacks something the emulated cluster needs; the message names each missing part."""


def parse_rate(rate: str | None) -> int | None:
    """A link rate in bit/s from tc's notation (``"1gbit"``, ``"10gbit"``, ``"100mbit"``: decimal prefixes), at
    least 8kbit (:data:`MIN_RATE_BITS`), or ``None`` for ``None``/``"unshaped"``/``"none"``/``"off"`` (no limit)."""
    if rate is None or rate.strip().lower() in UNSHAPED:
        return None
    match = _RATE.match(rate.strip().lower())
    bits = float(match.group(1)) * _RATE_FACTORS[match.group(2)] if match else 0
    if bits < 1:
        raise ValueError(
            f"link rate {rate!r}: give bits per second in tc's units, like 1gbit, 10gbit or 100mbit, or 'unshaped'"
        )
    if bits < MIN_RATE_BITS:
        raise ValueError(
            f"link rate {rate!r} is {bits:g} bit/s: the lowest is 8kbit (below it tc's token bucket cannot hold "
            "the link's 256 KiB burst); give 8kbit or more, or 'unshaped'"
        )
    return int(bits)


def threads_per_rank(ranks: int) -> int:
    """The threads each of ``ranks`` ranks gets when all of them share this machine's cores: cores // ranks, at
    least 1 (:func:`machine_cores`)."""
    return max(1, machine_cores() // max(1, ranks))


def machine_cores() -> int:
    """The cores this process may run on, which every emulated node shares."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def missing_requirements() -> list[str]:
    """What this process lacks to run an emulated cluster, one sentence each (empty: nothing)."""
    missing = []
    if os.geteuid() != 0:
        missing.append(
            "root: the emulated cluster creates network namespaces, links and qdiscs (run as root, or with sudo; "
            "in a container: --privileged)"
        )
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` on PATH (package {package}: apt-get install {package})")
    if not Path("/proc/self/ns/net").exists():
        missing.append("a kernel with network namespaces (CONFIG_NET_NS)")
    if not os.access(LAUNCHER, os.X_OK):
        missing.append(f"an executable {LAUNCHER} (chmod +x it)")
    try:
        problem = _mpiexec_problem(tuple(_launch().mpiexec_command()))
    except ClusterUnavailableError as error:
        problem = str(error)
    if problem:
        missing.append(problem)
    return missing


class EmulatedCluster:
    """``nodes`` emulated nodes with links of ``rate`` (tc notation, default 1 Gbit/s; ``None``/"unshaped": no
    limit), up from :meth:`start` (or entering the ``with`` block) until :meth:`close` (or leaving it).

    Attributes:
        nodes: the nodes (namespace, host name ``node<k>``, address ``198.18.0.<10+k>``); MPI rank r of a job with
            R ranks per node runs on node r // R.
        run_name: the prefix of this cluster's namespaces, unique on the machine.
        rate_bits: the current link rate in bit/s, ``None`` when unshaped.
        removed_stale: the runs of dead processes whose leftovers :meth:`start` removed.
    """

    def __init__(self, nodes: int = 2, rate: str | None = "1gbit") -> None:
        self.run_name = _netns.new_run_name()
        self.nodes: tuple[Node, ...] = _netns.nodes_of(self.run_name, nodes)
        self.rate_bits = parse_rate(rate)
        self.removed_stale: list[str] = []
        self._up = False
        self._saved_handlers: dict[int, Any] = {}

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> EmulatedCluster:
        """Check the requirements, remove stale runs, build the network and shape it. Raises
        :class:`ClusterUnavailableError` (what is missing) or :class:`NetworkSetupError` (which step failed)."""
        missing = missing_requirements()
        if missing:
            raise ClusterUnavailableError("the emulated cluster needs " + "; ".join(missing))
        self._catch_termination()
        try:
            self.removed_stale = _netns.remove_stale_runs()
            if self.removed_stale:
                log.warning("removed the leftovers of dead emulated clusters: %s", ", ".join(self.removed_stale))
            self._up = True
            _netns.create(self.run_name, self.nodes)
            _netns.shape(self.run_name, self.nodes, self.rate_bits)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop what still runs in the nodes and remove the namespaces, links, bridge and host files. Idempotent;
        SIGINT/SIGTERM/SIGHUP wait until it is done."""
        masked = threading.current_thread() is threading.main_thread()
        if masked:
            previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *_TERMINATING_SIGNALS})
        try:
            if self._up:
                _netns.remove(self.run_name)
                self._up = False
        finally:
            for signum, handler in self._saved_handlers.items():
                signal.signal(signum, handler)
            self._saved_handlers.clear()
            if masked:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)

    def shape(self, rate: str | None) -> None:
        """Set every link to ``rate`` (tc notation; ``None``/"unshaped": no limit) without re-creating the nodes."""
        self._require_up()
        self.rate_bits = parse_rate(rate)
        _netns.shape(self.run_name, self.nodes, self.rate_bits)

    def shaped_rates(self) -> list[tuple[int | None, int | None]]:
        """Per node, the (send, receive) rates in bit/s that the kernel applies (``None``: unshaped)."""
        self._require_up()
        return _netns.shaped_rates(self.run_name, self.nodes)

    def link_bytes(self) -> tuple[LinkBytes, ...]:
        """Per node (index = node index), the bytes its link has sent and received since the cluster started;
        subtract two readings for what a job in between moved."""
        self._require_up()
        return tuple(_netns.link_bytes(node) for node in self.nodes)

    def routes(self) -> list[list[str]]:
        """Per node, the destinations it has routes to (only the cluster's own subnet)."""
        self._require_up()
        return [_netns.routes(node) for node in self.nodes]

    def mpiexec_command(self, command: Sequence[str], ranks_per_node: int = 1, nodes: int | None = None) -> list[str]:
        """The command line (run from the root namespace) that starts ``command`` under MPICH's mpiexec with
        ``ranks_per_node`` ranks on each of the first ``nodes`` nodes (default: all); mpiexec itself runs in node
        0 and starts the ranks through ``netns_launcher.sh``."""
        used = self._used_nodes(nodes)
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={ranks_per_node!r}: give a positive number of MPI ranks per node")
        hosts = ",".join(f"{node.namespace}:{ranks_per_node}" for node in used)
        return [
            "ip", "netns", "exec", used[0].namespace,
            *_launch().mpiexec_command(),
            "-launcher", "ssh", "-launcher-exec", str(LAUNCHER),
            "-hosts", hosts, "-n", str(ranks_per_node * len(used)),
            "-localhost", used[0].address,
            "-genvall",
            *command,
        ]  # fmt: skip

    def environment(self, env: Mapping[str, str] | None = None, ranks: int | None = None) -> dict[str, str]:
        """The environment of a job: this process's without MPI launcher variables, the transport settings that
        route inter-node messages over the links, then ``env``; for a job of ``ranks`` ranks in all, also
        ``OMP_NUM_THREADS`` = :func:`threads_per_rank` where neither this process nor ``env`` sets it (every node
        shares this machine's cores: a node's share per rank would oversubscribe them)."""
        job_env = {**_launch().without_launcher_variables(os.environ), **TRANSPORT_ENV, **(env or {})}
        if ranks is not None and "OMP_NUM_THREADS" not in job_env:
            job_env["OMP_NUM_THREADS"] = str(threads_per_rank(ranks))
        return job_env

    def run(
        self,
        command: Sequence[str],
        ranks_per_node: int = 1,
        *,
        nodes: int | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        capture_output: bool = False,
        check: bool = False,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` as an MPI job (see :meth:`mpiexec_command`) and return it when it ends, as
        :func:`subprocess.run` does (text output when captured; ``check`` raises ``CalledProcessError``). ``env``
        adds to (or overrides) the job's environment (:meth:`environment`), it does not replace it; without an
        ``OMP_NUM_THREADS`` there or in this process's environment, the job gets cores // its ranks.

        As with Hydra on a real cluster, a rank that exits non-zero without ``MPI_Abort`` (or a signal) does not end
        the ranks on other nodes: mpistrategy's failure handling aborts, and ``timeout`` bounds any other job.

        After ``timeout`` seconds, or when this process is interrupted, the job gets SIGINT (mpiexec passes it to
        every rank), then SIGKILL after a grace period, and anything left in the nodes is killed; the exception
        (``subprocess.TimeoutExpired``, ``KeyboardInterrupt``, ...) propagates.

        However the job ends, the files MPICH leaves when it ends without ``MPI_Finalize`` (``/dev/shm/mpich_shm_*``,
        ``/tmp/hydra_hwloc_xmlfile_*``) are removed: those that appeared while it ran and that no live process holds
        (the files of other jobs running at the same time are held by them).
        """
        self._require_up()
        args = self.mpiexec_command(command, ranks_per_node, nodes)
        ranks = ranks_per_node * len(self._used_nodes(nodes))
        pipe = subprocess.PIPE if capture_output else None
        mpich_files_before = _netns.mpich_files()
        try:
            job = subprocess.Popen(
                args,
                env=self.environment(env, ranks),
                stdin=stdin,
                stdout=pipe,
                stderr=pipe,
                text=True,
                start_new_session=True,
                preexec_fn=end_with_parent,
            )
            try:
                out, err = job.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._stop(job)
                out, err = job.communicate()
                raise subprocess.TimeoutExpired(args, timeout or 0, out, err) from None
            except BaseException:
                self._stop(job)
                raise
        finally:
            self._remove_job_files(mpich_files_before)
        done = subprocess.CompletedProcess(args, job.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def describe(self) -> str:
        """One line: the nodes, their addresses and the link rate."""
        if self.rate_bits is None:
            rate = "unshaped"
        elif self.rate_bits >= 10**9:
            rate = f"{self.rate_bits / 1e9:g} Gbit/s"
        else:
            rate = f"{self.rate_bits / 1e6:g} Mbit/s"
        listing = ", ".join(f"{node.hostname} {node.address}" for node in self.nodes)
        return f"emulated cluster {self.run_name}: {len(self.nodes)} nodes ({listing}), links {rate}"

    def _remove_job_files(self, before: set[str]) -> None:
        """Remove the MPICH files that appeared since ``before`` and that no live process holds (signals wait)."""
        masked = threading.current_thread() is threading.main_thread()
        if masked:
            previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *_TERMINATING_SIGNALS})
        try:
            new = _netns.mpich_files() - before
            if new and any(_netns.processes_in(node.namespace) for node in self.nodes):
                # The job's last processes may still be exiting (mpiexec returns once its proxies are gone).
                deadline = time.monotonic() + STOP_GRACE_SECONDS
                while any(_netns.processes_in(node.namespace) for node in self.nodes) and time.monotonic() < deadline:
                    time.sleep(0.05)
            removed = _netns.remove_unheld(new)
            if removed:
                log.info("removed what MPICH left of the job: %s", ", ".join(removed))
        finally:
            if masked:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)

    def _stop(self, job: subprocess.Popen[str]) -> None:
        if job.poll() is None:
            try:
                os.killpg(job.pid, signal.SIGINT)
                job.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            except ProcessLookupError:
                pass
        _netns.kill_processes(self.run_name)

    def _used_nodes(self, nodes: int | None) -> tuple[Node, ...]:
        if nodes is None:
            return self.nodes
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= len(self.nodes):
            raise ValueError(f"nodes={nodes!r}: this cluster has {len(self.nodes)} nodes; give 1 to {len(self.nodes)}")
        return self.nodes[:nodes]

    def _require_up(self) -> None:
        if not self._up:
            raise RuntimeError("the emulated cluster is not up: use `with EmulatedCluster(...) as cluster:`")

    def _catch_termination(self) -> None:
        """Turn SIGTERM/SIGHUP into SystemExit(128 + signal) while the cluster is up, so that teardown runs (only
        where the program kept the default action, and only in the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in _TERMINATING_SIGNALS:
            if signal.getsignal(signum) is signal.SIG_DFL:
                self._saved_handlers[signum] = signal.signal(signum, _exit_on_signal)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@cache
def _launch() -> ModuleType:
    """``mpistrategy.launch`` (the one mpiexec lookup), loaded on its own: importing the package would start MPI
    and torch in this controller process, which runs no rank."""
    package = importlib.util.find_spec("mpistrategy")
    if package is None or not package.submodule_search_locations:
        raise ClusterUnavailableError("mpistrategy installed in this Python (pip install -e '.[mpich]')")
    spec = importlib.util.spec_from_file_location(
        "_mpistrategy_launch", Path(package.submodule_search_locations[0]) / "launch.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def _mpiexec_problem(mpiexec: tuple[str, ...]) -> str:
    """Why ``mpiexec`` cannot start ranks in the nodes ("" if it can): it must be MPICH's Hydra, whose launcher
    can be replaced."""
    advice = "install the mpich extra in this environment (pip install -e '.[mpich]') or set MPISTRATEGY_MPIEXEC"
    if shutil.which(mpiexec[0]) is None:
        return f"MPICH's mpiexec: {mpiexec[0]} not found; {advice}"
    try:
        version = subprocess.run([mpiexec[0], "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"MPICH's mpiexec: {mpiexec[0]} --version failed ({error}); {advice}"
    if "HYDRA" not in version:
        return f"MPICH's mpiexec (Hydra): {mpiexec[0]} is another MPI's launcher; {advice}"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--nodes",
        type=integer_in(1, _netns.MAX_NODES),
        default=2,
        help=f"emulated nodes, 1 to {_netns.MAX_NODES} (default 2)",
    )
    parser.add_argument(
        "--ranks-per-node", type=integer_in(1, None), default=1, help="MPI ranks per node, 1 or more (default 1)"
    )
    parser.add_argument(
        "--rate",
        default="1gbit",
        type=_rate_argument,
        help="link rate per node and direction, tc notation, 8kbit or more: 1gbit (default), 10gbit, 100mbit, ... "
        "or unshaped",
    )
    parser.add_argument("--timeout", type=_positive_seconds, help="seconds before the job is stopped (> 0)")
    parser.add_argument("--cleanup", action="store_true", help="remove the leftovers of dead runs, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command each rank runs")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.cleanup:
        if os.geteuid() != 0:
            print("emulated cluster: --cleanup removes network namespaces and needs root", file=sys.stderr)
            return 2
        removed = _netns.remove_stale_runs()
        print(f"removed {len(removed)} stale run(s){': ' if removed else ''}{', '.join(removed)}", file=sys.stderr)
        return 0
    if not command:
        parser.error("give the command to run after --, for example: -- python train.py")
    try:
        cluster = EmulatedCluster(nodes=args.nodes, rate=args.rate)
        with cluster:
            threads = _threads_note(args.ranks_per_node * args.nodes)
            print(
                f"{cluster.describe()}; {args.ranks_per_node} rank(s) per node; {threads}", file=sys.stderr, flush=True
            )
            before = cluster.link_bytes()
            try:
                done = cluster.run(command, args.ranks_per_node, timeout=args.timeout, stdin=None)
            finally:
                _print_link_bytes(cluster, before)
    except (ClusterUnavailableError, NetworkSetupError, ValueError) as error:
        print(f"emulated cluster: {error}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired:
        print(f"emulated cluster: the job was stopped after --timeout {args.timeout:g} s", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print("emulated cluster: interrupted; the job was stopped and the nodes removed", file=sys.stderr)
        return 128 + signal.SIGINT
    return done.returncode if done.returncode >= 0 else 128 - done.returncode


def _threads_note(ranks: int) -> str:
    """How many threads each rank of a job of ``ranks`` ranks gets, and from where (for the startup line)."""
    if "OMP_NUM_THREADS" in os.environ:
        return f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} from the environment"
    return (
        f"OMP_NUM_THREADS={threads_per_rank(ranks)} (the nodes share this machine's {machine_cores()} cores: "
        f"cores // {ranks} ranks, at least 1; set OMP_NUM_THREADS to choose)"
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; give more than 0") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is out of range; give a number of seconds more than 0")
    return value


def _rate_argument(text: str) -> str:
    try:
        parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _print_link_bytes(cluster: EmulatedCluster, before: tuple[LinkBytes, ...]) -> None:
    moved = [after - start for start, after in zip(before, cluster.link_bytes(), strict=True)]
    listing = ", ".join(
        f"{node.hostname} sent {delta.sent / 1e6:.1f} MB, received {delta.received / 1e6:.1f} MB"
        for node, delta in zip(cluster.nodes, moved, strict=True)
    )
    print(f"links: {listing}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
