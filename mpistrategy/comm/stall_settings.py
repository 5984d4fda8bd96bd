"""The stall watchdog's settings (:mod:`mpistrategy.comm.watchdog`): the timeout and what follows a report.

``MPISTRATEGY_STALL_TIMEOUT`` (seconds, default :data:`DEFAULT_TIMEOUT`; 0 turns the watchdog off) and
``MPISTRATEGY_STALL_ACTION`` (``"abort"``, the default, or ``"warn"``), read when mpistrategy is imported, or
:func:`set_stall_timeout` in Python (on every rank alike).
"""

from __future__ import annotations

import os

#: the default stall timeout in seconds: longer than any healthy wait in a collective on a cluster
DEFAULT_TIMEOUT = 300.0
ACTIONS = ("abort", "warn")


def _timeout_from_environment() -> float:
    text = os.environ.get("MPISTRATEGY_STALL_TIMEOUT", "").strip()
    try:
        seconds = float(text) if text else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(
            f"MPISTRATEGY_STALL_TIMEOUT={text!r} is not a number of seconds; set it to e.g. 300, or 0 to turn the "
            "stall watchdog off."
        ) from None
    return _checked_timeout(seconds)


def _checked_timeout(seconds: float) -> float:
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
        raise ValueError(f"stall timeout: {seconds!r} is not a number of seconds >= 0 (0 turns the watchdog off).")
    return float(seconds)


def _checked_action(action: str) -> str:
    if action not in ACTIONS:
        raise ValueError(f"stall action: {action!r} is not one of {ACTIONS}.")
    return action


_timeout = _timeout_from_environment()
_action = _checked_action(os.environ.get("MPISTRATEGY_STALL_ACTION", "abort").strip().lower() or "abort")


def set_stall_timeout(seconds: float, action: str | None = None) -> None:
    """Report a rank that waited more than ``seconds`` in a collective (0: never); ``action`` ``"abort"`` ends the
    job with exit code :data:`STALL_EXIT_CODE` after the report, ``"warn"`` only reports. Call it on every rank."""
    global _timeout, _action
    _timeout = _checked_timeout(seconds)
    if action is not None:
        _action = _checked_action(action)


def stall_timeout() -> float:
    """The stall timeout in seconds (0: the watchdog is off)."""
    return _timeout


def stall_action() -> str:
    """``"abort"`` or ``"warn"``: what the watchdog does after its report."""
    return _action
