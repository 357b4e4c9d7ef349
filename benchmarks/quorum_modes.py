"""``benchmarks/quorum.py --steady`` and ``--scale G``: the quorum's steady cost and its scale.

``--steady``: 3 groups of one rank, the tiny MLP of quorum.py, no sleep and no fault; the
median step of plain torch DDP over gloo (3 ranks, no quorum), of torchft 0.2.0 and of
rallypoint.ft, in one run, each over the second half of its ``--rounds`` steps (2,000 for
a steady state). ``--steady --cpu``: also the CPU each stack spends a step, by process and
by thread (psutil, over 4 s of that half): where its cost goes.

``--scale G``: G members ask for a quorum every round through the coordination API
(``LighthouseClient.quorum``), hosted as threads by two processes, against torchft's Rust
lighthouse and against ``rallypoint lighthouse`` (``--min_replicas G``, so every round
holds every member): rounds per second and each member's median wait for its quorum.
``--scale G --store etcd``: the same, ``rallypoint lighthouse --store etcd://`` (a real
etcd, Debian's ``etcd-server``) against ``rallypoint lighthouse`` on its own TCPStore;
torchft's lighthouse has no etcd.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ports import free_port

DDP = """
import os, sys, time
import torch, torch.distributed as dist
OUT, STEPS = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
rank = dist.get_rank()
with open(f"{OUT}/steps-{rank}", "w", buffering=1) as log:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
        log.write(f"{time.time()!r} {step + 1}\\n")
dist.barrier()
dist.destroy_process_group()
"""

MEMBERS = """
import importlib, json, statistics, sys, threading, time
from datetime import timedelta
coordination = importlib.import_module(sys.argv[1])
addr, first, count, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
client = coordination.LighthouseClient(addr, timedelta(seconds=30))
waits, ends = [], []
def member(i):
    for step in range(rounds):
        t = time.perf_counter()
        client.quorum(replica_id=f"m{i}", timeout=timedelta(seconds=120), step=step, world_size=1)
        waits.append(time.perf_counter() - t)
        if step == 0:
            ends.append(("first", time.time()))
    ends.append(("last", time.time()))
threads = [threading.Thread(target=member, args=(i,)) for i in range(first, first + count)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"waits": waits, "first": max(t for k, t in ends if k == "first"),
                  "last": max(t for k, t in ends if k == "last")}))
"""


def steady(steps: int, cpu: dict[str, dict[str, float]] | None = None) -> dict[str, float]:
    """The median step (seconds) of each stack over the second half of ``steps`` (the first
    holds the start: rallypoint's warm process imports what later steps may need, torch's
    first steps warm up), in one run; into ``cpu``, when given, each stack's CPU
    milliseconds a step by part (:func:`_cpu_per_step`)."""
    from quorum import WORKER, _group, _lighthouse

    out: dict[str, float] = {}
    tmp = Path(tempfile.mkdtemp(prefix="rp-steady-"))
    ddp = tmp / "ddp.py"
    ddp.write_text(DDP)
    (tmp / "ddp").mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--nproc-per-node", "3",
           str(ddp), str(tmp / "ddp"), str(steps)]  # fmt: skip
    # torch 2.13's gloo ranks sometimes abort in destroy_process_group after the last step
    # ("terminate called without an active exception"): the steps logged are what counts
    ranks = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    if cpu is not None:
        cpu["plain DDP"] = _cpu_per_step(tmp / "ddp", steps, [ranks.pid])
    ranks.wait(timeout=600)
    for rank in range(3):
        logged = (tmp / "ddp" / f"steps-{rank}").read_text().splitlines()
        assert len(logged) == steps, f"plain DDP rank {rank} logged {len(logged)} of {steps} steps"
    out["plain DDP"] = _median_step(tmp / "ddp", 3, skip=steps // 2)
    worker = WORKER.replace("time.sleep(0.15)", "pass").replace(
        "manager.current_step() >= FAULT", "False"
    )
    for kind in ("torchft", "rallypoint"):
        run = tmp / kind
        run.mkdir()
        script = run / "worker.py"
        script.write_text(worker)
        port = free_port()
        house = _lighthouse(kind, port, ["--min_replicas", "3"])  # every step holds all 3
        time.sleep(1.0)
        groups = [_group(kind, g, port, script, run, (steps, steps)) for g in range(3)]
        name = "torchft" if kind == "torchft" else "rallypoint.ft"
        try:
            if cpu is not None:
                cpu[name] = _cpu_per_step(run, steps, [p.pid for p in groups], house.pid)
            for p in groups:
                p.wait(timeout=600)
        finally:
            for p in groups:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            house.kill()
            house.wait()
        out[name] = _median_step(run, 3, skip=steps // 2)
    return out


def _cpu_per_step(
    out: Path, steps: int, launchers: list[int], lighthouse: int = 0
) -> dict[str, float]:
    """CPU milliseconds a step, from half of ``steps`` to 80% of them or for 4 s,
    whichever ends first (as logged in ``out``'s ``steps-<rank>``), by part: the
    lighthouse; the launchers with their processes outside the collectives (agents, warm
    processes); and the ranks: their main threads, gloo's threads, their other threads."""
    import psutil

    def logged() -> int:
        files = [out / f"steps-{r}" for r in range(3)]
        return min(len(f.read_text().splitlines()) if f.exists() else 0 for f in files)

    def sample() -> dict[str, float]:
        parts: dict[str, float] = {}
        roots = [psutil.Process(pid) for pid in launchers]
        procs = [(q, "launchers") for p in roots for q in [p, *p.children(recursive=True)]]
        procs += [(psutil.Process(lighthouse), "lighthouse")] if lighthouse else []
        for proc, part in procs:
            with contextlib.suppress(psutil.Error):
                threads = [(t, _comm(proc.pid, t.id)) for t in proc.threads()]
                rank = part == "launchers" and any("gloo" in comm for _, comm in threads)
                for t, comm in threads:
                    name = part
                    if rank:  # a process in the collectives
                        kind = "gloo" if "gloo" in comm else "other"
                        name = f"ranks: {'main' if t.id == proc.pid else kind} thread(s)"
                    parts[name] = parts.get(name, 0.0) + t.user_time + t.system_time
        return parts

    deadline = time.monotonic() + 300
    while logged() < steps // 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    before, first, t0 = sample(), logged(), time.monotonic()
    while logged() < 0.8 * steps and time.monotonic() - t0 < 4.0:
        time.sleep(0.05)
    after, done = sample(), logged() - first
    per = {k: 1000 * (after[k] - before.get(k, 0.0)) / max(1, done) for k in after}
    per["all"] = sum(per.values())
    per["wall ms a step"] = 1000 * (time.monotonic() - t0) / max(1, done)
    return per


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def _median_step(out: Path, groups: int, skip: int) -> float:
    gaps = []
    for g in range(groups):
        times = [
            float(line.split()[0])
            for line in (out / f"steps-{g}").read_text().splitlines()
            if line.split()[1] != "fault"
        ]
        gaps += [b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False)]
    return statistics.median(gaps)


