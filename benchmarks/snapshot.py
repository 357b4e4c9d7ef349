"""Benchmark: rallypoint.snapshot vs torch.save/torch.load and torch.distributed.checkpoint.

A model whose training state (parameters + AdamW's two moments) is about 256 MiB, trained
under ``rallypoint run`` on this machine's CPU. Measured in the same run:

1. **A step with a save every step**, relative to the same step without one (modes
   interleaved in rounds, in one worker, so load on the machine hits all alike):
   ``rallypoint.snapshot.save``; ``torch.save`` to a local file; DCP ``save`` (sync) and
   ``async_save`` (waiting for the previous one before the next, as DCP requires; the
   last step of each turn also waits for its own save's background part). The
   step is forward + backward + AdamW on a batch chosen so that one step takes about
   ``--step-seconds`` (default 2 s): a realistic step for a model of this size on this
   CPU. ``save()`` itself (the staging copy into the node's shared memory) is timed too:
   the 1.05x bar holds for steps of at least 20x that.
2. The same with two nodes on loopback (data parallel, world 2): the snapshot is also
   replicated to the other node, on the same two cores.
3. **Restore after a worker crash** (one node, the worker SIGKILLed, ``--max-restarts 1``):
   ``snapshot.restore`` (the node's memory), ``torch.load`` + ``load_state_dict`` of the
   file written before the crash (warm page cache), DCP ``load``.
4. **Restore after a node loss** (two nodes on loopback; one node SIGKILLed, a
   replacement started): ``snapshot.restore`` on the replacement (the replica, fetched
   from the surviving node) and on the survivor (its own memory). Time from the last
   rank's arrival in ``restore`` to the end of each rank's.

    .venv/bin/python benchmarks/snapshot.py --plot docs/img/snapshot.png
    .venv/bin/python benchmarks/snapshot.py --mib 64 --rounds 2        # quicker
"""

from __future__ import annotations

import argparse
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
from typing import Any

