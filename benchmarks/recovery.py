"""Benchmark: multi-node recovery after a worker dies, a node dies, or the rendezvous
store loses a member or its host (rallypoint vs torchrun, c10d vs etcd, same run).

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

A spare takes over (``--sections spare``): ``--nnodes 2:2``, one worker per node, the
rendezvous store hosted by this script; a third agent starts once both nodes train and
waits as a spare; then one member's agent is SIGKILLed. The time is from the kill until
both ranks of the next world (the survivor's and the spare's) have passed an all_reduce;
torchrun in the same scenario, with ``--max-restarts 1``.

    .venv/bin/python benchmarks/recovery.py --sections spare --repeat 3 --timeout 60

No single point of failure (``--sections spof``): three nodes x one worker train in a loop
(``rallypoint.testing.training_log``: gloo all_reduces, each step's time logged) on a
3-member etcd cluster (loopback; 500 ms election timeout), and lose
- the etcd leader (SIGKILL; the nodes talk to it),
- the etcd leader's link (network namespaces: etcd on three fake hosts, two training
  hosts; needs root, else skipped),
- a training node (the one whose group rank 0 hosts the workers' store; SIGKILL of its
  agent and workers);
the time is from the loss until every rank has logged a step after it (a job that never
stops shows one step time). The same three nodes on the c10d backend then lose the node
hosting the TCPStore: the job ends, as torchrun's does (time until every other agent
exited, and how).

    .venv/bin/python benchmarks/recovery.py --sections spof --repeat 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src")]

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
if mode in ("loss", "spare") and nodes == "2":
    while True:          # keep the collective going until a node is lost
        dist.all_reduce(t)
        time.sleep(0.01)
dist.barrier()
dist.destroy_process_group()
"""


