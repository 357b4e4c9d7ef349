"""What an option's value means, for the declarations in ``_config``: a flag's text as
the ``launch()`` keyword's value (a :class:`~rallypoint._launch._option.Flag`'s ``value``),
and the keyword's value as its group's field, checked (an ``Option``'s ``parse``).

Each takes the value and the flag's or the option's name, which its ``ValueError`` or
``TypeError`` names (the command line turns it into one usage line).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal

from rallypoint._core.checks import MAX_SECONDS, check_int, check_seconds, to_timedelta
from rallypoint._elastic._options import BUILTIN_CHECKS, check_backend, parse_nnodes
from rallypoint._supervise._options import SIGNALS, parse_std_spec
from rallypoint._watch._flight._recorder import parse_buffer
from rallypoint._watch._stragglers._pace import check_window, parse_threshold

__all__ = [
    "as_backend",
    "as_buffer",
    "as_checks",
    "as_conf",
    "as_cwd",
    "as_endpoint",
    "as_env",
    "as_events",
    "as_filters",
    "as_health_timeout",
    "as_host",
    "as_local_addr",
    "as_modules",
    "as_nnodes",
    "as_numa_mode",
    "as_path",
    "as_ranks",
    "as_role",
    "as_run_id",
    "as_signals",
    "as_std_spec",
    "as_text",
    "as_threshold",
    "as_window",
    "buffer",
    "count",
    "count_or_off",
    "filters",
    "fork_or_spawn",
    "health_checks",
    "key_values",
    "local_ranks",
    "module_names",
    "one_of",
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


def run_id(value: str | None, flag: str) -> str | None:
    """``--rdzv-id`` (``PET_RDZV_ID``): the job's run id; ``None`` for ``none``."""
    if value is None or value in ("", "none"):
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


# ------------------------------------------- a keyword's value as its group's field, checked

_MODULE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def count(
    minimum: int | None = None, *, maximum: int | None = None, none: bool = False
) -> Callable[[Any, str], Any]:
    """An int in ``[minimum, maximum]`` (``None`` too, with ``none``)."""
    return lambda value, name: check_int(
        value, name, minimum=minimum, maximum=maximum, allow_none=none
    )


def one_of(*choices: str) -> Callable[[Any, str], Any]:
    def check(value: Any, name: str) -> Any:
        if value not in choices:
            allowed = " or ".join(repr(c) for c in choices)
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
        return value

    return check


def as_text(value: Any, name: str) -> Any:
    """A str or ``None``."""
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    return value


def as_role(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def as_host(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty host name, got {value!r}")
    return value


def as_nnodes(value: Any, name: str) -> tuple[int, int]:
    return parse_nnodes(value)


def as_path(value: Any, name: str) -> Any:
    """A path or ``None`` (as a str)."""
    value = os.fspath(value) if isinstance(value, str | os.PathLike) else value
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a path or None, got {type(value).__name__}")
    return value


def as_events(value: Any, name: str) -> Any:
    value = os.fspath(value) if isinstance(value, str | os.PathLike) else value
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a path, got {type(value).__name__}")
    return value


def as_cwd(value: Any, name: str) -> str | None:
    path: str | None = as_path(value, name)
    if path is not None and not os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is not a directory")
    return path


def as_modules(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    elif not isinstance(value, Iterable):
        raise TypeError(f"{name} must be 'a,b' or a list of module names, got {value!r}")
    modules = tuple(m for m in value if m)
    for module in modules:
        if not isinstance(module, str) or not _MODULE.fullmatch(module):
            raise ValueError(f"{name}: {module!r} is not a module name")
    return modules


def as_env(value: Any, name: str) -> Mapping[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise TypeError(f"{name} must be a mapping of str to str")
    return value


def as_numa_mode(value: Any, name: str) -> Any:
    """torch's ``AffinityMode`` is a str enum: its value (checked with the GPUs, by the
    workers' group)."""
    return getattr(value, "value", value)


def as_signals(value: Any, name: str) -> tuple[str, ...]:
    signals = tuple(n.strip() for n in str(value).split(",") if n.strip())
    for signal_name in signals:
        if signal_name not in SIGNALS:
            raise ValueError(f"{name}: {signal_name!r} is not one of {', '.join(SIGNALS)}")
    return signals


def as_std_spec(value: Any, name: str) -> Any:
    return parse_std_spec(value, name)


def as_filters(value: Any, name: str) -> Any:
    value = tuple(value) if isinstance(value, list | tuple) else value  # torch's takes a list
    if not isinstance(value, tuple) or not all(isinstance(f, str) for f in value):
        raise TypeError(f"{name} must be a list of strings, got {value!r}")
    return value


def as_ranks(value: Any, name: str) -> frozenset[int] | None:
    if value is None:
        return None
    if not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a set of local ranks such as {{0, 1}}, got {value!r}")
    ranks = frozenset(value)
    if not (ranks and all(_is_local_rank(r) for r in ranks)):
        raise ValueError(f"{name} must be a non-empty set of local ranks such as {{0, 1}}")
    return ranks


def _is_local_rank(value: object) -> bool:
    try:
        check_int(value, "local rank", minimum=0)
    except (TypeError, ValueError):
        return False
    return True


def as_run_id(value: Any, name: str) -> str | None:
    as_text(value, name)
    if value is not None and ("/" in value or "\0" in value):
        raise ValueError(
            f"{name} {value!r} must not contain '/' or NUL: it names the job's log "
            "and snapshot directories (use letters, digits, '-', '_' and '.')"
        )
    return value


def as_backend(value: Any, name: str) -> str:
    return check_backend(value, name)


def as_endpoint(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be 'HOST:PORT', got {type(value).__name__}")
    return value


def as_conf(value: Any, name: str) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping of option names to values")
    return value


def as_local_addr(value: Any, name: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"{name} must be a host name or address, got {value!r}")
    return value


def as_checks(value: Any, name: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    elif not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list of commands, got {value!r}")
    checks = tuple(value)
    if not all(isinstance(c, str) for c in checks):
        raise TypeError(f"{name} must be a list of commands, got {checks!r}")
    for check in checks:
        if not check.strip():
            raise ValueError(
                f"{name} needs a shell command or one of {', '.join(BUILTIN_CHECKS)}, got {check!r}"
            )
        if check.strip().startswith("builtin:") and check.strip() not in BUILTIN_CHECKS:
            raise ValueError(
                f"unknown health check {check.strip()!r}; the built-in checks are "
                f"{', '.join(BUILTIN_CHECKS)}"
            )
    return checks


def as_health_timeout(value: Any, name: str) -> timedelta:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return to_timedelta(value, name, maximum=MAX_SECONDS)
    check_seconds(value, name, maximum=MAX_SECONDS)
    return value  # type: ignore[no-any-return]


def as_buffer(value: Any, name: str) -> int | None:
    return parse_buffer(value, name)


def as_threshold(value: Any, name: str) -> float | None:
    return parse_threshold(value, name)


def as_window(value: Any, name: str) -> timedelta:
    return timedelta(seconds=check_window(value, name))
