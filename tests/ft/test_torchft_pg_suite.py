"""torchft's own tests of its process groups, futures and parameter server, run against
``rallypoint.ft`` with the import swapped.

The files ship in torchft 0.2.0's wheel; their text is read from the installed package,
``torchft`` rewritten to ``rallypoint.ft`` (imports and the module paths that ``patch``
names), and run in a child process. ``process_group_test.py``'s cases about
``ProcessGroupBabyGloo``'s child process (its pipes, threads and "handle is closed" error)
are left out: here the Baby classes abort in process and have none (docs/ft.md).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_torchft_suite import _failures

BABY_INTERNALS = [
    "test_baby_gloo_apis",
    "test_baby_gloo_timeout",
    "test_reconfigure_baby_process_group",
]
"""They read the child process of torchft's Baby groups, which rallypoint's do not have."""

PG_CASES = [
    "ProcessGroupTest::test_dummy",
    "ProcessGroupTest::test_error_swallowing_process_group_wrapper",
    "ProcessGroupTest::test_functional_collectives",
    "ProcessGroupTest::test_gloo_apis_0",
    "ProcessGroupTest::test_gloo_timeout",
    "ProcessGroupTest::test_managed_process_group",
    "ProcessGroupTest::test_process_group_wrapper",
    *(f"CreateStoreClientTest::test_parses_addr_{i}" for i in range(5)),
    *(f"{cls}::test_{kind}_{i}" for cls in ("NormalGlooMultiPgTest", "BabyGlooMultiPgTest")
      for kind in ("collective", "collective_with_resiliency") for i in range(8)),
]  # fmt: skip
"""What passes here (the CUDA cases skip on a CPU); parametrized names end in an index."""


def _swapped(tmp_path: Path, name: str) -> Path:
    spec = importlib.util.find_spec("torchft")
    assert spec is not None and spec.origin is not None
    text = Path(spec.origin).with_name(name).read_text()
    text = text.replace("from torchft.", "from rallypoint.ft.")
    text = text.replace('"torchft.', '"rallypoint.ft.')  # patch("torchft.process_group.X")
    unswapped = re.findall(r"^\s*(?:from|import) torchft\b.*$", text, re.M)
    assert not unswapped, unswapped
    path = tmp_path / name.replace("_test.py", "_swapped_test.py")
    path.write_text(text)
    return path


def _run(tmp_path: Path, paths: list[Path], *args: str, timeout: float) -> tuple[set[str], str]:
    """The cases that passed (``Class::test``, a parametrized index kept, its id dropped)
    and pytest's output: its failures first (a tail alone had lost them behind the summary's
    list of passed cases), then its summary (``_failures``, as the other swapped suites)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "--timeout", "120", "-rA", *map(str, paths), *args]  # fmt: skip
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )
    names = re.findall(r"^PASSED \S+?::(\S+)", done.stdout, re.M)
    passed = {re.sub(r"(_\d+)_.*$", r"\1", n) for n in names}
    return passed, _failures(done.stdout) + done.stderr[-2000:]


skip_without_torchft = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="needs torchft==0.2.0"
)


@pytest.mark.timeout(600)
@skip_without_torchft
@pytest.mark.skipif(importlib.util.find_spec("parameterized") is None, reason="needs parameterized")
def test_torchfts_process_group_tests_pass_with_the_import_swapped(tmp_path: Path) -> None:
    path = _swapped(tmp_path, "process_group_test.py")
    passed, out = _run(tmp_path, [path], "-k", " and ".join(f"not {n}" for n in BABY_INTERNALS),
                       timeout=560)  # fmt: skip
    assert passed == set(PG_CASES), out


@pytest.mark.timeout(300)
@skip_without_torchft
def test_torchfts_futures_and_parameter_server_tests_pass_with_the_import_swapped(
    tmp_path: Path,
) -> None:
    paths = [_swapped(tmp_path, "futures_test.py"), _swapped(tmp_path, "parameter_server_test.py")]
    passed, out = _run(tmp_path, paths, timeout=280)
    expected = {
        "FuturesTest::test_future_wait",
        "FuturesTest::test_future_timeout",
        "FuturesTest::test_future_timeout_result",
        "FuturesTest::test_future_timeout_exception",
        "FuturesTest::test_context_timeout",
        "FuturesTest::test_exit_on_stuck_callback",
        "TestParameterServer::test_parameter_server",
    }  # test_stream_timeout needs CUDA
    assert passed == expected, out
