"""torchft's own checkpointing tests, run against ``rallypoint.ft.checkpointing`` with the
import swapped (as ``test_torchft_suite.py`` runs its manager tests).

torchft 0.2.0's wheel ships ``checkpointing/{transport,http_transport,pg_transport,rwlock}
_test.py``. Their text is read from the installed package, ``torchft`` becomes
``rallypoint.ft``, and they run in a child process (their threads and gloo stay out of this
one). ``transport_test.py`` holds no test: it is the helper the others import
(``run_multi_recovery_test``: three ranks, a send to two then to one, a receive that times
out), copied beside them. ``test_benchmark`` runs torchft's benchmark script, which imports a
private timing helper of torchft's HTTP transport: it is not run (docs/ft.md).
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

PASSING = {
    "test_checkpoint_server_0_no_chunks",
    "test_checkpoint_server_1_chunked",
    "test_checkpoint_server_locking",
    "test_multi_http_transport_cpu",
    "test_pg_transport_gloo",
    "test_w_locked",
    "test_w_lock_timeout",
    "test_r_lock_timeout",
}
"""Every case that runs on a CPU, less ``test_benchmark``; the CUDA cases skip here."""


def _swapped(tmp_path: Path, name: str, out: str) -> Path:
    spec = importlib.util.find_spec("torchft")
    assert spec is not None and spec.origin is not None
    text = (Path(spec.origin).parent / "checkpointing" / name).read_text()
    text = text.replace(
        "from torchft.checkpointing.http_transport_bench import main as bench_main",
        "bench_main = None  # torchft's benchmark script: not run (docs/ft.md)",
    )
    text = text.replace(
        "from torchft.checkpointing.transport_test import", "from transport_helpers import"
    )
    text = text.replace("from torchft.", "from rallypoint.ft.")
    unswapped = re.findall(r"^\s*(?:from|import) torchft\b.*$", text, re.M)
    assert not unswapped, unswapped
    path = tmp_path / out
    path.write_text(text)
    return path


@pytest.mark.timeout(400)
@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs torchft==0.2.0")
@pytest.mark.skipif(importlib.util.find_spec("parameterized") is None, reason="needs parameterized")
def test_torchfts_checkpointing_tests_pass_with_the_import_swapped(tmp_path: Path) -> None:
    _swapped(tmp_path, "transport_test.py", "transport_helpers.py")
    paths = [
        _swapped(tmp_path, f"{name}_test.py", f"{name}_swapped_test.py")
        for name in ("http_transport", "pg_transport", "rwlock")
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           "--timeout", "120", "-rA", *map(str, paths), "-k", "not test_benchmark"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=380, env=env, cwd=tmp_path)
    passed = set(re.findall(r"^PASSED \S+::(?:\w+::)?(\w+)", done.stdout, re.M))
    # the failures' own sections first: -rA's passed cases' output would crowd them out of
    # a tail (test_multi_http_transport_cpu's 400 for a step its source had not yet offered
    # was cut so; a failure there also leaves the default process group for the next file)
    assert passed == PASSING, _failures(done.stdout) + done.stderr[-2000:]
