"""What the console says about an in-process restart (``@rallypoint.restartable``): a node
that keeps none of its workers still says the restart is in process, and the summary of a
failed job says that the workers waiting for a restart were stopped, not kept.

Real ``rallypoint run`` jobs of ``_restart_train.py``: rank 1 SIGKILLs itself after step 10
(``kill``: on the first attempt; ``every``: on every attempt).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from _support import cli_zygote
from rallypoint._core.net import free_port

SCRIPT = Path(__file__).with_name("_restart_train.py")
PRELOAD = "torch._dynamo"
KEPT = "kept for an in-process restart"
STOPPED = "stopped by rallypoint: the job failed before its in-process restart"


def _cmd(out: Path, mode: str, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "rallypoint", "run", *flags, "--preload", PRELOAD, str(SCRIPT),
        str(out), mode, "30",
    ]  # fmt: skip


@pytest.mark.timeout(120)
def test_one_node_a_failed_jobs_summary_says_the_waiting_workers_were_stopped(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "--max-same-failure", "1"]
    done = cli_zygote.run(_cmd(out, "kill", *flags), capture_output=True, text=True, timeout=100)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    assert "not restarting (--max-same-failure 1)" in text, text
    # rank 0 had left its function for the restart that the job then did not make
    summary = text[text.index("Other ranks:") :]
    assert "rank 0 (local_rank: 0, pid " in summary and STOPPED in summary, text
    assert KEPT not in text, text


@pytest.mark.timeout(300)
def test_two_agents_each_says_in_process_and_the_failed_summary_says_stopped(
    tmp_path: Path,
) -> None:
    """One worker per node: the node of rank 1 keeps none of its workers, yet the restart
    is in process (the other node keeps rank 0); then the job fails, and rank 0, waiting
    for a restart that does not come, is stopped."""
    endpoint = f"127.0.0.1:{free_port()}"  # the first agent hosts the rendezvous store there
    out = tmp_path / "out"
    out.mkdir()
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--rdzv-id", "wording", "--max-restarts", "1",
    ]  # fmt: skip
    agents = [
        cli_zygote.Popen(
            _cmd(out, "every", *flags),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        texts = [p.communicate(timeout=250)[0] for p in agents]
    finally:
        for p in agents:
            p.kill()
    assert [p.returncode for p in agents] == [1, 1], texts
    joined = "".join(texts)
    assert "restarting the workers on every node" not in joined, joined
    restarts = [ln for ln in joined.splitlines() if "in-process restart on" in ln]
    assert len(restarts) == 2, joined  # one line per node, the same restart
    assert any("rank 1 replaced (killed by SIGKILL)" in ln for ln in restarts), restarts
    assert any("rank 0 kept (pid " in ln for ln in restarts), restarts
    assert STOPPED in joined and KEPT not in joined, joined
