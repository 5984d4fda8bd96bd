"""Checks of a scheme's constructor arguments: each raises a ``ValueError`` (``TypeError`` for a wrong type) that
names the scheme, the field, the value given and the values allowed."""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Real
from typing import Any

from mpistrategy.comm.checks import is_integer


def check_fraction(scheme: str, name: str, value: Any) -> float:
    """``value`` as a float in ``(0, 1]`` (a share of the elements)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{scheme}: {name} must be a number in (0, 1], got {value!r} ({type(value).__name__}).")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(
            f"{scheme}: {name}={value!r} is outside (0, 1]; {name} is the share of each bucket's elements sent "
            f"(for example 0.01 for 1%, 1 to send everything)."
        )
    return float(value)


def check_integer(scheme: str, name: str, value: Any, low: int, high: int | None = None, meaning: str = "") -> int:
    """``value`` as an int in ``[low, high]`` (``high=None``: no upper bound)."""
    allowed = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    note = f" ({meaning})" if meaning else ""
    if not is_integer(value):
        raise TypeError(f"{scheme}: {name} must be {allowed}{note}, got {value!r} ({type(value).__name__}).")
    number = int(value)
    if number < low or (high is not None and number > high):
        raise ValueError(f"{scheme}: {name}={value!r} is invalid; {name} must be {allowed}{note}.")
    return number


def check_number(scheme: str, name: str, value: Any, low: float) -> float:
    """``value`` as a float ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not float(value) >= low:
        raise ValueError(f"{scheme}: {name}={value!r} is invalid; {name} must be a number >= {low}.")
    return float(value)


def check_choice(scheme: str, name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` if it is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        listing = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{scheme}: {name}={value!r} is not valid; choose one of {listing}.")
    return value


def check_flag(scheme: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{scheme}: {name} must be True or False, got {value!r} ({type(value).__name__}).")
    return value