WORKER = r'''
import json, os, signal, sys, time
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from rallypoint import snapshot
from rallypoint._snapshot import _api, _node   # imported before anything is timed

cfg = json.loads(os.environ["BENCH_CFG"])
out = cfg["out"]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
H, L = cfg["hidden"], cfg["layers"]

def fresh():
    """A new model and optimizer (no optimizer state yet), as a restarted worker has."""
    global model, opt, state
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(H, H) for _ in range(L)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optimizer": opt}

fresh()

def step(batch):
    x = torch.randn(batch, H)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()

def nbytes():
    sd = {"m": model.state_dict(), "o": opt.state_dict()["state"]}
    total = 0
    def walk(v):
        nonlocal total
        if isinstance(v, torch.Tensor): total += v.numel() * v.element_size()
        elif isinstance(v, dict): [walk(x) for x in v.values()]
    walk(sd)
    return total

def dcp_state():
    """DCP's way: model and optimizer state dicts from get_state_dict (which also gives
    a fresh optimizer its state, so that a load has tensors to load into)."""
    model_sd, opt_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optimizer": opt_sd}

def record(name, value):
    with open(os.path.join(out, f"{name}-{rank}-{os.getpid()}.json"), "w") as fp:
        json.dump(value, fp)

phase = cfg["phase"]
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if phase == "steps":
    step(8)                                   # AdamW's state exists from here on
    batch = cfg["batch"]
    for _ in range(3 if cfg["calibrate"] else 0):  # the first steps at a size run slow
        trial = []
        for _ in range(3):
            t = time.perf_counter(); step(batch); trial.append(time.perf_counter() - t)
        batch = max(8, int(batch * cfg["step_seconds"] / sorted(trial)[1]))
    modes = cfg["modes"]
    times = {m: [] for m in modes}
    first = []
    for counter in (1, 2):                   # the first save into each slot allocates it
        s0 = time.perf_counter()
        snapshot.save(state, step=counter)
        first.append(time.perf_counter() - s0)
    snapshot.wait()
    staging, pending = [], None
    for r in range(cfg["rounds"]):
        for m in modes:
            for k in range(cfg["steps"]):
                counter += 1
                t0 = time.perf_counter()
                step(batch)
                if m == "snapshot":
                    s0 = time.perf_counter(); snapshot.save(state, step=counter)
                    staging.append(time.perf_counter() - s0)
                elif m == "torch.save":
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                               os.path.join(out, f"ts-{rank}.pt"))
                elif m == "dcp":
                    dcp.save(dcp_state(), checkpoint_id=os.path.join(out, "dcp"),
                             no_dist=world == 1)
                elif m == "dcp-async":
                    if pending is not None:
                        pending.result()
                    where = os.path.join(out, f"dcpa-{counter % 2}")
                    pending = dcp.async_save(dcp_state(), checkpoint_id=where, no_dist=world == 1)
                if k == cfg["steps"] - 1:   # the block's last step also waits for its save's
                    if m == "dcp-async":    # background part, so every save's is counted
                        pending.result(); pending = None
                    if m == "snapshot":
                        snapshot.wait()
                times[m].append(time.perf_counter() - t0)
    record("steps", {"times": times, "staging": staging, "first": first, "batch": batch,
                     "bytes": nbytes()})
elif phase == "crash":
    if restart == 0:
        step(8)
        snapshot.save(state, step=1)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(out, "crash.pt"))
        dcp.save(dcp_state(), checkpoint_id=os.path.join(out, "crash-dcp"), no_dist=True)
        snapshot.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    got = {}                                 # each from fresh objects, as after a restart
    t = time.perf_counter()
    assert snapshot.restore(state) == 1
    got["snapshot"] = time.perf_counter() - t
    fresh()
    t = time.perf_counter()
    sd = torch.load(os.path.join(out, "crash.pt"))
    model.load_state_dict(sd["model"]); opt.load_state_dict(sd["optimizer"])
    got["torch.load"] = time.perf_counter() - t
    fresh()
    t = time.perf_counter()
    target = dcp_state()
    dcp.load(target, checkpoint_id=os.path.join(out, "crash-dcp"), no_dist=True)
    set_state_dict(model, opt, model_state_dict=target["model"],
                   optim_state_dict=target["optimizer"])
    got["dcp"] = time.perf_counter() - t
    record("crash", got)
elif phase == "loss":
    marker = os.path.join(out, "lost")
    if not os.path.exists(marker):
        step(8)
        snapshot.save(state, step=1)
        snapshot.wait()
        if rank == world - 1:
            with open(marker + ".tmp", "w") as fp:
                fp.write(str(os.getpid()))
            os.replace(marker + ".tmp", marker)
        time.sleep(600)
    enter = time.time(); got = snapshot.restore(state); leave = time.time()
    record("loss", {"enter": enter, "leave": leave, "step": got, "rank": rank})
dist.destroy_process_group()
'''


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """Layers of H x H (+ bias) so that parameters + AdamW's two moments make ``--mib``."""
    hidden = args.hidden
    per_layer = (hidden * hidden + hidden) * 4 * 3
    layers = max(1, round(args.mib * 2**20 / per_layer))
    return {"hidden": hidden, "layers": layers, "batch": args.batch, "rounds": args.rounds,
            "steps": args.steps, "step_seconds": args.step_seconds, "calibrate": True}  # fmt: skip


def _agent(
    script: Path, cfg: dict[str, Any], nproc: int, extra: list[str], endpoint: str = ""
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", str(nproc)]
    if endpoint:
        conf = "is_host=false,keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=1"
        cmd += ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                "--rdzv-id", f"bench-{cfg['phase']}", "--rdzv-conf", conf]  # fmt: skip
    cmd += [*extra, "--shutdown-timeout", "3", str(script)]
    env = {**os.environ, "BENCH_CFG": json.dumps(cfg), "OMP_NUM_THREADS": str(cfg["threads"])}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def _wait(procs: list[subprocess.Popen[str]], timeout: float = 1800) -> None:
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"benchmark job failed:\n{text[-4000:]}")


