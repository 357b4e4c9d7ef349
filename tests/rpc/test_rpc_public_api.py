"""Public names of ``rallypoint.rpc`` report the module users import them from."""

from __future__ import annotations

import importlib
import pickle
import types

import torch

from rallypoint import rpc


def test_public_classes_and_functions_report_rallypoint_rpc() -> None:
    checked = []
    for name in rpc.__all__:
        obj = getattr(rpc, name)
        if not isinstance(obj, type | types.FunctionType):
            continue
        if name == "TensorPipeRpcBackendOptions":  # torch's own class, re-exported
            assert obj.__module__.startswith("torch."), obj.__module__
            continue
        if name == "DistributedOptimizer":  # lives in the public module rallypoint.rpc.optim
            assert obj.__module__ == "rallypoint.rpc.optim"
            assert importlib.import_module(obj.__module__).DistributedOptimizer is obj
            continue
        assert obj.__module__ == "rallypoint.rpc", (name, obj.__module__)
        assert getattr(rpc, obj.__name__) is obj, name  # pickle finds it there
        checked.append(name)
    assert {"RRef", "WorkerInfo", "RpcError", "RpcShutdownError", "init_rpc"} <= set(checked)
    assert {"RpcAgent", "RallypointRpcBackendOptions", "BackendType", "BackendValue"} <= set(
        checked
    )
    assert rpc.functions.async_execution.__module__ == "rallypoint.rpc.functions"
    assert rpc.dist_autograd.backward.__module__ == "rallypoint.rpc.dist_autograd"
    assert set(rpc.dist_autograd.__all__) == {
        "backward",
        "context",
        "get_gradients",
        "is_available",
    }


def test_public_objects_pickle_by_their_public_name() -> None:
    info = rpc.WorkerInfo("worker0", 0)
    assert pickle.loads(pickle.dumps(info)) == info
    error = pickle.loads(pickle.dumps(rpc.RpcShutdownError("gave up", missing=["w1"])))
    assert isinstance(error, rpc.RpcShutdownError) and error.missing == ["w1"]
    assert b"rallypoint.rpc._" not in pickle.dumps(rpc.RpcTimeoutError)
    options = rpc.RallypointRpcBackendOptions(rpc_timeout=3, device_maps={"w1": {0: 1}})
    again = pickle.loads(pickle.dumps(options))
    assert again.rpc_timeout == 3.0 and again.device_maps == {
        "w1": {torch.device("cuda", 0): torch.device("cuda", 1)}
    }


def test_constants_module_has_torchs_names_and_values() -> None:
    theirs = importlib.import_module("torch.distributed.rpc.constants")
    names = [n for n in vars(theirs) if n.isupper() and not n.startswith("_")]
    assert len(names) >= 6
    for name in names:
        assert getattr(rpc.constants, name) == getattr(theirs, name), name
    assert rpc.constants.UNSET_RPC_TIMEOUT == rpc.UNSET_RPC_TIMEOUT
    from rallypoint.rpc.constants import DEFAULT_RPC_TIMEOUT_SEC  # as torch's module allows

    assert DEFAULT_RPC_TIMEOUT_SEC == rpc.DEFAULT_RPC_TIMEOUT_SEC
