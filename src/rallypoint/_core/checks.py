"""Validation of user input shared by every part.

Each check raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a value
out of range, with a message that names the option and what it got. ``bool`` is never an
int here (``True`` is not a count).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Literal, overload

__all__ = ["check_int", "check_seconds", "to_timedelta"]


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
) -> float | None:
    """A duration in seconds from a ``timedelta`` (or, with ``numbers``, an int/float).

    Negative durations are rejected, and zero unless ``allow_zero``.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, timedelta):
        secs = value.total_seconds()
    elif numbers and not isinstance(value, bool) and isinstance(value, int | float):
        secs = float(value)
    else:
        wanted = "seconds (float) or a datetime.timedelta" if numbers else "a datetime.timedelta"
        raise TypeError(f"{what} must be {wanted}, got {_type_name(value)}")
    if secs != secs or secs < 0 or (secs == 0 and not allow_zero):  # NaN fails the first test
        raise ValueError(f"{what} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return secs


def to_timedelta(value: object, what: str, *, allow_zero: bool = False) -> timedelta:
    """A ``timedelta`` from a ``timedelta`` or seconds (the CLI and env give seconds)."""
    secs = check_seconds(value, what, allow_zero=allow_zero, numbers=True)
    assert secs is not None
    return timedelta(seconds=secs)
