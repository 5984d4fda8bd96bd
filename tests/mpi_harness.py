"""Pytest plugin that runs ``@pytest.mark.mpi`` tests on several MPI ranks.

Mark a test with ``@pytest.mark.mpi`` (rank counts 1-4) or
``@pytest.mark.mpi(ranks=(2, 3), timeout=30)`` and use ``mpi4py.MPI.COMM_WORLD``
in it as usual; the ``mpi_nranks`` fixture holds the rank count.

Outer (plain) run: each mpi test is parametrized per rank count (``test_x[np2]``).
The first item at a rank count launches one ``mpiexec -n N python -m pytest @<node ids>``
job for all selected items at that rank count, whatever folder and module they are in
(each rank's start-up, most of it importing torch and Lightning, is paid once per rank
count, not once per folder or module); each module starts from the job's environment
variables. The other items report the cached results.

Inner run (``MPISTRATEGY_TEST_NRANKS`` set, on every rank): only the mpi tests at
that rank count are kept. Each rank appends its outcomes to ``rank<r>.jsonl`` in
``MPISTRATEGY_TEST_REPORT_DIR`` (if set) and calls ``MPI.COMM_WORLD.Abort`` after a
failure, so no rank waits forever in a collective. To debug by hand, run e.g.
``MPISTRATEGY_TEST_NRANKS=2 mpiexec -n 2 python -m pytest tests/test_x.py``; a plain
``mpiexec -n 2 python -m pytest`` would make every rank an outer run.

A job is killed (SIGTERM, then SIGKILL, to its process group) when a test exceeds
its timeout, when it exceeds the sum of its tests' timeouts plus
``mpi_startup_timeout``, or when, after its first test, all ranks spend that long
outside tests (e.g. hung at shut-down).
Tests a job never reached, or left unfinished only because another test's failure
aborted it, are rerun in a fresh job.

``MPISTRATEGY_MPIEXEC`` overrides the launcher (default: the ``mpiexec`` next to
``sys.executable``, else on ``PATH``); ``MPISTRATEGY_MPIEXEC_ARGS`` adds flags to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import pytest

from tests import job_processes

NRANKS_ENV = "MPISTRATEGY_TEST_NRANKS"
REPORT_DIR_ENV = "MPISTRATEGY_TEST_REPORT_DIR"
DEFAULT_RANKS = (1, 2, 3, 4)

_FIXTURE = "mpi_nranks"
_INNER_RUN_PREFIX = "MPISTRATEGY_TEST_"
_POLL_SECONDS = 0.2
_KILL_GRACE_SECONDS = 5.0
_TAIL_LINES = 40
#: how far into a test's timeout its ranks write their stacks
_STACKS_AT = 0.9
#: frames of pytest itself, left out of those stacks
_PYTEST_FRAMES = ("/_pytest/", "/pluggy/", "/pytest/__main__.py", "<frozen runpy>")

Record = dict[str, Any]
When = Literal["setup", "call", "teardown"]
Outcome = Literal["passed", "failed", "skipped"]


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the command-line and ini options."""
    group = parser.getgroup("mpi", "multi-rank MPI tests")
    group.addoption(
        "--mpi-ranks",
        type=_parse_ranks,
        metavar="N,M,...",
        help="only run MPI tests at these rank counts (default: all counts of each marker)",
    )
    group.addoption("--no-mpi", action="store_true", help="skip all MPI tests")
    parser.addini(
        "mpi_test_timeout",
        "default timeout in seconds of one MPI test",
        type="float",
        default=60.0,
    )
    parser.addini(
        "mpi_startup_timeout",
        "start-up seconds of an MPI job, added to its tests' timeouts; also the most its ranks "
        "may spend outside tests once one started (e.g. hung at shut-down)",
        type="float",
        default=30.0,
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker and the outer- or inner-run plugin."""
    config.addinivalue_line(
        "markers",
        "mpi(ranks=(1, 2, 3, 4), timeout=None): run the test under mpiexec at each "
        "rank count; timeout in seconds (default: ini mpi_test_timeout)",
    )
    nranks = _inner_nranks()
    if nranks is not None:
        config.pluginmanager.register(_RankRecorder(config, nranks), "mpi_rank_recorder")
    elif not config.option.no_mpi:
        config.pluginmanager.register(_Launcher(config), "mpi_launcher")


@pytest.fixture(autouse=True)
def mpi_nranks() -> int | None:
    """Rank count of the running MPI test (parametrized per marker); None otherwise."""
    return None


_JOB_ENVIRON = dict(os.environ)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In an inner run, every module starts from the environment the job started with: a job runs many modules,
    and a module's tests may leave variables behind (Lightning's ``seed_everything`` sets
    ``PL_GLOBAL_SEED``, which seeds every later Trainer's sampler)."""
    global _last_module
    if _inner_nranks() is None or item.path == _last_module:
        return
    _last_module = item.path
    os.environ.clear()
    os.environ.update(_JOB_ENVIRON)


_last_module: Path | None = None


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize mpi tests over their rank counts, after any other parametrization."""
    marker = metafunc.definition.get_closest_marker("mpi")
    if marker is not None:
        ranks = _marker_ranks(marker)
        metafunc.parametrize(_FIXTURE, ranks, ids=[f"np{n}" for n in ranks])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect rank counts not wanted in this run; apply ``--no-mpi``."""
    inner = _inner_nranks()
    wanted = {inner} if inner is not None else config.option.mpi_ranks
    selected, deselected = [], []
    for item in items:
        nranks = _nranks(item)
        if nranks is None:
            keep = inner is None
        else:
            keep = wanted is None or nranks in wanted
            if config.option.no_mpi:
                item.add_marker(pytest.mark.skip(reason="MPI tests disabled by --no-mpi"))
        (selected if keep else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


_STARTUP_ENVIRON = dict(os.environ)


def clean_environ() -> dict[str, str]:
    """The environment pytest started with, without MPI launcher variables and this harness's inner-run variables.

    It is the environment at startup, not the current one: single-process tests that train in this process leave
    variables behind (Lightning's ``PL_GLOBAL_SEED`` reseeds every later Trainer and its sampler), and an MPI job
    started after them must not depend on which tests ran before it.
    """
    from mpistrategy.launch import without_launcher_variables  # on use: importing mpistrategy initialises MPI

    return without_launcher_variables(_STARTUP_ENVIRON, (_INNER_RUN_PREFIX,))


def _parse_ranks(text: str) -> set[int]:
    try:
        ranks = {int(part) for part in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rank counts, got {text!r}") from None
    if min(ranks) < 1:
        raise argparse.ArgumentTypeError(f"rank counts must be positive, got {text!r}")
    return ranks


def _inner_nranks() -> int | None:
    value = os.environ.get(NRANKS_ENV)
    return None if value is None else int(value)


def _marker_ranks(marker: pytest.Mark) -> tuple[int, ...]:
    if marker.args or not set(marker.kwargs) <= {"ranks", "timeout"}:
        raise TypeError(f"pytest.mark.mpi takes only the keywords ranks and timeout, got {marker}")
    ranks = tuple(marker.kwargs.get("ranks", DEFAULT_RANKS))
    if not ranks or not all(isinstance(n, int) and n >= 1 for n in ranks):
        raise ValueError(f"pytest.mark.mpi ranks must be positive ints, got {ranks!r}")
    return ranks


def _nranks(item: pytest.Item) -> int | None:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get(_FIXTURE)


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("mpi")
    timeout = None if marker is None else marker.kwargs.get("timeout")
    return float(item.config.getini("mpi_test_timeout") if timeout is None else timeout)


class _RankRecorder:
    """Inner-run plugin: log this rank's outcomes and abort the job after a failure."""

    def __init__(self, config: pytest.Config, nranks: int) -> None:
        from mpi4py import MPI

        self._config = config
        self._comm = MPI.COMM_WORLD
        if self._comm.size != nranks:
            raise pytest.UsageError(
                f"MPI.COMM_WORLD has {self._comm.size} ranks, expected {nranks}: "
                "is mpiexec from the MPI library that mpi4py uses?"
            )
        report_dir = os.environ.get(REPORT_DIR_ENV)
        path = None if report_dir is None else Path(report_dir) / f"rank{self._comm.rank}.jsonl"
        self._file = None if path is None else path.open("a", encoding="utf-8", buffering=1)
        self._stacks = None if path is None else path.with_suffix(".stacks").open("w", encoding="utf-8")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        """Write every thread's stack to ``rank<r>.stacks`` if the test is still running shortly before its
        timeout, so that the outer run can say where each rank hung."""
        if self._stacks is not None:
            self._stacks.seek(0)  # only the stacks of the test that hangs
            self._stacks.truncate()
            faulthandler.dump_traceback_later(_STACKS_AT * _timeout(item), file=self._stacks)
        yield
        if self._stacks is not None:
            faulthandler.cancel_dump_traceback_later()

    def _write(self, **record: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        """Record that this rank entered a test, so a hang can be attributed to it."""
        self._write(event="started", nodeid=nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Record one phase's outcome; abort the job if it failed."""
        longrepr = report.longrepr
        self._write(
            event="report",
            nodeid=report.nodeid,
            when=report.when,
            outcome=report.outcome,
            longrepr=list(longrepr) if isinstance(longrepr, tuple) else report.longreprtext,
            sections=report.sections,
            duration=report.duration,
            wasxfail=getattr(report, "wasxfail", None),
        )
        if report.failed and self._comm.size > 1:
            # Other ranks may wait for this one in a collective. Show the failure first:
            # the aborted run never reaches its summary.
            writer = self._config.get_terminal_writer()
            writer.line(f"\nrank {self._comm.rank}: {report.nodeid} failed, aborting the MPI job")
            writer.line(report.longreprtext)
            writer.flush()
            self._comm.Abort(1)

    def pytest_unconfigure(self) -> None:
        """Close this rank's record files."""
        if self._file is not None:
            self._file.close()
        if self._stacks is not None:
            self._stacks.close()


@dataclasses.dataclass(frozen=True)
class _Phase:
    """The merged outcome of one runtest phase over all ranks."""

    when: When
    outcome: Outcome
    longrepr: str | tuple[str, int, str] | None = None
    sections: tuple[tuple[str, str], ...] = ()
    duration: float = 0.0
    wasxfail: str | None = None

    def with_error(self, text: str) -> _Phase:
        """This phase turned failed, with ``text`` appended to its failure text."""
        prior = f"{self.longrepr}\n\n" if self.outcome == "failed" else ""
        return dataclasses.replace(self, outcome="failed", longrepr=prior + text)

    def report(self, item: pytest.Item) -> pytest.TestReport:
        """Build the outer run's report for ``item``."""
        return pytest.TestReport(
            item.nodeid,
            item.location,
            dict.fromkeys(item.keywords, 1),
            self.outcome,
            self.longrepr,
            self.when,
            self.sections,
            self.duration,
            user_properties=item.user_properties,
            **({} if self.wasxfail is None else {"wasxfail": self.wasxfail}),
        )


def _combine(when: When, records: dict[int, Record], nranks: int, missing: str | None = None) -> _Phase:
    """Merge the ranks' records of one phase; ``missing`` describes ranks without a result."""
    sections = tuple(
        (f"{title} [rank {rank}]", text) for rank, rec in sorted(records.items()) for title, text in rec["sections"]
    )
    duration = max((rec["duration"] for rec in records.values()), default=0.0)
    failed = [
        f"rank {rank} of {nranks}:\n{rec['longrepr']}"
        for rank, rec in sorted(records.items())
        if rec["outcome"] == "failed"
    ]
    if failed or missing:
        text = "\n\n".join(failed + ([missing] if missing else []))
        return _Phase(when, "failed", text, sections, duration)
    if records and all(rec["outcome"] == "skipped" for rec in records.values()):
        first = records[min(records)]
        longrepr = tuple(first["longrepr"]) if isinstance(first["longrepr"], list) else first["longrepr"]
        return _Phase(when, "skipped", longrepr, sections, duration, first["wasxfail"])
    wasxfail = next((rec["wasxfail"] for rec in records.values() if rec["wasxfail"] is not None), None)
    return _Phase(when, "passed", None, sections, duration, wasxfail)


def _is_done(records: dict[str, Record]) -> bool:
    """Whether a rank finished a test: it ran the teardown, or failed and aborted."""
    return "teardown" in records or any(rec["outcome"] == "failed" for rec in records.values())


def _merge(per_rank: list[dict[str, Record]], reason: str) -> list[_Phase]:
    """The outer item's phases from each rank's records of one test.

    Ranks that did not finish the test are reported, with ``reason``, as a
    failure of the call phase (or of the setup phase if that failed).
    """
    nranks = len(per_rank)
    missing_ranks = [rank for rank, records in enumerate(per_rank) if not _is_done(records)]
    missing = None
    if missing_ranks:
        plural = "s" if len(missing_ranks) > 1 else ""
        listed = ", ".join(map(str, missing_ranks))
        missing = f"rank{plural} {listed} of {nranks} produced no result for this test: {reason}"

    def phase(when: When, note: str | None = None) -> _Phase:
        present = {rank: records[when] for rank, records in enumerate(per_rank) if when in records}
        return _combine(when, present, nranks, note)

    setup = phase("setup")
    if setup.outcome == "failed":
        return [phase("setup", missing), phase("teardown")]
    if setup.outcome == "skipped" and missing is None:
        return [setup, phase("teardown")]
    setup = _Phase("setup", "passed", sections=setup.sections, duration=setup.duration)
    return [setup, phase("call", missing), phase("teardown")]


class _RankLog:
    """Incremental reader of the JSON-lines file that one rank writes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Record]] = {}
        self.current: str | None = None
        self.phase: When = "setup"
        self.since = 0.0
        self._offset = 0

    def poll(self) -> bool:
        """Read the records written since the last poll; return whether there were any."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                data = file.read()
        except FileNotFoundError:
            return False
        data = data[: data.rfind(b"\n") + 1]
        self._offset += len(data)
        for line in data.splitlines():
            rec = json.loads(line)
            if rec["event"] == "started":
                self.tests[rec["nodeid"]] = {}
                self.current, self.phase, self.since = rec["nodeid"], "setup", time.monotonic()
                continue
            self.tests[rec["nodeid"]][rec["when"]] = rec
            if rec["when"] == "teardown":
                self.current = None
            else:
                self.phase = "call" if rec["when"] == "setup" and rec["outcome"] == "passed" else "teardown"
        return bool(data)

    def where(self) -> str:
        """Which test (and phase) this rank is in."""
        return "not in a test" if self.current is None else f"in {self.current} ({self.phase})"


class _Job:
    """One ``mpiexec`` run of some items at one rank count."""

    def __init__(self, config: pytest.Config, nranks: int, items: list[pytest.Item]) -> None:
        self._config = config
        self._nranks = nranks
        self._items = items
        self._timeouts = {item.nodeid: _timeout(item) for item in items}
        self._logs: list[_RankLog] = []
        self.end = ""
        self.stalled = False

    def run(self) -> dict[str, list[_Phase]]:
        """Run the job; return the phases of each item it decided (others need a rerun).

        ``end`` then says how the job ended; ``stalled`` whether it was killed outside tests.
        """
        with tempfile.TemporaryDirectory(prefix="mpistrategy-test-") as tmp:
            report_dir = Path(tmp)
            self._logs = [_RankLog(report_dir / f"rank{rank}.jsonl") for rank in range(self._nranks)]
            self.end = self._execute(report_dir)
            return self._decide()

    def _command(self, report_dir: Path) -> list[str]:
        """``mpiexec -n N python -m pytest ... @<file of node ids>`` (a job's node ids can be more than a command
        line holds)."""
        from mpistrategy.launch import mpiexec_command  # on use: importing mpistrategy initialises MPI

        config = self._config
        node_ids = report_dir / "node_ids.txt"
        node_ids.write_text("".join(f"{item.path}::{item.nodeid.split('::', 1)[1]}\n" for item in self._items))
        cmd = [*mpiexec_command(), "-n", str(self._nranks)]
        cmd += [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += [f"--rootdir={config.rootpath}", f"--tb={config.option.tbstyle}"]
        if config.inipath is not None:
            cmd += ["-c", str(config.inipath)]
        return [*cmd, f"@{node_ids}"]

    def _execute(self, report_dir: Path) -> str:
        """Run mpiexec under the watchdog; return a description of how it ended."""
        env = clean_environ()
        env.setdefault("OMP_NUM_THREADS", "1")
        env[NRANKS_ENV] = str(self._nranks)
        env[REPORT_DIR_ENV] = str(report_dir)
        marker = job_processes.mark(env)
        cmd = self._command(report_dir)
        output = report_dir / "output.log"
        with output.open("wb") as out:
            try:
                proc = subprocess.Popen(
                    cmd,
                    cwd=self._config.invocation_params.dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                return f"cannot launch {cmd[0]!r} (set MPISTRATEGY_MPIEXEC): {exc}"
            try:
                overrun = self._watch(proc)
            finally:
                if proc.poll() is None:
                    _kill(proc, marker)
        for log in self._logs:
            log.poll()
        what = overrun or f"the MPI job exited with code {proc.returncode}"
        where = "\n".join(f"  rank {rank}: {log.where()}" for rank, log in enumerate(self._logs))
        stacks = "".join(_stacks(log.path.with_suffix(".stacks"), rank) for rank, log in enumerate(self._logs))
        return f"{what} while the ranks were:\n{where}\noutput tail:\n{_tail(output)}{stacks if overrun else ''}"

    def _watch(self, proc: subprocess.Popen[bytes]) -> str | None:
        """Follow the rank logs until mpiexec exits (None) or a timeout expires (what timed out)."""
        allowance = self._config.getini("mpi_startup_timeout")
        start = last_record = time.monotonic()
        deadline = start + allowance + sum(self._timeouts.values())
        while _wait(proc, _POLL_SECONDS) is None:
            now = time.monotonic()
            if any([log.poll() for log in self._logs]):
                last_record = now
            for log in self._logs:
                if log.current is not None and now - log.since > self._timeouts[log.current]:
                    return f"{log.current} timed out after {self._timeouts[log.current]:g} s"
            started = any(log.tests for log in self._logs)
            if started and all(log.current is None for log in self._logs) and now - last_record > allowance:
                self.stalled = True
                return f"the MPI job spent {allowance:g} s outside any test after its tests started"
            if now > deadline:
                return f"the MPI job timed out after {now - start:.0f} s"
        return None

    def _decide(self) -> dict[str, list[_Phase]]:
        failures = [
            (rank, nodeid)
            for rank, log in enumerate(self._logs)
            for nodeid, records in log.tests.items()
            if any(rec["outcome"] == "failed" for rec in records.values())
        ]
        aborted = self._nranks > 1 and bool(failures)
        reason = f"the MPI job was aborted after rank {failures[0][0]} failed {failures[0][1]}" if aborted else self.end
        decided = {}
        for item in self._items:
            per_rank = [log.tests.get(item.nodeid) for log in self._logs]
            if all(records is None for records in per_rank):
                continue
            filled = [records or {} for records in per_rank]
            failed = any(rec["outcome"] == "failed" for records in filled for rec in records.values())
            # A test merely interrupted by another test's abort is left for a rerun.
            if failed or not aborted or all(map(_is_done, filled)):
                decided[item.nodeid] = _merge(filled, reason)
        return decided


class _Launcher:
    """Outer-run plugin: run mpi items in mpiexec jobs and report their merged results."""

    def __init__(self, config: pytest.Config) -> None:
        self._config = config
        self._results: dict[str, list[_Phase]] = {}
        self._jobs: list[tuple[float, int, int, int]] = []  # seconds, ranks, tests, folders

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        """Report an mpi item from its (module, rank count) job, launching the job if needed. An item marked
        ``skip`` (e.g. a GPU test on a machine without one) is left to pytest: no job is started for it."""
        nranks = _nranks(item)
        if nranks is None or item.get_closest_marker("skip") is not None:
            return None
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        if item.nodeid not in self._results:
            self._run_batch(item, nranks)
        phases = self._results[item.nodeid]
        error = _teardown_outer(item, nextitem)
        if error is not None:
            phases = [*phases[:-1], phases[-1].with_error(f"outer process teardown: {error}")]
        for phase in phases:
            ihook.pytest_runtest_logreport(report=phase.report(item))
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """With ``--durations``, the MPI jobs' wall times (start-up included, which the tests' durations leave
        out), slowest first."""
        if self._config.option.durations is None or not self._jobs:
            return
        terminalreporter.write_sep("=", f"MPI jobs: {len(self._jobs)}, {sum(job[0] for job in self._jobs):.0f} s")
        for seconds, nranks, tests, folders in sorted(self._jobs, reverse=True):
            terminalreporter.write_line(f"{seconds:7.1f}s  {nranks} ranks: {tests} tests in {folders} folders")

    def _run_batch(self, first: pytest.Item, nranks: int) -> None:
        """Run all pending items at ``nranks``, rerunning interrupted ones."""
        pending = [
            item
            for item in first.session.items
            if _nranks(item) == nranks and item.nodeid not in self._results and item.get_closest_marker("skip") is None
        ]
        while pending:
            job = _Job(self._config, nranks, pending)
            start = time.monotonic()
            decided = job.run()
            folders = len({item.path.parent for item in pending})
            self._jobs.append((time.monotonic() - start, nranks, len(pending), folders))
            if job.stalled and decided:
                warnings.warn(f"the job at {nranks} ranks: {job.end}", pytest.PytestWarning, stacklevel=1)
            decided = decided or {item.nodeid: _merge([{}] * nranks, job.end) for item in pending}
            self._results.update(decided)
            pending = [item for item in pending if item.nodeid not in decided]


def _teardown_outer(item: pytest.Item, nextitem: pytest.Item | None) -> str | None:
    """Tear down what earlier single-process tests set up and ``nextitem`` does not need."""
    try:
        item.session._setupstate.teardown_exact(nextitem)  # as the default protocol does
    except Exception:
        return str(pytest.ExceptionInfo.from_current().getrepr(style="short"))
    return None


def _wait(proc: subprocess.Popen[bytes], seconds: float) -> int | None:
    try:
        return proc.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


def _kill(proc: subprocess.Popen[bytes], marker: str) -> None:
    """SIGTERM mpiexec (it forwards the signal to the ranks), then SIGKILL every process of the job."""
    proc.terminate()
    if _wait(proc, _KILL_GRACE_SECONDS) is None:
        job_processes.kill(marker)
        proc.wait()


def _tail(path: Path) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-_TAIL_LINES:]) or "(no output)"


def _stacks(path: Path, rank: int) -> str:
    """The stacks ``rank`` wrote when its test neared its timeout (see ``_RankRecorder``), if it wrote them."""
    try:
        text = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        return ""
    lines = [line for line in text.splitlines() if not any(frame in line for frame in _PYTEST_FRAMES)]
    return f"\nrank {rank}'s threads {_STACKS_AT:.0%} into the test's timeout:\n" + "\n".join(lines) if text else ""
