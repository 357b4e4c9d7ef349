"""GPU checks for the ``cuda``-marked RPC tests, made without touching CUDA in this process.

Workers are forked (from the session's zygote, or from this process): a process in which
CUDA was initialised cannot fork workers that use it, and ``torch.cuda.is_available()``
initialises it. The count comes from a short-lived child process instead.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
import torch


@functools.cache
def gpus() -> int:
    """How many GPUs a worker process sees (0 on a CPU-only build or machine)."""
    if torch.version.cuda is None:
        return 0
    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def need_gpus(count: int = 1) -> None:
    """Skip the calling test unless ``count`` GPUs are there."""
    if gpus() < count:
        pytest.skip(f"needs {count} NVIDIA GPU(s); this machine has {gpus()}")
