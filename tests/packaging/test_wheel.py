"""The built distributions as a user gets them: ``python -m build`` makes an sdist and a wheel (from the sdist); the
wheel installed, not editable, into a fresh venv runs from a directory outside the checkout.

The venv is made once for the module: torch, then the core (``wheel[mpich]``), whose checks are recorded, then the
``train`` extra on top. Nothing here puts the checkout on ``sys.path``.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.docs.test_links import PAGES, _links
from tests.mpi_harness import clean_environ

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU wheel the README installs first
OPTIONAL = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "hydra", "omegaconf", "sklearn")
OPTIONAL += ("matplotlib", "rich")

# Run under mpiexec -n 2 in the core venv (each rank writes core-rank<r>.json): the collectives work, and nothing
# optional was imported.
CORE_CHECK = f"""
import json, sys
import torch
import mpistrategy, mpistrategy.aggregation, mpistrategy.nn, mpistrategy.sync
from mpi4py import MPI
loaded = sorted(set({OPTIONAL!r}) & {{name.split(".")[0] for name in sys.modules}})
x = torch.full((3,), float(MPI.COMM_WORLD.rank + 1), dtype=torch.float64, requires_grad=True)
y = mpistrategy.allreduce(x)
y.sum().backward()
try:
    from mpistrategy.strategy import MPIADStrategy
    error = None
except ImportError as exc:
    error = f"{{type(exc).__name__}}: {{exc}}"
result = {{"loaded": loaded, "y": y.tolist(), "grad": x.grad.tolist(), "error": error}}
with open(f"core-rank{{MPI.COMM_WORLD.rank}}.json", "w") as handle:
    json.dump(result, handle)
"""

# A user's own configs: a model group option and an experiment preset that uses it.
USER_MODEL = "defaults:\n  - mlp\nhidden: 7\n"
USER_EXPERIMENT = """# @package _global_
defaults:
  - override /trainer: debug
  - override /model: tiny
task_name: mine
trainer:
  limit_val_batches: 1
