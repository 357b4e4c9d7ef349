"""Several ``rallypoint run`` agents on loopback forming one job through a c10d rendezvous."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from _support import cli_zygote

WORKER = """
import json, os, sys
import torch, torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
        "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS"]
env = {k: os.environ[k] for k in keys}
env["sum"] = t.item()
out = os.path.join(sys.argv[1], f"{os.environ['RANK']}-{os.environ['TORCHELASTIC_RESTART_COUNT']}")
with open(out, "w") as fp:
    json.dump(env, fp)
dist.barrier()  # every rank wrote its file before the last one fails (then all are stopped)
mode = sys.argv[2]
last = int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
if last and (mode == "always" or (mode == "once" and first)):
    raise ValueError("boom on the last rank")
dist.destroy_process_group()
"""


def _agent(
    endpoint: str,
    run_id: str,
    nproc: int,
    script: Path,
    *args: str,
    restarts: int = 1,
    events: Path | None = None,
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "rallypoint", "run",
        *(["--events", str(events)] if events else []),
        "--nnodes", "2", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf", "is_host=false,read_timeout=20",
        "--max-restarts", str(restarts), "--shutdown-timeout", "5",
        str(script), *args,
    ]  # fmt: skip
    return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen[str]], timeout: float = 100) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout + stderr))
    return out


@pytest.mark.timeout(150)
def test_world_env_crash_restarts_every_node_with_one_budget(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    envs = tmp_path / "env"
    envs.mkdir()
    # mismatched --nproc-per-node (2 and 1), as torchrun allows: world size 3
    logs = [tmp_path / f"events{n}.jsonl" for n in (2, 1)]
    procs = [
        _agent(endpoint, "job-a", n, script, str(envs), "once", events=log)
        for n, log in zip((2, 1), logs, strict=True)
    ]
    results = _finish(procs)
    for code, text in results:
        assert code == 0, text
        assert "restarting the workers on every node (restarts used: 1 of 1)" in text, text
    seen = {p.name: json.loads(p.read_text()) for p in envs.iterdir()}
    assert sorted(seen) == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"]
    port = {e["MASTER_PORT"] for name, e in seen.items() if name.endswith("-1")}
    assert len(port) == 1  # one worker store per round
    for name, e in seen.items():
        rank, count = map(int, name.split("-"))
        assert e["TORCHELASTIC_RESTART_COUNT"] == str(count)
        assert e["WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == "3" and e["GROUP_WORLD_SIZE"] == "2"
        assert e["RANK"] == e["ROLE_RANK"] == str(rank) and e["sum"] == 3.0
        assert e["TORCHELASTIC_RUN_ID"] == "job-a" and e["TORCHELASTIC_MAX_RESTARTS"] == "1"
        # RANK = local world sizes of lower group ranks + local rank
        local_ws, group = int(e["LOCAL_WORLD_SIZE"]), int(e["GROUP_RANK"])
        offset = 0 if group == 0 else 3 - local_ws
        assert rank == offset + int(e["LOCAL_RANK"])

    # every agent logged the rounds, the shared restart and the end; one merged timeline
    from rallypoint.launcher import read_events

    events = read_events(logs)
    rounds = [e for e in events if e.kind == "round"]
    assert len(rounds) == 4 and {e.get("nnodes") for e in rounds} == {2}
    assert all(len(e.get("members")) == 2 for e in events if e.kind == "members")
    assert [e.get("restart_count") for e in events if e.kind == "restart"] == [1, 1]
    assert [e.get("status") for e in events if e.kind == "job_end"] == ["succeeded"] * 2
    picture = tmp_path / "timeline.svg"
    rep = cli_zygote.run(
        [sys.executable, "-m", "rallypoint", "report", *map(str, logs), "-o", str(picture)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert rep.returncode == 0 and "3 ranks" in rep.stdout, rep.stdout + rep.stderr

    # the run is closed now: a late agent with the same id does not hang
    late = _agent(endpoint, "job-a", 1, script, str(envs), "once")
    [(code, text)] = _finish([late], timeout=60)
    assert code == 0 and "already finished successfully" in text, text


@pytest.mark.timeout(150)
def test_spent_budget_every_agent_prints_the_same_root_cause(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    envs = tmp_path / "env"
    envs.mkdir()
    procs = [_agent(endpoint, "job-b", 2, script, str(envs), "always") for _ in range(2)]
    results = _finish(procs)
    causes = []
    for code, text in results:
        assert code == 1, text
        assert "FAILED (1 restart(s) used of 1)" in text, text
        block = text[text.index("Root cause") :]
        assert "rank      : 3" in block and "ValueError: boom on the last rank" in block
        causes.append(block.split("Other ranks")[0])
    assert causes[0] == causes[1]  # the same report on every node
    assert sorted(p.name for p in envs.iterdir()) == [f"{r}-{c}" for r in range(4) for c in (0, 1)]


@pytest.mark.timeout(60)
def test_unreachable_endpoint_is_a_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text("pass\n")
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x",
        "--rdzv-conf", "is_host=false,read_timeout=2", str(script),
    ]  # fmt: skip
    proc = cli_zygote.run(cmd, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rallypoint run: rendezvous '127.0.0.1:1'") and "127.0.0.1:1" in last


ELASTIC = """
import json, os, sys, time
import torch, torch.distributed as dist
import rallypoint.launcher as rl

