"""A multi-node SLURM cluster on one machine: the emulated nodes of benchmarks/cluster.py (network namespaces on
a private switch, addresses 198.18.0.<10+k>), a slurmctld in node 0, a slurmd in every node and a munged of its own
(needs root, iproute2, and slurm-wlm and munge: ``slurm/local-cluster.sh install`` installs them).

    python benchmarks/slurm_cluster.py --nodes 2 -- srun -N 2 --mpi=pmi2 hostname
    python benchmarks/slurm_cluster.py --nodes 2                 # a shell in node 0: sbatch, squeue, sinfo ...

The command runs in node 0, with ``SLURM_CONF`` naming the cluster's configuration (the clients of this machine's
own SLURM, if any, are not affected: the daemons listen inside the nodes and the configuration lives in a directory
of the cluster's own). A job's steps run in the nodes SLURM gives them, each node with its own host name
(``node<k>``) and network; MPI ranks started by ``srun --mpi=pmi2`` see the nodes as separate
(``Split_type(COMM_TYPE_SHARED)`` groups each node's ranks), and talk between nodes over TCP through the links with
the transport settings of :data:`benchmarks.cluster.TRANSPORT_ENV` (which :meth:`SlurmCluster.settings` holds).

Python API, for tests:

    with SlurmCluster(nodes=2) as slurm:
        done = slurm.run(["sbatch", "--parsable", "-N", "2", "job.sbatch"], env=slurm.environment())

Everything it starts is stopped and removed when the ``with`` block ends (also on an exception or SIGTERM): the
daemons, every process left in the nodes (job steps included), the namespaces and the directory of configuration,
state and logs; the leftovers of a run whose process was killed outright are removed by the next cluster.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from cluster import TRANSPORT_ENV, ClusterUnavailableError, EmulatedCluster, missing_requirements  # noqa: E402

__all__ = ["ClusterUnavailableError", "SlurmCluster", "SlurmStartError", "missing_slurm"]

DAEMONS = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "nsenter")
CPUS_PER_NODE = 4
READY_SECONDS = 60.0
# Job ids start at a random number in [FIRST_JOB_ID, FIRST_JOB_ID + JOB_ID_SPREAD), below SLURM's MaxJobId: MPICH
# names a job step's shared memory (/dev/shm/mpich_shm_<id>_<node>) after its id, and a step that ends without
# MPI_Finalize (an abort, a stall exit) leaves it there; a later step of the same id, on another cluster of this
# machine (a new cluster counts from 1 again), would map that stale segment and fail in MPI_Init.
FIRST_JOB_ID = 1_000_000
JOB_ID_SPREAD = 60_000_000
STOP_SECONDS = 10.0
# Runs a command in a node: its network namespace, a UTS namespace with the node's host name and a mount namespace
# with the node's hosts file. Not `ip netns exec`, which remounts /sys: slurmd then finds no cgroup file system.
_ENTER = (
    'mount --bind "/etc/netns/$1/hosts" /etc/hosts && cat "/etc/netns/$1/hostname" > /proc/sys/kernel/hostname '
    '&& shift && exec "$@"'
)


class SlurmStartError(RuntimeError):
    """A daemon of the cluster did not start or the nodes did not become idle; the message holds its log's tail."""


def missing_slurm() -> list[str]:
    """What this machine lacks to run a :class:`SlurmCluster`, one sentence each (empty: nothing)."""
    missing = missing_requirements()
    absent = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if absent:
        missing.append(
            f"SLURM and munge ({', '.join(absent)} not on PATH): slurm/local-cluster.sh install (apt-get install "
            "slurm-wlm munge)"
        )
    return missing


