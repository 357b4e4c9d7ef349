"""What a worker prints reaches the launcher's terminal fit for one: a
200 KB line is cut and says by how much, escape sequences that clear the screen or set the
title are gone (colours stay), a progress bar shows its last state; the log file keeps every
byte as the worker wrote it. A c10d warning's C++ stack is one line there."""

from __future__ import annotations

import os
import re
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


def _run(
    tmp_path: Path, name: str, script: str, stream: str
) -> tuple[subprocess.CompletedProcess[bytes], Path]:
    """``rallypoint run --tee`` of ``script`` with a log directory: the run, and the log
    file of its rank 0's ``stream`` (``stdout`` or ``stderr``)."""
    path = tmp_path / f"{name}.py"
    path.write_text(script)
    logs = tmp_path / "logs"
    tee = "1" if stream == "stdout" else "2"
    argv = ["--tee", tee, "--log-dir", str(logs), "--rdzv-id", name, str(path)]
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", *argv],
        capture_output=True,
        timeout=50,
        env={**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"},
    )
    assert proc.returncode == 0, proc.stderr.decode()
    [log] = logs.glob(f"{name}_*/attempt_0/0/{stream}.log")
    return proc, log


@pytest.mark.timeout(60)
def test_worker_output_is_fit_for_a_terminal_and_files_keep_it_raw(tmp_path: Path) -> None:
    proc, log = _run(tmp_path, "noisy", SCRIPT, "stdout")
    assert proc.stdout.split(b"\n") == [
        b"[rank0]: " + b"x" * LINE_LIMIT + b" [... %d bytes cut]" % (200_000 - LINE_LIMIT),
        b"[rank0]: abc\td \x1b[31mred\x1b[0m",
        b"[rank0]: training 100%",
        b"[rank0]: done",
        b"",
    ]
    raw = log.read_bytes()
    assert raw.startswith(b"x" * 200_000 + b"\n") and b"\x1b]0;pwned\x07" in raw


C10D_WARNS = r"""
import sys, threading, time
import torch.distributed as dist
master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", master.port, is_master=False, wait_for_workers=False)
def waiter():
    try:
        client.wait(["never"])
    except Exception as exc:
        print("the store is gone:", type(exc).__name__, file=sys.stderr, flush=True)
thread = threading.Thread(target=waiter)
thread.start()
time.sleep(0.5)
del master  # the store's server stops: c10d warns, with the C++ stack it caught
thread.join(10)
print("not c10d's warning\nException raised from here\nframe #0: kept", file=sys.stderr)
"""


@pytest.mark.timeout(60)
def test_a_c10d_warnings_cpp_stack_is_one_line_on_the_console_and_whole_in_the_file(
    tmp_path: Path,
) -> None:
    proc, log = _run(tmp_path, "warns", C10D_WARNS, "stderr")
    err = proc.stderr.decode()
    lines = [line for line in err.splitlines() if line.startswith("[rank0]: ")]
    [warning] = [i for i, line in enumerate(lines) if "[c10d] recvValueWithTimeout failed" in line]
    folded = lines[warning + 1]
    assert re.fullmatch(
        r"\[rank0\]:   \(the warning's C\+\+ stack, \d+ lines, is left out of the console\)",
        folded,
    ), err
    assert lines[warning + 2 :] == [
        "[rank0]: the store is gone: DistNetworkError",
        "[rank0]: not c10d's warning",
        "[rank0]: Exception raised from here",  # another stack: shown whole
        "[rank0]: frame #0: kept",
    ], err
    raw = log.read_text()
    assert "Exception raised from recvBytes" in raw and "frame #5: " in raw  # every byte