def scale(
    members: int, rounds: int, store: str = "", second_first: bool = False
) -> dict[str, dict[str, float]]:
    """Rounds per second and the median wait, per lighthouse, ``members`` in two processes
    (``store="etcd"``: rallypoint's over etcd against rallypoint's over its TCPStore), the
    second of the two run first with ``second_first``."""
    if store != "etcd":
        both = {"torchft": ("torchft", ""), "rallypoint": ("rallypoint", "")}
        return _in_order(both, members, rounds, second_first)
    from rallypoint.testing._etcd import EtcdServer

    with EtcdServer() as etcd:
        both = {
            "rallypoint, TCPStore": ("rallypoint", ""),
            "rallypoint, etcd": ("rallypoint", etcd.endpoint),
        }
        return _in_order(both, members, rounds, second_first)


def _in_order(
    both: dict[str, tuple[str, str]], members: int, rounds: int, second_first: bool
) -> dict[str, dict[str, float]]:
    """Each of ``both`` (name: kind and etcd endpoint) measured, in the order asked for."""
    names = list(both)
    ran = {
        name: _scale_one(both[name][0], members, rounds, both[name][1])
        for name in (names[::-1] if second_first else names)
    }
    return {name: ran[name] for name in names}


def _scale_one(kind: str, members: int, rounds: int, etcd: str = "") -> dict[str, float]:
    port = free_port()
    if kind == "torchft":
        cmd = [str(Path(sys.executable).with_name("torchft_lighthouse"))]
        module = "torchft.coordination"
    else:
        cmd = [sys.executable, "-m", "rallypoint", "lighthouse"]
        module = "rallypoint.ft.coordination"
    cmd += ["--min_replicas", str(members), "--bind", f"[::]:{port}",
            "--join_timeout_ms", "60000"]  # fmt: skip
    address = f"http://localhost:{port}"
    if etcd:
        address = f"etcd://{etcd}/scale{port}"
        cmd += ["--store", address]
    house = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    half = members // 2
    hosts = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                MEMBERS,
                module,
                address,
                str(first),
                str(count),
                str(rounds),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for first, count in ((0, half), (half, members - half))
    ]
    try:
        outs = [json.loads(h.communicate(timeout=900)[0]) for h in hosts]
    finally:
        house.kill()
        house.wait()
    waits = [w for o in outs for w in o["waits"][1:]]
    began = max(o["first"] for o in outs)
    ended = max(o["last"] for o in outs)
    return {
        "rounds/s": (rounds - 1) / (ended - began),
        "median wait ms": 1000 * statistics.median(waits),
    }


def growth(rounds: int) -> dict[str, float]:
    """4 members, ``rounds`` rounds against a ``rallypoint lighthouse`` process: its store's
    keys and its resident memory after 100 rounds and at the end."""
    import threading
    from datetime import timedelta

    import psutil

    from rallypoint.ft.coordination import LighthouseClient
    from rallypoint.rendezvous import connect_kv

    port = free_port()
    house = subprocess.Popen(
        [sys.executable, "-m", "rallypoint", "lighthouse", "--min_replicas", "4",
         "--bind", f"[::]:{port}", "--join_timeout_ms", "60000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(1.5)
    address = f"http://localhost:{port}"
    client = LighthouseClient(address, timedelta(seconds=30))
    kv, _ = connect_kv(address, timeout=timedelta(seconds=30))
    out: dict[str, float] = {}

    def run(first: int, last: int) -> None:
        def member(i: int) -> None:
            for step in range(first, last):
                client.quorum(f"m{i}", timedelta(seconds=60), step=step, world_size=1)

        threads = [threading.Thread(target=member, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    try:
        run(0, 100)
        time.sleep(1.0)  # the lighthouse deletes on a thread of its own: let it catch up
        out["keys at 100"] = kv.store.num_keys()  # type: ignore[attr-defined]
        out["rss MB at 100"] = psutil.Process(house.pid).memory_info().rss / 2**20
        run(100, rounds)
        time.sleep(1.0)
        out[f"keys at {rounds}"] = kv.store.num_keys()  # type: ignore[attr-defined]
        out[f"rss MB at {rounds}"] = psutil.Process(house.pid).memory_info().rss / 2**20
    finally:
        client.close()
        house.kill()
        house.wait()
    return out
