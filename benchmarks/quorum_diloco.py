"""``benchmarks/quorum.py --diloco``: DiLoCo across replica groups, rallypoint.ft against
torchft 0.2.0 in one run: the same program, written against torchft's API
(``Manager(use_async_quorum=False)``, ``local_sgd.DiLoCo``), with only its import changed.

3 groups of one rank, gloo on CPU, a model of 100 MB (6 bias-free 2048 x 2048 linear
layers; its inner step a fixed gradient and plain SGD, 0.05 s of sleep standing for the
compute), ``sync_every`` 4, one fragment; each group is a ``torchrun`` (torchft) or a
``rallypoint run`` under its stack's lighthouse.

- ``sync``: no fault, ``--min_replicas 3``, ``fragment_sync_delay`` 0. A sync is the inner
  step that runs it (quorum, allreduce of the pseudo-gradients, commit, outer step), less
  the median inner step that does not; the median over the groups' syncs after the first 2.
- ``fault``: ``--min_replicas 2``, ``fragment_sync_delay`` 1; group 1's first process
  SIGKILLs itself mid-sync at outer step 3 (its quorum asked and its average sent, before
  the commit). The others' longest gap between outer steps from the fault on, and the
  failed group's return: from the fault to its first outer step in a new process.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ports import free_port

WORKER = """
import importlib, os, signal, sys, time
from datetime import timedelta
import torch

IMPL = os.environ["FT_IMPL"]
torchft = importlib.import_module(IMPL)
local_sgd = importlib.import_module(IMPL + ".local_sgd")
OUT, SYNCS, MB, KILL, DELAY = sys.argv[1], *map(int, sys.argv[2:6])
GROUP = int(os.environ["REPLICA_GROUP_ID"])
FIRST = not os.path.exists(f"{OUT}/started-{GROUP}")
open(f"{OUT}/started-{GROUP}", "a").close()
SYNC_EVERY, WIDTH = 4, 2048
torch.manual_seed(0)
layers = max(1, round(MB * 1e6 / 4 / WIDTH**2))
model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
grads = [torch.full_like(p, 1e-4 * (GROUP + 1)) for p in model.parameters()]
inner = torch.optim.SGD(model.parameters(), lr=0.1)
outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
manager = torchft.Manager(
    pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
    load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
    state_dict=lambda: {"model": model.state_dict()},
    replica_id=str(GROUP), timeout=timedelta(seconds=10), use_async_quorum=False,
)
diloco = local_sgd.DiLoCo(manager, [model], inner, outer, sync_every=SYNC_EVERY,
                          pin_memory=False, fragment_sync_delay=DELAY)
with diloco, open(f"{OUT}/steps-{GROUP}", "a", buffering=1) as log:
    while manager.current_step() < SYNCS:
        step = manager.current_step()
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        t = time.perf_counter()
        inner.step()
        took = time.perf_counter() - t
        now = manager.current_step()
        log.write(f"{time.time()!r} {now} {took!r} {int(now > step)} {os.getpid()}\\n")
        mid_sync = DELAY and diloco._local_step == SYNC_EVERY - DELAY
        if FIRST and GROUP == 1 and 0 <= KILL <= now and mid_sync:
            log.write(f"{time.time()!r} fault\\n")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
