"""One RPC secret per job under ``rallypoint run``, whatever the number of nodes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _support import cli_zygote

WORKER = """
import hashlib, os, sys
import torch
from rallypoint import rpc

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
secret = os.environ["RALLYPOINT_RPC_SECRET"].encode()
with open(os.path.join(sys.argv[1], str(rank)), "w") as fp:
    fp.write(hashlib.sha256(secret).hexdigest())
rpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
peer = (rank + world // 2) % world            # a worker on the other node
got = rpc.rpc_sync(f"w{peer}", torch.add, args=(torch.ones(2), rank))
assert torch.equal(got, torch.ones(2) + rank), got
print(f"rank {rank} called w{peer}: ok", flush=True)
rpc.shutdown()
"""


def _agents(endpoint: str, run_id: str, script: Path, out: Path, env: dict[str, str]) -> list[str]:
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", "is_host=false,read_timeout=20", "--shutdown-timeout", "3",
        str(script), str(out),
    ]  # fmt: skip
    procs = [
        cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for _ in range(2)
    ]
    texts = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=90)
            assert p.returncode == 0, text
            texts.append(text)
    finally:
        for p in procs:
            p.kill()
    return texts


@pytest.mark.timeout(120)
def test_two_node_job_workers_share_one_secret_and_call_across_nodes(
    tmp_path: Path, endpoint: str
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "RALLYPOINT_RPC_SECRET"}
    texts = _agents(endpoint, "rpc-secret", script, tmp_path, env)
    joined = "".join(texts)
    for rank, peer in ((0, 2), (1, 3), (2, 0), (3, 1)):
        assert f"rank {rank} called w{peer}: ok" in joined, joined
    digests = {(tmp_path / str(r)).read_text() for r in range(4)}
    assert len(digests) == 1  # the same secret in every worker of both nodes


@pytest.mark.timeout(120)
def test_the_users_secret_is_kept_and_never_written_to_the_store(
    tmp_path: Path, endpoint: str
) -> None:
    import torch.distributed as dist

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "RALLYPOINT_RPC_SECRET": "the-users-own-secret"}
    _agents(endpoint, "rpc-user", script, tmp_path, env)
    want = hashlib.sha256(b"the-users-own-secret").hexdigest()
    assert {(tmp_path / str(r)).read_text() for r in range(4)} == {want}
    host, port = endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    assert not store.check(["rallypoint/rpc-user/job/rpc_secret"])
