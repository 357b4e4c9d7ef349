"""``--local-addr`` / ``local_addr=``: the address a node gives the others, which becomes
the workers' ``MASTER_ADDR`` when it hosts their store; checked against torchrun in the
same test, on one node and on two (loopback: every 127.x address reaches this host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _support import cli_zygote
from rallypoint.launcher import LaunchConfig, launch

WORKER = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
keys = ["RANK", "GROUP_RANK", "MASTER_ADDR"]
out = {k: os.environ[k] for k in keys}
out["sum"] = t.item()
out["node"] = sys.argv[2] if len(sys.argv) > 2 else None  # the --local-addr of its node
with open(os.path.join(sys.argv[1], os.environ["RANK"]), "w") as fp:
    json.dump(out, fp)
dist.destroy_process_group()
"""

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RALLYPOINT = [sys.executable, "-m", "rallypoint", "run"]


def _seen(out: Path) -> dict[str, Any]:
    return {p.name: json.loads(p.read_text()) for p in sorted(out.iterdir())}


def _finish(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, stdout + stderr


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_one_node_the_workers_master_addr_is_the_local_addr(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    launchers = {"torchrun": [*TORCHRUN, "--standalone"], "rallypoint": RALLYPOINT}
    procs = []
    for name, cmd in launchers.items():  # both at once: separate stores on free ports
        out = tmp_path / name
        out.mkdir()
        argv = [*cmd, "--nproc-per-node", "2", "--local-addr", "127.0.0.5", str(script), str(out)]
        procs.append(
            cli_zygote.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    _finish(procs)
    seen = {name: _seen(tmp_path / name) for name in launchers}
    assert seen["rallypoint"] == seen["torchrun"]
    assert {e["MASTER_ADDR"] for e in seen["rallypoint"].values()} == {"127.0.0.5"}
    assert {e["sum"] for e in seen["rallypoint"].values()} == {2.0}


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_nodes_every_worker_gets_the_store_hosts_local_addr(
    tmp_path: Path, endpoint: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    seen = {}
    for name, cmd in (("torchrun", TORCHRUN), ("rallypoint", RALLYPOINT)):
        out = tmp_path / name
        out.mkdir()
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", name]
        common = [*cmd, "--nnodes", "2", "--nproc-per-node", "1", *rdzv]
        common += ["--rdzv-conf", "is_host=false"]
        procs = [
            cli_zygote.Popen(
                [*common, "--local-addr", addr, str(script), str(out), addr],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for addr in ("127.0.0.2", "127.0.0.3")
        ]
        _finish(procs)
        seen[name] = _seen(out)
    for name, ranks in seen.items():
        assert sorted(ranks) == ["0", "1"], (name, ranks)
        assert {e["sum"] for e in ranks.values()} == {2.0}
        # the node of group rank 0 hosts the workers' store: its address for everyone
        # (which node that is: torch sorts by address, rallypoint takes the first to join)
        assert ranks["0"]["GROUP_RANK"] == "0" and ranks["1"]["GROUP_RANK"] == "1"
        assert {e["node"] for e in ranks.values()} == {"127.0.0.2", "127.0.0.3"}
        assert {e["MASTER_ADDR"] for e in ranks.values()} == {ranks["0"]["node"]}, (name, ranks)


def _master_addr() -> str:
    return os.environ["MASTER_ADDR"]


@pytest.mark.timeout(60)
def test_launch_api_and_bad_input(tmp_path: Path) -> None:
    assert launch(_master_addr, nproc=2, local_addr="127.0.0.7") == ["127.0.0.7"] * 2
    assert LaunchConfig(local_addr="10.1.2.3").local_addr == "10.1.2.3"
    for bad in ("", "  "):
        with pytest.raises(ValueError, match="local_addr must be a host name or address"):
            LaunchConfig(local_addr=bad)
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    proc = cli_zygote.run(
        [*RALLYPOINT, "--local-addr", "", str(script)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "hello" not in proc.stdout, proc.stderr
    assert proc.stderr.strip() == (
        "rallypoint run: error: local_addr must be a host name or address, got ''"
    ), proc.stderr
