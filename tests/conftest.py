"""Session-wide set-up of rallypoint's own suite."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# torch.cuda.is_available() (a skipif at collection, say) asks NVML instead of starting
# CUDA's driver in this process: workers forked from it (or from the zygote) could not use
# CUDA after that, and every fork-based cuda test on a GPU host would fail
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"

from _support.store_host import store_host
from rallypoint.testing import worker_zygote
from rallypoint.testing._zygote import Zygote


@pytest.fixture(scope="session", autouse=True)
def zygote() -> Iterator[Zygote]:
    """Every ``run_workers`` worker of the session is forked from one single-threaded copy
    of this process, made before the first test starts a thread (see
    ``rallypoint.testing._zygote``: a worker forked from this process while one of its
    threads looked a name up blocked for good in its own store connect)."""
    with worker_zygote() as made:
        yield made


@pytest.fixture(autouse=True)
def no_cuda_in_the_test_process() -> Iterator[None]:
    """A test that starts CUDA in the pytest process fails, naming itself, rather than every
    later test whose forked workers use CUDA (CUDA does not survive a fork)."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.fail("this test initialised CUDA in the pytest process: do CUDA in workers")


@pytest.fixture
def endpoint() -> Iterator[str]:
    """``HOST:PORT`` of a c10d rendezvous store hosted for a multi-node test (so it outlives
    the agents) in a process of its own; the agents get ``--rdzv-conf is_host=false``."""
    with store_host() as port:
        yield f"127.0.0.1:{port}"


@pytest.fixture
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallDisk]:
    """A real filesystem of its own (tmpfs, 256 KiB) that a test can fill or remount
    read-only; skipped where mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    disk = SmallDisk(tmp_path_factory.mktemp("disk"))
    disk.mount("size=256k")
    try:
        yield disk
    finally:
        disk.unmount()


class SmallDisk:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.mounts = 0

    def mount(self, options: str) -> None:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(self.path)],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        self.mounts += 1

    def read_only(self) -> None:
        """From now on, nothing can be made under the path (what a failing disk's
        filesystem does when the kernel remounts it read-only): an empty read-only tmpfs
        is mounted over it (a remount would be refused while files are open for writing)."""
        self.mount("ro,size=4k")

    def unmount(self) -> None:
        for _ in range(self.mounts):
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=10)
