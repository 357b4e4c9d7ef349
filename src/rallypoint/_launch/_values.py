"""What an option's value means, for the declarations in ``_config``: a flag's text as
the ``launch()`` keyword's value (a :class:`~rallypoint._launch._option.Flag`'s ``value``),
and the keyword's value as its group's field (an ``Option``'s ``parse``).

Each takes the value and the flag's or the option's name, which its ``ValueError`` or
``TypeError`` names (the command line turns it into one usage line).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import Any, Literal

from rallypoint._core.checks import MAX_SECONDS, to_timedelta
from rallypoint._elastic._options import BUILTIN_CHECKS, check_backend, parse_nnodes
from rallypoint._watch._flight._recorder import parse_buffer
from rallypoint._watch._stragglers._pace import parse_threshold

__all__ = [
    "as_checks",
    "as_modules",
    "as_nnodes",
    "as_path",
    "as_ranks",
    "as_seconds",
    "as_signals",
    "as_tuple",
    "buffer",
    "count_or_off",
    "filters",
    "fork_or_spawn",
    "health_checks",
    "key_values",
    "local_ranks",
    "module_names",
    "or_none",
    "parse_nproc",
    "positive",
    "rdzv_backend",
    "run_id",
    "text",
    "threshold",
]


def text(value: Any, flag: str) -> str:
    return str(value)


def or_none(value: Any, flag: str) -> Any:
    return value or None


def fork_or_spawn(value: str, flag: str) -> Literal["fork", "spawn"]:
    """torchrun's ``forkserver`` starts fresh interpreters here, as ``spawn`` does."""
    return "fork" if value == "fork" else "spawn"


def module_names(value: str, flag: str) -> tuple[str, ...]:
    """``a, b``: module names."""
    return tuple(m.strip() for m in str(value).split(",") if m.strip())


def run_id(value: str, flag: str) -> str | None:
    """``--rdzv-id`` (``PET_RDZV_ID``): the job's run id; ``None`` for ``none``."""
    if value in ("", "none"):
        return None
    if "/" in value or "\0" in value:
        raise ValueError(
            f"{flag} {value!r} must not contain '/': the run id names the job's log and "
            f"snapshot directories; use letters, digits, '-', '_' and '.' (say "
            f"{flag} {value.replace('/', '-').replace(chr(0), '')})"
        )
    return value


def rdzv_backend(value: str, flag: str) -> str:
    """``--rdzv-backend``: a name the rendezvous registry knows, plugins' included."""
    return check_backend(str(value).strip(), flag)


def count_or_off(value: str, flag: str) -> int | None:
    text = str(value).strip().lower()
    if text == "off":
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{flag} must be a number >= 1 or off, got {value!r}")
    return int(text)


def key_values(value: str | None, flag: str) -> dict[str, str]:
    """``k=v,k=v``."""
    out: dict[str, str] = {}
    for item in str(value or "").split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} must be key=value,key=value; got {item.strip()!r}")
        out[key.strip()] = val.strip()
    return out


def local_ranks(value: str, flag: str) -> frozenset[int] | None:
    if not value:
        return None
    try:
        return frozenset(int(r) for r in str(value).split(","))
    except ValueError:
        raise ValueError(
            f"{flag} must be a comma-separated list of integers e.g. {flag}=0,1,2"
        ) from None


def filters(value: str | None, flag: str) -> tuple[str, ...]:
    """torchrun's comma-separated filter list: ``,,`` stands for a comma."""
    if value is None:
        return ()
    placeholder = "\0"
    return tuple(
        item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")
    )


def threshold(value: str, flag: str) -> float | None:
    return parse_threshold(value, flag)


def buffer(value: str, flag: str) -> int | None:
    return parse_buffer(value, flag)


def health_checks(value: list[str] | None, flag: str) -> tuple[str, ...]:
    """Health checks: shell commands and the built-in ones."""
    for check in value or ():
        name = check.strip()
        if not name:
            raise ValueError(
                f"{flag} needs a shell command or one of {', '.join(BUILTIN_CHECKS)}, got {check!r}"
            )
        if name.startswith("builtin:") and name not in BUILTIN_CHECKS:
            raise ValueError(
                f"{flag} {name!r} is not a built-in check; use one of {', '.join(BUILTIN_CHECKS)}"
            )
    return tuple(value or ())


def positive(value: float, flag: str) -> float:
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"{flag} must be > 0 seconds, got {seconds:g}")
    return seconds


def _cpu_count() -> int:
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    with contextlib.suppress(OSError):
        return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    return 0


def parse_nproc(value: str, flag: str = "--nproc-per-node") -> int:
    """torchrun's ``--nproc-per-node`` values: an int, ``cpu``, ``gpu`` or ``auto``."""
    text = str(value).strip()
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 1:
            raise ValueError(f"{flag} must be >= 1, got {n}")
        return n
    if text == "cpu":
        return _cpu_count()
    if text == "gpu":
        n = _gpu_count()
        if not n:
            raise ValueError(f"{flag} gpu: Cuda is not available.")
        return n
    if text == "auto":
        return _gpu_count() or _cpu_count()
    raise ValueError(
        f"Unsupported nproc_per_node value: {text!r} (use an integer >= 1, cpu, gpu or auto)"
    )


# ------------------------------------------------------- a keyword's value, its group's field


def as_nnodes(value: Any, name: str) -> tuple[int, int]:
    return parse_nnodes(value)


def as_path(value: Any, name: str) -> Any:
    return os.fspath(value) if isinstance(value, str | os.PathLike) else value


def as_modules(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    elif not isinstance(value, Iterable):
        raise TypeError(f"{name} must be 'a,b' or a list of module names, got {value!r}")
    return tuple(m for m in value if m)


def as_signals(value: Any, name: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in str(value).split(",") if n.strip())


def as_checks(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of commands, got {value!r}")
    return tuple(value)


def as_tuple(value: Any, name: str) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value  # torch's takes a list


def as_ranks(value: Any, name: str) -> frozenset[int] | None:
    if value is None:
        return None
    if not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a set of local ranks such as {{0, 1}}, got {value!r}")
    return frozenset(value)


def as_seconds(value: Any, name: str) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return to_timedelta(value, name, maximum=MAX_SECONDS)
    return value
