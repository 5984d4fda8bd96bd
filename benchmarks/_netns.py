"""Network namespaces, veth links, a bridge and tc rate shaping: the network of the emulated cluster (needs root).

One run's layout; every object lives in namespaces the run creates, the root namespace is never touched:

- ``<run>-sw``, the switch: a bridge ``br0`` with one port ``p<k>`` per node;
- ``<run>-n<k>``, node k: ``lo`` and ``eth0`` with ``198.18.0.<10+k>/24``, the other end of the veth pair whose
  switch end is ``p<k>``; host name ``node<k>`` (set by the MPI launcher) and an ``/etc/hosts`` that names every
  node (``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``);
- shaping: a token-bucket filter (``tc qdisc ... tbf``) of the link rate on ``eth0`` (what the node sends) and on
  ``p<k>`` (what it receives), so that every node has a full-duplex link of that rate into a non-blocking switch.

Addresses come from the benchmarking range 198.18.0.0/15 and the namespaces have no route beyond their /24 and no
link to the root namespace, so no packet can leave the machine.

A run is named ``mpiemu-<pid namespace>-<pid>-<process start time>-<sequence>`` after the process that owns it, so
concurrent runs never share a name, and the leftovers of a run whose owner died (killed, crashed) are recognised as
stale and removed by the next run (:func:`remove_stale_runs`).

MPICH leaves files outside the namespaces when a job ends without ``MPI_Finalize`` (an abort, a killed rank, a
signal): each node's shared-memory segment ``/dev/shm/mpich_shm_*`` and each Hydra proxy's hwloc topology file
``/tmp/hydra_hwloc_xmlfile_*`` (a fixed path, not ``$TMPDIR``). :func:`mpich_files` lists them before a job and
:func:`remove_unheld` removes, after it, those that appeared meanwhile and that no live process holds: a running
job keeps its own open (the ranks map the segment, the proxy keeps the topology file open), so the files of other
jobs running at the same time stay.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PREFIX = "mpiemu-"
SUBNET_PREFIX = "198.18.0."
SUBNET_BITS = 24
FIRST_HOST = 10
MAX_NODES = 240
NODE_DEVICE = "eth0"
BRIDGE = "br0"
NETNS_ETC = Path("/etc/netns")
# What an MPICH job ended without MPI_Finalize leaves: shared-memory segments and Hydra's hwloc topology files.
MPICH_FILES = ("/dev/shm/mpich_shm_*", "/tmp/hydra_hwloc_xmlfile_*")

_RUN_NAME = re.compile(r"^mpiemu-(\d+)-(\d+)-(\d+)-(\d+)$")
_NAMESPACE = re.compile(r"^(mpiemu-\d+-\d+-\d+-\d+)-(sw|n\d+)$")
_KILL_WAIT_SECONDS = 5.0
_sequence = itertools.count()

# What the kernel lacks when a step fails, and how to get it.
NETNS_HINT = (
    "the kernel must support network namespaces (CONFIG_NET_NS) and this process needs CAP_SYS_ADMIN and "
    "CAP_NET_ADMIN: run as root (in a container: --privileged, or --cap-add SYS_ADMIN --cap-add NET_ADMIN)"
)
BRIDGE_HINT = "the kernel must support Linux bridges (CONFIG_BRIDGE; `modprobe bridge`)"
VETH_HINT = "the kernel must support virtual ethernet pairs (CONFIG_VETH; `modprobe veth`)"
TBF_HINT = "the kernel must support the token bucket filter qdisc (CONFIG_NET_SCH_TBF; `modprobe sch_tbf`)"


class NetworkSetupError(RuntimeError):
    """A step of building or shaping the emulated network failed; the message names the command and the cause."""


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a node's link carried (the kernel's counters of its ``eth0``): ``sent`` = its transmitted bytes,
    ``received`` = its received bytes, Ethernet frames including headers."""

    sent: int
    received: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.sent - other.sent, self.received - other.received)


@dataclass(frozen=True)
class Node:
    """One emulated node: its namespace, host name and address."""

    index: int
    namespace: str
    hostname: str
    address: str


def new_run_name() -> str:
    """A name for a run owned by this process, unique on the machine while this process lives."""
    pid = os.getpid()
    return f"{PREFIX}{_pid_namespace()}-{pid}-{_start_ticks(pid)}-{next(_sequence)}"


def nodes_of(run: str, count: int) -> tuple[Node, ...]:
    """The nodes of ``run``: namespace ``<run>-n<k>``, host name ``node<k>``, address ``198.18.0.<10+k>``."""
    if not 1 <= count <= MAX_NODES:
        raise ValueError(f"nodes={count}: the emulated cluster has 1 to {MAX_NODES} nodes")
    return tuple(Node(k, f"{run}-n{k}", f"node{k}", f"{SUBNET_PREFIX}{FIRST_HOST + k}") for k in range(count))