def _agents(
    tool: str,
    script: Path,
    port: int,
    env: dict[str, str],
    nnodes: str,
    is_host: str = "",
    count: int = 2,
    nproc: int = 2,
) -> list[Any]:
    procs = []
    for _ in range(count):
        if tool == "rallypoint":
            cmd = [sys.executable, "-m", "rallypoint", "run"]
            conf = "last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=3"
            conf += f",is_host={is_host}" if is_host else ""
            extra = ["--rdzv-conf", conf, "--shutdown-timeout", "2"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run"]
            conf = "last_call_timeout=1" + (f",is_host={is_host}" if is_host else "")
            extra = ["--rdzv-conf", conf]
        cmd += [
            "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
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
        procs = _agents(tool, script, free_port(), env, "2")
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


def spare_takes_over(tool: str, timeout: float) -> float | None:
    """``--nnodes 2:2`` and a third agent (a spare); SIGKILL a member -> both ranks of the
    next world (the survivor's and the spare's) passed an all_reduce."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        out = Path(tmp) / "stamps"
        env = dict(os.environ, BENCH_OUT=str(out), BENCH_MODE="spare", OMP_NUM_THREADS="1")
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        run = functools.partial(_agents, tool, script, store.port, env, "2:2", "false", nproc=1)
        procs = run(count=2)
        deadline = time.monotonic() + timeout
        try:
            while len({s[1] for s in _stamps(out)}) < 2:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    return None
                time.sleep(0.02)
            procs += run(count=1)  # the spare
            time.sleep(8)  # it starts and waits (rallypoint says so; torchrun says nothing)
            os.killpg(procs[1].pid, signal.SIGKILL)
            killed = time.time()
            while time.monotonic() < deadline:
                after = {s[1] for s in _stamps(out) if s[2] > killed}
                if len(after) == 2:
                    return max(s[2] for s in _stamps(out) if s[2] > killed) - killed
                time.sleep(0.02)
            return None
        finally:
            _stop(procs)


# ---------------------------------------------------------------- no single point of failure

HA_CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=8,read_timeout=30,last_call_timeout=30"


def _ha_agent(
    tool: str,
    name: str,
    backend: str,
    endpoint: str,
    script: Path,
    out: Path,
    popen: Callable[..., Any] = subprocess.Popen,
) -> Any:
    if tool == "rallypoint":
        cmd = [sys.executable, "-m", "rallypoint", "run", "--rdzv-conf", HA_CONF]
        cmd += ["--shutdown-timeout", "2", "--events", str(out / f"events-{name}")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-conf", "last_call_timeout=30"]
    cmd += [
        "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", backend,
        "--rdzv-endpoint", endpoint, "--rdzv-id", "spof", "--max-restarts", "0",
        str(script), str(out),
    ]  # fmt: skip
    env = dict(os.environ, NODE_NAME=name, OMP_NUM_THREADS="1")
    log = open(out / f"agent-{name}.log", "w")  # noqa: SIM115 - handed to the child
    try:
        return popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()


@contextlib.contextmanager
def _training_dir() -> Iterator[tuple[Path, Path]]:
    from rallypoint.testing import training_log

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(training_log.STEP_WORKER)
        out = Path(tmp) / "out"
        out.mkdir()
        yield script, out


def _restarts(out: Path) -> int:
    from rallypoint.observe import read_events

    return sum(1 for e in read_events(sorted(out.glob("events-*"))) if e.kind == "restart")


def etcd_loss(kind: str, timeout: float) -> tuple[float, int] | None:
    """(seconds from the loss until every rank stepped after it, restarts seen)."""
    from rallypoint.testing import EtcdCluster, Network, training_log

    with contextlib.ExitStack() as stack:
        script, out = stack.enter_context(_training_dir())
        names = ["n0", "n1", "n2"]
        popens: list[Callable[..., Any]] = [subprocess.Popen] * 3
        if kind == "leader-cut":
            net = stack.enter_context(Network(5))
            cluster = stack.enter_context(EtcdCluster(3, hosts=net.hosts[:3]))
            names, popens = ["n3", "n4"], [net.hosts[3].popen, net.hosts[4].popen]
        else:
            cluster = stack.enter_context(EtcdCluster(3))
        first = cluster.leader()
        order = [(first + i) % 3 for i in range(3)]
        endpoint = ",".join(cluster.members[i].endpoint for i in order)  # they use the leader
        procs = [
            _ha_agent("rallypoint", n, "etcd", endpoint, script, out, popen=p)
            for n, p in zip(names, popens, strict=True)
        ]
        stack.callback(_stop, procs)
        world = len(procs)
        try:
            training_log.wait_training(out, world, 0.0, timeout)
            time.sleep(1)
            if kind == "node-kill":
                host = next(t for t in training_log.step_times(out, world) if t.startswith("0-"))
                victim = names.index(host.rsplit("-", 1)[1])
                os.killpg(procs[victim].pid, signal.SIGKILL)
                world -= 1
            elif kind == "leader-kill":
                cluster.kill(first)
            else:
                cluster.cut(first)
            lost = time.time()
            took = training_log.wait_training(out, world, lost, timeout)
            time.sleep(5)  # past the liveness window: did anyone restart late?
            return took, _restarts(out)
        except TimeoutError:
            return None


def rendezvous_loss(kind: str) -> float:
    """Three thread-nodes, min = max = 3, talking to the etcd leader: two wait in round 0
    when the leader is lost (``kill``: SIGKILL; ``freeze``: SIGSTOP, silence as behind a
    cut link; ``none``: the baseline) and the third joins: seconds until all have ranks."""
    from concurrent.futures import ThreadPoolExecutor

    from rallypoint.rendezvous import RendezvousParameters, get_rendezvous_handler
    from rallypoint.testing import EtcdCluster

    with EtcdCluster(3) as cluster, ThreadPoolExecutor(3) as pool:
        first = cluster.leader()
        order = [(first + i) % 3 for i in range(3)]
        endpoint = ",".join(cluster.members[i].endpoint for i in order)
        conf = {"keep_alive_interval": "3", "use_agent_store": "false", "read_timeout": "30"}
        handlers = [
            get_rendezvous_handler(RendezvousParameters("etcd", endpoint, "r", 3, 3, **conf))
            for _ in range(3)
        ]
        early = [pool.submit(h.next_rendezvous) for h in handlers[:2]]
        time.sleep(1)  # both are in their watch on the leader
        if kind == "kill":
            cluster.kill(first)
        elif kind == "freeze":
            cluster.freeze(first)
        start = time.monotonic()
        late = pool.submit(handlers[2].next_rendezvous)
        for f in [*early, late]:
            f.result(60)
        took = time.monotonic() - start
        for h in handlers:
            h.shutdown()
        if kind == "freeze":
            cluster.kill(first)
        return took


def c10d_host_loss(tool: str, timeout: float) -> tuple[float, list[int | None]]:
    """Kill the node hosting the c10d store: (seconds until the others exited, exit codes)."""
    from rallypoint.testing import training_log

    with _training_dir() as (script, out):
        endpoint = f"127.0.0.1:{free_port()}"
        procs = [_ha_agent(tool, "n0", "c10d", endpoint, script, out)]
        time.sleep(3)  # n0 binds the store's port first: it hosts the store
        procs += [_ha_agent(tool, n, "c10d", endpoint, script, out) for n in ("n1", "n2")]
        try:
            training_log.wait_training(out, 3, 0.0, timeout)
            time.sleep(1)
            os.killpg(procs[0].pid, signal.SIGKILL)
            lost = time.monotonic()
            deadline = lost + timeout
            while any(p.poll() is None for p in procs[1:]) and time.monotonic() < deadline:
                time.sleep(0.05)
            return time.monotonic() - lost, [p.poll() for p in procs[1:]]
        except TimeoutError:
            return float("nan"), [None, None]
        finally:
            _stop(procs)


def _fmt_loss(values: list[tuple[float, int] | None]) -> str:
    text = _fmt([None if v is None else v[0] for v in values])
    done = [v for v in values if v is not None]
    if done and all(v[1] == 0 for v in done):
        return f"{text} (no worker stopped)"
    return f"{text} (workers restarted in the smaller world, no restart budget spent)"


def _fmt_end(values: list[tuple[float, list[int | None]]]) -> str:
    ended = [t for t, codes in values if all(c is not None for c in codes)]
    codes = sorted({c for _, cs in values for c in cs}, key=str)
    if not ended:
        return f"did not end within the timeout (exit codes {codes})"
    return f"job ended after {statistics.median(ended):.2f} s (exit codes {codes})"


def spof(repeat: int, timeout: float, torchrun: bool) -> None:
    import torch

    from rallypoint.testing import netns_available

    rows = [
        ("etcd leader killed (the member the nodes use)", "leader-kill"),
        ("etcd leader's link cut (netns)", "leader-cut"),
        ("training node killed (group rank 0: hosts the workers' store)", "node-kill"),
    ]
    ok, why = netns_available()
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.node()} ({os.cpu_count()} cores), torch "
        f"{torch.__version__}, 3 nodes x 1 worker, 3-member etcd, {repeat} repeats"
    )
    print("| loss during training | backend | time until every rank trains again (s) |")
    print("|---|---|---|")
    for label, kind in rows:
        if kind == "leader-cut" and not ok:
            print(f"| {label} | etcd | skipped: {why} |")
            continue
        values = [etcd_loss(kind, timeout) for _ in range(repeat)]
        print(f"| {label} | etcd | {_fmt_loss(values)} |", flush=True)
    ends = [c10d_host_loss("rallypoint", timeout) for _ in range(repeat)]
    print(f"| node hosting the store killed | c10d (rallypoint) | never: {_fmt_end(ends)} |")
    if torchrun:
        ends = [c10d_host_loss("torchrun", timeout) for _ in range(repeat)]
        print(f"| node hosting the store killed | c10d (torchrun) | never: {_fmt_end(ends)} |")
    print("\n| etcd leader lost while 2 of 3 nodes wait in a round | round complete (s) |")
    print("|---|---|")
    for label, kind in (("no loss (baseline)", "none"), ("killed", "kill"), ("frozen", "freeze")):
        print(f"| {label} | {_fmt([rendezvous_loss(kind) for _ in range(repeat)])} |")


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
    parser.add_argument(
        "--sections",
        default="restart,spare,spof",
        help="restart (worker death, node loss), spare (a spare replaces a lost node), spof",
    )
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    if "restart" in sections:
        restart_section(args)
    if "spare" in sections:
        spare_section(args)
    if "spof" in sections:
        spof(args.repeat, args.timeout, not args.skip_torchrun)


def restart_section(args: argparse.Namespace) -> None:
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


def spare_section(args: argparse.Namespace) -> None:
    import torch

    ours = [spare_takes_over("rallypoint", args.timeout) for _ in range(args.repeat)]
    theirs: list[float | None] = []
    if not args.skip_torchrun:
        theirs = [spare_takes_over("torchrun", args.timeout) for _ in range(args.repeat)]
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.node()} ({os.cpu_count()} cores), torch "
        f"{torch.__version__}, --nnodes 2:2 + 1 spare, 1 worker each, {args.repeat} repeats"
    )
    print("| measurement | rallypoint (s) | torchrun (s) | ratio |")
    print("|---|---|---|---|")
    done_ours = [v for v in ours if v is not None]
    done_theirs = [v for v in theirs if v is not None]
    ratio = "-"
    if done_ours and done_theirs:
        ratio = f"{statistics.median(done_theirs) / statistics.median(done_ours):.1f}x"
    print(
        f"| member SIGKILLed -> the spare and the survivor past an all_reduce | {_fmt(ours)} | "
        f"{_fmt(theirs) if theirs else 'skipped'} | {ratio} |"
    )
    print(f"\nraw rallypoint {ours}, torchrun {theirs}")


if __name__ == "__main__":
    main()
