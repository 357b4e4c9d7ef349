"""Benchmark: multi-node recovery after a worker dies (rallypoint vs torchrun, same run).

Two simulated nodes (two agents on loopback, ``--nnodes 2 --nproc-per-node 2``, c10d
rendezvous, ``--max-restarts 1``). Rank 3 dies right after its first gloo all_reduce; the
time measured is from its death until every rank has passed the first all_reduce of the
next round. torchrun gets a timeout: on this machine its restarted workers can hang or
fail to reach a stale store address.

    .venv/bin/python benchmarks/recovery.py               # 3 repeats each
    .venv/bin/python benchmarks/recovery.py --repeat 1 --timeout 60

Every worker appends ``restart_count rank unix_time`` to a file right after its first
all_reduce; the dying rank writes its death time first. Also printed: node-loss detection
(one agent SIGKILLed; time until the survivor restarts its workers in a one-node world),
which is bounded by the keep-alive window configured here (0.5 s x 3 attempts).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = """
import os, sys, time
import torch
import torch.distributed as dist
out = os.environ["BENCH_OUT"]
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
rank = dist.get_rank()
nodes = os.environ.get("GROUP_WORLD_SIZE", "?")
with open(out, "a") as fp:
    fp.write(f"{attempt} {rank} {time.time()!r} {nodes}\\n")
mode = os.environ["BENCH_MODE"]
if mode == "die" and attempt == "0" and rank == 3:
    with open(out + ".death", "w") as fp:
        fp.write(repr(time.time()))
    os._exit(1)
if mode == "loss" and nodes == "2":
    while True:          # keep the collective going until a node is lost
        dist.all_reduce(t)
        time.sleep(0.01)
dist.barrier()
dist.destroy_process_group()
"""


def _free_port() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from rallypoint._core.net import free_port

    return free_port()


def _agents(
    tool: str, script: Path, port: int, env: dict[str, str], nnodes: str, is_host: str = ""
) -> list[Any]:
    procs = []
    for _ in range(2):
        if tool == "rallypoint":
            cmd = [sys.executable, "-m", "rallypoint", "run"]
            conf = "last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3"
            conf += f",is_host={is_host}" if is_host else ""
            extra = ["--rdzv-conf", conf, "--shutdown-timeout", "2"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run"]
            extra = ["--rdzv-conf", "last_call_timeout=1"]
        cmd += [
            "--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}",
            "--max-restarts", "1", *extra, str(script),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
    return procs


def _stop(procs: list[Any]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _stamps(out: Path) -> list[tuple[str, int, float, str]]:
    if not out.exists():
        return []
    rows = []
    for line in out.read_text().splitlines():
        a, r, t, n = line.split()
        rows.append((a, int(r), float(t), n))
    return rows


def recovery(tool: str, timeout: float) -> float | None:
    """Death of rank 3 -> every rank passed the first all_reduce of the next round."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        out = Path(tmp) / "stamps"
        env = dict(os.environ, BENCH_OUT=str(out), BENCH_MODE="die", OMP_NUM_THREADS="1")
        procs = _agents(tool, script, _free_port(), env, "2")
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                again = [s for s in _stamps(out) if s[0] == "1"]
                if len({s[1] for s in again}) == 4:
                    death = float(Path(str(out) + ".death").read_text())
                    return max(s[2] for s in again) - death
                if all(p.poll() is not None for p in procs):
                    return None
                time.sleep(0.02)
            return None
        finally:
            _stop(procs)


def node_loss(timeout: float) -> float | None:
    """SIGKILL one rallypoint agent -> the survivor's workers passed an all_reduce alone."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        out = Path(tmp) / "stamps"
        env = dict(os.environ, BENCH_OUT=str(out), BENCH_MODE="loss", OMP_NUM_THREADS="1")
        # the rendezvous store lives here, not in the agent that gets killed
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        procs = _agents("rallypoint", script, store.port, env, "1:2", is_host="false")
        deadline = time.monotonic() + timeout
        try:
            while len([s for s in _stamps(out) if s[3] == "2"]) < 4:
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.02)
            os.killpg(procs[1].pid, signal.SIGKILL)
            killed = time.time()
            while time.monotonic() < deadline:
                alone = [s for s in _stamps(out) if s[3] == "1"]
                if len(alone) == 2:
                    return max(s[2] for s in alone) - killed
                time.sleep(0.02)
            return None
        finally:
            _stop(procs)


def _fmt(values: list[float | None]) -> str:
    done = [v for v in values if v is not None]
    if not done:
        return "did not recover"
    text = f"{statistics.median(done):.2f}"
    if len(done) < len(values):
        text += f" ({len(values) - len(done)} of {len(values)} did not recover)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per run")
    parser.add_argument("--skip-torchrun", action="store_true")
    args = parser.parse_args()
    ours = [recovery("rallypoint", args.timeout) for _ in range(args.repeat)]
    theirs: list[float | None] = []
    if not args.skip_torchrun:
        theirs = [recovery("torchrun", args.timeout) for _ in range(args.repeat)]
    loss = [node_loss(args.timeout) for _ in range(args.repeat)]
    print("| measurement (2 nodes x 2 workers, loopback) | rallypoint (s) | torchrun (s) | ratio |")
    print("|---|---|---|---|")
    ratio = "-"
    done_ours = [v for v in ours if v is not None]
    done_theirs = [v for v in theirs if v is not None]
    if done_ours and done_theirs:
        ratio = f"{statistics.median(done_theirs) / statistics.median(done_ours):.1f}x"
    print(
        f"| worker death -> every rank past the next first all_reduce | {_fmt(ours)} | "
        f"{_fmt(theirs) if theirs else 'skipped'} | {ratio} |"
    )
    print(
        f"| agent SIGKILLed -> survivor past an all_reduce alone (keep-alive 0.5 s x 3) | "
        f"{_fmt(loss)} | - | - |"
    )
    print(f"\nrepeats: {args.repeat}; raw rallypoint {ours}, torchrun {theirs}, loss {loss}")


if __name__ == "__main__":
    main()
