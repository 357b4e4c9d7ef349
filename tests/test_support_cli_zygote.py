"""The tests' stand-in for ``python -m rallypoint`` subprocesses (``_support.cli_zygote``)
gives what a new interpreter gives: the same exit status and output, the caller's
environment and directory, Python warnings and log records on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from _support import cli_zygote

JOB = """
import logging, os, sys, warnings
warnings.warn("a worker's warning")
logging.getLogger("job").warning("a worker's log record")
print("cwd", os.getcwd(), "var", os.environ.get("CLI_ZYGOTE_VAR"), "argv", sys.argv[1:], flush=True)
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_command_gives_what_a_new_interpreter_gives(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    cmd = [sys.executable, "-m", "rallypoint", "run", str(script)]
    env = dict(os.environ, CLI_ZYGOTE_VAR="set")
    done = {}
    for name, run in (("subprocess", subprocess.run), ("forked", cli_zygote.run)):
        for code in ("0", "3"):  # two ranks that succeed; one that fails
            argv = [*cmd[:4], "--nproc-per-node", "2" if code == "0" else "1", *cmd[4:], code]
            proc = run(argv, capture_output=True, text=True, env=env, cwd=tmp_path)
            # the ranks' lines as they came; the failure summary names pids and times
            err = proc.stderr.split("====")[0]
            done[name, code] = (
                proc.returncode,
                sorted(proc.stdout.splitlines()),
                sorted(err.splitlines()),
            )
    for code in ("0", "3"):
        assert done["forked", code] == done["subprocess", code]
    returncode, out, err = done["forked", "0"]
    assert returncode == 0 and f"[rank1]: cwd {tmp_path} var set argv ['0']" in out, out
    assert any("UserWarning: a worker's warning" in line for line in err), err
    assert "[rank0]: a worker's log record" in err, err
    assert done["forked", "3"][0] == 1


def test_only_python_m_rallypoint_is_forked_and_by_the_command_zygote(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "rallypoint", "--version"]
    proc = cli_zygote.Popen(cmd, stdout=subprocess.PIPE, text=True)
    parent = psutil.Process(proc.pid).ppid()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.startswith("rallypoint "), out
    assert parent != os.getpid()  # a child of the command zygote
    # a variable read as an interpreter starts, set otherwise than the zygote's: a real one
    env = dict(os.environ, PYTHONWARNINGS="error")
    real = cli_zygote.Popen(cmd, stdout=subprocess.PIPE, env=env)
    assert isinstance(real, subprocess.Popen) and psutil.Process(real.pid).ppid() == os.getpid()
    real.communicate(timeout=60)
    other = cli_zygote.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True)
    assert other.stdout == "1\n"


LINES = """
import sys
print("first", flush=True)
print("second\\nthird", flush=True)  # one write: in the pipe with the first line's rest
sys.exit(0)
"""


def test_communicate_after_readline_gives_every_line_not_read(tmp_path: Path) -> None:
    """A line read with ``readline()`` and the rest from ``communicate()``: nothing that a
    buffered stream would have read ahead is lost (Popen's own stream can lose it)."""
    script = tmp_path / "lines.py"
    script.write_text(LINES)
    cmd = [sys.executable, "-m", "rallypoint", "run", str(script)]
    for text in (True, False):
        proc = cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=text)
        assert not isinstance(proc, subprocess.Popen)  # forked
        assert proc.stdout is not None
        end = "first\n" if text else b"first\n"
        while not (first := proc.stdout.readline()).endswith(end):
            assert first, proc.communicate(timeout=60)
        proc.wait(timeout=60)  # every line is in the pipe by now
        rest, _ = proc.communicate(timeout=60)
        lines = rest.splitlines() if text else rest.decode().splitlines()
        assert [line[-6:].strip() for line in lines[:2]] == ["second", "third"], rest
