"""Every duration option of ``rallypoint run`` and ``rallypoint.launch`` refuses a value that
is not finite (``inf``, ``1e400``, ``nan``) or absurdly long with one line that names the
option (the CLI: argparse's ``argument --x:``, exit status 2; ``launch``: ``ValueError``),
never a traceback (``timedelta(seconds=inf)`` raises ``OverflowError``); a negative, zero
or sub-microsecond one says the number as the user typed it (``got -1``, ``got 1e-9``),
never a ``timedelta``'s text (``-1 day, 23:59:59``, ``0:00:00``)."""

from __future__ import annotations

import math
import os
import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest

import rallypoint
from _support import cli_zygote

ZERO_ALLOWED = {"--shutdown-timeout"}
# (flag, launch keyword)
DURATIONS = [
    ("--monitor-interval", "monitor_interval"),
    ("--shutdown-timeout", "shutdown_timeout"),
    ("--restart-grace", "restart_grace"),
    ("--timeout", "timeout"),
    ("--hang-timeout", "hang_timeout"),
    ("--straggler-window", "straggler_window"),
    ("--health-check-timeout", "health_check_timeout"),
]
ABSURD = 1e12
"""Seconds (some 31,700 years): finite, and a ``timedelta`` still holds it."""


def _usage_error(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run the real CLI (forked: its ``main`` parses as a new interpreter's would); assert
    exit status 2 and one line on stderr; return that line."""
    proc = cli_zygote.run(
        [sys.executable, "-m", "rallypoint", "run", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "hello" not in proc.stdout, "the job must not run"
    return lines[0]


def _never() -> None:
    raise AssertionError("the job must not start")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["inf", "1e400", "nan", "-inf", f"{ABSURD:g}"])
@pytest.mark.parametrize(("flag", "keyword"), DURATIONS)
def test_a_duration_that_is_not_finite_or_absurd_is_refused_naming_the_option(
    tmp_path: Path, flag: str, keyword: str, value: str
) -> None:
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    line = _usage_error([f"{flag}={value}", str(script)])
    assert re.match(rf"rallypoint run: error: argument {flag}(/--\w+)?: ", line), line
    assert repr(value) in line, line
    # the same through the API, where durations are timedeltas (or, for some, seconds)
    number = float(value)
    given: object = timedelta(seconds=number) if math.isfinite(number) else number
    with pytest.raises(ValueError, match=f"^{keyword} must be "):
        rallypoint.launch(_never, nproc=1, **{keyword: given})  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_year_is_the_longest_duration_and_an_hour_the_longest_monitor_interval(
    tmp_path: Path,
) -> None:
    from rallypoint._launch._config import LaunchConfig

    year = timedelta(days=366)
    config = LaunchConfig(timeout=year, hang_timeout=year, monitor_interval=timedelta(hours=1))
    assert config.timeout == year and config.monitor_interval == timedelta(hours=1)
    with pytest.raises(ValueError, match=r"monitor_interval must be at most 3600 s \(1 h\)"):
        LaunchConfig(monitor_interval=timedelta(hours=2))
    with pytest.raises(ValueError, match=r"timeout must be at most 31622400 s \(366 days\)"):
        LaunchConfig(timeout=year + timedelta(seconds=1))
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    line = _usage_error(["--monitor-interval", "7200", str(script)])
    assert "argument --monitor-interval/--monitor_interval: must be at most 3600 s" in line


@pytest.mark.timeout(30)
def test_an_infinite_shutdown_timeout_from_the_environment_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    line = _usage_error([str(script)], env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "inf"})
    assert line.startswith("rallypoint run: error: TORCH_ELASTIC_SHUTDOWN_TIMEOUT: "), line
    line = _usage_error([str(script)], env={"PET_HANG_TIMEOUT": "nan"})
    assert line.startswith("rallypoint run: error: argument --hang-timeout/"), line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["-1", "-0.5", "0", "1e-9"])
@pytest.mark.parametrize(("flag", "keyword"), DURATIONS)
def test_a_negative_zero_or_tiny_duration_says_the_number_as_typed(
    tmp_path: Path, flag: str, keyword: str, value: str
) -> None:
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    zero = flag in ZERO_ALLOWED
    if value == "0" and zero:
        return  # a valid value (the job would run)
    if value == "1e-9":
        least = "0 or at least" if zero else "at least"
        says = f"must be {least} 0.000001 (a microsecond), got 1e-9"
    else:
        says = f"must be {'>= 0' if zero else '> 0'}, got {value}"
    line = _usage_error([flag, value, str(script)])
    assert re.fullmatch(
        rf"rallypoint run: error: argument {flag}(/--\w+)?: {re.escape(says)}", line
    ), line
    # the API takes a timedelta: its seconds, not its text
    if value.startswith("-") or (not zero and value == "0"):
        with pytest.raises(ValueError) as refused:
            rallypoint.launch(_never, nproc=1, **{keyword: timedelta(seconds=float(value))})  # type: ignore[arg-type]
        assert str(refused.value) == f"{keyword} {says} s", refused.value
