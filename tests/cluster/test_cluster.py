"""The emulated cluster (benchmarks/cluster.py): real namespaces, links and MPI jobs, driven from this process.

The tests that build a cluster need root, iproute2 and MPICH's mpiexec; where one is missing they are skipped with
the missing parts as the reason. The tests of the messages for a missing requirement run everywhere.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from benchmarks import cluster as cluster_module
from benchmarks.cluster import EmulatedCluster, _netns, main, missing_requirements, parse_rate
from tests.mpi_harness import clean_environ

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = ROOT / "benchmarks" / "cluster.py"
ALLREDUCE_BENCHMARK = ROOT / "benchmarks" / "cluster_allreduce.py"
JOB = Path(__file__).parent / "scripts" / "cluster_job.py"
ELEMENTS = 2_000_000  # 8 MB of float32 per rank
SLEEPER = "import os, time; os.write(1, b'ready %d\\n' % os.getpid()); time.sleep(600)"
# An MPI job whose ranks print the MPICH files of their node (the shared memory they map, the topology file their
# Hydra proxy holds open), then rank 0 fails as an mpistrategy job does (MPI_Abort) while the others wait.
FILES_THEN_ABORT = """
import json, os
from mpi4py import MPI
comm = MPI.COMM_WORLD
mapped = {line.split()[-1] for line in open("/proc/self/maps") if "/mpich_shm_" in line}
proxy = f"/proc/{os.getppid()}/fd"
topology = {os.readlink(f"{proxy}/{fd}") for fd in os.listdir(proxy)}
topology = {path for path in topology if "hydra_hwloc_xmlfile_" in path}
print(json.dumps(sorted(mapped | topology)), flush=True)
comm.Barrier()
comm.rank == 0 and comm.Abort(3)
comm.Barrier()
"""

MISSING = missing_requirements()
needs_cluster = pytest.mark.skipif(bool(MISSING), reason="emulated cluster unavailable, needs " + "; ".join(MISSING))


@needs_cluster
def test_two_nodes_of_two_ranks_talk_through_the_shaped_link() -> None:
    devices_before = _root_namespace_links()
    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        run_name = cluster.run_name
        assert sorted(_netns.namespaces_of(run_name)) == sorted(
            [*(n.namespace for n in cluster.nodes), f"{run_name}-sw"]
        )
        assert cluster.shaped_rates() == [(10**9, 10**9)] * 2
        assert all(set(routes) <= {"198.18.0.0/24", "fe80::/64"} for routes in cluster.routes())
        before = cluster.link_bytes()
        done = cluster.run(
            [sys.executable, str(JOB), str(ELEMENTS)],
            ranks_per_node=2,
            env=clean_environ(),
            timeout=120,
            capture_output=True,
        )
        moved = [after - start for start, after in zip(before, cluster.link_bytes(), strict=True)]
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    records = _job_records(done.stdout)
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    for record in records:
        node = record["rank"] // 2
        assert record["shared_ranks"] == [2 * node, 2 * node + 1], record
        assert (record["num_nodes"], record["node_rank"], record["local_rank"]) == (2, node, record["rank"] % 2)
        assert record["node_sizes"] == [2, 2] and record["virtual"] is False, record
        assert (record["hostname"], record["address"]) == (f"node{node}", f"198.18.0.{10 + node}"), record
        assert record["main_address"] == "node0" and record["allreduce_exact"] is True, record
        assert record["buckets_in_window"] and record["node_step_in_shared_memory"], record
        assert record["equals_flat"] is True, record
    payload = ELEMENTS * 4
    for node, delta in enumerate(moved):
        assert delta.sent >= payload and delta.received >= payload, f"node{node} link moved {delta}, < {payload} B"
    assert _leftovers(run_name) == []
    assert _root_namespace_links() == devices_before


@needs_cluster
def test_a_job_ends_with_every_message_between_nodes_received() -> None:
    """The stall watchdogs' messages at exit cross the link too: each is received before MPI_Finalize, for which
    UCX would otherwise warn ``unexpected tag-receive descriptor ... was not matched``."""
    with EmulatedCluster(nodes=2, rate="unshaped") as cluster:
        done = cluster.run(
            [sys.executable, "-c", "import mpistrategy"],
            ranks_per_node=2,
            env=clean_environ(),
            timeout=120,
            capture_output=True,
        )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "was not matched" not in done.stdout + done.stderr, done.stderr[-3000:]


@needs_cluster
def test_a_failing_job_ends_and_the_cluster_and_mpich_files_are_removed() -> None:
    # Rank 0 fails while the ranks of the other node wait in a barrier; MPICH leaves its files, run removes them.
    with pytest.raises(subprocess.CalledProcessError) as failure:
        with EmulatedCluster(nodes=2, rate="10gbit") as cluster:
            run_name = cluster.run_name
            cluster.run(
                [sys.executable, "-c", FILES_THEN_ABORT],
                ranks_per_node=2,
                env=clean_environ(),
                timeout=60,
                check=True,
                capture_output=True,
            )
    assert failure.value.returncode == 3, failure.value.stderr[-3000:]
    assert _leftovers(run_name) == []
    files = set(
        re.findall(r'"(/[^"]*(?:mpich_shm_|hydra_hwloc_xmlfile_)[^"]*)"', failure.value.stdout)
    )  # lines interleave
    # one shared-memory segment and one topology file per node
    assert sum("/mpich_shm_" in path for path in files) == 2, failure.value.stdout
    assert sum("hydra_hwloc_xmlfile_" in path for path in files) == 2, failure.value.stdout
    assert [path for path in files if os.path.lexists(path)] == []


def test_only_the_mpich_files_no_process_holds_are_removed(tmp_path: Path) -> None:
    opened, mapped, free = (tmp_path / name for name in ("mpich_shm_a_0", "mpich_shm_b_0", "hydra_hwloc_xmlfile_c"))
    for path in (opened, mapped, free):
        path.write_bytes(b"x" * mmap.PAGESIZE)
    with opened.open("rb"), mapped.open("r+b") as handle:
        mapping = mmap.mmap(handle.fileno(), mmap.PAGESIZE)
        handle.close()  # held through the mapping alone, as MPICH's ranks hold their segment
        try:
            removed = _netns.remove_unheld([str(opened), str(mapped), str(free), str(tmp_path / "gone")])
        finally:
            mapping.close()
    assert removed == [str(free)]
    assert opened.exists() and mapped.exists() and not free.exists()


def test_each_rank_gets_its_share_of_the_machine_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cluster_module, "machine_cores", lambda: 8)
    cluster = EmulatedCluster(nodes=4, rate=None)  # not started: the environment needs no network
    assert cluster.environment(ranks=4)["OMP_NUM_THREADS"] == "2"  # 4 nodes x 1 rank on 8 shared cores
    assert cluster.environment(ranks=16)["OMP_NUM_THREADS"] == "1"
    assert cluster.environment({"OMP_NUM_THREADS": "3"}, ranks=4)["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in cluster.environment()
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cluster.environment(ranks=4)["OMP_NUM_THREADS"] == "5"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks-per-node", "0"], "argument --ranks-per-node: 0 is out of range; give 1 or more"),
        (["--ranks-per-node", "-2"], "argument --ranks-per-node: -2 is out of range; give 1 or more"),
        (["--nodes", "0"], "argument --nodes: 0 is out of range; give 1 to 240"),
        (["--timeout", "0"], "argument --timeout: 0 is out of range; give a number of seconds more than 0"),
        (["--timeout", "-5"], "argument --timeout: -5 is out of range; give a number of seconds more than 0"),
        (["--rate", "0.5kbit"], "argument --rate: link rate '0.5kbit' is 500 bit/s: the lowest is 8kbit"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_built(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_module.EmulatedCluster, "start", _must_not_start)
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--", "true"])
    assert refused.value.code == 2
    assert message in capsys.readouterr().err


def _must_not_start(self: EmulatedCluster) -> EmulatedCluster:
    raise AssertionError("the cluster was started despite a bad argument")


@needs_cluster
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_the_script_removes_the_cluster_when_interrupted(signum: int) -> None:
    script = _start_script("--nodes", "2", "--rate", "unshaped", "--", sys.executable, "-c", SLEEPER)
    try:
        run_name, rank_pids = _wait_for_ranks(script, 2)
        assert len(_netns.namespaces_of(run_name)) == 3
        script.send_signal(signum)
        _, err = script.communicate(timeout=30)
    finally:
        _kill(script)
    assert script.returncode == 128 + signum, err
    assert not [pid for pid in rank_pids if _netns.is_running(pid)], "ranks survived the interrupted script"
    assert _leftovers(run_name) == []


@needs_cluster
def test_a_killed_runs_job_ends_and_its_namespaces_are_removed_by_the_next_run() -> None:
    script = _start_script("--nodes", "2", "--rate", "unshaped", "--", sys.executable, "-c", SLEEPER)
    try:
        run_name, rank_pids = _wait_for_ranks(script, 2)
        script.kill()
        script.wait(timeout=30)
    finally:
        _kill(script)
    deadline = time.monotonic() + 15  # mpiexec gets SIGTERM when the script dies, and ends the ranks
    while any(_netns.is_running(pid) for pid in rank_pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in rank_pids if _netns.is_running(pid)], "the ranks outlived the killed script"
    assert len(_netns.namespaces_of(run_name)) == 3
    with EmulatedCluster(nodes=1, rate=None) as cluster:
        assert run_name in cluster.removed_stale
        assert _leftovers(run_name) == [] and not [pid for pid in rank_pids if _netns.is_running(pid)]
    assert _leftovers(cluster.run_name) == []


@needs_cluster
def test_the_allreduce_benchmark_times_every_contender(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ALLREDUCE_BENCHMARK), "--quick", "--rates", "1gbit", "--results", str(tmp_path)],
        env=clean_environ(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    payload = json.loads((tmp_path / "cluster_allreduce.json").read_text())
    rows = payload["contenders"]
    assert set(rows) == {"one node", "2x2 1gbit"}
    assert all(row["median_ms"] > 0 and len(row["rounds_ms"]) == 1 for row in rows.values())
    # 4 MB allreduces: between the nodes every link carries at least the payload each way; within one node, nothing.
    assert all(min(rows[name]["sent_mb_per_allreduce"]) >= 4.0 for name in rows if name != "one node"), rows
    assert max(rows["one node"]["sent_mb_per_allreduce"]) < 0.1, rows["one node"]
    assert "x one node" in done.stdout


@needs_cluster
@pytest.mark.parametrize(
    ("tool", "word", "error", "hint"),
    [
        ("ip", "veth", "Error: Unknown device type.", "(CONFIG_VETH; `modprobe veth`)"),
        ("tc", "tbf", "Error: Specified qdisc kind is unknown.", "(CONFIG_NET_SCH_TBF; `modprobe sch_tbf`)"),
    ],
    ids=["veth", "tbf"],
)
def test_a_kernel_without_veth_or_tbf_is_named_and_the_partial_cluster_removed(
    tmp_path: Path, tool: str, word: str, error: str, hint: str
) -> None:
    # A stand-in for `ip` or `tc` that answers as a kernel without that feature does and runs everything else.
    (tmp_path / tool).write_text(
        f'#!/bin/sh\ncase " $* " in *" {word} "*) echo "{error}" >&2; exit 2 ;; esac\nexec {shutil.which(tool)} "$@"\n'
    )
    (tmp_path / tool).chmod(0o755)
    done = subprocess.run(
        [sys.executable, str(CLUSTER_SCRIPT), "--", "true"],
        env={**clean_environ(), "PATH": f"{tmp_path}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert hint in done.stderr and error in done.stderr, done.stderr
    run_name = re.search(r"(mpiemu-\d+-\d+-\d+-\d+)-", done.stderr).group(1)
    assert _leftovers(run_name) == []


def test_a_missing_tool_is_named(tmp_path: Path) -> None:
    for tool in ("ip", "unshare"):  # everything but tc
        if shutil.which(tool):
            (tmp_path / tool).symlink_to(shutil.which(tool))
    done = subprocess.run(
        [sys.executable, str(CLUSTER_SCRIPT), "--", "true"],
        env={**clean_environ(), "PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "`tc` on PATH (package iproute2: apt-get install iproute2)" in done.stderr


def test_running_without_root_is_named() -> None:
    """The command line, started by a user other than root, exits with 2 and says it needs root.

    As root, the check switches to ``nobody``, who may not be able to read the checkout (a clone in a 0700
    directory) or run its virtual environment's Python. So the script and the modules it imports are copied to a
    world-readable directory and run by the Python the virtual environment was made from (the standard library is
    all the script needs before its requirement check).
    """
    drop_root = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    if drop_root and shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to run as a user other than root")
    python = _base_python() if drop_root else sys.executable
    with tempfile.TemporaryDirectory(prefix="mpistrategy-cluster-") as scratch:
        os.chmod(scratch, 0o755)
        for name in (CLUSTER_SCRIPT.name, "_launch.py", "_netns.py", "netns_launcher.sh"):
            shutil.copy2(CLUSTER_SCRIPT.with_name(name), scratch)
        probe = subprocess.run([*drop_root, python, "-c", "pass"], capture_output=True, timeout=60, check=False)
        if probe.returncode != 0:
            pytest.skip(f"{python} cannot be run by the unprivileged user (exit {probe.returncode})")
        done = subprocess.run(
            [*drop_root, python, str(Path(scratch) / CLUSTER_SCRIPT.name), "--", "true"],
            env=clean_environ(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            cwd="/",
        )
    assert done.returncode == 2, done.stderr
    assert "the emulated cluster needs root" in done.stderr


def _base_python() -> str:
    """The interpreter this one's virtual environment was made from (this one outside a virtual environment)."""
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")