dist.init_process_group("gloo")
nodes = int(os.environ["GROUP_WORLD_SIZE"])
out = os.path.join(sys.argv[1], f"{os.environ['RANK']}-{nodes}-{os.getpid()}")
with open(out, "w") as fp:
    json.dump({k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}, fp)
t = torch.ones(1)
while nodes != int(sys.argv[2]):   # run until the world has the wanted number of nodes
    rl.progress()
    dist.all_reduce(t)
    time.sleep(0.05)
dist.all_reduce(t)
dist.destroy_process_group()
"""


def _elastic_agent(
    endpoint: str, run_id: str, script: Path, *args: str, last_call: int = 1
) -> subprocess.Popen[str]:
    """An agent of a 1:2-node job; ``last_call``: how long a 1-node round waits for more."""
    cmd = [
        sys.executable, "-m", "rallypoint", "run",
        "--nnodes", "1:2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--rdzv-conf",
        f"is_host=false,read_timeout=20,last_call_timeout={last_call},keep_alive_interval=0.5,"
        "keep_alive_max_attempt=3",
        "--shutdown-timeout", "2", str(script), *args,
    ]  # fmt: skip
    return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(directory: Path, pattern: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(list(directory.glob(pattern))) < count:
        assert time.monotonic() < deadline, sorted(p.name for p in directory.iterdir())
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_scale_up_admits_a_new_node_without_spending_budget(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC)
    envs = tmp_path / "env"
    envs.mkdir()
    first = _elastic_agent(endpoint, "job-up", script, str(envs), "2")
    try:
        _wait_for(envs, "*-1-*", 2)  # running alone, in a 1-node world
        second = _elastic_agent(endpoint, "job-up", script, str(envs), "2")
    except BaseException:
        first.kill()
        raise
    results = _finish([first, second])
    for code, text in results:
        assert code == 0, text
    assert "membership changed" in results[0][1]
    grown = [json.loads(p.read_text()) for p in envs.glob("*-2-*")]
    assert sorted(int(e["RANK"]) for e in grown) == [0, 1, 2, 3]
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in grown} == {"0"}  # no budget spent


@pytest.mark.timeout(120)
def test_node_loss_survivor_continues_at_min(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC)
    envs = tmp_path / "env"
    envs.mkdir()
    # both must meet in the first round (alone, a node's script exits at once): 4 s for the
    # second agent to start on a loaded host; a round of max nodes completes at once
    agents = [
        _elastic_agent(endpoint, "job-loss", script, str(envs), "1", last_call=4) for _ in range(2)
    ]
    try:
        _wait_for(envs, "*-2-*", 4)  # both nodes' workers run in a 2-node world
        victim = agents[1]
        victim.kill()  # SIGKILL: no goodbye; its warm process and workers die with it
        victim.wait(10)
        started = time.monotonic()
        [(code, text)] = _finish([agents[0]], timeout=60)
        noticed = time.monotonic() - started
    finally:
        for a in agents:
            a.kill()
    assert code == 0, text
    assert "membership changed" in text, text
    assert sorted(p.name.split("-")[0] for p in envs.glob("*-1-*")) == ["0", "1"]
    assert noticed < 30


@pytest.mark.timeout(120)
def test_stacks_on_demand_for_a_running_job(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC)
    envs = tmp_path / "env"
    envs.mkdir()
    agents = [_elastic_agent(endpoint, "job-st", script, str(envs), "3") for _ in range(2)]
    try:
        _wait_for(envs, "*-2-*", 4)
        proc = cli_zygote.run(
            [sys.executable, "-m", "rallypoint", "stacks", "--rdzv-endpoint", endpoint,
             "--rdzv-id", "job-st", "--timeout", "20"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        for a in agents:
            a.kill()
            a.wait(10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the collective view from the Flight Recorders of both nodes' workers, then the stacks
    view = proc.stdout.splitlines()[:2]
    assert view[0] == "Collectives by group (Flight Recorder):", proc.stdout
    assert view[1].startswith("  world [0, 1, 2, 3]: #"), proc.stdout
    assert "Root cause" not in proc.stdout  # a running job: a collective in flight is normal
    assert "\nrank" in proc.stdout and "elastic.py" in proc.stdout, proc.stdout
    for rank in range(4):
        assert f" {rank} (pid " in proc.stdout, proc.stdout  # every rank of both nodes


def test_stacks_bad_input() -> None:
    proc = cli_zygote.run(
        [sys.executable, "-m", "rallypoint", "stacks", "--rdzv-id", "x"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2 and "--rdzv-endpoint" in proc.stderr


HANG = """
import os, time
import torch, torch.distributed as dist
import rallypoint.launcher as rl

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
t = torch.ones(1)
for step in range(3):
    rl.progress()
    if attempt == "0" and rank == world - 1 and step == 1:
        time.sleep(3600)
    dist.all_reduce(t)
