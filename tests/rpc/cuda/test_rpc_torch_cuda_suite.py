"""torch's own CUDA RPC tests that need at most one GPU, against rallypoint.rpc.

torch's test modules are run with only their imports swapped (``rpc``, ``dist_autograd``,
``RRef``, also in torch's ``dist_init`` harness) and rallypoint's backend, four workers,
``file://`` init, each test in fresh processes as torch runs it:

- ``TensorPipeAgentCudaRpcTest``: every test of the class itself that needs at most one
  GPU (device-map validation and errors, CPU<->GPU maps, RRef stream synchronisation,
  views as return values, CUDA futures and ``@async_execution`` with them). Its one test
  that needs none, ``test_device_map_cpu``, runs without a GPU too.
- ``CudaDistAutogradTest`` (distributed autograd across CPU and GPU): all three.
- ``CudaRpcTest`` has one test, which needs two GPUs (and is skipped on Linux by torch).

The names are read from torch's sources without importing them (importing torch's test
utilities initialises CUDA, after which this process could not fork workers that use it).
Tests that need a GPU are marked ``cuda`` and skipped without one.
"""

from __future__ import annotations

import ast
import os
import sys
import tempfile
import types
import unittest
from pathlib import Path
from typing import Any

import pytest
import torch
from _gpu import need_gpus

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.testing import run_workers

ENV = {RPC_SECRET: "torch-cuda-suite"}
SUITES = Path(torch.__file__).parent / "testing/_internal/distributed/rpc"
CLASSES = {
    "TensorPipeAgentCudaRpcTest": "rpc_test",
    "CudaDistAutogradTest": "dist_autograd_test",
    "CudaRpcTest": "rpc_test",
}


def _gpus_needed(function: ast.FunctionDef) -> int:
    """The N of the test's ``@skip_if_lt_x_gpu(N)`` (0 without one)."""
    for decorator in function.decorator_list:
        if (
            isinstance(decorator, ast.Call)
            and getattr(decorator.func, "id", None) == "skip_if_lt_x_gpu"
            and isinstance(decorator.args[0], ast.Constant)
            and isinstance(decorator.args[0].value, int)
        ):
            return decorator.args[0].value
    return 0


def torch_tests(most_gpus: int) -> list[tuple[str, str, int]]:
    """(class, test, GPUs it needs) of the classes above, needing at most ``most_gpus``."""
    found = []
    for class_name, module in CLASSES.items():
        tree = ast.parse((SUITES / f"{module}.py").read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == class_name:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name.startswith("test_"):
                        needed = _gpus_needed(item)
                        if needed <= most_gpus:
                            found.append((class_name, item.name, needed))
    return found


def _swap_imports() -> dict[str, Any]:
    """torch's test modules with rallypoint's RPC in place of torch's."""
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ModuleNotFoundError:
            # torch's TestCase derives from expecttest's only for assertExpectedInline,
            # which these tests never call; torch's dev requirements install it
            shim = types.ModuleType("expecttest")
            shim.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            sys.modules["expecttest"] = shim
    import torch.testing._internal.dist_utils as dist_utils
    from torch.testing._internal.distributed.rpc import dist_autograd_test, rpc_test

    for module in (rpc_test, dist_autograd_test):
        module.rpc = rpc  # type: ignore[attr-defined]
        module.dist_autograd = dist_autograd  # type: ignore[attr-defined]
        module.RRef = rpc.RRef  # type: ignore[attr-defined]
    rpc_test.WorkerInfo = rpc.WorkerInfo  # type: ignore[attr-defined,assignment]
    dist_utils.rpc = rpc  # type: ignore[attr-defined]  # dist_init's init_rpc and shutdown
    return {"rpc_test": rpc_test, "dist_autograd_test": dist_autograd_test}


def _case(class_name: str, test: str, workdir: str) -> Any:
    modules = _swap_imports()
    from torch.testing._internal.common_utils import TestCase

    base = getattr(modules[CLASSES[class_name]], class_name)

    class Case(base, TestCase):  # type: ignore[misc,valid-type]
        rank = int(os.environ["RANK"])

        @property
        def rpc_backend(self) -> Any:
            return rpc.BackendType.RALLYPOINT

        @property
        def rpc_backend_options(self) -> Any:
            return rpc.construct_rpc_backend_options(
                rpc.BackendType.RALLYPOINT, init_method=self.init_method
            )

        def get_shutdown_error_regex(self) -> str:
            return ".*"

        def get_timeout_error_regex(self) -> str:
            return "RPC ran for more than"

        def _handle_test_skip(self, message: str) -> None:  # torch's GPU-count skip
            raise unittest.SkipTest(message)

    case = Case(test)
    case.file_name = os.path.join(workdir, "init")
    return case


def _run_one(class_name: str, test: str, workdir: str) -> str:
    case = _case(class_name, test, workdir)
    try:
        getattr(case, test)()
    except unittest.SkipTest as skipped:
        return f"skipped: {skipped}"
    return "passed"


def _run(class_name: str, test: str) -> list[str]:
    with tempfile.TemporaryDirectory() as workdir:
        return run_workers(_run_one, 4, class_name, test, workdir, timeout=240, env=ENV)


@pytest.mark.timeout(300)
def test_torchs_cpu_device_map_test_passes() -> None:
    """The one test of torch's CUDA class that needs no GPU: a ``{"cpu": "cpu"}`` map."""
    assert ("TensorPipeAgentCudaRpcTest", "test_device_map_cpu", 0) in torch_tests(0)
    assert _run("TensorPipeAgentCudaRpcTest", "test_device_map_cpu") == ["passed"] * 4


ONE_GPU = [(c, t) for c, t, needed in torch_tests(1) if needed == 1]


def test_the_selection_is_torchs_one_gpu_tests() -> None:
    names = {t for _, t in ONE_GPU}
    assert {"test_device_maps_missing_config", "test_rref_to_here_synchronization1"} <= names
    assert {"test_gpu_simple", "test_gpu_to_cpu_continuation"} <= names
    assert "test_device_maps_gpu" not in names  # two GPUs
    assert not [t for c, t in ONE_GPU if c == "CudaRpcTest"]


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("class_name", "test"), ONE_GPU, ids=[f"{c}.{t}" for c, t in ONE_GPU])
def test_torchs_one_gpu_test_passes(class_name: str, test: str) -> None:
    need_gpus(1)
    assert _run(class_name, test) == ["passed"] * 4