def _read(out: Path, name: str) -> list[Any]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-*.json"))]


def _store() -> tuple[Any, str]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return store, f"127.0.0.1:{store.port}"


def run_steps(script: Path, base: dict[str, Any], work: Path, nodes: int) -> dict[str, Any]:
    out = work / f"steps{nodes}"
    out.mkdir()
    modes = (
        ["none", "snapshot", "torch.save", "dcp", "dcp-async"]
        if nodes == 1
        else ["none", "snapshot"]
    )
    cfg = {**base, "phase": "steps", "out": str(out), "modes": modes, "threads": 2 // nodes}
    if nodes == 1:
        _wait([_agent(script, cfg, 1, [])])
    else:
        store, endpoint = _store()
        _wait([_agent(script, cfg, 1, [], endpoint) for _ in range(2)])
        del store
    return _read(out, "steps")[0]


def run_crash(script: Path, base: dict[str, Any], work: Path) -> dict[str, float]:
    out = work / "crash"
    out.mkdir()
    cfg = {**base, "phase": "crash", "out": str(out), "threads": 2}
    _wait([_agent(script, cfg, 1, ["--max-restarts", "1"])])
    result: dict[str, float] = _read(out, "crash")[0]
    return result


def run_loss(script: Path, base: dict[str, Any], work: Path) -> dict[str, float]:
    import psutil

    out = work / "loss"
    out.mkdir()
    cfg = {**base, "phase": "loss", "out": str(out), "threads": 1}
    store, endpoint = _store()
    agents = [_agent(script, cfg, 1, [], endpoint) for _ in range(2)]
    marker = out / "lost"
    deadline = time.monotonic() + 600
    while not marker.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the node-loss job did not reach its first snapshot")
        time.sleep(0.05)
    pid = int(marker.read_text())
    lost = next(a for a in agents if pid in {c.pid for c in psutil.Process(a.pid).children(True)})
    for p in [psutil.Process(lost.pid), *psutil.Process(lost.pid).children(True)]:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    lost.communicate()
    replacement = _agent(script, cfg, 1, [], endpoint)
    _wait([a for a in agents if a is not lost] + [replacement])
    del store
    records = _read(out, "loss")
    arrived = max(r["enter"] for r in records)
    by_rank = {r["rank"]: r["leave"] - arrived for r in records}
    return {"replacement (fetched from the peer)": by_rank[1], "survivor (own node)": by_rank[0]}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _paired(xs: list[float], base: list[float]) -> float:
    """The median of step i with a save over step i without (the same round and position:
    the modes run in turns, so the pair saw about the same load)."""
    return _median([x / b for x, b in zip(xs, base, strict=True)])


def report(steps1: dict[str, Any], steps2: dict[str, Any], crash: dict[str, float],
           loss: dict[str, float]) -> str:  # fmt: skip
    mib = steps1["bytes"] / 2**20
    base = _median(steps1["times"]["none"])
    stage = _median(steps1["staging"])
    lines = [
        f"state {mib:.0f} MiB, batch {steps1['batch']}, step without a save {base:.3f} s "
        f"(median of {len(steps1['times']['none'])}); snapshot.save() itself {stage * 1000:.0f} ms "
        f"(the 1.05x bar holds for steps >= {20 * stage:.2f} s; the first save into each of "
        f"the two slots, which allocates them: {', '.join(f'{x:.2f}' for x in steps1['first'])} s)",
        "",
        "| a step with a save every step (one node) | median step (s) | vs no save (medians) "
        "| paired median ratio | fastest step vs fastest without |",
        "|---|---|---|---|---|",
    ]
    none1 = steps1["times"]["none"]
    for mode, xs in steps1["times"].items():
        lines.append(
            f"| {mode} | {_median(xs):.3f} | {_median(xs) / base:.3f}x | "
            f"{_paired(xs, none1):.3f}x | {min(xs) / min(none1):.3f}x |"
        )
    base2 = _median(steps2["times"]["none"])
    snap2 = _median(steps2["times"]["snapshot"])
    lines += [
        "",
        f"two nodes on loopback (world 2, replicated): step {base2:.3f} s, with snapshot.save "
        f"every step {snap2:.3f} s ({snap2 / base2:.3f}x; paired median ratio "
        f"{_paired(steps2['times']['snapshot'], steps2['times']['none']):.3f}x)",
        "",
        "| restore of the whole state | seconds |",
        "|---|---|",
    ]
    for name, secs in crash.items():
        lines.append(f"| worker crash: {name} | {secs:.3f} |")
    for name, secs in loss.items():
        lines.append(f"| node loss: snapshot.restore on the {name} | {secs:.3f} |")
    return "\n".join(lines)


def plot(
    steps1: dict[str, Any], crash: dict[str, float], loss: dict[str, float], path: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    base = _median(steps1["times"]["none"])
    modes = [m for m in steps1["times"] if m != "none"]
    ratios = [_median(steps1["times"][m]) / base for m in modes]
    bars = left.bar(modes, ratios, color=["tab:green"] + ["tab:gray"] * (len(modes) - 1))
    left.bar_label(bars, fmt="%.2fx")
    left.axhline(1.05, color="tab:red", linestyle="--", linewidth=1, label="1.05x bar")
    left.set_ylabel("step time / step without a save")
    left.set_title(f"save every step ({steps1['bytes'] / 2**20:.0f} MiB state)")
    left.legend()
    names = [f"crash:\n{k}" for k in crash] + ["loss:\nreplacement", "loss:\nsurvivor"]
    values = [*crash.values(), *loss.values()]
    colors = ["tab:green" if "snapshot" in n or "loss" in n else "tab:gray" for n in names]
    bars = right.bar(names, values, color=colors)
    right.bar_label(bars, fmt="%.2f s")
    right.axhline(0.5, color="tab:red", linestyle="--", linewidth=1, label="0.5 s (crash)")
    right.axhline(2.0, color="tab:orange", linestyle=":", linewidth=1, label="2 s (node loss)")
    right.legend(fontsize=8)
    right.set_ylabel("seconds")
    right.set_title("restore")
    right.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=256, help="training state size (MiB)")
    parser.add_argument("--hidden", type=int, default=2364, help="4 layers make 256 MiB")
    parser.add_argument("--batch", type=int, default=64, help="first guess; calibrated")
    parser.add_argument("--step-seconds", type=float, default=2.0, help="target step length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per mode per round")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="write the raw numbers")
    args = parser.parse_args()
    base = _config(args)
    print(f"load average at the start: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory(prefix="rp-snapbench-") as tmp:
        work = Path(tmp)
        script = work / "worker.py"
        script.write_text(WORKER)
        steps1 = run_steps(script, base, work, 1)
        half = {**base, "batch": max(8, steps1["batch"] // 2), "calibrate": False}
        steps2 = run_steps(script, half, work, 2)
        crash = run_crash(script, base, work)
        loss = run_loss(script, base, work)
    loads = os.getloadavg()
    print(report(steps1, steps2, crash, loss))
    print(f"load average at the end (1, 5, 15 min): {loads[0]:.1f} {loads[1]:.1f} {loads[2]:.1f}")
    if args.json:
        raw = {"steps1": steps1, "steps2": steps2, "crash": crash, "loss": loss}
        Path(args.json).write_text(json.dumps(raw, indent=1))
    if args.plot:
        plot(steps1, crash, loss, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
