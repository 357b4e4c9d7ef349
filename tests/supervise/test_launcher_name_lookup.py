"""A name server that never answers: workers and their replacements do not wait it out.

c10d looks up the peer's name on a process's first connection (for its log lines) until a
lookup fails; with a resolver that never answers, that is the resolver's timeout in every
process. The warm process pays it once, before it forks. Staged for real: a mount namespace
whose ``/etc/resolv.conf`` names a UDP socket of this test that reads and never replies,
and the same script run directly as the control (it must wait, or the stage is wrong).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = """
import os, sys, time
import torch.distributed as dist

began = time.monotonic()
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
took = time.monotonic() - began
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "direct")
with open(os.path.join(sys.argv[1], f"took-{restart}"), "w") as out:
    out.write(repr(took))
if restart == "0":
    os.kill(os.getpid(), 9)  # the replacement is forked from the warm process too
"""

BLACK_HOLE = "127.0.0.77"


def _unshare_works() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "a mount namespace needs root; run the tests as root"
    if shutil.which("unshare") is None:
        return False, "unshare (util-linux) is not installed"
    done = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
    return done.returncode == 0, f"unshare -m failed: {done.stderr.strip()}"


_ok, _why = _unshare_works()
pytestmark = pytest.mark.skipif(not _ok, reason=_why)


def _run_without_answers(resolv: Path, *cmd: str) -> subprocess.CompletedProcess[str]:
    script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env["RES_OPTIONS"] = "timeout:1 attempts:1"
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, str(resolv), *cmd],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


@pytest.mark.timeout(180)
def test_workers_and_replacements_connect_at_once_where_the_name_server_never_answers(
    tmp_path: Path,
) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {BLACK_HOLE}\n")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as hole:
        hole.bind((BLACK_HOLE, 53))  # it takes the questions and never answers
        control = _run_without_answers(resolv, sys.executable, str(script), str(tmp_path))
        assert control.returncode == 0, control.stderr
        job = _run_without_answers(
            resolv, sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "1",
            "--max-restarts", "1", str(script), str(tmp_path),
        )  # fmt: skip
    direct = float((tmp_path / "took-direct").read_text())
    assert direct >= 0.9, f"the stage is wrong: a lookup did not wait ({direct:.3f} s)"
    assert job.returncode == 0, job.stdout + job.stderr
    first, replacement = (float((tmp_path / f"took-{n}").read_text()) for n in (0, 1))
    assert first < 0.5 and replacement < 0.5, (direct, first, replacement, job.stderr)


@pytest.mark.timeout(120)
def test_the_settling_connection_gives_up_at_once_where_the_loopback_is_down() -> None:
    """A network namespace whose loopback is down: c10d would retry its connect for the
    store's timeout (300 s by default) and hold the warm process up that long."""
    code = (
        "import time, torch\n"
        "from rallypoint._supervise._warm._name_lookup import settle_reverse_lookup\n"
        "began = time.monotonic(); settle_reverse_lookup(); print(time.monotonic() - began)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        ["unshare", "-n", sys.executable, "-c", code],
        capture_output=True, text=True, env=env, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 0.5, done.stdout