class SlurmCluster:
    """``nodes`` emulated nodes (``node0`` ...) with unshaped links, each running a slurmd with ``cpus`` CPUs in
    partition ``debug``; up from :meth:`start` (or the ``with`` block) until :meth:`close`.

    Attributes:
        directory: configuration (``slurm.conf``), state, spool and logs (``*.log``); removed by :meth:`close`.
        network: the :class:`~benchmarks.cluster.EmulatedCluster` of the nodes.
    """

    def __init__(self, nodes: int = 2, cpus: int = CPUS_PER_NODE) -> None:
        self.network = EmulatedCluster(nodes=nodes, rate=None)
        self.cpus = cpus
        self.directory = Path(tempfile.mkdtemp(prefix="mpistrategy-slurm-nodes-"))
        self.conf = self.directory / "slurm.conf"
        self.socket = self.directory / "munge.socket"
        self._daemons: list[subprocess.Popen[bytes]] = []
        self._munged_pid: int | None = None

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> SlurmCluster:
        """Build the nodes, start munged, slurmctld and the slurmds, and wait until every node is idle. Raises
        :class:`~benchmarks.cluster.ClusterUnavailableError` (what is missing) or :class:`SlurmStartError`."""
        missing = missing_slurm()
        if missing:
            raise ClusterUnavailableError("the SLURM cluster needs " + "; ".join(missing))
        try:
            self.network.start()
            self.conf.write_text(self._configuration())
            self._start_munged()
            self._daemons.append(self._daemon(0, "slurmctld"))
            self._daemons += [self._daemon(node.index, "slurmd") for node in self.network.nodes]
            self._wait_until_idle()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop the daemons and munged, kill what is left in the nodes, remove the nodes and the directory."""
        for daemon in reversed(self._daemons):
            _stop(daemon)
        self._daemons.clear()
        if self._munged_pid is not None:
            _kill(self._munged_pid)
            self._munged_pid = None
        self.network.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def command(self, argv: Sequence[str], node: int = 0) -> list[str]:
        """``argv`` as a command line that runs it in ``node`` (from the root namespace), with ``SLURM_CONF``."""
        namespace = self.network.nodes[node].namespace
        return [
            "nsenter", f"--net=/var/run/netns/{namespace}", "unshare", "--uts", "--mount",
            "sh", "-c", _ENTER, "sh", namespace, "env", f"SLURM_CONF={self.conf}", *argv,
        ]  # fmt: skip

    def settings(self) -> dict[str, str]:
        """The variables a job's submitter adds to its environment (sbatch exports them to the job): the cluster's
        ``SLURM_CONF`` and the transport settings that send MPI's messages between nodes over the links."""
        return {**TRANSPORT_ENV, "SLURM_CONF": str(self.conf)}

    def environment(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment without MPI launcher variables, with :meth:`settings` and ``env``."""
        return self.network.environment({**self.settings(), **(env or {})})

    def run(
        self, argv: Sequence[str], node: int = 0, env: Mapping[str, str] | None = None, timeout: float | None = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` (a SLURM client such as sbatch, srun, scontrol) in ``node``; its output as text."""
        return subprocess.run(
            self.command(argv, node), env=dict(env) if env is not None else None, capture_output=True, text=True,
            timeout=timeout, stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def logs(self, lines: int = 20) -> str:
        """The last ``lines`` of every daemon's log."""
        tails = []
        for log in sorted(self.directory.glob("*.log")):
            tails.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(tails)

    def _configuration(self) -> str:
        directory, nodes = self.directory, self.network.nodes
        lines = [
            "ClusterName=mpistrategy-nodes",
            f"FirstJobId={FIRST_JOB_ID + secrets.randbelow(JOB_ID_SPREAD)}",
            f"SlurmctldHost={nodes[0].hostname}({nodes[0].address})",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket},cred_expire=10",
            "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={directory}/jobcomp.txt",
            "KillWait=5",
            "MinJobAge=300",
            "InactiveLimit=0",
            "MessageTimeout=10",
            "SchedulerParameters=sched_interval=2,bf_interval=2,sched_min_interval=0",
            f"StateSaveLocation={directory}/state",
            f"SlurmdSpoolDir={directory}/spool/%n",
            f"SlurmctldPidFile={directory}/slurmctld.pid",
            f"SlurmdPidFile={directory}/slurmd.%n.pid",
            f"SlurmctldLogFile={directory}/slurmctld.log",
            f"SlurmdLogFile={directory}/slurmd.%n.log",
        ]
        lines += [
            f"NodeName={node.hostname} NodeAddr={node.address} CPUs={self.cpus} Boards=1 SocketsPerBoard=1 "
            f"CoresPerSocket={self.cpus} ThreadsPerCore=1 State=UNKNOWN"
            for node in nodes
        ]
        names = ",".join(node.hostname for node in nodes)
        lines.append(f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE")
        return "\n".join(lines) + "\n"

    def _start_munged(self) -> None:
        """A munged of the cluster's own on its own socket (a path: every node reaches it); the key is the
        machine's (/etc/munge/munge.key)."""
        pid_file = self.directory / "munged.pid"
        started = subprocess.run(
            [
                "munged", "--force", f"--socket={self.socket}", f"--pid-file={pid_file}",
                f"--log-file={self.directory}/munged.log", f"--seed-file={self.directory}/munged.seed",
            ],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if started.returncode != 0:
            raise SlurmStartError(f"munged did not start (exit {started.returncode}): {started.stderr.strip()}")
        self._munged_pid = int(pid_file.read_text().strip())

    def _daemon(self, node: int, name: str) -> subprocess.Popen[bytes]:
        """``name`` (slurmctld or slurmd) in the foreground in ``node``, its output into ``<name>.out``."""
        (self.directory / "state").mkdir(exist_ok=True)
        (self.directory / "spool" / self.network.nodes[node].hostname).mkdir(parents=True, exist_ok=True)
        with open(self.directory / f"{name}.{node}.out", "ab") as output:
            return subprocess.Popen(
                self.command([name, "-D", "-f", str(self.conf)], node),
                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def _wait_until_idle(self) -> None:
        deadline = time.monotonic() + READY_SECONDS
        states = ""
        while time.monotonic() < deadline:
            for daemon in self._daemons:
                if daemon.poll() is not None:
                    raise SlurmStartError(f"a SLURM daemon ended (exit {daemon.returncode}):\n{self.logs()}")
            states = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=30).stdout
            if len(states.split()) == 2 * len(self.network.nodes) and all(
                state == "idle" for state in states.split()[1::2]
            ):
                return
            time.sleep(0.5)
        raise SlurmStartError(
            f"the nodes are not idle after {READY_SECONDS:.0f} s ({states.strip()!r}):\n{self.logs()}"
        )


def _stop(daemon: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after :data:`STOP_SECONDS`."""
    if daemon.poll() is None:
        daemon.terminate()
        try:
            daemon.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def _kill(pid: int) -> None:
    """SIGTERM to a process that is not our child (munged detaches), waiting up to :data:`STOP_SECONDS`."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_SECONDS
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    parser.add_argument("--cpus", type=int, default=CPUS_PER_NODE, help=f"CPUs per node (default {CPUS_PER_NODE})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run in node 0")
    args = parser.parse_args(argv)
    command = (args.command[1:] if args.command[:1] == ["--"] else args.command) or [os.environ.get("SHELL", "sh")]
    try:
        with SlurmCluster(nodes=args.nodes, cpus=args.cpus) as slurm:
            print(f"SLURM on {slurm.network.describe()}", file=sys.stderr, flush=True)
            return subprocess.call(slurm.command(command), env=slurm.environment())
    except (ClusterUnavailableError, SlurmStartError) as error:
        print(f"SLURM cluster: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
