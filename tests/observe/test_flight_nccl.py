"""The NCCL path of the Flight Recorder: recording on, the dump gathered on a hang, and
the watchdog's dump settings (one process on one GPU; skipped without one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

NCCL_HANG = """
import os, time
import torch, torch.distributed as dist
import rallypoint.launcher as rl

dist.init_process_group("nccl")
torch.cuda.set_device(0)
t = torch.ones(1024, device="cuda")
for _ in range(3):
    rl.progress()
    dist.all_reduce(t)
torch.cuda.synchronize()
keys = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE")
print(" ".join(f"{k}={os.environ.get(k)}" for k in keys), flush=True)
time.sleep(3600)  # the hang
"""


def _has_gpu() -> bool:
    try:
        import torch
        import torch.distributed as dist

        return bool(torch.cuda.is_available() and dist.is_nccl_available())
    except ImportError:
        return False


@pytest.mark.cuda
@pytest.mark.timeout(180)
def test_nccl_worker_records_and_its_dump_is_gathered_on_a_hang(tmp_path: Path) -> None:
    if not _has_gpu():
        pytest.skip("needs an NVIDIA GPU with NCCL")
    script = tmp_path / "nccl_hang.py"
    script.write_text(NCCL_HANG)
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "1", "--hang-timeout",
         "5", "--on-hang", "fail", str(script)],
        capture_output=True, text=True, timeout=160,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1" in proc.stdout, proc.stdout
    assert "nccl_trace_rank_" in proc.stdout
    assert "Collectives by group (Flight Recorder):" in proc.stderr, proc.stderr
    assert "  world [0]: #3 completed by all" in proc.stderr, proc.stderr
    assert "rank 0: sleep at nccl_hang.py" in proc.stderr