manager.shutdown()
"""


def _run(kind: str, mode: str, mb: int, timeout: float) -> Path:
    """Run the 3 groups of one stack; the folder with their step logs."""
    from quorum import _group, _lighthouse

    out = Path(tempfile.mkdtemp(prefix=f"rp-diloco-{kind}-{mode}-"))
    (out / "worker.py").write_text(WORKER)
    port = free_port()
    house = _lighthouse(kind, port, ["--min_replicas", "3" if mode == "sync" else "2"])
    time.sleep(1.0)
    args = (10, mb, -1, 0) if mode == "sync" else (10, mb, 3, 1)
    groups = [_group(kind, g, port, out / "worker.py", out, args) for g in range(3)]
    deadline = time.monotonic() + timeout
    try:
        for p in groups:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        (out / "timed-out").touch()
    finally:
        for p in groups:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        house.kill()
        house.wait()
    return out


def _rows(out: Path, group: int) -> tuple[list[tuple[float, int, float, int, str]], float | None]:
    """``(time, outer step, inner step's seconds, whether it synced, pid)``, and the fault."""
    rows, fault = [], None
    path = out / f"steps-{group}"
    for line in path.read_text().splitlines() if path.exists() else []:
        f = line.split()
        if f[1] == "fault":
            fault = float(f[0])
        else:
            rows.append((float(f[0]), int(f[1]), float(f[2]), int(f[3]), f[4]))
    return rows, fault


def sync_time(kind: str, mb: int, timeout: float = 300.0) -> dict[str, object]:
    """The median sync (seconds) over the 3 groups' syncs after their first 2."""
    out = _run(kind, "sync", mb, timeout)
    syncs: list[float] = []
    last = []
    for g in range(3):
        rows, _ = _rows(out, g)
        plain = statistics.median([r[2] for r in rows if not r[3]] or [0.0])
        syncs += [r[2] - plain for r in rows if r[3]][2:]
        last.append(rows[-1][1] if rows else None)
    if not syncs:
        return {"note": f"no sync (outer steps {last}); logs in {out}"}
    shutil.rmtree(out, ignore_errors=True)
    return {"sync": statistics.median(syncs), "syncs": len(syncs), "ends": last}


def fault(kind: str, mb: int, timeout: float = 300.0) -> dict[str, object]:
    """The others' longest pause from the fault on, and the failed group's return."""
    out = _run(kind, "fault", mb, timeout)
    rows1, at = _rows(out, 1)
    if at is None:
        return {"note": f"the fault never came; logs in {out}"}
    pauses = []
    for g in (0, 2):
        times = [r[0] for r in _rows(out, g)[0] if r[3]]  # the outer steps
        pauses += [b - a for a, b in itertools.pairwise(times) if b > at]
    back = [r for r in rows1 if r[0] > at and r[3]]
    ends = [(_rows(out, g)[0] or [(0, None)])[-1][1] for g in range(3)]
    if not back or not pauses:
        return {"note": f"no pause or no return (outer steps {ends}); logs in {out}"}
    shutil.rmtree(out, ignore_errors=True)
    return {"pause": max(pauses), "back": back[0][0] - at, "ends": ends}


def diloco(repeat: int, mb: int) -> None:
    """Both measures for each stack, stacks alternated by repeat; a table of medians."""
    kinds = ["torchft", "rallypoint"]
    found: dict[str, dict[str, list[dict[str, object]]]] = {
        k: {"sync": [], "fault": []} for k in kinds
    }
    for r in range(repeat):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            for mode, measure in (("sync", sync_time), ("fault", fault)):
                result = measure(kind, mb)
                found[kind][mode].append(result)
                print(f"  {kind} {mode}: {result}", file=sys.stderr, flush=True)
    print(f"\n{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; 3 groups x 1 rank, gloo, "
          f"a {mb} MB model, DiLoCo sync_every 4\n")  # fmt: skip
    print("| stack | a sync (median) | others' longest pause, a group killed mid-sync "
          "| the killed group back | runs |")  # fmt: skip
    print("| --- | --- | --- | --- | --- |")
    table = {}
    for kind in kinds:
        syncs = [float(x["sync"]) for x in found[kind]["sync"] if "sync" in x]  # type: ignore[arg-type]
        faults = found[kind]["fault"]
        pauses = [float(x["pause"]) for x in faults if "pause" in x]  # type: ignore[arg-type]
        backs = [float(x["back"]) for x in faults if x.get("back") is not None]  # type: ignore[arg-type]
        table[kind] = [statistics.median(v) if v else float("nan") for v in (syncs, pauses, backs)]
        s, p, b = table[kind]
        runs = f"{len(syncs)} + {len(backs)} of {repeat} + {repeat}"
        print(f"| {kind} | {s:.2f} s ({_all(syncs)}) | {p:.2f} s ({_all(pauses)}) | "
              f"{b:.2f} s ({_all(backs)}) | {runs} |")  # fmt: skip
    ft, rp = table["torchft"], table["rallypoint"]
    print(f"\nrallypoint / torchft: sync {rp[0] / ft[0]:.2f}, pause {rp[1] / ft[1]:.2f}, "
          f"back {rp[2] / ft[2]:.2f}")  # fmt: skip


def _all(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) or "none"
