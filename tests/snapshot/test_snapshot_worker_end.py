"""What workers' snapshot sessions print, in real ``rallypoint run`` jobs (warnings reach the
screen there, not in workers forked from pytest): a script that never calls
``snapshot.wait()`` ends quietly, a slot this worker cannot map is said to be memory, and a
restore from ``--snapshot-dir`` does not print DCP's ``no_dist`` warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

NO_WAIT = r"""
import torch, torch.distributed as dist
from rallypoint import snapshot
dist.init_process_group("gloo")
state = {"w": torch.zeros(1 << 22)}  # 16 MiB: the replica's copy takes a moment
snapshot.restore(state)
for step in range(1, 4):
    state["w"] += 1
    snapshot.save(state, step=step)
# no snapshot.wait(): the last save's answer is still on its way when the script ends
"""

NO_MEMORY = r"""
import resource, torch
from rallypoint import snapshot
state = {"w": torch.zeros(1 << 24)}  # 64 MiB
snapshot.restore(state)  # the session, its threads and its connection exist now
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1])
resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (16 << 20), resource.RLIM_INFINITY))
for step in range(1, 4):  # mapping the 64 MiB slot fails: ENOMEM
    state["w"] += 1
    snapshot.save(state, step=step)
print("trained on", flush=True)
"""


DISK = r"""
import torch, torch.distributed as dist
from rallypoint import snapshot
dist.init_process_group("gloo")
state = {"w": torch.zeros(8)}
start = snapshot.restore(state) or 0
for step in range(start, start + 10):
    state["w"] += 1
    snapshot.save(state, step=step + 1)
snapshot.wait()
dist.destroy_process_group()
"""


def _lines(text: str) -> list[str]:
    """What a job printed, without torchrun's OMP_NUM_THREADS banner."""
    return [x for x in text.splitlines() if x and "OMP_NUM_THREADS" not in x and "****" not in x]


@pytest.mark.timeout(150)
def test_a_script_without_wait_ends_with_no_warning(tmp_path: Path) -> None:
    import torch.distributed as dist

    script = tmp_path / "no_wait.py"
    script.write_text(NO_WAIT)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    common = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
        "--rdzv-id", "no-wait", "--rdzv-conf", "is_host=false", str(script),
    ]  # fmt: skip
    pipe = subprocess.PIPE
    procs = [
        subprocess.Popen(common, stdout=pipe, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    for p in procs:
        text, _ = p.communicate(timeout=120)
        assert p.returncode == 0, text
        assert _lines(text) == [], text  # was: "dropped a worker connection: ConnectionResetError"


@pytest.mark.timeout(120)
def test_a_slot_the_worker_cannot_map_is_said_to_be_memory(tmp_path: Path) -> None:
    script = tmp_path / "no_memory.py"
    script.write_text(NO_MEMORY)
    done = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=100,
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text
    [line] = [x for x in _lines(text) if "rallypoint.snapshot" in x]
    assert "cannot map a snapshot slot of 64.0 MiB" in line and "out of memory" in line, line
    assert "lost the node's snapshot server" not in line, line
    assert "trained on" in text, text


@pytest.mark.timeout(150)
def test_a_restore_from_disk_prints_no_dcp_warning(tmp_path: Path) -> None:
    script = tmp_path / "disk.py"
    script.write_text(DISK)
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2",
        "--snapshot-dir", str(tmp_path / "ck"), "--snapshot-every", "5", str(script),
    ]  # fmt: skip
    texts = []
    for _ in range(2):  # the second job restores step 10 from disk
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
        texts.append(done.stdout + done.stderr)
        assert done.returncode == 0, texts[-1]
    assert "restored step 10 from disk on every rank" in texts[1], texts[1]
    assert _lines(texts[1]) == [
        "[rank0]: rallypoint.snapshot: restored step 10 from disk on every rank (2 ranks; "
        + texts[1].split("(2 ranks; ")[1].splitlines()[0]
    ], texts[1]
