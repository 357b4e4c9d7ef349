"""Validation of user input shared by every part.

Each check raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a value
out of range, with a message that names the option and what it got. ``bool`` is never an
int here (``True`` is not a count).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Literal, overload

__all__ = ["MAX_SECONDS", "check_int", "check_seconds", "duration_text", "to_timedelta"]

MAX_SECONDS = 366 * 24 * 3600.0
"""The longest duration a launch option takes (a year): anything longer is a mistake, and
would overflow the waits it ends up in (``inf`` cannot even become a ``timedelta``)."""


def _type_name(value: object) -> str:
    return type(value).__name__


@overload
def check_int(
    value: object,
    what: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: Literal[False] = False,
) -> int: ...


@overload
def check_int(
    value: object,
    what: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool,
) -> int | None: ...


def check_int(
    value: object,
    what: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """``value`` as an int in ``[minimum, maximum]`` (``None`` passes when ``allow_none``).

    >>> check_int(3, "nproc", minimum=1)
    3
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {_type_name(value)} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{what} must be <= {maximum}, got {value}")
    return value


def check_seconds(
    value: object,
    what: str,
    *,
    allow_zero: bool = False,
    allow_none: bool = False,
    numbers: bool = False,
    maximum: float | None = None,
) -> float | None:
    """A duration in seconds from a ``timedelta`` (or, with ``numbers``, an int/float).

    Negative durations are rejected, zero unless ``allow_zero``, more than ``maximum``
    seconds if given; a float that is not finite (NaN, infinity) is a ``ValueError`` even
    where only a ``timedelta`` is taken.
    """
    if value is None and allow_none:
        return None
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} must be {bound} and finite, got {value}")
    if isinstance(value, timedelta):
        secs = value.total_seconds()
    elif numbers and not isinstance(value, bool) and isinstance(value, int | float):
        secs = float(value)
    else:
        wanted = "seconds (float) or a datetime.timedelta" if numbers else "a datetime.timedelta"
        raise TypeError(f"{what} must be {wanted}, got {_type_name(value)}")
    # a timedelta as the seconds it holds: "-1 s", never "-1 day, 23:59:59"
    shown = f"{secs:g} s" if isinstance(value, timedelta) else f"{value}"
    if secs < 0 or (secs == 0 and not allow_zero):
        raise ValueError(f"{what} must be {bound}, got {shown}")
    if maximum is not None and secs > maximum:
        raise ValueError(f"{what} must be at most {duration_text(maximum)}, got {shown}")
    return secs


def duration_text(seconds: float) -> str:
    """``seconds`` as a reader counts them: ``3600 s (1 h)``."""
    text = f"{seconds:.0f} s" if seconds == int(seconds) else f"{seconds:g} s"
    for unit, size in (("days", 86400), ("h", 3600)):
        if seconds >= size and seconds % size == 0:
            return f"{text} ({seconds / size:g} {unit})"
    return text


def to_timedelta(
    value: object, what: str, *, allow_zero: bool = False, maximum: float | None = None
) -> timedelta:
    """A ``timedelta`` from a ``timedelta`` or seconds (the CLI and env give seconds)."""
    secs = check_seconds(value, what, allow_zero=allow_zero, numbers=True, maximum=maximum)
    assert secs is not None
    return timedelta(seconds=secs)
