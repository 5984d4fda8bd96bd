"""The kernel cache loads nothing that someone else could have placed or changed: a library planted where the cache
would look, whose constructor leaves a mark, must never run (one process each)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mpistrategy import launch
from mpistrategy.comm import kernel_cache, rank_sum
from tests.comm.test_rank_sum import PROBE

REFUSED = "not loading compiled kernels from"
NOBODY = 65534

PLANTED_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *mark = fopen(MARK, "w");
    if (mark) { fputs("the planted library ran", mark); fclose(mark); }
}
void rank_sum(void) {}
"""


def _probe(cache: Path | None, **environment: str) -> subprocess.CompletedProcess:
    """``rank_sum.available(torch.float32)`` in a fresh process whose cache is ``cache`` (None: no home, no cache)."""
    env = {key: value for key, value in os.environ.items() if key not in (rank_sum.CACHE_VARIABLE, "XDG_CACHE_HOME")}
    env.update({rank_sum.CACHE_VARIABLE: str(cache)} if cache is not None else {"HOME": "~"})
    env.update(environment)
    return subprocess.run(
        [sys.executable, "-W", "always", "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def mark(tmp_path: Path) -> Path:
    return tmp_path / "mark"


@pytest.fixture
def planted_library(tmp_path: Path, mark: Path) -> Path:
    """A library with a ``rank_sum`` symbol whose constructor writes ``mark``."""
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_SOURCE)
    library = tmp_path / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARK="{mark}"', str(source), "-o", str(library)], check=True)
    return library


def _plant(library: Path, cache: Path) -> Path:
    """Put ``library`` where the kernel's build in ``cache`` would be, with its true SHA-256 recorded beside it,
    as anyone who can write there could; return the build directory."""
    target = rank_sum.cached_library(cache)
    assert target is not None
    target.parent.mkdir(parents=True, mode=0o755)
    target.write_bytes(library.read_bytes())
    target.chmod(0o755)
    digest = target.parent / kernel_cache.DIGEST
    digest.write_text(hashlib.sha256(library.read_bytes()).hexdigest() + "\n")
    digest.chmod(0o644)
    return target.parent


def _chown_tree(top: Path, uid: int) -> None:
    for path in (top, *top.rglob("*")):
        os.chown(path, uid, -1)


def _assert_refused_and_not_run(result: subprocess.CompletedProcess, mark: Path, directory: Path, reason: str) -> None:
    assert result.stdout.strip() == "True", result.stderr  # built for the process alone
    assert not mark.exists(), "the planted library was loaded"
    warnings = [line for line in result.stderr.splitlines() if REFUSED in line]
    assert len(warnings) == 1, result.stderr
    assert f"{REFUSED} {directory}:" in warnings[0] and reason in warnings[0], warnings[0]


def _needs_root() -> None:
    if os.getuid() != 0:
        pytest.skip("giving a directory to another user (chown) needs root")


def test_a_cache_owned_by_another_user_is_refused_and_nothing_in_it_runs(
    tmp_path: Path, planted_library: Path, mark: Path
) -> None:
    _needs_root()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    _plant(planted_library, cache)
    _chown_tree(cache, NOBODY)
    before = sorted(cache.rglob("*"))
    _assert_refused_and_not_run(_probe(cache), mark, cache, f"owned by uid {NOBODY}")
    assert sorted(cache.rglob("*")) == before, "the refused cache was written to"


def test_a_build_owned_by_another_user_in_the_users_cache_is_refused(
    tmp_path: Path, planted_library: Path, mark: Path
) -> None:
    _needs_root()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    entry = _plant(planted_library, cache)
    _chown_tree(entry, NOBODY)
    _assert_refused_and_not_run(_probe(cache), mark, entry, f"owned by uid {NOBODY}")


@pytest.mark.parametrize(
    ("loosened", "mode", "named", "reason"),
    [
        ("cache", 0o777, "cache", "it is writable by others (mode 0777)"),
        ("cache", 0o770, "cache", "it is writable by others (mode 0770)"),  # by its group
        ("build", 0o777, "build", "the build directory is writable by others (mode 0777)"),
        ("library", 0o666, "build", "the library is writable by others (mode 0666)"),
        ("above", 0o777, "cache", "above it is owned by uid"),  # not sticky: the cache can be renamed away
    ],
)
def test_a_cache_that_others_can_write_is_refused_and_nothing_in_it_runs(
    tmp_path: Path, planted_library: Path, mark: Path, loosened: str, mode: int, named: str, reason: str
) -> None:
    cache = tmp_path / "above" / "cache"
    cache.mkdir(parents=True, mode=0o700)
    entry = _plant(planted_library, cache)
    paths = {"above": cache.parent, "cache": cache, "build": entry, "library": entry / kernel_cache.LIBRARY}
    paths[loosened].chmod(mode)
    _assert_refused_and_not_run(_probe(cache), mark, paths[named], reason)


def test_a_sticky_directory_above_the_cache_is_fine(tmp_path: Path) -> None:
    above = tmp_path / "shared"
    above.mkdir()
    above.chmod(0o1777)  # as /tmp
    result = _probe(above / "mine")
    assert result.stdout.strip() == "True" and REFUSED not in result.stderr, result.stderr
    assert stat.S_IMODE((above / "mine").stat().st_mode) == 0o700, "the cache was not created private"
    assert rank_sum.cached_library(above / "mine").is_file()  # type: ignore[union-attr]


def test_a_library_changed_after_its_build_is_not_loaded(tmp_path: Path, planted_library: Path, mark: Path) -> None:
    cache = tmp_path / "cache"
    assert _probe(cache).stdout.strip() == "True"
    library = rank_sum.cached_library(cache)
    assert library is not None and library.is_file()
    swapped = library.with_name("swapped")
    swapped.write_bytes(planted_library.read_bytes())
    swapped.chmod(0o755)
    os.replace(swapped, library)  # the user's own file, private directory: only the digest tells
    _assert_refused_and_not_run(_probe(cache), mark, library.parent, "SHA-256 differs from the recorded one")


SWAP_ON_PUBLISH = """
import hashlib, os, sys, torch
from mpistrategy import launch
from mpistrategy.comm import kernel_cache, rank_sum
planted, real_rename = open(sys.argv[1], "rb").read(), os.rename
def rename_then_swap(source, target):
    real_rename(source, target)
    for name, data in ((kernel_cache.LIBRARY, planted),
                       (kernel_cache.DIGEST, (hashlib.sha256(planted).hexdigest() + "\\n").encode())):
        with open(os.path.join(target, "swap"), "wb") as swap:
            swap.write(data)
        os.chmod(os.path.join(target, "swap"), 0o755)
        os.replace(os.path.join(target, "swap"), os.path.join(target, name))
os.rename = rename_then_swap
print(rank_sum.available(torch.float32))
"""


def test_a_library_swapped_between_its_build_and_its_load_is_not_the_one_loaded(
    tmp_path: Path, planted_library: Path, mark: Path
) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, rank_sum.CACHE_VARIABLE: str(cache)}
    result = subprocess.run(
        [sys.executable, "-c", SWAP_ON_PUBLISH, str(planted_library)], env=env, capture_output=True, text=True
    )
    assert result.stdout.strip() == "True", result.stderr
    library = rank_sum.cached_library(cache)
    assert library is not None and library.read_bytes() == planted_library.read_bytes(), "the swap did not happen"
    assert not mark.exists(), "the library swapped in after the build was loaded"


