"""torch idioms that libraries use beyond torch's public RPC API, compared with torch.

Found by running PiPPy 0.1.1's RPC pipeline driver with its imports swapped:

- ``rpc._get_current_rpc_agent()._get_device_map(worker_info)`` (PiPPy's ``get_device``,
  torch's own ``RemoteModule``) returns the device map for calls to that worker, as
  torch's agent does, on both backends; anything but a ``WorkerInfo`` is a ``TypeError``.
- The proxies of ``rref.rpc_sync()`` / ``rpc_async()`` / ``remote()`` are torch's
  ``RRefProxy``: plain objects with the attributes ``rref``, ``rpc_api`` and
  ``rpc_timeout`` (so ``vars(proxy)`` and ``proxy.__getstate__()``, which Python 3.11
  answers on the proxy itself, give torch's dict), and an ``rpc_async`` proxy call joins
  torch's ``rpc.api._wait_all()`` as ``rpc_async`` does.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
import torch.distributed.rpc.api as torch_rpc_api

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.testing._workers import runner_for

ENV = {RPC_SECRET: "private-idioms-secret"}
BACKENDS = ("RALLYPOINT", "TENSORPIPE")
OPTIONS = {
    "RALLYPOINT": rpc.RallypointRpcBackendOptions,
    "TENSORPIPE": rpc.TensorPipeRpcBackendOptions,
}


class Box:
    def __init__(self) -> None:
        self.param_groups = [{"lr": 0.1}]

    def __getstate__(self) -> dict[str, Any]:
        return {"param_groups": self.param_groups}

    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"


def _idioms(backend: str) -> dict[str, Any] | None:
    kind = rpc.BackendType[backend]
    rank = int(os.environ["RANK"])
    maps = {"w1": {"cpu": "cpu"}} if rank == 0 else {}
    # (torch's construct_rpc_backend_options drops device_maps: build the options directly)
    options = OPTIONS[backend](rpc_timeout=20, device_maps=maps)
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, Any] | None = None
    if rank == 0:
        agent = rpc._get_current_rpc_agent()
        out = {
            "maps": [agent._get_device_map(rpc.get_worker_info(n)) for n in ("w0", "w1")],
        }
        try:
            agent._get_device_map("w1")
            out["by name"] = "accepted"
        except TypeError as exc:
            out["by name"] = "incompatible function arguments" in str(exc)
        rref = rpc.remote("w1", Box)
        proxy = rref.rpc_sync(timeout=7)
        out["vars"] = sorted(vars(proxy))
        state = proxy.__getstate__()
        out["state"] = sorted(state) if isinstance(state, dict) else type(state).__name__
        out["attributes"] = [proxy.rref is rref, proxy.rpc_timeout, proxy.rpc_api.__name__]
        out["remote state"] = proxy.__getattr__("__getstate__")()
        out["apis"] = [p.rpc_api.__name__ for p in (rref.rpc_async(), rref.remote())]
        with torch_rpc_api._wait_all():
            future = rref.rpc_async().slow(0.5)
        out["joined wait_all"] = future.done()
        out["value"] = future.wait()
        del rref, proxy
    rpc.shutdown()
    return out


@pytest.mark.timeout(150)
def test_device_maps_and_rref_proxies_answer_as_torchs() -> None:
    seen = {b: runner_for(b)(_idioms, 2, b, timeout=60, env=ENV)[0] for b in BACKENDS}
    ours, theirs = seen["RALLYPOINT"], seen["TENSORPIPE"]
    assert ours is not None and theirs is not None
    cpu = torch.device("cpu")
    assert theirs["maps"] == [{}, {cpu: cpu}]
    assert theirs["by name"] is True
    assert theirs["vars"] == ["rpc_api", "rpc_timeout", "rref"]
    assert theirs["state"] == theirs["vars"]
    assert theirs["attributes"] == [True, 7, "rpc_sync"]
    assert theirs["remote state"] == {"param_groups": [{"lr": 0.1}]}
    assert theirs["apis"] == ["rpc_async", "remote"]
    assert theirs["joined wait_all"] is True and theirs["value"] == "done"
    assert ours == theirs
