"""``@rallypoint.restartable``: a fault replaces the failed rank only; the other ranks leave
their function, stay in their processes (their set-up is not repeated) and resume at the
last snapshot, ending bit-identical to an uninterrupted run.

Real ``rallypoint run`` jobs of ``_restart_train.py`` (gloo, 4 ranks unless said): every
entry into the function writes ``enter-<restart>-<rank>`` (pid, start step), every process
``setup-<pid>`` once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rallypoint
from _support import cli_zygote
from rallypoint._core import envvars
from rallypoint.observe import read_events
from rallypoint.observe._timeline import build_timeline

SCRIPT = Path(__file__).with_name("_restart_train.py")
PRELOAD = "torch._dynamo"
"""Imported once by the warm process, not by every worker's first optimizer (~1 s each)."""


def _run(
    out: Path,
    mode: str,
    *flags: str,
    nproc: int = 4,
    steps: int = 30,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", str(nproc),
        "--max-restarts", "3", "--preload", PRELOAD, *flags, str(SCRIPT), str(out), mode,
        str(steps),
    ]  # fmt: skip
    env = {**os.environ, **(env or {})}
    done = cli_zygote.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    return done.returncode, done.stdout + done.stderr


def _entries(out: Path, restart: int) -> dict[int, tuple[int, int]]:
    """``{rank: (pid, start step)}`` of the entries into the function at ``restart``."""
    found = {}
    for path in out.glob(f"enter-{restart}-[0-9]*"):
        if path.suffix == ".tmp":
            continue
        pid, start = path.read_text().split()[:2]
        found[int(path.name.rsplit("-", 1)[1])] = (int(pid), int(start))
    return found


def _setups(out: Path) -> int:
    return len(list(out.glob("setup-*")))


