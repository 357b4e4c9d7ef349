"""The public surface of rallypoint.distributed, and that importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys

import rallypoint.distributed as rd

EXPECTED = {
    "DIM_NAMES",
    "AlreadyInitializedError",
    "BackendUnavailableError",
    "DistributedConfig",
    "DistributedError",
    "NotInitializedError",
    "ParallelGroups",
    "ParallelWorker",
    "all_gather",
    "all_to_all",
    "destroy_process_group",
    "get_parallel_groups",
    "init_parallel_groups",
    "init_process_group",
    "parallel_worker",
    "reduce_scatter",
}


def test_public_names() -> None:
    assert set(rd.__all__) == EXPECTED
    for name in rd.__all__:
        assert getattr(rd, name) is not None, name
    assert rd.DIM_NAMES == ("pp", "dp", "cp", "tp")


def test_error_tree() -> None:
    for error in (rd.AlreadyInitializedError, rd.NotInitializedError, rd.BackendUnavailableError):
        assert issubclass(error, rd.DistributedError)
    assert issubclass(rd.DistributedError, RuntimeError)


def test_import_does_not_load_torch_until_a_collective_is_used() -> None:
    code = (
        "import sys, rallypoint.distributed as rd; a = 'torch' in sys.modules; "
        "rd.DistributedConfig(tensor_parallel=2); b = 'torch' in sys.modules; "
        "import logging; h = logging.getLogger('rallypoint.distributed').handlers; "
        "rd.all_to_all; print(a, b, 'torch' in sys.modules, h == [])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "True"]
