"""``--burn-in``: after a round forms, the agents time their links; a node whose link is
much slower than the others' is excluded like a failing one, and nobody is on a healthy
network. The slow link is a real one: a token bucket (``tc ... tbf``) on one fake host's
link in network namespaces (this machine's kernel has no ``netem``)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from _support import cli_zygote
from rallypoint.testing._netns import Network, netns_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]
_ok, _why = netns_available()

WORKER = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"trained-{os.environ['RANK']}-{t.item():.0f}"), "w").close()
dist.destroy_process_group()
"""


def _cmd(script: Path, out: Path, endpoint: str, extra: list[str], conf: str = "") -> list[str]:
    return [
        sys.executable, "-m", "rallypoint", "run", "--burn-in",
        "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--rdzv-id", "burn",
        "--rdzv-conf", f"{conf}read_timeout=20,last_call_timeout=10", "--shutdown-timeout", "2",
        *extra, str(script), str(out),
    ]  # fmt: skip


def _end(p: subprocess.Popen[Any], timeout: float = 100) -> tuple[int, str]:
    try:
        text, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"agent did not end:\n{p.communicate()[0]}") from None
    return p.returncode, text


@pytest.mark.netns
@pytest.mark.skipif(not _ok, reason=_why)
def test_the_node_with_a_slow_link_is_excluded(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    with Network(3) as net:
        net.hosts[2].throttle("40mbit")  # 4 MiB: ~0.8 s against ~0.01 s on the others
        procs = []
        for host in net.hosts:
            cmd = _cmd(script, tmp_path, "h0:29400", [])
            procs.append(
                host.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
            if host.index == 0:
                time.sleep(0.5)  # h0 hosts the rendezvous store
        code, text = _end(procs[2])
        assert code == 4, text
        # the agent's identity in the rendezvous, shown with its host
        assert re.search(r"excluded node \S+ \(host h2\): its link took", text), text
        for p in procs[:2]:
            code, text = _end(p)
            assert code == 0, text
            slow = r"burn-in: node \S+ \(host h2\) is slow; restarting the workers on the other"
            assert re.search(slow, text), text
    assert sorted(p.name for p in tmp_path.glob("trained-*")) == ["trained-0-2", "trained-1-2"]


def test_nobody_is_excluded_on_a_healthy_network(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    procs = [
        cli_zygote.Popen(
            _cmd(
                script, tmp_path, endpoint, ["--local-addr", f"127.0.0.{i + 2}"], "is_host=false,"
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(3)
    ]
    for p in procs:
        code, text = _end(p)
        assert code == 0, text
        assert "excluded" not in text and "burn-in" not in text, text
    assert len(list(tmp_path.glob("trained-*-3"))) == 3