def switch_of(run: str) -> str:
    """The namespace of ``run``'s switch."""
    return f"{run}-sw"


def create(run: str, nodes: tuple[Node, ...]) -> None:
    """Build ``run``'s switch and nodes (unshaped). On failure, what was built stays: call :func:`remove`."""
    switch = switch_of(run)
    _ip(["netns", "add", switch], "creating a network namespace", NETNS_HINT)
    _ip(["-n", switch, "link", "add", BRIDGE, "type", "bridge"], "creating the switch's bridge", BRIDGE_HINT)
    _ip(["-n", switch, "link", "set", BRIDGE, "up"], "bringing the bridge up")
    hosts = "".join(["127.0.0.1\tlocalhost\n::1\tlocalhost\n", *(f"{n.address}\t{n.hostname}\n" for n in nodes)])
    for node in nodes:
        port = _port(node)
        _ip(["netns", "add", node.namespace], "creating a network namespace", NETNS_HINT)
        _write_etc(node, hosts)
        veth = f"link add {NODE_DEVICE} netns {node.namespace} type veth peer name {port} netns {switch}"
        _ip(veth.split(), "creating a veth pair", VETH_HINT)
        _ip(["-n", node.namespace, "link", "set", "lo", "up"], "bringing lo up")
        _ip(
            ["-n", node.namespace, "addr", "add", f"{node.address}/{SUBNET_BITS}", "dev", NODE_DEVICE],
            "addressing a node",
        )
        _ip(["-n", node.namespace, "link", "set", NODE_DEVICE, "up"], "bringing a node's link up")
        _ip(["-n", switch, "link", "set", port, "master", BRIDGE], "attaching a link to the bridge")
        _ip(["-n", switch, "link", "set", port, "up"], "bringing a switch port up")


