"""What a worker prints reaches the launcher's terminal fit for one: a
200 KB line is cut and says by how much, escape sequences that clear the screen or set the
title are gone (colours stay), a progress bar shows its last state; the log file keeps every
byte as the worker wrote it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rallypoint._core.terminal import LINE_LIMIT

SCRIPT = r"""
import sys
sys.stdout.write("x" * 200_000 + "\n")
sys.stdout.write("a\x1b[2J\x1b[Hb\x1b]0;pwned\x07c\td \x1b[31mred\x1b[0m\n")
for percent in range(0, 101, 25):
    sys.stdout.write(f"\rtraining {percent}%")
    sys.stdout.flush()
sys.stdout.write("\ndone\n")
"""


@pytest.mark.timeout(60)
def test_worker_output_is_fit_for_a_terminal_and_files_keep_it_raw(tmp_path: Path) -> None:
    script = tmp_path / "noisy.py"
    script.write_text(SCRIPT)
    logs = tmp_path / "logs"
    argv = ["--tee", "1", "--log-dir", str(logs), "--rdzv-id", "noisy", str(script)]
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", *argv],
        capture_output=True,
        timeout=50,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.split(b"\n") == [
        b"[rank0]: " + b"x" * LINE_LIMIT + b" [... %d bytes cut]" % (200_000 - LINE_LIMIT),
        b"[rank0]: abc\td \x1b[31mred\x1b[0m",
        b"[rank0]: training 100%",
        b"[rank0]: done",
        b"",
    ]
    [log] = logs.glob("noisy_*/attempt_0/0/stdout.log")
    raw = log.read_bytes()
    assert raw.startswith(b"x" * 200_000 + b"\n") and b"\x1b]0;pwned\x07" in raw
