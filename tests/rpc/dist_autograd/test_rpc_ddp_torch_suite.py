"""torch's own ``DdpComparisonTest`` against rallypoint.rpc, and the teardown race it lost.

torch's ``ddp_under_dist_autograd_test.py`` is run with only its imports swapped
(``rpc``, ``dist_autograd`` and ``RemoteModule`` to rallypoint's, also in torch's
``dist_init`` harness) and rallypoint's backend, four workers, ``file://`` init, each
test under ``dist_init`` as torch runs it. ``test_ddp_comparison`` calls
``destroy_process_group()`` and then lets its DDP module go: the reducer dropped the
gloo group's last reference with the GIL held, and ``~ProcessGroupGloo`` waited for a
gloo thread that needed the GIL to free a finished all-reduce of a Python-made tensor
(one run in about twelve hung; torch's race, see ``rpc/dist_autograd/_ddp_groups.py``). The second
test makes that race certain: gloo's thread is still busy with such an all-reduce when
the module goes.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import types
import unittest
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.testing._workers import run_workers

ENV = {RPC_SECRET: "ddp-comparison"}
TORCH_TESTS = (
    "test_ddp_comparison",
    "test_ddp_comparison_uneven_inputs",
    "test_ddp_dist_autograd_sparse_grads",
    "test_ddp_dist_autograd_local_vs_remote",
)
COMPARISON_RUNS = 4  # test_ddp_comparison, the one that hung, runs this many times


def _torch_module() -> Any:
    """torch's test module with rallypoint's RPC in place of torch's."""
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
    from torch.testing._internal.distributed import ddp_under_dist_autograd_test as module

    from rallypoint.rpc.nn import RemoteModule

    module.rpc = rpc
    module.dist_autograd = dist_autograd
    module.RemoteModule = RemoteModule
    dist_utils.rpc = rpc  # dist_init's init_rpc and shutdown
    return module


def _case_class(module: Any) -> Any:
    from torch.testing._internal.common_utils import TestCase

    class Case(module.DdpComparisonTest, TestCase):  # type: ignore[misc,name-defined]
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

    return Case


def _run_torch_tests(workdir: str) -> list[str]:
    """Each test in a fresh store file, one after the other; what passed."""
    case_class = _case_class(_torch_module())
    passed = []
    names = [TORCH_TESTS[0]] * (COMPARISON_RUNS - 1) + list(TORCH_TESTS)
    for i, name in enumerate(names):
        case = case_class(name)
        case.file_name = os.path.join(workdir, f"init-{i}")
        getattr(case, name)()
        if dist.is_initialized():  # the two that never destroy it (a process each, in torch)
            dist.destroy_process_group()
        passed.append(name)
    return passed


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torchs_ddp_comparison_tests_pass_on_rallypoint_rpc() -> None:
    with tempfile.TemporaryDirectory() as workdir:
        results = run_workers(_run_torch_tests, 4, workdir, timeout=200, env=ENV)
    expected = [TORCH_TESTS[0]] * (COMPARISON_RUNS - 1) + list(TORCH_TESTS)
    assert results == [expected] * 4


def _late(_: Any) -> None:
    time.sleep(0.3)  # on gloo's thread, which holds the finished work meanwhile


def _late_gloo_thread(workdir: str) -> str:
    """torch's test_ddp_comparison, each blocking all-reduce (of the tensors ``Join``
    and DDP make in Python) finishing late on gloo's thread: a callback there runs after
    the caller is woken, so gloo still holds the work while the test tears down."""
    real = dist.all_reduce

    def late_all_reduce(tensor: torch.Tensor, *args: Any, async_op: bool = False, **kw: Any) -> Any:
        work = real(tensor, *args, async_op=True, **kw)
        if async_op:
            return work
        future = work.get_future()  # type: ignore[union-attr]
        future.then(_late)
        future.wait()  # wakes before the callbacks run
        return None

    dist.all_reduce = late_all_reduce  # this worker only (a forked process)
    case = _case_class(_torch_module())(TORCH_TESTS[0])
    case.file_name = os.path.join(workdir, "init")
    case.test_ddp_comparison()
    return "ok"


@pytest.mark.timeout(120)
def test_a_ddp_module_freed_after_destroy_process_group_does_not_hang_its_worker() -> None:
    """The module goes while gloo's thread still holds a finished all-reduce of a
    Python-made tensor: its group is let go without the GIL, after that thread is done
    (this hung every time, in the teardown of torch's test, before)."""
    with tempfile.TemporaryDirectory() as workdir:
        results = run_workers(_late_gloo_thread, 4, workdir, timeout=60, env=ENV)
    assert results == ["ok"] * 4