def shape(run: str, nodes: tuple[Node, ...], rate_bits: int | None) -> None:
    """Limit every node's link to ``rate_bits`` bit/s in each direction (``None``: remove the limit).

    A token bucket of ``rate_bits`` with a burst of 2 ms of traffic (at least 256 KiB, above the 64 KiB segments
    that GSO hands the qdisc) and at most 50 ms of queue, on both ends of each veth.
    """
    switch = switch_of(run)
    for node in nodes:
        for namespace, device in ((node.namespace, NODE_DEVICE), (switch, _port(node))):
            # Drop the current limit, if any (tc fails when there is none, which is fine).
            subprocess.run(
                ["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], capture_output=True, check=False
            )
            if rate_bits is not None:
                burst = max(256 * 1024, rate_bits // 8 // 500)
                tbf = f"-n {namespace} qdisc add dev {device} root tbf rate {rate_bits}bit burst {burst} latency 50ms"
                _tc(tbf.split(), "shaping a link", TBF_HINT)


def shaped_rates(run: str, nodes: tuple[Node, ...]) -> list[tuple[int | None, int | None]]:
    """Per node, the rates in bit/s the kernel applies to what it sends and what it receives (``None``: unshaped)."""
    switch = switch_of(run)
    return [(_tbf_rate(node.namespace, NODE_DEVICE), _tbf_rate(switch, _port(node))) for node in nodes]


def link_bytes(node: Node) -> LinkBytes:
    """The byte counters of ``node``'s link."""
    shown = _ip(
        ["-n", node.namespace, "-json", "-statistics", "link", "show", "dev", NODE_DEVICE], "reading a link's counters"
    )
    stats = json.loads(shown)[0]["stats64"]
    return LinkBytes(sent=stats["tx"]["bytes"], received=stats["rx"]["bytes"])


def routes(node: Node) -> list[str]:
    """The destinations ``node`` has a route to."""
    shown = _ip(["-n", node.namespace, "-json", "route", "show", "table", "all"], "reading a node's routes")
    return [route["dst"] for route in json.loads(shown) if route.get("type", "unicast") == "unicast"]


def namespaces_of(run: str) -> list[str]:
    """The namespaces of ``run`` that exist now."""
    return [name for name in list_namespaces() if (match := _NAMESPACE.match(name)) and match.group(1) == run]


def list_namespaces() -> list[str]:
    """The names of all named network namespaces."""
    shown = subprocess.run(["ip", "-json", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [entry["name"] for entry in json.loads(shown or "[]")]


def processes_in(namespace: str) -> list[int]:
    """The processes whose network namespace is ``namespace``."""
    shown = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False).stdout
    return [int(pid) for pid in shown.split()]


def kill_processes(run: str) -> None:
    """SIGKILL every process left in ``run``'s namespaces (all of them were started by the run) and wait until
    they are gone."""
    pids = {pid for namespace in namespaces_of(run) for pid in processes_in(namespace)}
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _KILL_WAIT_SECONDS
    while any(is_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def remove(run: str) -> None:
    """Remove everything of ``run``: its processes, namespaces (and with them the veths and the bridge) and
    ``/etc/netns`` entries. Idempotent; parts that are already gone are skipped."""
    kill_processes(run)
    for namespace in namespaces_of(run):
        subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, check=False)
    for etc in NETNS_ETC.glob(f"{run}-*"):
        shutil.rmtree(etc, ignore_errors=True)
    _remove_netns_etc_if_empty()


def mpich_files() -> set[str]:
    """The MPICH job files (:data:`MPICH_FILES`) that exist now."""
    return {path for pattern in MPICH_FILES for path in glob.glob(pattern)}


def remove_unheld(paths: Iterable[str]) -> list[str]:
    """Remove those of ``paths`` that no live process has open or mapped (of any mount namespace: files are
    compared by device and inode) and return them; the others, and paths already gone, are left alone."""
    candidates: dict[tuple[int, int], str] = {}
    for path in paths:
        try:
            info = os.lstat(path)
        except OSError:
            continue
        candidates[(info.st_dev, info.st_ino)] = path
    if not candidates:
        return []
    held = _held(candidates)
    removed = []
    for key, path in sorted(candidates.items(), key=lambda item: item[1]):
        if key in held:
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def _held(files: dict[tuple[int, int], str]) -> set[tuple[int, int]]:
    """Which of ``files`` (keyed by device and inode) a live process has open (``/proc/<pid>/fd``) or mapped
    (``/proc/<pid>/maps``)."""
    names = {Path(path).name for path in files.values()}
    inodes = {inode for _, inode in files}
    held: set[tuple[int, int]] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            descriptors = list((proc / "fd").iterdir())
        except OSError:  # gone, or not ours to read: judged by its maps alone
            descriptors = []
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor).rsplit("/", 1)[-1] not in names:
                    continue
                info = os.stat(descriptor)
            except OSError:
                continue
            held.add((info.st_dev, info.st_ino))
        try:
            maps = (proc / "maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].rsplit("/", 1)[-1].split(" ")[0] in names and int(fields[4]) in inodes:
                # A mapping names its file's inode (the device as the kernel shows it may differ): any candidate
                # with that inode counts as held, erring on the side of keeping.
                held |= {key for key in files if key[1] == int(fields[4])}
    return held


def stale_runs() -> list[str]:
    """Runs whose namespaces or ``/etc/netns`` entries exist but whose owner process is gone (runs of other PID
    namespaces, e.g. other containers, cannot be judged and are left alone)."""
    names = set(list_namespaces()) | ({entry.name for entry in NETNS_ETC.iterdir()} if NETNS_ETC.is_dir() else set())
    runs = {match.group(1) for name in names if (match := _NAMESPACE.match(name))}
    return sorted(run for run in runs if _owner_gone(run))


def remove_stale_runs() -> list[str]:
    """Remove the leftovers of every stale run (see :func:`stale_runs`) and return those runs' names."""
    runs = stale_runs()
    for run in runs:
        remove(run)
    return runs


def _owner_gone(run: str) -> bool:
    match = _RUN_NAME.match(run)
    if match is None:
        return False
    pid_namespace, pid, start = (int(group) for group in match.groups()[:3])
    if pid_namespace != _pid_namespace():
        return False
    return not is_running(pid) or _start_ticks(pid) != start


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_ticks(pid: int) -> int:
    """The start time of process ``pid`` in clock ticks after boot (field 22 of /proc/<pid>/stat), -1 if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _write_etc(node: Node, hosts: str) -> None:
    """Write the node's ``hosts`` and ``hostname`` under /etc/netns/<namespace>/, retrying when another run removed
    the (then empty) /etc/netns between the creation of it and of the node's folder."""
    etc = NETNS_ETC / node.namespace
    for attempt in range(3):
        try:
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "hostname").write_text(node.hostname + "\n")
            return
        except FileNotFoundError:
            if attempt == 2:
                raise


def _remove_netns_etc_if_empty() -> None:
    try:
        NETNS_ETC.rmdir()
    except OSError:
        pass


def _port(node: Node) -> str:
    return f"p{node.index}"


def _tbf_rate(namespace: str, device: str) -> int | None:
    shown = _tc(["-n", namespace, "-json", "qdisc", "show", "dev", device, "root"], "reading a link's qdisc")
    for qdisc in json.loads(shown or "[]"):
        if qdisc.get("kind") == "tbf":
            return int(qdisc["options"]["rate"]) * 8
    return None


def _ip(args: list[str], what: str, hint: str = "") -> str:
    return _command(["ip", *args], what, hint)


def _tc(args: list[str], what: str, hint: str = "") -> str:
    return _command(["tc", *args], what, hint)


def _command(command: list[str], what: str, hint: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        cause = done.stderr.strip() or f"exit status {done.returncode}"
        advice = f" ({hint})" if hint else ""
        raise NetworkSetupError(f"{what} failed{advice}: `{' '.join(command)}`: {cause}")
    return done.stdout
