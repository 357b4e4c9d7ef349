"""A launch SIGKILLed with its whole process group leaves its temporary directories; the
next launch removes them, and never those of a launch that still runs.

Real ``rallypoint run`` jobs with ``TMPDIR`` pointing at a directory of the test's own.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rallypoint._core.tempdirs import OWNER, PREFIXES

# every worker writes OUT/ready-<rank>, then waits for OUT/go (at most 100 s)
WAIT = """
import os, sys, time
out = sys.argv[1]
open(os.path.join(out, f"ready-{os.environ['RANK']}"), "w").close()
deadline = time.monotonic() + 100
while not os.path.exists(os.path.join(out, "go")) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.fixture
def tmpdir_short() -> Iterator[Path]:
    """A temp dir short enough that the snapshot server's socket directory goes in it too."""
    path = Path(tempfile.mkdtemp(prefix="rp-stale-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ours(tmp: Path) -> set[str]:
    return {p.name for p in tmp.iterdir() if p.name.startswith(PREFIXES)}


def _start(script: Path, out: Path, tmp: Path) -> subprocess.Popen[str]:
    """``rallypoint run --nproc-per-node 2`` in a session (a process group) of its own;
    returns once both workers run."""
    out.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2", str(script),
         str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 100
    while not all((out / f"ready-{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    return proc


def _wait_session_gone(sid: int) -> None:
    """Until no process of session ``sid`` is left (zombies aside)."""
    import psutil

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = []
        for p in psutil.process_iter(["status"]):
            with contextlib.suppress(OSError, psutil.Error):
                if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(p.pid)
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes of the killed launch still run: {left}")


@pytest.mark.timeout(300)
def test_the_next_launch_removes_a_killed_launchs_temp_dirs_and_keeps_a_live_ones(
    tmp_path: Path, tmpdir_short: Path
) -> None:
    tmp = tmpdir_short
    script = tmp_path / "wait.py"
    script.write_text(WAIT)
    live = _start(script, tmp_path / "live", tmp)
    try:
        mine = _ours(tmp)
        assert len(mine) == 3, mine  # scratch, stacks, snapshot socket
        killed = _start(script, tmp_path / "killed", tmp)  # two launches at once
        assert mine < _ours(tmp)  # the second one's start removed nothing of the first's
        os.killpg(killed.pid, signal.SIGKILL)  # the launcher, its warm process, their children
        killed.communicate(timeout=60)
        _wait_session_gone(killed.pid)
        stale = _ours(tmp) - mine
        kinds = {prefix for prefix in PREFIXES for name in stale if name.startswith(prefix)}
        assert kinds == set(PREFIXES), stale
        [sockets] = [name for name in stale if name.startswith("rallypoint-snapshots-")]
        assert (tmp / sockets / "server.sock").exists()
        assert all((tmp / name / OWNER).is_file() for name in stale), stale
        # a third launch, while the first runs: the killed launch's go, the live one's stay
        hello = tmp_path / "hello.py"
        hello.write_text("print('hello')\n")
        done = subprocess.run(
            [sys.executable, "-m", "rallypoint", "run", str(hello)],
            capture_output=True,
            text=True,
            timeout=100,
            env={**os.environ, "TMPDIR": str(tmp)},
        )
        assert done.returncode == 0, done.stderr
        assert _ours(tmp) == mine, (_ours(tmp), mine)
        assert live.poll() is None
    finally:
        (tmp_path / "live" / "go").touch()
        text = live.communicate(timeout=100)[0]
    assert live.returncode == 0, text
    assert _ours(tmp) == set(), _ours(tmp)  # and a launch that ends removes its own


@pytest.mark.timeout(60)
def test_only_dirs_whose_owner_is_gone_or_was_replaced_are_removed(tmp_path: Path) -> None:
    from rallypoint._core.tempdirs import mark_owned, remove_stale

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in ("rallypoint_live", "rallypoint_reused", "rallypoint_gone", "rallypoint_x"):
            (tmp_path / name).mkdir()
        mark_owned(tmp_path / "rallypoint_live", child.pid)
        mark_owned(tmp_path / "rallypoint_reused", child.pid)
        pid, _ = (tmp_path / "rallypoint_reused" / OWNER).read_text().split()
        (tmp_path / "rallypoint_reused" / OWNER).write_text(f"{pid} 1\n")  # another start
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        mark_owned(tmp_path / "rallypoint_gone", gone.pid)
        (tmp_path / "other_dir").mkdir()  # not ours: never looked at
        removed = remove_stale([str(tmp_path)])
        assert sorted(Path(p).name for p in removed) == ["rallypoint_gone", "rallypoint_reused"]
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == ["other_dir", "rallypoint_live", "rallypoint_x"]  # x: no owner file
    finally:
        child.kill()
        child.wait()
