"""Snapshots under ``rallypoint run`` on one node: a worker crash, a crash in the middle of a
save, bounded memory, and persistence with DCP across jobs and world sizes."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from _jobs import TRAIN, run, same_params, starts
from _ports import snapshot_listeners

from _support import cli_zygote


@pytest.mark.timeout(150)
@pytest.mark.parametrize("virtual_local_rank", [False, True])  # True: LOCAL_RANK is 0 for all
def test_worker_killed_at_37_resumes_at_37_bit_identical(
    tmp_path: Path, reference: Path, virtual_local_rank: bool
) -> None:
    text = run(2, tmp_path, "crash", 60, max_restarts=1, virtual_local_rank=virtual_local_rank)
    assert "restored step 37 from memory on every rank (2 ranks" in text, text
    assert starts(tmp_path) == [(0, 0, 2), (0, 0, 2), (37, 37, 2), (37, 37, 2)]
    same_params(tmp_path / "final.pt", reference)


@pytest.mark.timeout(150)
def test_crash_during_a_save_restores_the_previous_complete_step(
    tmp_path: Path, reference: Path
) -> None:
    text = run(2, tmp_path, "savecrash", 60, max_restarts=1)
    assert "restored step 36 from memory" in text, text
    assert starts(tmp_path) == [(0, 0, 2), (0, 0, 2), (36, 36, 2), (36, 36, 2)]
    same_params(tmp_path / "final.pt", reference)


MEMORY = r"""
import json, os, sys, torch, torch.distributed as dist
from rallypoint import snapshot
from rallypoint._snapshot import _api

dist.init_process_group("gloo")
state = {"w": torch.zeros(1 << 14)}               # 64 KiB
def snapshot_memory():
    pid = _api.current_session().client.server_pid
    shm = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:                                        # the server opens and closes sockets
            if os.readlink(path).startswith("/memfd:"):
                st = os.stat(path)                  # (a mapped slot has two descriptors)
                shm[st.st_ino] = st.st_blocks * 512 # pages actually allocated
        except FileNotFoundError:                   # closed since listdir
            continue
    rss = int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS")).split()[1])
    return sum(shm.values()), rss * 1024
seen = {}
for step in range(1, 1001):
    state["w"] += 1
    snapshot.save(state, step=step)
    if step in (10, 1000):
        snapshot.wait()
        dist.barrier()
        seen[step] = snapshot_memory()
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as fp:
        json.dump(seen, fp)
"""


@pytest.mark.timeout(150)
def test_memory_stays_two_snapshots_per_rank_per_copy_after_1000_saves(
    tmp_path: Path,
) -> None:
    import torch.distributed as dist

    script = tmp_path / "memory.py"
    script.write_text(MEMORY)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    common = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
        "--rdzv-id", "memory", "--rdzv-conf", "is_host=false", str(script),
    ]  # fmt: skip
    procs = [
        cli_zygote.Popen([*common, str(tmp_path / f"m{i}.json")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]  # fmt: skip
    for p in procs:
        text, _ = p.communicate(timeout=120)
        assert p.returncode == 0, text
    [result] = [json.loads(f.read_text()) for f in tmp_path.glob("m*.json")]
    (shm10, rss10), (shm1000, rss1000) = result["10"], result["1000"]
    state = 1 << 16
    # rank 0's node: its own rank's two slots and two slots of the other node's rank
    slot = state + 4096  # the state, its header and meta, in whole pages
    assert shm1000 == shm10 == 2 * 2 * slot, result
    # nothing else grows with the number of saves (256 bytes a save would show)
    assert rss1000 - rss10 < 1 << 18, result


@pytest.mark.timeout(240)
def test_snapshot_dir_restores_a_fresh_job_and_reshards_for_another_world(
    tmp_path: Path, reference: Path
) -> None:
    ck = tmp_path / "ck"
    run(2, tmp_path / "a", "none", 45, snapshot_dir=ck)  # persisted steps 30 and 40 (the last two)
    assert sorted(p.name for p in ck.rglob("step-*")) == [
        "step-000000000030",
        "step-000000000040",
    ]
    # a new job (nothing in memory): the same world resumes at 40 and ends where 60 steps do
    text = run(2, tmp_path / "b", "none", 60, snapshot_dir=ck)
    assert "restored step 40 from disk on every rank" in text, text
    assert starts(tmp_path / "b") == [(40, 40, 2), (40, 40, 2)]
    same_params(tmp_path / "b" / "final.pt", reference)
    [second] = ck.iterdir()  # with two checkpoints of its own, b removed a's namespace
    assert sorted(p.name for p in second.glob("step-*")) == [
        "step-000000000050",
        "step-000000000060",
    ]
    # (which persisted 50 and 60.) Three workers: DCP loads the two-rank checkpoint of step 60
    text = run(3, tmp_path / "c", "none", 61, snapshot_dir=ck)
    assert "restored step 60 from disk on every rank (3 ranks" in text, text
    assert starts(tmp_path / "c") == [(60, 60, 3)] * 3
    same_params(tmp_path / "c" / "restored-60-3.pt", reference)


@pytest.mark.timeout(120)
def test_a_single_node_job_listens_for_peers_on_loopback_only(tmp_path: Path) -> None:
    """Nobody else ever connects to the snapshot server of a one-node job: its peer port
    is bound to loopback, not to 0.0.0.0."""
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2",
        "--max-restarts", "0", "--shutdown-timeout", "2", str(TRAIN), str(tmp_path), "node", "60",
    ]  # fmt: skip
    agent = cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "at37").exists():  # rank 1 saved step 37 and sleeps
            assert agent.poll() is None and time.monotonic() < deadline, agent.poll()
            time.sleep(0.05)
        listeners = snapshot_listeners(agent.pid)
    finally:
        procs = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        agent.communicate(timeout=30)
    assert listeners, "the snapshot server listens on no TCP port"
    assert all(ip == "127.0.0.1" for ip, _ in listeners), listeners
