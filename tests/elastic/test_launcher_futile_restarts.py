"""No futile restarts on one node: a root cause that repeats identically ends the job after
``--max-same-failure`` attempts (default 3) instead of spending the whole budget, and
``rallypoint.FatalError`` ends it at once. Before, ``--max-restarts 100`` printed 100
identical tracebacks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import rallypoint
from _support import cli_zygote
from rallypoint._cli._run import run_main
from rallypoint._elastic._signature import failure_signature
from rallypoint.launcher import FatalError, LaunchConfig, WorkerFailedError, launch

pytestmark = pytest.mark.timeout(90)

CONFIG_BUG = """
import os
config = {"lr": 0.1}
if os.environ["RANK"] == "1":
    print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], flush=True)
    batch = config["batch_size"]  # the same KeyError, at the same line, every attempt
"""


def _restarts(err: str) -> int:
    return err.count("restarting the worker group")


def test_the_same_failure_three_times_in_a_row_ends_the_job(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(CONFIG_BUG)
    assert run_main(["--nproc-per-node", "2", "--max-restarts", "100", str(script)]) == 1
    out, err = capfd.readouterr()
    assert out.count("attempt") == 3 and _restarts(err) == 2, err
    line = f"the same failure (KeyError at {script}:6) ended 3 attempts in a row"
    assert f"rallypoint: {line}; not restarting (--max-same-failure 3)" in err, err
    assert "KeyError: 'batch_size'" in err[err.index("Root cause") :]


def test_max_same_failure_off_and_n(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text(CONFIG_BUG)
    argv = ["--nproc-per-node", "2", "--max-restarts", "3", str(script)]
    assert run_main(["--max-same-failure", "off", *argv]) == 1
    out, err = capfd.readouterr()
    assert out.count("attempt") == 4 and "same failure" not in err, "off: the whole budget"
    assert run_main(["--max-same-failure", "2", *argv]) == 1
    out, err = capfd.readouterr()
    assert out.count("attempt") == 2 and "ended 2 attempts in a row" in err


def test_different_failures_and_exit_codes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    flaky = tmp_path / "flaky.py"  # a different line each attempt: not the same failure
    flaky.write_text(
        "import os\n"
        "n = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "if n == 0: raise RuntimeError('a')\n"
        "if n == 1: raise RuntimeError('b')\n"
        "if n == 2: raise RuntimeError('c')\n"
        "if n == 3: raise RuntimeError('d')\n"
    )
    assert run_main(["--nproc-per-node", "1", "--max-restarts", "4", str(flaky)]) == 0
    _, err = capfd.readouterr()
    assert _restarts(err) == 4 and "same failure" not in err
    exits = tmp_path / "exits.py"  # no traceback: the same exit at the same rank
    exits.write_text("import os, sys\nif os.environ['RANK'] == '1': sys.exit(3)\n")
    assert run_main(["--nproc-per-node", "2", "--max-restarts", "9", str(exits)]) == 1
    _, err = capfd.readouterr()
    assert "the same failure (rank 1 exited with 3) ended 3 attempts in a row" in err, err


def test_fatal_error_ends_the_job_at_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script, printed = tmp_path / "train.py", tmp_path / "rank0-printed"
    script.write_text(  # rank 1 fails once rank 0 said its attempt; rank 0 is then stopped
        "import os, time, rallypoint\n"
        "print('attempt', os.environ['TORCHELASTIC_RESTART_COUNT'], flush=True)\n"
        f"if os.environ['RANK'] == '0': open({str(printed)!r}, 'w').close()\n"
        "if os.environ['RANK'] == '1':\n"
        f"    while not os.path.exists({str(printed)!r}): time.sleep(0.01)\n"
        "    raise rallypoint.FatalError('no dataset at /data/x')\n"
        "time.sleep(60)\n"
    )
    assert run_main(["--nproc-per-node", "2", "--max-restarts", "5", str(script)]) == 1
    out, err = capfd.readouterr()
    assert out.count("attempt 0") == 2 and "attempt 1" not in out, "no restart"
    assert "rallypoint: rank 1 raised FatalError; not restarting" in err
    root = err[err.index("Root cause") :]
    assert "FatalError: no dataset at /data/x" in root and "rank      : 1" in root
    assert rallypoint.FatalError is FatalError


def _fatal(x: int) -> int:
    if os.environ["RANK"] == "0":
        raise FatalError(f"stop {x}")
    return x


def test_fatal_error_through_launch() -> None:
    with pytest.raises(WorkerFailedError, match="FatalError: stop 7") as info:
        launch(_fatal, 7, nproc=2, max_restarts=3)
    assert isinstance(info.value.__cause__, FatalError)


@pytest.mark.parametrize("flag", ["--max-same-failure", "--max-node-failures"])
@pytest.mark.parametrize("value", ["0", "-1", "abc", ""])
def test_bad_counts_are_one_line(tmp_path: Path, flag: str, value: str) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('hi')\n")
    proc = cli_zygote.run(
        [sys.executable, "-m", "rallypoint", "run", flag, value, str(script)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert f"{flag} must be a number >= 1 or off" in line
    name = flag.lstrip("-").replace("-", "_")
    with pytest.raises(ValueError, match=name):
        LaunchConfig(**{name: 0})  # type: ignore[misc]
    with pytest.raises(TypeError, match=name):
        LaunchConfig(**{name: "3"})  # type: ignore[misc]


def test_signatures() -> None:
    site = os.path.dirname(os.path.dirname(os.__file__))
    tb = (
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 40, in <module>\n'
        "    main()\n"
        '  File "/home/u/train.py", line 12, in main\n'
        "    load(cfg)\n"
        f'  File "{site}/json/__init__.py", line 293, in load\n'
        "    return loads(fp.read())\n"
        "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n"
    )
    assert failure_signature(1, "exited with 1", tb) == (
        "json.decoder.JSONDecodeError at /home/u/train.py:12"
    )
    chained = (
        tb + "\nDuring handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n"
        '  File "/home/u/train.py", line 14, in main\n'
        "    raise ValueError('bad config')\n"
        "ValueError: bad config\n"
    )
    assert failure_signature(1, "exited with 1", chained) == "ValueError at /home/u/train.py:14"
    assert failure_signature(2, "killed by SIGSEGV", "") == "rank 2 killed by SIGSEGV"
