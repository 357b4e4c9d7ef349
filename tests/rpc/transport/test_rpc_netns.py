"""Two "hosts" (network namespaces): TCP transport, raw tensor bytes, and a partition."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rallypoint.testing._netns import Network, netns_available

_ok, _why = netns_available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not _ok, reason=_why)]

WORKER = r"""
import sys, time, torch
from rallypoint import rpc
from rallypoint.rpc._agent._agent import current_rallypoint_agent

def echo(x):
    return x

rank = int(sys.argv[1])
opts = rpc.RallypointRpcBackendOptions(init_method=sys.argv[2], rpc_timeout=20)
rpc.init_rpc(f"h{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
if rank == 1:
    time.sleep(120)
x = torch.randn(1 << 20)
assert torch.equal(rpc.rpc_sync("h1", echo, args=(x,)), x)
agent = current_rallypoint_agent()
print("ECHO", agent.stats["inline_tensor_bytes"], agent.stats["shm_tensor_bytes"],
      agent.connections.outbound("h1").uds, agent.connections.outbound("h0").uds, flush=True)
sys.stdin.readline()  # the test cuts h1's link, then tells us to go on
try:
    rpc.rpc_sync("h1", echo, args=(1,), timeout=1.0)
    print("NO-TIMEOUT", flush=True)
except rpc.RpcTimeoutError:
    print("TIMEOUT", flush=True)
start = time.monotonic()
try:
    rpc.shutdown(timeout=2.0)
except rpc.RpcShutdownError as exc:
    print("SHUTDOWN", exc.missing, round(time.monotonic() - start, 1), flush=True)
"""


@pytest.mark.timeout(90)
def test_two_hosts_tcp_and_partition() -> None:
    env = {**os.environ, "RALLYPOINT_RPC_SECRET": "netns-secret", "OMP_NUM_THREADS": "1"}
    with Network(2) as net:
        init = f"tcp://{net.hosts[0].address}:29517"
        procs = [
            net.hosts[i].popen(
                [sys.executable, "-c", WORKER, str(i), init],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        main = procs[0]
        assert main.stdout is not None and main.stdin is not None
        echo = main.stdout.readline().split()
        assert echo[0] == "ECHO", echo
        assert int(echo[1]) >= 4 << 20 and int(echo[2]) == 0  # raw bytes over TCP, no shm
        assert echo[3:] == ["False", "True"]  # TCP to the other host, Unix socket to itself
        net.hosts[1].cut()
        main.stdin.write("go\n")
        main.stdin.flush()
        assert main.stdout.readline().strip() == "TIMEOUT"
        shutdown = main.stdout.readline().split()
        assert shutdown[:2] == ["SHUTDOWN", "['h1']"], shutdown
        assert float(shutdown[2]) < 15.0
        main.wait(30)