print(f"finished rank={rank} attempt={attempt}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_hang_across_nodes_prints_every_rank_and_restarts(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    procs = []
    for _ in range(2):
        cmd = [
            sys.executable, "-m", "rallypoint", "run",
            "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "job-hang",
            "--rdzv-conf", "is_host=false,read_timeout=20", "--max-restarts", "1",
            "--hang-timeout", "3", "--shutdown-timeout", "2", str(script),
        ]  # fmt: skip
        procs.append(
            cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    results = _finish(procs)
    joined = "".join(text for _, text in results)
    for code, text in results:
        assert code == 0, text
    assert joined.count("stacks of every rank:") == 1, joined  # one agent prints the report
    assert "ranks 0-2: all_reduce" in joined and "rank 3: sleep" in joined, joined
    for rank in range(4):
        assert f"finished rank={rank} attempt=1" in joined


@pytest.mark.timeout(150)
def test_etcd_backend_restart(tmp_path: Path) -> None:
    from rallypoint.testing._etcd import EtcdServer, etcd_binary

    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    envs = tmp_path / "env"
    envs.mkdir()
    with EtcdServer() as server:
        procs = []
        for _ in range(2):
            cmd = [
                sys.executable, "-m", "rallypoint", "run",
                "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                "--rdzv-endpoint", server.endpoint, "--rdzv-id", "job-etcd",
                "--max-restarts", "1", "--shutdown-timeout", "2", str(script), str(envs), "once",
            ]  # fmt: skip
            procs.append(
                cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        results = _finish(procs)
    for code, text in results:
        assert code == 0, text
    assert sorted(p.name for p in envs.iterdir()) == ["0-0", "0-1", "1-0", "1-1"]


@pytest.mark.timeout(60)
def test_sigterm_while_waiting_for_other_nodes_stops_at_once(tmp_path: Path, endpoint: str) -> None:
    import signal

    script = tmp_path / "worker.py"
    script.write_text("pass\n")
    lonely = _agent(endpoint, "job-alone", 1, script)  # --nnodes 2: waits for a second node
    import torch.distributed as dist

    host, port = endpoint.split(":")
    client = dist.TCPStore(host, int(port), is_master=False)
    deadline = time.monotonic() + 40
    while not client.check(["rallypoint/rdzv/job-alone/r0/joined"]):  # it joined round 0
        assert time.monotonic() < deadline and lonely.poll() is None
        time.sleep(0.05)
    lonely.send_signal(signal.SIGTERM)
    started = time.monotonic()
    _, err = lonely.communicate(timeout=30)
    assert lonely.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM while waiting for the other nodes" in err
    assert time.monotonic() - started < 10


def _api_work() -> float:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1) * (int(os.environ["RANK"]) + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t.item())


API_PEER = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (int(os.environ["RANK"]) + 1)
dist.all_reduce(t)
print("peer sum", t.item(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_launch_api_joins_a_multi_node_job(tmp_path: Path, endpoint: str) -> None:
    from rallypoint.launcher import launch

    script = tmp_path / "peer.py"
    script.write_text(API_PEER)
    peer = _agent(endpoint, "job-api", 1, script)
    try:
        results = launch(
            _api_work,
            nproc=2,
            nnodes="2",
            rdzv_endpoint=endpoint,
            run_id="job-api",
            rdzv_conf={"is_host": "false", "read_timeout": "20"},
        )
        [(code, text)] = _finish([peer])
    finally:
        peer.kill()
    assert results == [6.0, 6.0]  # world of 3: ranks 1+2+3 on every rank
    assert code == 0 and "peer sum 6.0" in text, text
    # the handler was shut down: no heartbeat thread lives on in the caller's process
    assert [t.name for t in threading.enumerate() if t.name.startswith("rdzv-")] == []


@pytest.mark.timeout(120)
def test_static_backend_node_ranks_and_restart(tmp_path: Path) -> None:
    from rallypoint._core.net import free_port

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    envs = tmp_path / "env"
    envs.mkdir()
    port = free_port()
    procs = [
        cli_zygote.Popen(
            [
                sys.executable,
                "-m",
                "rallypoint",
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "--max-restarts",
                "1",
                "--shutdown-timeout",
                "2",
                str(script),
                str(envs),
                "once",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    for code, text in _finish(procs):
        assert code == 0, text
    seen = {p.name: json.loads(p.read_text()) for p in envs.iterdir()}
    assert sorted(seen) == ["0-0", "0-1", "1-0", "1-1"]
    assert all(e["GROUP_RANK"] == e["RANK"] for e in seen.values())  # --node-rank is the rank


STORE_HOST = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(store.port, flush=True)
time.sleep(3600)
"""


@pytest.mark.timeout(120)
def test_lost_rendezvous_store_stops_every_agent_cleanly(tmp_path: Path) -> None:
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        endpoint = f"127.0.0.1:{host.stdout.readline().strip()}"
        script = tmp_path / "elastic.py"
        script.write_text(ELASTIC)
        envs = tmp_path / "env"
        envs.mkdir()
        agents = [_elastic_agent(endpoint, "job-lost", script, str(envs), "3") for _ in range(2)]
        _wait_for(envs, "*-2-*", 4)
        host.kill()
        results = _finish(agents, timeout=60)
    finally:
        host.kill()
    for code, text in results:
        assert code == 1, text
        assert "lost the rendezvous store" in text.strip().splitlines()[-1], text
        assert "Traceback" not in text.split("lost the rendezvous store")[0].split("\n")[-1]
        # the agent's own lines: torch's C++ store warnings and frame dumps (background
        # threads of the agent) never reach the screen, before or after the root cause
        agent = [line for line in text.splitlines() if not line.startswith("[rank")]
        assert not [line for line in agent if "TCPStore.cpp" in line or "frame #" in line], text
