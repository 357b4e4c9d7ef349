"""rallypoint.rpc.nn.RemoteModule: torch's API, errors and autograd, on the rallypoint backend."""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import pytest
import torch
from torch.distributed.nn import RemoteModule as _TorchRemoteModule
from torch.distributed.remote_device import _remote_device

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.rpc.nn import RemoteDevice, RemoteModule, _remote_module_receiver
from rallypoint.testing._workers import run_workers

GOOD = ["ps", "ps/cpu", "trainer0/cuda:1", "rank:3/cpu", "rank:0", "cpu", "cuda:0"]
BAD = ["a/b/c", "/cpu", "rank:x/cpu", "rank:1:2/cpu", "worker:1/cpu", "ps/notadevice"]


@pytest.mark.parametrize("text", GOOD)
def test_remote_device_parses_as_torchs(text: str) -> None:
    ours, theirs = RemoteDevice(text), _remote_device(text)
    assert (ours.worker_name, ours.rank, ours.device) == (
        theirs.worker_name(),
        theirs.rank(),
        theirs.device(),
    )
    assert repr(ours) == repr(theirs)


@pytest.mark.parametrize("text", BAD)
def test_bad_remote_device_gives_torchs_error(text: str) -> None:
    with pytest.raises((ValueError, RuntimeError)) as theirs:
        _remote_device(text)
    with pytest.raises(theirs.type, match="^" + str(theirs.value)[:40].replace("(", r"\(")):
        RemoteDevice(text)
    with pytest.raises(TypeError, match="Invalid type for remote_device"):
        RemoteDevice(3)  # type: ignore[arg-type]


def test_outside_rpc_is_torchs_assertion() -> None:
    with pytest.raises(AssertionError, match=r"RemoteModule only works in RPC\."):
        RemoteModule("ps", torch.nn.Linear, args=(2, 2))


@pytest.mark.parametrize(
    "method",
    ["to", "cpu", "state_dict", "named_parameters", "buffers", "modules", "zero_grad", "apply"],
)
def test_local_state_methods_raise_torchs_value_error(method: str) -> None:
    module = _remote_module_receiver("ps", "cpu", False, None)
    with pytest.raises(ValueError, match=f"^Method ``{method}`` not supported for RemoteModule$"):
        getattr(module, method)()
    with pytest.raises(ValueError, match="Please use ``remote_parameters`` instead"):
        module.parameters()
    assert repr(module) == "RemoteModule(on='ps', device='cpu')"


def _not_a_module() -> int:
    return 3


def _grads_on_owner(context_id: int, module_rref: Any) -> list[torch.Tensor]:
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p] for p in module_rref.local_value().parameters()]


def _training(module_rref: Any) -> bool:
    return bool(module_rref.local_value().training)


def _use_sent(module: RemoteModule, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = module(x)  # nn.Module.__call__ works on a received RemoteModule
    return out


def _checks() -> dict[str, Any]:
    torch.manual_seed(0)
    remote_linear = RemoteModule("w1/cpu", torch.nn.Linear, args=(3, 2), kwargs={"bias": True})
    local = remote_linear.get_module_rref().to_here()
    x = torch.randn(4, 3)
    out: dict[str, Any] = {
        "forward": torch.equal(remote_linear.forward(x), local(x)),
        "forward_async": torch.equal(remote_linear.forward_async(x).wait(), local(x)),
        "sent": torch.equal(rpc.rpc_sync("w1", _use_sent, args=(remote_linear, x)), local(x)),
        "n_params": len(remote_linear.remote_parameters()),
        "by_rank": torch.equal(
            RemoteModule.init_from_module_rref("rank:1/cpu", remote_linear.get_module_rref())(x),
            local(x),
        ),
    }
    remote_linear.eval()
    out["eval"] = rpc.rpc_sync("w1", _training, args=(remote_linear.get_module_rref(),))
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [remote_linear.forward(x).sum()])
        grads = rpc.rpc_sync(
            "w1", _grads_on_owner, args=(context_id, remote_linear.get_module_rref())
        )
    expected = torch.autograd.grad(local(x).sum(), list(local.parameters()))
    out["grads"] = all(torch.allclose(g, e) for g, e in zip(grads, expected, strict=True))
    bad = RemoteModule("w1", _not_a_module)
    try:
        bad.forward(x)
    except ValueError as exc:
        out["bad_cls"] = str(exc)
    for name in ("nobody/cpu", "rank:7/cpu", "cpu"):
        try:
            RemoteModule(name, torch.nn.Linear, args=(1, 1))
        except Exception as exc:
            out[name] = type(exc).__name__
    for name, save in (("pickle", pickle.dumps), ("torch.save", _torch_save)):
        try:
            save(remote_linear)
        except Exception as exc:
            out[name] = (type(exc), str(exc))
    return out


def _torch_save(obj: Any) -> None:
    torch.save(obj, io.BytesIO())


def _torchs_pickle_error() -> tuple[type, str]:
    """What pickling torch's own RemoteModule raises (its __getstate__, run unbound)."""
    try:
        _TorchRemoteModule.__getstate__(None)  # type: ignore[arg-type]
    except Exception as exc:
        return type(exc), str(exc)
    raise AssertionError("torch's RemoteModule pickled")


def _worker() -> dict[str, Any] | None:
    rank = int(os.environ["RANK"])
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2)
    result = _checks() if rank == 0 else None
    rpc.shutdown()
    return result


@pytest.mark.timeout(90)
def test_remote_module_on_the_rallypoint_backend() -> None:
    result = run_workers(_worker, 2, timeout=60, env={RPC_SECRET: "remote-module"})[0]
    assert (
        "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>"
        in result.pop("bad_cls")
    )
    # plain pickling fails with torch's error; only RPC messages carry a RemoteModule
    assert result.pop("pickle") == result.pop("torch.save") == _torchs_pickle_error()
    assert result == {
        "forward": True,
        "forward_async": True,
        "sent": True,
        "n_params": 2,
        "by_rank": True,
        "eval": False,
        "grads": True,
        "nobody/cpu": "RpcError",  # unknown worker, from get_worker_info
        "rank:7/cpu": "RpcError",
        "cpu": "ValueError",  # a device only: no worker
    }
