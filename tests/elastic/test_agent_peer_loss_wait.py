"""A failure that says a peer vanished waits for its cause once: one liveness window from
the moment its node first saw it, however many parts of the agent see it (the in-process
restart holding the raised exception, then the coordinator waiting for the other nodes).

Two ``rallypoint run`` agents of 2 ranks on loopback (a c10d rendezvous store hosted in a
process of its own), running ``_peer_loss_worker.py``'s ``@rallypoint.restartable``
function; each agent writes its events, and the ``restart`` event's time is when its node
decided.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from _support import cli_zygote
from rallypoint.observe import Event, read_events

SCRIPT = Path(__file__).with_name("_peer_loss_worker.py")
INTERVAL, MISSED = 1.0, 4
WINDOW = INTERVAL * (MISSED + 2)
"""The rendezvous's liveness window for these settings (``liveness_window()``: the missed
heartbeats, one interval for the check that sees them, one for writing the mark)."""
MARGIN = WINDOW / 2
"""What a decision may take after the window: a worker re-raising and exiting, the store's
round trips, on a loaded machine. Two windows are well past it."""


def _agent(endpoint: str, out: Path, mode: str, events: Path) -> subprocess.Popen[str]:
    conf = (
        f"is_host=false,read_timeout=30,keep_alive_interval={INTERVAL:g},"
        f"keep_alive_max_attempt={MISSED},last_call_timeout=1"
    )
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--events", str(events),
        "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--rdzv-id", "peer-loss", "--rdzv-conf", conf,
        "--max-restarts", "3", "--shutdown-timeout", "5", str(SCRIPT), str(out), mode,
    ]  # fmt: skip
    return cli_zygote.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _finish(agents: list[subprocess.Popen[str]]) -> list[str]:
    texts = [p.communicate(timeout=90)[0] for p in agents]
    assert [p.returncode for p in agents] == [0] * len(agents), texts
    return texts


def _restart(events: Path, text: str) -> Event:
    """The first restart this node decided (announced)."""
    restarts = [e for e in read_events(events) if e.kind == "restart"]
    assert restarts, text
    return restarts[0]


def _wipe_out(agent: subprocess.Popen[str]) -> None:
    """A node gone at once: its agent and every process under it (warm process, workers)."""
    procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(OSError, psutil.Error):
            if os.getpgid(proc.pid) == proc.pid:  # it leads a group: all of it (workers')
                os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()


@pytest.mark.timeout(180)
def test_a_node_wiped_out_is_decided_on_within_one_window(tmp_path: Path, endpoint: str) -> None:
    """Rank 1's node is SIGKILLed whole while the other node's ranks wait for it in an
    all-reduce: they raise gloo's "Connection closed by peer", and their node restarts in
    process (a membership change) within one liveness window of the loss."""
    events = [tmp_path / f"events-{i}.jsonl" for i in range(2)]
    agents = [_agent(endpoint, tmp_path, "node", e) for e in events]
    try:
        marker = tmp_path / "at-fault"
        while not marker.exists():
            assert all(p.poll() is None for p in agents), [p.communicate() for p in agents]
            time.sleep(0.05)
        pid = int(marker.read_text())
        [lost] = [a for a in agents if pid in {c.pid for c in psutil.Process(a.pid).children(True)}]
        _wipe_out(lost)
        wiped = time.time()
        [survivor] = [a for a in agents if a is not lost]
        [text] = _finish([survivor])
    finally:
        for p in agents:
            p.kill()
    decided = _restart(events[agents.index(survivor)], text)
    took = decided.ts - wiped
    print(f"the survivor decided {took:.2f} s after the loss (window {WINDOW:g} s): {decided}")
    assert took < WINDOW + MARGIN, (
        f"decided {took:.1f} s after the loss (window {WINDOW:g} s): {decided}\n{text}"
    )


@pytest.mark.timeout(180)
def test_a_peer_loss_whose_cause_never_shows_is_judged_after_one_window(
    tmp_path: Path, endpoint: str
) -> None:
    """Every rank raises gloo's "Connection reset by peer" at once and no process dies:
    no node is lost and none decides for the others, so each node holds its ranks' peer
    losses for one window, then judges them its own failure (one restart, spent once).
    The wait of the in-process restart and the coordinator's are one: two windows would
    be the old double wait."""
    events = [tmp_path / f"events-{i}.jsonl" for i in range(2)]
    agents = [_agent(endpoint, tmp_path, "reset", e) for e in events]
    try:
        texts = _finish(agents)
    finally:
        for p in agents:
            p.kill()
    raised = min(float(p.read_text()) for p in tmp_path.glob("raised-*"))
    for path, text in zip(events, texts, strict=True):
        decided = _restart(path, text)
        took = decided.ts - raised
        print(f"{path.name}: decided {took:.2f} s after the peer loss (window {WINDOW:g} s)")
        assert took < WINDOW + MARGIN, (
            f"decided {took:.1f} s after the peer loss (window {WINDOW:g} s): {decided}\n{text}"
        )
        assert took > WINDOW - 1.0, (took, text)  # it did wait for a cause
        assert decided.get("restart_count") == 1, decided
