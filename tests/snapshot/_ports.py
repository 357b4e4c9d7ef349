"""The peer port of a running node's snapshot server."""

from __future__ import annotations

import contextlib
import time

import psutil


def snapshot_listeners(agent_pid: int, timeout: float = 30) -> list[tuple[str, int]]:
    """``(ip, port)`` of every TCP listener of the snapshot server under ``agent_pid`` (the
    process among its descendants that listens on ``rallypoint-snapshots-*/server.sock``)."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in psutil.Process(agent_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                unix = proc.net_connections(kind="unix")
                if any("rallypoint-snapshots-" in str(c.laddr) for c in unix):
                    tcp = proc.net_connections(kind="tcp")
                    found = [c.laddr for c in tcp if c.status == psutil.CONN_LISTEN]
                    if found:
                        return [(str(a.ip), int(a.port)) for a in found]
        assert time.monotonic() < deadline, "no snapshot server listens on TCP"
        time.sleep(0.1)
