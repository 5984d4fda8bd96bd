"""Compiled C kernels, built once per user and machine type, and loaded only from places no one else can write.

A library is built from one C source with the system's compiler and loaded with ``ctypes``; loading a shared
library runs its code (its constructors) in the process, so the library must be the one this package built. Where
it lives and what is checked:

- The cache directory is ``$MPISTRATEGY_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpistrategy``, else
  ``~/.cache/mpistrategy``; missing directories on the way are created with mode 0700. Without a home directory
  there is no cache.
- The cache is used only when it is safe, the checks ssh makes of ``~/.ssh``: the directory (symbolic links
  resolved) is owned by the running user and writable by no one else, and every directory above it is owned by the
  user or root and writable by no one else, or sticky (as ``/tmp`` is: others cannot rename or remove what is the
  user's in it). Each build is one directory in the cache, ``<name>-<machine>-<key>/`` (the key a hash of the
  source, the compiler and its flags), holding the library and the SHA-256 of the library as built; it is made by
  ``mkdtemp`` (mode 0700) beside the cache's entries and renamed into place whole, so processes that build at once
  publish one build and never see half of one.
- A build is loaded only when its directory and its library are the user's and writable by no one else, the
  library is a regular file (not a link), and its SHA-256 is the recorded one. The checks are made on a file
  descriptor opened with ``O_NOFOLLOW``, and the library is loaded through that descriptor
  (``/proc/self/fd/<n>``): a file renamed over the checked one in between is not the one loaded. The digest
  catches a library changed after it was built by anyone who can write it (the user's own tools, a partial copy).
- A cache that fails a check is not touched: the kernel is built for this process in a fresh private directory
  (``tempfile.mkdtemp``), loaded, and the directory removed at once; rank 0 warns once, naming the directory and
  the reason. Without a cache, every process builds its own copy the same way, silently.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

CACHE_VARIABLE = "MPISTRATEGY_CACHE_DIR"
LIBRARY = "library.so"
DIGEST = "library.so.sha256"
_BUILD_SECONDS = 120
_FD_DIRECTORY = "/proc/self/fd"
_warned: set[str] = set()


class UnsafeCacheWarning(RuntimeWarning):
    """The kernel cache is not used: someone other than the user could change what is loaded from it."""


def cache_directory() -> Path | None:
    """The configured cache directory (see the module doc), or None without a home directory."""
    configured = os.environ.get(CACHE_VARIABLE)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if base.startswith("~"):
        return None
    return Path(base) / "mpistrategy"


def build_directory(cache: Path, source: Path, compiler: Sequence[str], flags: Sequence[str]) -> Path:
    """The directory in ``cache`` that holds the build of ``source`` with ``compiler`` and ``flags``."""
    machine = platform.machine()
    identity = source.read_bytes() + " ".join((*compiler, *flags, machine)).encode()
    return cache / f"{source.stem}-{machine}-{hashlib.sha256(identity).hexdigest()[:16]}"


def load(source: Path, compiler: Sequence[str], flags: Sequence[str]) -> ctypes.CDLL:
    """The library built from ``source`` with ``compiler`` and ``flags``, from the cache where it is safe, else
    built for this process. Raises ``OSError`` or ``subprocess.SubprocessError`` when it cannot be built."""
    cache = cache_directory()
    problem = None if cache is None else _cache_problem(cache)
    if cache is not None and problem is None:
        entry = build_directory(cache.resolve(), source, compiler, flags)
        try:
            with _cached(entry, source, compiler, flags) as descriptor:
                return _load_descriptor(descriptor, entry / LIBRARY)
        except _Untrusted as refused:
            cache, problem = entry, str(refused)
    if cache is not None and problem is not None:
        _warn_once(cache, problem)
    private = Path(tempfile.mkdtemp(prefix="mpistrategy-kernel-"))
    try:
        with _built(private, source, compiler, flags) as descriptor:
            return _load_descriptor(descriptor, private / LIBRARY)
    finally:
        shutil.rmtree(private, ignore_errors=True)


class _Untrusted(Exception):
    """A cached build that fails a check (the message says which)."""


def _owner_problem(status: os.stat_result, what: str) -> str | None:
    if status.st_uid != os.getuid():
        return f"{what} is owned by uid {status.st_uid}, not by this user (uid {os.getuid()})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by others (mode {stat.S_IMODE(status.st_mode):04o})"
    return None


def _cache_problem(cache: Path) -> str | None:
    """Why ``cache`` is not safe to load from (creating it, mode 0700, where it is missing), or None."""
    try:
        _make_private_directories(cache)
        resolved = cache.resolve(strict=True)
        status = os.lstat(resolved)
        above_statuses = [(parent, os.lstat(parent)) for parent in resolved.parents]
    except OSError as error:
        return f"it cannot be created or read ({error.strerror or error})"
    if not stat.S_ISDIR(status.st_mode):
        return "it is not a directory"
    problem = _owner_problem(status, "it")
    if problem is not None:
        return problem
    for parent, above in above_statuses:
        writable_by_others = above.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not above.st_mode & stat.S_ISVTX
        if above.st_uid not in (0, os.getuid()) or writable_by_others:
            return (
                f"the directory {parent} above it is owned by uid {above.st_uid} with mode "
                f"{stat.S_IMODE(above.st_mode):04o}: someone else can replace the cache"
            )
    return None


def _make_private_directories(directory: Path) -> None:
    """Create ``directory`` and the missing directories above it, each with mode 0700."""
    missing = []
    path = directory.absolute()
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it at the same moment
            os.mkdir(path, 0o700)


@contextlib.contextmanager
def _cached(entry: Path, source: Path, compiler: Sequence[str], flags: Sequence[str]) -> Iterator[int]:
    """A verified descriptor of the build in ``entry``, built and published first where there is none."""
    if not os.path.lexists(entry):
        building = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        try:
            with _built(building, source, compiler, flags) as descriptor:
                try:
                    os.rename(building, entry)
                except OSError as error:
                    if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                        raise
                else:  # published: this is the build that was just checked
                    yield descriptor
                    return
        finally:
            shutil.rmtree(building, ignore_errors=True)
    with _verified(entry) as descriptor:  # built before, or by another process at the same moment
        yield descriptor


@contextlib.contextmanager
def _built(directory: Path, source: Path, compiler: Sequence[str], flags: Sequence[str]) -> Iterator[int]:
    """Build into ``directory`` (private, empty), record the library's digest, and yield a descriptor of it."""
    library = directory / LIBRARY
    command = [*compiler, *flags, str(source), "-o", str(library)]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=_BUILD_SECONDS)
    descriptor = os.open(library, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        digest = _digest(descriptor)
        recording = directory / f".{DIGEST}.tmp"
        recording.write_text(digest + "\n")
        os.replace(recording, directory / DIGEST)
        yield descriptor
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def _verified(entry: Path) -> Iterator[int]:
    """A descriptor of the library in ``entry`` that passed every check of the module doc; else ``_Untrusted``."""
    try:
        problem = _owner_problem(os.lstat(entry), "the build directory")
        if problem is None and not stat.S_ISDIR(os.lstat(entry).st_mode):
            problem = "the build directory is not a directory"
        if problem is not None:
            raise _Untrusted(problem)
        descriptor = os.open(entry / LIBRARY, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise _Untrusted(f"its library cannot be opened safely ({error.strerror or error})") from error
    try:
        status = os.fstat(descriptor)
        problem = _owner_problem(status, "the library")
        if problem is None and not stat.S_ISREG(status.st_mode):
            problem = "the library is not a regular file"
        if problem is None and _digest(descriptor) != _recorded_digest(entry):
            problem = "the library is not the one built there (its SHA-256 differs from the recorded one)"
        if problem is not None:
            raise _Untrusted(problem)
        yield descriptor
    finally:
        os.close(descriptor)


def _recorded_digest(entry: Path) -> str:
    try:
        descriptor = os.open(entry / DIGEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise _Untrusted(f"its recorded SHA-256 cannot be read ({error.strerror or error})") from error
    with os.fdopen(descriptor, "r") as recorded:
        return recorded.read().strip()


def _digest(descriptor: int) -> str:
    """The SHA-256 of the whole file behind ``descriptor`` (read from its start; the offset is left at 0)."""
    hasher = hashlib.sha256()
    os.lseek(descriptor, 0, os.SEEK_SET)
    while chunk := os.read(descriptor, 1 << 20):
        hasher.update(chunk)
    os.lseek(descriptor, 0, os.SEEK_SET)
    return hasher.hexdigest()


def _load_descriptor(descriptor: int, path: Path) -> ctypes.CDLL:
    """Load the file behind ``descriptor`` (through ``/proc/self/fd``; by ``path`` where there is no such
    directory, after the same checks)."""
    if os.path.isdir(_FD_DIRECTORY):
        return ctypes.CDLL(f"{_FD_DIRECTORY}/{descriptor}")
    return ctypes.CDLL(str(path))


def _warn_once(directory: Path, reason: str) -> None:
    """One warning per directory and process, on rank 0 only."""
    if str(directory) in _warned or _world_rank() != 0:
        return
    _warned.add(str(directory))
    warnings.warn(
        f"mpistrategy: not loading compiled kernels from {directory}: {reason}. The kernel is built for this "
        f"process alone instead (each process compiles it). To use the cache, make the directory yours and writable "
        f"only by you (chown, chmod go-w; remove a build that was changed), or set {CACHE_VARIABLE} to such a "
        "directory.",
        UnsafeCacheWarning,
        stacklevel=2,
    )


def _world_rank() -> int:
    """This process's rank in the MPI world (the package initialises MPI on import; 0 without it)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return int(mpi.COMM_WORLD.Get_rank())
    return 0