"""


@dataclass
class Venv:
    path: Path
    home: Path  # the working directory of every command: outside the checkout
    core: dict[str, subprocess.CompletedProcess] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in clean_environ().items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
        env.update(VIRTUAL_ENV=str(self.path), OMP_NUM_THREADS="1")
        env["PATH"] = str(self.path / "bin") + os.pathsep + env.get("PATH", "")
        env.update(extra)
        return env

    def run(self, args: list[str], timeout: float = 300, check: bool = True, **env: str) -> subprocess.CompletedProcess:
        result = subprocess.run(
            args, cwd=self.home, env=self.env(**env), capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{shlex.join(args)} exited with {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n"
                f"--- stderr\n{result.stderr[-6000:]}"
            )
        return result

    def mpiexec(self, n: int, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        launcher = [self.bin("mpiexec"), *shlex.split(os.environ.get("MPISTRATEGY_MPIEXEC_ARGS", ""))]
        return self.run([*launcher, "-n", str(n), *args], timeout=timeout, **env)

    def pip_install(self, step: str, *requirements: str) -> None:
        # --no-compile: the modules compile when imported; byte-compiling all of torch at install takes longer.
        start = time.monotonic()
        self.run([self.bin("python"), "-m", "pip", "install", "--quiet", "--no-compile", *requirements], timeout=600)
        self.seconds[step] = time.monotonic() - start


@dataclass
class Dist:
    wheel: Path
    sdist: Path


def _version() -> str:
    tree = ast.parse((ROOT / "mpistrategy" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("mpistrategy/__init__.py assigns no __version__")


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=600, env=clean_environ(),
    )  # fmt: skip
    assert result.returncode == 0, f"python -m build failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    wheels, sdists = list(out.glob("*.whl")), list(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    return Dist(wheel=wheels[0], sdist=sdists[0])


@pytest.fixture(scope="module")
def venv(dist: Dist, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    base = tmp_path_factory.mktemp("installed")
    env = Venv(path=base / "venv", home=base / "elsewhere")
    env.home.mkdir()
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(env.path)], check=True, timeout=120)
    env.seconds["venv"] = time.monotonic() - start
    env.pip_install("torch", TORCH)
    env.pip_install("core", f"{dist.wheel}[mpich]")
    env.core["collectives"] = env.mpiexec(2, env.bin("python"), "-c", CORE_CHECK, timeout=120)
    env.core["train"] = env.run([env.bin("mpistrategy-train")], check=False, timeout=120)
    env.pip_install("train", f"{dist.wheel}[train,mpich]")
    print("install seconds:", {k: round(v, 1) for k, v in env.seconds.items()})
    return env


def test_the_wheel_installs_the_package_mpistrategy_and_nothing_else(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as wheel:
        names = set(wheel.namelist())
        info = f"mpistrategy-{_version()}.dist-info"
        metadata = wheel.read(f"{info}/METADATA").decode()
        top_level = wheel.read(f"{info}/top_level.txt").decode().split()
    assert {name.split("/")[0] for name in names} == {"mpistrategy", info}
    assert top_level == ["mpistrategy"]
    # Every module of the package, the recipes and every config, at their installed places.
    expected = {f"mpistrategy/{p.relative_to(ROOT / 'mpistrategy')}" for p in (ROOT / "mpistrategy").rglob("*.py")}
    expected |= {f"mpistrategy/recipes/{p.relative_to(ROOT / 'recipes')}" for p in (ROOT / "recipes").rglob("*.py")}
    expected |= {f"mpistrategy/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.y*ml")}
    expected |= {"mpistrategy/conf/__init__.py", "mpistrategy/comm/rank_sum.c", f"{info}/licenses/LICENSE"}
    assert expected <= names, sorted(expected - names)
    assert f"Version: {_version()}" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    core = sorted(
        line.split()[1] for line in metadata.splitlines() if line.startswith("Requires-Dist:") and ";" not in line
    )
    assert [name.split(">")[0].split("<")[0] for name in core] == ["mpi4py", "numpy", "torch"], core


def test_the_sdist_holds_the_configs_the_recipes_the_templates_and_the_license(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "conf").rglob("*.yaml")}
    wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*.py")}
    wanted |= {str(p.relative_to(ROOT)) for p in (ROOT / "slurm").iterdir() if p.is_file()}
    wanted |= {"LICENSE", "CHANGELOG.md", "CONTRIBUTING.md", "README.md", "pyproject.toml", "tests/mpi_harness.py"}
    assert wanted <= names, sorted(wanted - names)


def _results_the_docs_name() -> set[str]:
    """The files under ``benchmarks/results`` that the documentation pages name (a named folder: all its files),
    relative to the repository."""
    results = ROOT / "benchmarks" / "results"
    named: set[str] = set()
    for page in PAGES:
        for target, base in _links(page):
            path = (base / target.partition("#")[0]).resolve()
            if path != results and path.is_relative_to(results):
                found = path.rglob("*") if path.is_dir() else [path]
                named |= {str(p.relative_to(ROOT)) for p in found if p.is_file()}
    return named


def test_the_sdist_ships_the_results_the_docs_name_and_no_others(dist: Dist) -> None:
    """Its docs build and tests/docs pass from the unpacked sdist; the other results stay out (MANIFEST.in)."""
    with tarfile.open(dist.sdist) as sdist:
        names = {m.name.split("/", 1)[1] for m in sdist.getmembers() if m.isfile() and "/" in m.name}
    wanted = _results_the_docs_name()
    assert wanted and wanted <= names, sorted(wanted - names)
    shipped = {name for name in names if name.startswith("benchmarks/results/")}
    assert shipped <= wanted, f"results no page names: {sorted(shipped - wanted)}"


def test_the_core_install_runs_the_collectives_without_lightning_or_hydra(venv: Venv) -> None:
    ranks = [json.loads((venv.home / f"core-rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert rank["loaded"] == []
        assert rank["y"] == [3.0, 3.0, 3.0]  # 1 + 2
        assert rank["grad"] == [2.0, 2.0, 2.0]  # the adjoint of allreduce-sum: the sum of both ranks' ones
        assert (
            rank["error"].startswith("MissingExtraError: ") and 'pip install "mpistrategy[lightning]"' in rank["error"]
        )
    train = venv.core["train"]
    assert train.returncode == 1
    assert "mpistrategy-train (mpistrategy.recipes) needs the 'train' extra" in train.stderr
    assert 'pip install "mpistrategy[train]"' in train.stderr


def test_help_and_the_composed_config_come_from_the_installed_package(venv: Venv) -> None:
    where = venv.run(
        [venv.bin("python"), "-c", "import mpistrategy.conf, mpistrategy.recipes.train as t; print(t.__file__)"]
    )
    assert Path(where.stdout.strip()).is_relative_to(venv.path), where.stdout
    help_text = venv.run([venv.bin("mpistrategy-train"), "--help"]).stdout
    assert "experiment: debug, digits_cnn, digits_mlp, pipeline_mlp, synthetic_mlp, tp_mlp" in help_text
    # A user's config folder on Hydra's search path extends ours; overrides apply on top.
    user = venv.home / "searchpath"
    (user / "model").mkdir(parents=True)
    (user / "model" / "tiny.yaml").write_text(USER_MODEL)
    overrides = ["model=tiny", "model.dropout=0.25", f"hydra.searchpath=[file://{user}]"]
    job = venv.run([venv.bin("mpistrategy-train"), "--cfg", "job", *overrides]).stdout
    assert "_target_: mpistrategy.recipes.models.MLPClassifier" in job
    assert "hidden: 7" in job and "dropout: 0.25" in job


def test_a_sweep_with_the_users_config_dir_under_mpiexec(venv: Venv) -> None:
    """The installed ``mpistrategy-train`` on two ranks outside the checkout: a two-point sweep of an experiment in
    the user's own config folder (the main job's defaults train in tests/recipes/test_hydra_mpi.py)."""
    user = venv.home / "myconf"
    (user / "model").mkdir(parents=True)
    (user / "experiment").mkdir()
    (user / "model" / "tiny.yaml").write_text(USER_MODEL)
    (user / "experiment" / "mine.yaml").write_text(USER_EXPERIMENT)
    venv.mpiexec(
        2, venv.bin("mpistrategy-train"), "-m", "experiment=mine", "optimizer.lr=0.2,0.1", f"--config-dir={user}",
        timeout=420, MPISTRATEGY_LOG_DIR=str(venv.home / "sweeps"),
    )  # fmt: skip
    sweeps = list((venv.home / "sweeps" / "mine" / "multiruns").iterdir())
    assert len(sweeps) == 1, sweeps
    for job, lr in (("0", 0.2), ("1", 0.1)):
        summary = json.loads((sweeps[0] / job / "summary.json").read_text())
        assert summary["world_size"] == 2 and f"optimizer.lr={lr}" in summary["overrides"]
        config = (sweeps[0] / job / ".hydra" / "config.yaml").read_text()
        assert "hidden: 7" in config and f"lr: {lr}" in config


def test_a_slurm_template_runs_the_installed_package(venv: Venv) -> None:
    """slurm/cpu-mpiexec.sbatch, run by bash with the variables SLURM gives a batch script, with the wheel's venv."""
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "1", "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "1"}
    venv.run(
        ["bash", str(ROOT / "slurm" / "cpu-mpiexec.sbatch")], timeout=300,
        VENV=str(venv.path), MPIEXEC=venv.bin("mpiexec"), EXPERIMENT="debug", OVERRIDES="trainer.limit_val_batches=1",
        MPISTRATEGY_LOG_DIR=str(venv.home / "slurm-logs"), SLURM_SUBMIT_DIR=str(venv.home), **slurm,
    )  # fmt: skip
    summary = json.loads((venv.home / "slurm-logs" / "debug" / "runs" / "slurm-4242" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["experiment"] == "debug"
