"""Pure pieces of the launcher: stream specs, wait statuses, output lines, the summary."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from rallypoint._supervise._options import parse_std_spec
from rallypoint._supervise._output import OutputRouter
from rallypoint._supervise._summary import describe_status, format_summary
from rallypoint.launcher import WorkerStatus, WorkerSummary


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0", 0), ("3", 3), (2, 2), ("0:1,1:2", {0: 1, 1: 2}), ({3: 3}, {3: 3})],
)
def test_std_spec(value: object, expected: object) -> None:
    assert parse_std_spec(value, "tee") == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["4", "a", "0:4", "0:1,", -1, True])
def test_bad_std_spec(value: object) -> None:
    with pytest.raises((ValueError, TypeError), match="tee"):
        parse_std_spec(value, "tee")  # type: ignore[arg-type]


def test_describe_status() -> None:
    assert describe_status(3 << 8) == (3, "exited with 3")
    assert describe_status(0) == (0, "exited with 0")
    assert describe_status(signal.SIGSEGV) == (-11, "killed by SIGSEGV")


def test_output_lines_prefix_partial_lines_and_files(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    router = OutputRouter()
    r, w = os.pipe()
    router.add(
        r,
        stream=1,
        prefix_template="[${role_name}${local_rank}/${rank}] ",
        rank=5,
        local_rank=1,
        role="trainer",
        console=True,
        file=tmp_path / "out.log",
    )
    os.write(w, b"one\ntw")
    assert router.on_readable(r)
    out, _ = capfd.readouterr()
    assert out == "[trainer1/5] one\n", "a partial line waits for its end"
    os.write(w, b"o\nthree")
    os.close(w)
    while router.on_readable(r):
        pass
    out, _ = capfd.readouterr()
    assert out == "[trainer1/5] two\n[trainer1/5] three\n", "EOF flushes the partial line"
    assert (tmp_path / "out.log").read_bytes() == b"one\ntwo\nthree"
    assert router.fds() == []


def test_summary_is_one_screen() -> None:
    root = WorkerSummary(
        rank=3, local_rank=1, pid=42, state=WorkerStatus.FAILED, exitcode=-9, detail="x"
    )
    others = [
        WorkerSummary(r, r, 100 + r, WorkerStatus.TERMINATED, -15, "killed by SIGTERM")
        for r in (0, 2)
    ]
    text = format_summary(
        title="rallypoint run t.py",
        root=root,
        host="h",
        when=0.0,
        elapsed=1.0,
        traceback_text="\n".join(f"line {i}" for i in range(500)),
        others=others,
        attempts="no restarts",
    )
    lines = text.splitlines()
    assert len(lines) < 60
    assert "line 499" in text and "line 0" in text and "line 250" not in text
    assert lines[-3].startswith("  rank 0") and lines[-2].startswith("  rank 2")
