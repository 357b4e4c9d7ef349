"""``--log-dir``: a fresh directory per launch, and no disk problem ends a healthy job.

The disks are real filesystems (a 256 KiB tmpfs, ``small_disk``) that fill or turn
read-only, as a user meets them; before the fix a full log directory killed the launcher
with an unhandled ``OSError: [Errno 28]`` and no summary, and a read-only one gave a
59-line traceback.
"""

from __future__ import annotations

import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from _support import cli_zygote
from rallypoint._cli._run import run_main
from rallypoint._core import envvars
from rallypoint.launcher import launch

pytestmark = pytest.mark.timeout(90)

RALLYPOINT = [sys.executable, "-m", "rallypoint", "run"]

CHATTY = """
import os, sys
rank = os.environ["RANK"]
for i in range(3000):  # ~240 KiB per rank: the 256 KiB disk fills on the way
    print(f"rank {rank} line {i:05d} " + "x" * 60)
print(f"rank {rank} done", flush=True)
"""

FAILS_ONCE = """
import os, sys, time
from pathlib import Path
flag = Path(sys.argv[1])
print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    (flag / f"ready{os.environ['RANK']}").write_text("")
    while not (flag / "go").exists():
        time.sleep(0.02)
    sys.exit(3)
print("second attempt ran", flush=True)
"""


def test_each_launch_gets_its_own_private_directory(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os\nprint('run', os.environ['RANK'])\nraise RuntimeError('bad')\n")
    logs = tmp_path / "logs"
    argv = ["--nproc-per-node", "1", "--log-dir", str(logs), "--rdzv-id", "same", "--tee", "3"]
    assert run_main([*argv, str(script)]) == 1
    time.sleep(1.1)  # the name has the start time to the second
    assert run_main([*argv, str(script)]) == 1
    _, err = capfd.readouterr()

    runs = sorted(logs.iterdir())
    assert len(runs) == 2, "two launches with one run id share a directory"
    shown = [line.rsplit(" ", 1)[1] for line in err.splitlines() if "log directory is" in line]
    assert shown == [str(r) for r in runs], "the newest must sort last"
    for run in runs:
        assert run.name.startswith("same_")
        assert stat.S_IMODE(run.stat().st_mode) == 0o700, oct(run.stat().st_mode)
        assert (run / "attempt_0" / "0" / "error.json").exists(), "each keeps its error file"
        assert (run / "attempt_0" / "0" / "stdout.log").read_text() == "run 0\n"


def test_a_read_only_log_dir_is_one_line_and_exit_2(small_disk: Any, tmp_path: Path) -> None:
    small_disk.read_only()
    script = tmp_path / "ok.py"
    script.write_text("print('hi')\n")
    logs = small_disk.path / "logs"
    proc = cli_zygote.run(
        [*RALLYPOINT, "--nproc-per-node", "1", "--log-dir", str(logs), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"--log-dir {logs}: cannot write there (Read-only file system)" in lines[0]
    with pytest.raises(ValueError, match=r"--log-dir .*Read-only file system"):
        launch(print, nproc=1, log_dir=str(logs))
    snapshots = {envvars.SNAPSHOT_DIR: str(small_disk.path / "snapshots")}
    with pytest.raises(ValueError, match=r"--snapshot-dir .*Read-only file system"):
        launch(print, nproc=1, env=snapshots)  # launch() checks it too, not only the CLI


def test_a_log_dir_that_fills_during_the_run_ends_nothing(small_disk: Any, tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    proc = cli_zygote.run(
        [
            *RALLYPOINT,
            "--nproc-per-node",
            "2",
            "--tee",
            "3",
            "--log-dir",
            str(small_disk.path),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: rank {rank} done" in proc.stdout, "the console copy stopped"
        assert proc.stdout.count(f"[rank{rank}]: rank {rank} line") == 3000
    trouble = [line for line in proc.stderr.splitlines() if "cannot write worker logs" in line]
    assert len(trouble) == 1, proc.stderr[-3000:]  # once a minute, not once per write
    assert str(small_disk.path) in trouble[0] and "No space left on device" in trouble[0]
    assert "free" in trouble[0]
    assert "Traceback" not in proc.stderr


def test_a_log_dir_that_turns_read_only_mid_run_ends_nothing(
    small_disk: Any, tmp_path: Path
) -> None:
    script = tmp_path / "fails_once.py"
    script.write_text(FAILS_ONCE)
    proc = cli_zygote.Popen(
        [
            *RALLYPOINT,
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--tee",
            "3",
            "--log-dir",
            str(small_disk.path),
            str(script),
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 45
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    small_disk.read_only()  # attempt 1's directories cannot be made
    (tmp_path / "go").write_text("")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("second attempt ran") == 2, out
    trouble = [line for line in err.splitlines() if "cannot write worker logs" in line]
    assert len(trouble) == 1 and "Read-only file system" in trouble[0], err[-3000:]
    assert "Traceback" not in err
