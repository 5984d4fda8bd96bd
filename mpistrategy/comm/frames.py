"""Where code runs: the caller's place in the user's code, and where a thread waits in mpistrategy.

A call site is the innermost frame outside mpistrategy, torch, Lightning (with lightning_utilities and
torchmetrics) and the standard library; which frames are skipped is decided once per code object.
"""

from __future__ import annotations

import os
import sys
from types import CodeType, FrameType


def _package_root(name: str) -> str | None:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return None if path is None else os.path.dirname(os.path.abspath(path)) + os.sep


def package_root() -> str:
    """The directory of the mpistrategy package, with a trailing separator."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


_SKIPPED_ROOTS = tuple(root for root in (package_root(), _package_root("torch")) if root is not None)
# Lightning's packages, and those its collectives run through, are skipped by name (imported after mpistrategy).
_SKIPPED_PARTS = tuple(
    f"{os.sep}{name}{os.sep}"
    for name in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "torchmetrics")
)
_MPISTRATEGY = package_root()
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
            where = f"{frame.f_code.co_filename.removeprefix(_MPISTRATEGY)}:{frame.f_lineno}"
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