def test_bad_sizes_and_rates_are_refused() -> None:
    assert (parse_rate("1gbit"), parse_rate("10gbit"), parse_rate("250mbit"), parse_rate("unshaped")) == (
        10**9,
        10**10,
        250 * 10**6,
        None,
    )
    for rate in ("1gb", "fast", "0gbit", "1 gbps"):
        with pytest.raises(ValueError, match="tc's units, like 1gbit"):
            parse_rate(rate)
    assert parse_rate("8kbit") == 8000
    for rate in ("7kbit", "0.5kbit", "100bit"):
        with pytest.raises(ValueError, match="the lowest is 8kbit"):
            parse_rate(rate)
    with pytest.raises(ValueError, match="1 to 240 nodes"):
        EmulatedCluster(nodes=0)


def _job_records(stdout: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if line.startswith("CLUSTER_JOB ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0].removeprefix("CLUSTER_JOB "))


def _leftovers(run_name: str) -> list[str]:
    """What of ``run_name`` still exists: namespaces, /etc/netns entries, processes in its namespaces."""
    namespaces = _netns.namespaces_of(run_name)
    etc = [str(path) for path in _netns.NETNS_ETC.glob(f"{run_name}-*")]
    processes = [f"pid {pid} in {ns}" for ns in namespaces for pid in _netns.processes_in(ns)]
    return [*namespaces, *etc, *processes]


def _root_namespace_links() -> list[str]:
    """The veth and bridge devices of the root namespace (the cluster must never add any)."""
    shown = [
        subprocess.run(["ip", "-json", "link", "show", "type", kind], capture_output=True, text=True, check=True)
        for kind in ("veth", "bridge")
    ]
    return sorted(link["ifname"] for done in shown for link in json.loads(done.stdout or "[]"))


def _start_script(*args: str) -> subprocess.Popen[bytes]:
    """The script with SIGINT at its default action, as from a terminal: a test run started in the background
    (``pytest &`` from a script, ``nohup``) ignores SIGINT, and a child inherits an ignored signal."""
    return subprocess.Popen(
        [sys.executable, str(CLUSTER_SCRIPT), *args],
        env=clean_environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        preexec_fn=_default_sigint,
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_ranks(script: subprocess.Popen[bytes], ranks: int, seconds: float = 60) -> tuple[str, list[int]]:
    """The cluster's run name (from the script's first stderr line, which also states the threads per rank) and the
    pids of its ``ranks`` ranks, once all of them printed 'ready <pid>'."""
    out, err = b"", b""
    deadline = time.monotonic() + seconds
    while len(re.findall(rb"ready (\d+)\n", out)) < ranks or not (
        header := re.search(rb"emulated cluster (mpiemu-[0-9-]+):.*; OMP_NUM_THREADS=[0-9]+", err)
    ):
        assert time.monotonic() < deadline and script.poll() is None, f"no ranks ready:\n{out!r}\n{err!r}"
        readable, _, _ = select.select([script.stdout, script.stderr], [], [], 0.5)
        for stream in readable:
            chunk = os.read(stream.fileno(), 65536)
            out, err = (out + chunk, err) if stream is script.stdout else (out, err + chunk)
    run_name = header.group(1).decode()
    pids = [int(pid) for pid in re.findall(rb"ready (\d+)\n", out)]
    return run_name, pids


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()
