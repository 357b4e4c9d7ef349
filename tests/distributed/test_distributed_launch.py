"""Groups set up by a launcher: parallel_worker, rallypoint.launch(parallel=...), rallypoint run."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import rallypoint.distributed as rd
from _support import cli_zygote
from rallypoint._core.net import free_port
from rallypoint.testing import run_workers


def _layout() -> dict[str, Any]:
    groups = rd.get_parallel_groups()
    return {
        "rank": dist.get_rank(),
        "tp": groups.ranks("tp"),
        "dp": groups.ranks("dp"),
        "env_rank": int(os.environ["RANK"]),
    }


def _fails() -> None:
    assert dist.is_initialized()
    raise KeyError("boom")


def _run_wrapped() -> dict[str, Any]:
    config = rd.DistributedConfig(tensor_parallel=2)
    worker = pickle.loads(pickle.dumps(rd.parallel_worker(_layout, config)))
    out = worker()
    out["after_ok"] = dist.is_initialized()
    try:
        rd.parallel_worker(_fails, {"tensor_parallel": 2})()
    except KeyError:
        out["after_error"] = dist.is_initialized()
    try:
        rd.get_parallel_groups()
    except rd.NotInitializedError:
        out["groups_cleared"] = True
    return out


TP2_DP2 = {0: ([0, 1], [0, 2]), 1: ([0, 1], [1, 3]), 2: ([2, 3], [0, 2]), 3: ([2, 3], [1, 3])}


@pytest.mark.timeout(100)
def test_parallel_worker_sets_up_and_tears_down_even_when_fn_raises() -> None:
    # A no-hang bound, not a speed check: on a loaded 2-core machine one TCPStore connect
    # can go unanswered for 20 s before torch retries it (seen in full-suite runs).
    for rank, out in enumerate(run_workers(_run_wrapped, 4, timeout=90)):
        assert (out["rank"], out["tp"], out["dp"]) == (rank, *TP2_DP2[rank])
        assert out["after_ok"] is False
        assert out["after_error"] is False
        assert out["groups_cleared"]


def test_parallel_worker_bad_input_fails_in_the_parent() -> None:
    with pytest.raises(TypeError, match=r"fn must be callable"):
        rd.parallel_worker(3, True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"parallel must be a DistributedConfig, a mapping"):
        rd.parallel_worker(_layout, 2)
    with pytest.raises(ValueError, match=r"unknown keys \['tensor'\]"):
        rd.parallel_worker(_layout, {"tensor": 2})
    with pytest.raises(ValueError, match=r"tensor_parallel must be >= 1"):
        rd.parallel_worker(_layout, {"tensor_parallel": 0})
    with pytest.raises(ValueError, match=r"world_size 6 is not divisible by tensor_parallel = 4"):
        rd.parallel_worker(_layout, {"tensor_parallel": 4}, world_size=6)
    with pytest.raises(ValueError, match=r"the launch has 4 processes"):
        rd.parallel_worker(_layout, {"world_size": 2}, world_size=4)
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        rd.parallel_worker(_layout, True, world_size=0)
    checked = rd.parallel_worker(_layout, {"tensor_parallel": 2}, world_size=4)
    assert checked.config.world_size is None
    worker = rd.parallel_worker(_layout, True)
    assert worker.config == rd.DistributedConfig()
    assert "ParallelWorker(_layout" in repr(worker)


@pytest.mark.timeout(60)
def test_launch_with_parallel_initialises_groups_in_each_worker() -> None:
    import rallypoint

    results = rallypoint.launch(_layout, nproc=4, parallel=rd.DistributedConfig(tensor_parallel=2))
    for rank, out in enumerate(results):
        assert (out["rank"], out["tp"], out["dp"]) == (rank, *TP2_DP2[rank])


@pytest.mark.timeout(60)
def test_launch_with_parallel_and_spawn_pickles_the_worker() -> None:
    import rallypoint

    results = rallypoint.launch(
        _layout, nproc=2, start_method="spawn", parallel={"pipeline_parallel": 2}
    )
    assert [(r["rank"], r["tp"], r["dp"]) for r in results] == [(0, [0], [0]), (1, [1], [1])]


SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import rallypoint.distributed as rd

groups = rd.init_parallel_groups(tensor_parallel=2)
t = torch.ones(1)
dist.all_reduce(t, group=groups.tp_group)
record = {
    "rank": dist.get_rank(),
    "world": dist.get_world_size(),
    "backend": str(dist.get_backend()),
    "backend_config": dist.get_backend_config(),
    "tp": groups.ranks("tp"),
    "dp": groups.ranks("dp"),
    "tp_sum": t.item(),
}
rd.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{record['rank']}.json"), "w") as f:
    json.dump(record, f)
"""


def _rallypoint_run(tmp_path: Path, extra_env: dict[str, str]) -> list[dict[str, Any]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, **extra_env}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "4", str(script)]
    proc = cli_zygote.run(
        [*cmd, str(tmp_path)], env=env, capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(60)
def test_env_based_init_under_rallypoint_run(tmp_path: Path) -> None:
    for rank, record in enumerate(_rallypoint_run(tmp_path, {})):
        assert (record["rank"], record["world"], record["backend"]) == (rank, 4, "gloo")
        assert (record["tp"], record["dp"]) == TP2_DP2[rank]
        assert record["tp_sum"] == 2.0


@pytest.mark.timeout(60)
def test_backend_env_under_rallypoint_run(tmp_path: Path) -> None:
    records = _rallypoint_run(tmp_path, {"TORCH_DISTRIBUTED_BACKEND": "cpu:gloo"})
    assert [r["rank"] for r in records] == [0, 1, 2, 3]
    assert {r["backend_config"] for r in records} == {"cpu:gloo"}


LAUNCH_SCRIPT = """
import sys
import rallypoint, rallypoint.distributed as rd
import torch.distributed as dist

def layout():
    groups = rd.get_parallel_groups()
    return dist.get_rank(), groups.ranks("tp"), groups.ranks("dp")

offset, port = int(sys.argv[1]), int(sys.argv[2])
results = rallypoint.launch(
    layout, nproc=2, rank_offset=offset, world_size=4, master_addr="127.0.0.1",
    master_port=port, parallel=rd.DistributedConfig(tensor_parallel=2),
)
print(repr(results))
"""


@pytest.mark.timeout(90)
def test_two_launches_share_one_world_with_rank_offset(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text(textwrap.dedent(LAUNCH_SCRIPT))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(offset), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for offset in (0, 2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=80)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(eval(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ranks = [entry for result in outputs for entry in result]
    assert ranks == [(r, *TP2_DP2[r]) for r in range(4)]
