"""A second Ctrl-C or SIGTERM to the launcher kills the workers at once and says so (issue
50, section 5: workers that ignore signals were stopped only after ``--shutdown-timeout``,
with no word about the second signal). One signal sent twice by one sender (``timeout``
signals the launcher, then its process group) is still one: the workers' handlers get
their grace period (``test_launcher_preemption``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rallypoint._supervise._signals import ECHO, SignalQueue

IGNORES_SIGNALS = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
Path(sys.argv[1]).write_text("")
time.sleep(120)
"""


@pytest.mark.timeout(10)
def test_the_same_signal_twice_at_once_is_one_signal() -> None:
    with SignalQueue((signal.SIGUSR1, signal.SIGUSR2)) as signals:
        for signum in (signal.SIGUSR1, signal.SIGUSR1, signal.SIGUSR2):
            os.kill(os.getpid(), signum)
        assert [signals.pop(), signals.pop(), signals.pop()] == [
            signal.SIGUSR1,
            signal.SIGUSR2,
            None,
        ]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_second_sigterm_kills_the_workers_at_once(tmp_path: Path) -> None:
    script, ready = tmp_path / "stubborn.py", tmp_path / "ready"
    script.write_text(IGNORES_SIGNALS)
    argv = ["--shutdown-timeout", "100", str(script), str(ready)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rallypoint", "run", *argv],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        workers = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGTERM)  # as `timeout` does: the launcher, then its group
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.stderr is not None
        while "stopping the workers" not in (line := proc.stderr.readline()):
            assert line, proc.communicate()
        assert line == (
            "rallypoint: received SIGTERM: stopping the workers (SIGKILL in 100 s, "
            "--shutdown-timeout; send it again to kill them now)\n"
        )
        time.sleep(ECHO)  # a second signal, not the first one's echo
        assert all(w.status() != psutil.STATUS_ZOMBIE for w in workers), "killed by the echo"
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 143, rest
    said = "rallypoint: received SIGTERM while stopping: killed the workers (SIGKILL) at once\n"
    assert rest.startswith(said), rest
    _, alive = psutil.wait_procs(workers, timeout=5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
