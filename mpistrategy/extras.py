"""The optional parts of the install and the error that names the missing one.

The core install (``pip install mpistrategy``) holds the differentiable collectives, the sync modes and the
compression aggregators. The Lightning strategy needs the ``lightning`` extra; ``mpistrategy-train`` and the recipes
need the ``train`` extra (``pip install "mpistrategy[train]"``).
"""

from __future__ import annotations

import importlib.util

EXTRAS: dict[str, tuple[str, ...]] = {
    "lightning": ("lightning", "torchmetrics"),
    "train": ("lightning", "torchmetrics", "hydra", "omegaconf", "sklearn", "matplotlib", "rich"),
}


class MissingExtraError(ImportError):
    """A part of mpistrategy was used whose extra is not installed."""


def missing_modules(extra: str) -> list[str]:
    """The import names of ``extra`` that cannot be found in this environment (none are imported)."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, feature: str) -> None:
    """Raise :class:`MissingExtraError` naming ``extra`` and the command that installs it when any of its modules is
    missing; ``feature`` says what needed it."""
    missing = missing_modules(extra)
    if missing:
        raise MissingExtraError(
            f"{feature} needs the '{extra}' extra of mpistrategy, which is not installed (missing: "
            f'{", ".join(missing)}). Install it with: pip install "mpistrategy[{extra}]"',
            name=missing[0],
        )