def test_the_cache_is_reused_without_a_compiler(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert _probe(cache).stdout.strip() == "True"
    library = rank_sum.cached_library(cache)
    assert library is not None
    modified = library.stat().st_mtime_ns
    reused = _probe(cache, PATH=str(tmp_path / "nothing-here"))  # `cc` cannot be found
    assert reused.stdout.strip() == "True" and "could not be built" not in reused.stderr, reused.stderr
    assert library.stat().st_mtime_ns == modified and [path.name for path in cache.iterdir()] == [library.parent.name]


def test_without_a_home_the_kernel_is_built_privately_and_the_old_shared_path_is_ignored(
    tmp_path: Path, planted_library: Path, mark: Path
) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    predictable = shared / f"mpistrategy-{os.getuid()}"
    predictable.mkdir(mode=0o777)
    _plant(planted_library, predictable)
    (predictable / f"rank_sum-x86_64-{'0' * 16}.so").write_bytes(planted_library.read_bytes())
    before = sorted(shared.rglob("*"))
    result = _probe(None, TMPDIR=str(shared))
    assert result.stdout.strip() == "True" and REFUSED not in result.stderr, result.stderr
    assert not mark.exists(), "a library from the shared temporary directory was loaded"
    assert sorted(shared.rglob("*")) == before, "the private build was left in the temporary directory"


def test_the_refusal_is_reported_once_on_rank_0_only(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    environment = {**launch.without_launcher_variables(os.environ), rank_sum.CACHE_VARIABLE: str(cache)}
    command = [*launch.mpiexec_command(), "-n", "3", sys.executable, "-W", "always", "-c", PROBE]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=180)
    # the ranks' lines reach mpiexec's output in pieces that can interleave ("TrueTrue\n\nTrue\n"): count the answers
    assert result.stdout.count("True") == 3 and "False" not in result.stdout, (result.stdout, result.stderr)
    assert result.stderr.count(REFUSED) == 1, result.stderr