def _same_params(a: Path, b: Path) -> None:
    x, y = torch.load(a), torch.load(b)
    assert x.keys() == y.keys()
    for name in x:
        assert torch.equal(x[name], y[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 uninterrupted steps of 4 ranks."""
    out = tmp_path_factory.mktemp("reference")
    code, text = _run(out, "none")
    assert code == 0, text
    return out / "final.pt"


def _kept_and_replaced(out: Path, replaced: set[int]) -> None:
    """Every rank entered the function twice, at step 0 and at step 10; the ranks in
    ``replaced`` in a new process, the others in the same one (set-up ran once each)."""
    first, second = _entries(out, 0), _entries(out, 1)
    assert sorted(first) == sorted(second) == [0, 1, 2, 3]
    assert {r for r in second if second[r][0] != first[r][0]} == replaced
    assert all(start == 0 for _, start in first.values()), first
    assert all(start == 10 for _, start in second.values()), second
    assert _setups(out) == 4 + len(replaced)


@pytest.mark.timeout(300)
def test_a_killed_rank_alone_is_replaced_and_the_run_ends_bit_identical(
    tmp_path: Path, reference: Path
) -> None:
    code, text = _run(tmp_path, "kill", "--events", str(tmp_path / "events"))
    assert code == 0, text
    _kept_and_replaced(tmp_path, {1})
    pids = ", ".join(str(_entries(tmp_path, 0)[r][0]) for r in (0, 2, 3))
    line = f"in-process restart 1 of 3: ranks 0, 2, 3 kept (pids {pids}); rank 1 replaced (killed"
    assert line in text, text
    _same_params(tmp_path / "final.pt", reference)
    # the report draws the kept processes' first attempt as kept, the replaced one's as failed
    timeline = build_timeline(read_events([tmp_path / "events"]))
    first = {b.rank: b.state for b in sorted(timeline.bars, key=lambda b: -b.start)}
    assert first == {0: "kept", 1: "failed", 2: "kept", 3: "kept"}, timeline.bars
    restart = next(m for m in timeline.marks if m.kind == "restart")
    assert "(in process: ranks [0, 2, 3] kept, [1] replaced)" in restart.label


@pytest.mark.timeout(300)
def test_a_rank_that_raises_is_replaced_and_its_traceback_shown(
    tmp_path: Path, reference: Path
) -> None:
    code, text = _run(tmp_path, "raise")
    assert code == 0, text
    _kept_and_replaced(tmp_path, {1})
    assert "ValueError: rank 1 found a bad batch" in text, text
    assert "rank 1 replaced (exited with 1)" in text, text
    _same_params(tmp_path / "final.pt", reference)


@pytest.mark.timeout(300)
def test_a_rank_spinning_in_python_is_found_by_the_hang_timeout_and_replaced_alone(
    tmp_path: Path, reference: Path
) -> None:
    code, text = _run(tmp_path, "spin", "--hang-timeout", "6")  # > start-up, on a busy host
    assert code == 0, text
    _kept_and_replaced(tmp_path, {1})
    assert "no worker reported progress" in text, text
    _same_params(tmp_path / "final.pt", reference)


@pytest.mark.timeout(300)
def test_the_rank_a_timed_out_collective_waited_for_is_replaced_alone(
    tmp_path: Path, reference: Path
) -> None:
    code, text = _run(tmp_path, "spin", env={"RESTART_TEST_PG_TIMEOUT": "3"})
    assert code == 0, text
    _kept_and_replaced(tmp_path, {1})
    assert "a collective timed out" in text, text
    assert "rank 1 replaced (killed by SIGKILL" in text, text
    _same_params(tmp_path / "final.pt", reference)


@pytest.mark.timeout(300)
def test_a_survivor_that_ignores_the_interruption_is_replaced_after_the_grace(
    tmp_path: Path, reference: Path
) -> None:
    code, text = _run(tmp_path, "ignore", "--restart-grace", "2")
    assert code == 0, text
    # rank 2 spins on; a rank blocked in a collective with it is freed once it is killed
    _kept_and_replaced(tmp_path, {1, 2})
    assert "rank(s) 2 did not leave the function within --restart-grace 2 s: replaced" in text
    where = text[text.index("rallypoint: where they were:") :]  # the stack it was stuck in
    assert where.splitlines()[1].startswith("rank 2: in _fault at _restart_train.py:"), text
    _same_params(tmp_path / "final.pt", reference)


@pytest.mark.timeout(300)
def test_a_script_without_the_decorator_restarts_every_process(
    tmp_path: Path, reference: Path
) -> None:
    out = tmp_path / "o"
    out.mkdir()
    cmd = [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "4", "--max-restarts",
           "1", "--preload", PRELOAD, "--spare-workers", "1", str(SCRIPT), str(out), "kill", "30",
           "0"]  # fmt: skip
    done = cli_zygote.run(cmd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restarting the worker group (restart 1 of 1)" in done.stderr, done.stderr
    assert "in-process" not in done.stderr
    assert "spare worker" not in done.stderr  # a spare only waits in a restartable function
    first, second = _entries(out, 0), _entries(out, 1)
    assert not {pid for pid, _ in first.values()} & {pid for pid, _ in second.values()}
    assert _setups(out) == 8
    _same_params(out / "final.pt", reference)


@pytest.mark.timeout(300)
def test_a_spare_worker_whose_set_up_ran_ahead_takes_the_killed_ranks_place(
    tmp_path: Path, reference: Path
) -> None:
    import psutil

    events = tmp_path / "events"
    code, text = _run(tmp_path, "spare", "--spare-workers", "1", "--events", str(events))
    assert code == 0, text
    line = next(x for x in text.splitlines() if "spare worker(s) run the script's set-up" in x)
    ready = int(line.rsplit("(pids ", 1)[1].rstrip(")"))
    assert (tmp_path / f"spare-ready-{ready}").exists()  # its set-up ran before the fault
    assert f"local rank 1 goes to spare worker {ready} (its set-up ran ahead)" in text, text
    first, second = _entries(tmp_path, 0), _entries(tmp_path, 1)
    assert second[1][0] == ready, (first, second)  # the spare, not a new process
    assert all(second[r][0] == first[r][0] for r in (0, 2, 3)), (first, second)
    assert all(start == 10 for _, start in second.values()), second
    _same_params(tmp_path / "final.pt", reference)
    # the used spare is replaced by a new one while training goes on; none outlives the job
    assert text.count("spare worker(s) run the script's set-up now") == 2, text
    for path in tmp_path.glob("setup-*"):
        assert not psutil.pid_exists(int(path.name.rsplit("-", 1)[1])), path
    started = [e for e in read_events([events]) if e.kind == "worker_start"]
    assert [(e.get("round"), e.rank) for e in started if e.get("spare")] == [(1, 1)]


@pytest.mark.timeout(300)
def test_a_spare_that_exited_is_passed_over_and_the_rank_started_afresh(
    tmp_path: Path, reference: Path
) -> None:
    env = {"RESTART_TEST_SPARE_EXITS": "1"}
    code, text = _run(tmp_path, "spare", "--spare-workers", "1", env=env)
    assert code == 0, text
    spares = {int(p.name.rsplit("-", 1)[1]) for p in tmp_path.glob("spare-gone-*")}
    assert len(spares) == 1 and "goes to spare worker" not in text, text
    [spare] = spares  # said once, with its output; no second spare is started
    assert f"spare worker {spare} exited before it took a rank; no more spares" in text, text
    assert "  the spare's set-up failed" in text, text
    assert text.count("spare worker(s) run the script's set-up now") == 1, text
    first, second = _entries(tmp_path, 0), _entries(tmp_path, 1)
    assert second[1][0] not in spares | {first[1][0]}, (first, second)  # a new process
    assert all(start == 10 for _, start in second.values()), second
    _same_params(tmp_path / "final.pt", reference)


LAUNCH_WITH_SPARE = """
import os, signal, sys
import torch, torch.distributed as dist
import rallypoint

@rallypoint.restartable
def train():
    dist.init_process_group("gloo")
    rank, restart = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    t = torch.ones(1)
    dist.all_reduce(t)
    if restart == 0 and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return rank, restart, t.item()

if __name__ == "__main__":
    print("RESULT", rallypoint.launch(train, nproc=2, max_restarts=1, spare_workers=1))
"""


@pytest.mark.timeout(120)
def test_launch_takes_spare_workers_too(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(LAUNCH_WITH_SPARE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT [(0, 1, 4.0), (1, 1, 4.0)]" in done.stdout, done.stdout + done.stderr
    assert "spare worker(s) run the script's set-up now" in done.stderr, done.stderr


def test_spare_workers_bad_input_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--spare-workers", "-1", str(SCRIPT)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 2 and "spare_workers" in done.stderr, done.stderr
    with pytest.raises(ValueError, match="spare_workers"):
        rallypoint.LaunchConfig(spare_workers=-1, max_restarts=1)
    with pytest.raises(TypeError, match="spare_workers"):
        rallypoint.LaunchConfig(spare_workers="1", max_restarts=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="virtual_local_rank"):
        rallypoint.LaunchConfig(nproc=2, spare_workers=1, max_restarts=1, virtual_local_rank=True)
    with pytest.raises(ValueError, match="spare_workers needs max_restarts > 0"):
        rallypoint.LaunchConfig(nproc=2, spare_workers=1)
    done = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--spare-workers", "1", str(SCRIPT)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 2 and "--max-restarts" in done.stderr, done.stderr


@pytest.mark.timeout(300)
def test_twenty_in_process_restarts_leak_no_descriptor_thread_or_memory(tmp_path: Path) -> None:
    code, text = _run(
        tmp_path, "every", "--max-restarts", "25", "--max-same-failure", "off", nproc=2, steps=12
    )
    assert code == 0, text
    assert text.count("in-process restart") == 20, text
    usage = {}
    for restart in range(21):
        pid, _, fds, threads, rss = map(int, (tmp_path / f"enter-{restart}-0").read_text().split())
        usage[restart] = (pid, fds, threads, rss)
    assert len({u[0] for u in usage.values()}) == 1  # rank 0 never left its process
    assert len({u[1] for u in usage.values()}) == 1, usage  # descriptors
    # threads: a leak adds one every restart; a loaded run once saw a fifth thread (one
    # that was ending) at one entry of twenty
    threads = [usage[r][2] for r in range(5, 21)]
    assert max(threads) - min(threads) <= 1 and threads[-1] <= min(threads) + 1, usage
    # the first restarts allocate what gloo and the snapshot session keep (one loaded run:
    # 6 MB more between restarts 1 and 2, then 28 KB over the next 18); a leak grows with
    # every restart
    assert usage[20][3] - usage[5][3] < 4 << 20, usage
    assert _setups(tmp_path) == 2 + 20


@pytest.mark.timeout(300)
def test_max_restarts_counts_in_process_restarts_and_nothing_is_left_running(
    tmp_path: Path,
) -> None:
    code, text = _run(tmp_path, "every", "--max-restarts", "2", "--max-same-failure", "off",
                      nproc=2, steps=12)  # fmt: skip
    assert code == 1, text
    assert text.count("in-process restart") == 2, text
    assert "FAILED (attempt 3 of 3)" in text, text
    pid = _entries(tmp_path, 0)[0][0]
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_outside_rallypoint_run_the_function_runs_once(tmp_path: Path) -> None:
    script = tmp_path / "once.py"
    script.write_text(
        "import rallypoint\n"
        "calls = []\n"
        "@rallypoint.restartable\n"
        "def train(x, *, y):\n"
        "    calls.append(1)\n"
        "    return x + y\n"
        "print(train(40, y=2), len(calls), train.__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != envvars.CONTROL_FD}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.stdout.split() == ["42", "1", "train"], done.stdout + done.stderr


def test_restartable_takes_a_function() -> None:
    with pytest.raises(TypeError, match="restartable\\(\\) takes a function, got int"):
        rallypoint.restartable(3)  # type: ignore[arg-type]


def _work(out: str) -> int:
    import signal

    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    Path(out, f"pid-{restart}-{rank}").write_text(str(os.getpid()))
    dist.barrier()
    if rank == 1 and restart == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    dist.destroy_process_group()
    return os.getpid()


@pytest.mark.timeout(120)
def test_launch_restarts_a_restartable_function_in_process(tmp_path: Path) -> None:
    pids = rallypoint.launch(rallypoint.restartable(_work), str(tmp_path), nproc=2, max_restarts=1)
    first = int((tmp_path / "pid-0-0").read_text())
    assert pids[0] == first  # rank 0 returned from the process it started in
    assert pids[1] != int((tmp_path / "pid-0-1").read_text())


# ---------------------------------------------------------------------- across nodes
def _agent(
    endpoint: str,
    out: Path,
    mode: str,
    *conf: str,
    nnodes: str = "2",
) -> subprocess.Popen[str]:
    """One agent of 2 ranks, as a user starts it on each node (default ``--local-addr``)."""
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", nnodes, "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "inproc",
        *conf, "--max-restarts", "3", "--preload", PRELOAD, str(SCRIPT), str(out), mode, "30",
    ]  # fmt: skip
    return cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(agents: list[subprocess.Popen[str]]) -> list[str]:
    texts = [p.communicate(timeout=150)[0] for p in agents]
    assert [p.returncode for p in agents] == [0] * len(agents), texts
    return texts


@pytest.mark.timeout(300)
def test_across_two_agents_a_crash_keeps_every_other_rank_on_both_nodes(
    tmp_path: Path, reference: Path
) -> None:
    from rallypoint._core.net import free_port

    endpoint = f"127.0.0.1:{free_port()}"  # the first agent hosts the rendezvous store there
    agents = [_agent(endpoint, tmp_path, "kill") for _ in range(2)]
    try:
        texts = _finish(agents)
    finally:
        for p in agents:
            p.kill()
    _kept_and_replaced(tmp_path, {1})
    joined = "".join(texts)
    assert "rank 0 kept" in joined and "ranks 2, 3 kept" in joined, joined
    _same_params(tmp_path / "final.pt", reference)


@pytest.mark.timeout(300)
def test_across_two_agents_a_spare_worker_takes_the_crashed_ranks_place(
    tmp_path: Path, reference: Path
) -> None:
    from rallypoint._core.net import free_port

    endpoint = f"127.0.0.1:{free_port()}"  # the first agent hosts the rendezvous store there
    agents = [_agent(endpoint, tmp_path, "spare", "--spare-workers", "1") for _ in range(2)]
    try:
        texts = _finish(agents)
    finally:
        for p in agents:
            p.kill()
    first, second = _entries(tmp_path, 0), _entries(tmp_path, 1)
    [taken] = [t for t in texts if "local rank 1 goes to spare worker" in t]
    spare = int(taken.split("local rank 1 goes to spare worker ")[1].split()[0])
    assert second[1][0] == spare and (tmp_path / f"spare-ready-{spare}").exists(), texts
    assert all(second[r][0] == first[r][0] for r in (0, 2, 3)), (first, second)
    assert all(start == 10 for _, start in second.values()), second
    _same_params(tmp_path / "final.pt", reference)


@pytest.mark.timeout(300)
def test_a_lost_node_leaves_the_other_nodes_ranks_in_their_processes(
    tmp_path: Path, endpoint: str
) -> None:
    import psutil

    conf = [
        "--rdzv-conf",
        "is_host=false,read_timeout=20,keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=1",
    ]
    agents = [_agent(endpoint, tmp_path, "node", *conf, nnodes="1:2") for _ in range(2)]
    try:
        marker = tmp_path / "at-fault"
        while not marker.exists():
            assert all(p.poll() is None for p in agents), [p.communicate() for p in agents]
            time.sleep(0.05)
        pid = int(marker.read_text())
        [lost] = [a for a in agents if pid in {c.pid for c in psutil.Process(a.pid).children(True)}]
        for proc in [psutil.Process(lost.pid), *psutil.Process(lost.pid).children(True)]:
            proc.kill()
        [survivor] = [a for a in agents if a is not lost]
        [text] = _finish([survivor])
    finally:
        for p in agents:
            p.kill()
    first, second = _entries(tmp_path, 0), _entries(tmp_path, 1)
    assert sorted(second) == [0, 1], second  # the world shrank to the surviving node
    kept = {pid for pid, _ in second.values()}
    assert kept < {pid for pid, _ in first.values()}, (first, second)  # the same processes
    assert pid not in kept
    assert "in-process restart" in text and "kept" in text, text


@pytest.mark.timeout(300)
def test_a_hot_spare_set_up_ahead_takes_a_lost_nodes_ranks(tmp_path: Path, endpoint: str) -> None:
    import psutil

    conf = [
        "--rdzv-conf",
        "is_host=false,read_timeout=20,keep_alive_interval=0.5,keep_alive_max_attempt=3,last_call_timeout=1",
        "--hot-spare",
    ]
    members = [_agent(endpoint, tmp_path, "node", *conf) for _ in range(2)]
    agents = list(members)
    try:
        while len(_entries(tmp_path, 0)) < 4:  # the round is full: a third agent is a spare
            assert all(p.poll() is None for p in agents), [p.communicate() for p in agents]
            time.sleep(0.05)
        spare = _agent(endpoint, tmp_path, "node", *conf)
        agents.append(spare)
        assert spare.stdout is not None
        line = ""
        while "hot spare:" not in line:
            line = spare.stdout.readline()
            assert line, spare.communicate()
        standby = {int(p) for p in line.split("(pids ")[1].rstrip(")\n").split(", ")}
        for pid in standby:  # their set-up ran, before any node was lost
            while not (tmp_path / f"setup-{pid}").exists():
                assert spare.poll() is None
                time.sleep(0.05)
        marker = tmp_path / "at-fault"
        while not marker.exists():
            assert all(p.poll() is None for p in agents)
            time.sleep(0.05)
        pid = int(marker.read_text())
        [lost] = [
            a for a in members if pid in {c.pid for c in psutil.Process(a.pid).children(True)}
        ]
        for proc in [psutil.Process(lost.pid), *psutil.Process(lost.pid).children(True)]:
            proc.kill()
        texts = _finish([a for a in agents if a is not lost])
    finally:
        for p in agents:
            p.kill()
    first, second = _entries(tmp_path, 0), _entries(tmp_path, 1)
    assert sorted(second) == [0, 1, 2, 3], second
    pids = {pid for pid, _ in second.values()}
    survivors = {p for p, _ in first.values()} - {int(marker.read_text())}
    assert pids == standby | (survivors & pids) and len(pids & standby) == 2, (first, second)
    assert len(pids - standby) == 2 and pids - standby <= survivors  # kept in their processes
    assert all(start == 10 for _, start in second.values()), second  # the snapshot, not 0
    assert "the spare joins job" in "".join(texts)
