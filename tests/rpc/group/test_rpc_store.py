"""init_process_group and init_rpc share MASTER_PORT, in any order, with or without a launcher.

torch's ``_create_c10d_store`` makes rank 0's TCPStore multi-tenant (a second store on the
same port in the same process reuses the server) and, under a launcher that sets
``TORCHELASTIC_USE_AGENT_STORE=True``, makes every rank a client of the launcher's store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint._cli._run import run_main
from rallypoint.testing._rpc._contract import run_rpc_pattern

SECRET = {"RALLYPOINT_RPC_SECRET": "store-secret"}
BIND_ERRORS = ("failed to bind", "EADDRINUSE", "address already in use")  # c10d's words


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["RALLYPOINT", "TENSORPIPE"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("rpc_first", [False, True], ids=["pg_then_rpc", "rpc_then_pg"])
def test_process_group_and_rpc_on_one_port(backend: str, world_size: int, rpc_first: bool) -> None:
    results = run_rpc_pattern(
        backend, "process_group_and_rpc", rpc_first, world_size=world_size, timeout=45, env=SECRET
    )
    assert results == [
        {"got": rank + 1, "total": world_size, "bind_errors": []} for rank in range(world_size)
    ]


SCRIPT = """
import os
import torch
import torch.distributed as dist
from rallypoint import rpc

def next_rank(rank):
    return rank + 1

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo")
rpc.init_rpc(f"w{rank}", rank=rank, world_size=world_size)
got = rpc.rpc_sync(f"w{(rank + 1) % world_size}", next_rank, args=(rank,))
total = torch.ones(1)
dist.all_reduce(total)
rpc.shutdown()
dist.destroy_process_group()
print(f"done {rank} got={got} total={total.item():.0f}")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_process_group_and_rpc_on_the_launchers_store(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], nproc: int
) -> None:
    script = tmp_path / "pg_rpc.py"
    script.write_text(SCRIPT)
    assert run_main(["--nproc-per-node", str(nproc), str(script)]) == 0
    out, err = capfd.readouterr()
    lines = sorted(line for line in out.splitlines() if "done" in line)
    assert lines == [f"[rank{r}]: done {r} got={r + 1} total={nproc}" for r in range(nproc)], (
        out + err
    )
    assert not [e for e in BIND_ERRORS if e in out + err], out + err
