"""Where code runs: the caller's place in the user's code, and where a thread waits in mpistrategy.

A call site is the innermost frame outside mpistrategy, torch, Lightning (with lightning_utilities and
torchmetrics) and the standard library; which frames are skipped is decided once per code object.
"""

from __future__ import annotations

import os
import sys
from types import CodeType, FrameType


def _directory_names(file: str, levels: int) -> tuple[str, ...]:
    """The directory ``levels`` above ``file``, with a trailing separator, as code objects name the files below it:
    absolute and normalised, and also as imported where that differs (a package found through a ``sys.path`` entry
    such as ``..`` has file names like ``/home/me/run/../mpistrategy/...``)."""
    directory = file
    for _ in range(levels):
        directory = os.path.dirname(directory)
    names = [os.path.abspath(directory) + os.sep]
    if directory and directory + os.sep != names[0]:
        names.append(directory + os.sep)
    return tuple(names)


def _package_names(name: str) -> tuple[str, ...]:
    path = getattr(sys.modules.get(name), "__file__", None)
    return () if path is None else _directory_names(path, 1)


def package_root() -> str:
    """The directory of the mpistrategy package, with a trailing separator."""
    return _MPISTRATEGY[0]


_MPISTRATEGY = _directory_names(__file__, 2)
_SKIPPED_ROOTS = _MPISTRATEGY + _package_names("torch")
# Lightning's packages, and those its collectives run through, are skipped by name (imported after mpistrategy).
_SKIPPED_PARTS = tuple(
    f"{os.sep}{name}{os.sep}"
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torchmetrics")
)
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_SITE_PACKAGES = f"{os.sep}site-packages{os.sep}"
_skipped: dict[CodeType, bool] = {}


def _is_skipped(code: CodeType) -> bool:
    found = _skipped.get(code)
    if found is None:
        name = code.co_filename
        found = _skipped[code] = (
            name.startswith(_SKIPPED_ROOTS)
            or any(part in name for part in _SKIPPED_PARTS)
            or (name.startswith(_STDLIB) and _SITE_PACKAGES not in name)  # contextlib, functools, threading ...
        )
    return found


def call_site(depth: int = 1, near: bool = False) -> tuple[str, int]:
    """``(file, line)`` of the innermost frame outside mpistrategy, torch, Lightning and the standard library (the
    outermost frame if every frame is inside them); ``near``: of the innermost frame outside mpistrategy (a few
    frames up, where the full walk may climb through dozens of Lightning frames)."""
    frame: FrameType | None = sys._getframe(depth)
    last = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        if not (code.co_filename.startswith(_MPISTRATEGY) if near else _is_skipped(code)):
            return code.co_filename, frame.f_lineno
        last = frame
        frame = frame.f_back
    return last.f_code.co_filename, last.f_lineno


def inside_package(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs mpistrategy's code."""
    return frame is not None and frame.f_code.co_filename.startswith(_MPISTRATEGY)


def innermost_inside(frames: dict[int, FrameType]) -> str | None:
    """``function (mpistrategy/file:line)`` of the first of ``frames`` (threads' innermost frames) that runs
    mpistrategy's code: where a thread waits in mpistrategy."""
    for frame in frames.values():
        if inside_package(frame):
            name = frame.f_code.co_filename
            root = next(root for root in _MPISTRATEGY if name.startswith(root))
            where = f"{name.removeprefix(root)}:{frame.f_lineno}"
            return f"{frame.f_code.co_name} (mpistrategy/{where})"
    return None


def now_at(frame: FrameType | None) -> str:
    """``file:line (in function)`` of a thread's innermost frame."""
    if frame is None:
        return "?"
    return f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno} (in {frame.f_code.co_name})"


def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, else as it is."""
    cwd = os.getcwd() + os.sep
    return path[len(cwd) :] if path.startswith(cwd) else path
