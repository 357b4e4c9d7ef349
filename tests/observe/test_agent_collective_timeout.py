"""A collective that times out: the ranks that waited in it fail first, yet the report
names the rank that never issued it (the Flight Recorder of every rank, the exited ones'
included). Real workers through ``rallypoint run``, gloo with a short process-group timeout."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _support import cli_zygote
from _support.flight import root_causes
from rallypoint._core import envvars
from rallypoint._watch._flight._final import (
    leave_final_trace,
    read_final_trace,
    remove_final_traces,
)
from rallypoint._watch._flight._recorder import NCCL_DUMP_PREFIX

SCRIPT = """
import time
from datetime import timedelta
import torch, torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=3))
rank = dist.get_rank()
t = torch.ones(4)
for step in range(3):
    dist.all_reduce(t)  # collectives #1-#3 of the world
if rank == 3:
    time.sleep(3600)  # STUCK
dist.all_reduce(t)  # WORLD
"""


def _line(marker: str) -> str:
    number = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if line.endswith(marker))
    return f"timeout.py:{number}"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_rank_that_never_issued_the_timed_out_collective_is_named(tmp_path: Path) -> None:
    script = tmp_path / "timeout.py"
    script.write_text(SCRIPT)
    proc = cli_zygote.run(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "4", str(script)],
        capture_output=True, text=True, timeout=80,
    )  # fmt: skip
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "Timed out waiting 3000ms" in err  # gloo's own error, as torchrun shows it
    assert re.search(r"rallypoint: rank [0-2] failed: a collective timed out", err), err
    [block] = root_causes(err)
    assert block["rank"] == "3", block
    assert block["collective"] == "all_reduce #4 of world [0, 1, 2, 3]: rank 3 never issued it"
    assert block["issued at"] == f"{_line('# WORLD')} (ranks 0-2)", block
    assert f"rank 3 is in: sleep at {_line('# STUCK')}" in err
    assert "ranks 0-2: no stack: exited (a collective timed out" in err
    # the failure summary still shows the first failure, as torchrun's does, and what it
    # waited for
    assert "Root cause (first failure):" in err
    summary = err.split("Root cause (first failure):")[1]
    waited = re.search(
        r"  waited for: rank 3 on \S+ \(pid \d+\): all_reduce #4 of world "
        r"\[0, 1, 2, 3\]: rank 3 never issued it \(Flight Recorder",
        summary,
    )
    assert waited, summary


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_across_two_agents_one_report_names_the_rank_on_the_other_node(
    tmp_path: Path, endpoint: str
) -> None:
    script = tmp_path / "timeout.py"
    script.write_text(SCRIPT)
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "job-timeout",
        "--rdzv-conf", "is_host=false,read_timeout=20", str(script),
    ]  # fmt: skip
    procs = [
        cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    errs = [p.communicate(timeout=100)[1] for p in procs]
    assert all(p.returncode == 1 for p in procs), errs
    blocks = [b for err in errs for b in root_causes(err)]
    assert len(blocks) == 1, errs  # one node reports for the job
    assert blocks[0]["rank"] == "3", blocks
    assert blocks[0]["collective"].endswith("rank 3 never issued it"), blocks
    for err in errs:  # every node's failure summary names it (the reporter's, in the store)
        summary = err.split("Root cause (first failure):")[1]
        assert re.search(r"  waited for: rank 3 on \S+ \(pid \d+\): ", summary), summary


def test_a_worker_leaves_its_trace_only_for_a_collective_timeout(tmp_path: Path) -> None:
    env = {envvars.STACKS_DIR: str(tmp_path), "RANK": "5"}
    assert not leave_final_trace("ValueError: bad input", env)
    assert not list(tmp_path.iterdir())
    gloo = "RuntimeError: [..unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"
    assert not leave_final_trace(gloo, {**env, "TORCH_FR_BUFFER_SIZE": "0"})  # recording off
    assert leave_final_trace(gloo, env)
    trace = read_final_trace(tmp_path, 5, os.getpid())
    assert trace is not None and trace.rank == 5
    # the suite's process may have used torch.distributed: then a trace, else why not
    assert trace.error in (None, "torch.distributed is not in use"), trace.error
    remove_final_traces(tmp_path, 5, os.getpid())
    assert read_final_trace(tmp_path, 5, os.getpid()) is None


def test_the_dump_nccls_watchdog_leaves_is_read(tmp_path: Path) -> None:
    # the layout of torch's pickled Flight Recorder dump (what TORCH_FR_DUMP_TEMP_FILE gets)
    entry = {
        "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 4,
        "profiling_name": "nccl:all_reduce", "time_created_ns": 10, "input_sizes": [[4]],
        "input_dtypes": ["Float"], "retired": False, "is_p2p": False,
        "frames": [{"filename": "train.py", "line": 9, "name": "<module>"}],
    }  # fmt: skip
    dump = {
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
        "pg_status": {"0": {"last_enqueued_collective": 4, "last_completed_collective": 3}},
        "entries": [entry],
    }
    (tmp_path / f"{NCCL_DUMP_PREFIX}2").write_bytes(pickle.dumps(dump))
    trace = read_final_trace(tmp_path, 2, 999_999_999)
    assert trace is not None and trace.error is None
    [group] = trace.groups
    assert group.ranks == (0, 1, 2, 3) and group.world
    assert (group.issued, group.completed) == (4, 3)
    assert group.entry(4) is not None and group.entry(4).frames == (("train.py", 9, "<module>"),)  # type: ignore[union-attr]
    (tmp_path / f"{NCCL_DUMP_PREFIX}1").write_bytes(b"not a pickle")
    assert read_final_trace(tmp_path, 1, 999_999_999) is None
