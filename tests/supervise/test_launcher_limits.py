"""``--nproc-per-node`` beyond what the host allows fails at once, naming the limit (it
forked until ``EMFILE`` and printed a 40-line traceback after 11 s); a soft open-files
limit that the hard one can cover is raised instead."""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rallypoint._supervise import _limits

pytestmark = pytest.mark.timeout(60)

RALLYPOINT = [sys.executable, "-m", "rallypoint", "run"]


def _run(nproc: int, script: Path, soft_fds: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        if soft_fds is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft_fds, hard))

    return subprocess.run(
        [*RALLYPOINT, "--nproc-per-node", str(nproc), str(script)],
        capture_output=True,
        text=True,
        timeout=50,
        preexec_fn=limit,
    )


def test_too_many_workers_for_the_open_files_limit_is_one_line(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('hi')\n")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    nproc = hard // _limits.FDS_PER_WORKER + 1
    started = time.monotonic()
    proc = _run(nproc, script)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert time.monotonic() - started < 15
    [line] = proc.stderr.strip().splitlines()
    assert f"--nproc-per-node {nproc} needs about" in line
    assert f"hard limit {hard}; `ulimit -n`" in line


def test_a_soft_open_files_limit_the_hard_one_covers_is_raised(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("print('hi')\n")
    proc = _run(40, script, soft_fds=128)  # 40 workers need ~300
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("hi") == 40


def test_more_workers_than_the_host_has_pids_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (resource.RLIM_INFINITY,) * 2)
    monkeypatch.setattr(
        _limits, "_read_int", lambda path: 500 if path.endswith("pid_max") else None
    )
    monkeypatch.setattr(_limits, "_tasks_on_host", lambda: 300)
    _limits.check_worker_limits(100)
    with pytest.raises(ValueError, match=r"room for 184 more \(300 running, kernel.pid_max"):
        _limits.check_worker_limits(300)
