"""Stacks of real workers (gloo all_reduce vs time.sleep) collected by signal and grouped."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from rallypoint._core.net import free_port
from rallypoint._watch._stacks import (
    DEFAULT_STACKS_SIGNAL,
    STACKS_DIR_ENV,
    STACKS_SIGNAL_ENV,
    Frame,
    StackDump,
    ThreadStack,
    collect_stacks,
    install_stack_dumper,
    parse_faulthandler_dump,
    stacks_env,
)
from rallypoint._watch._stacks_exchange import (
    MAX_ANSWER_BYTES,
    MAX_KEPT,
    MIN_ANSWER_INTERVAL,
    StacksAnswers,
    answer_stacks_request,
    latest_stacks_request,
    publish_node_count,
    request_stacks,
)
from rallypoint._watch._stacks_format import format_grouped_stacks, stack_summary
from rallypoint.testing._zygote import Zygote

_ctx = multiprocessing.get_context("fork")
_HERE = Path(__file__).read_text().splitlines()
SLEEP_LINE = next(i for i, line in enumerate(_HERE, 1) if line.endswith("# <- SLEEP"))
REDUCE_LINE = next(i for i, line in enumerate(_HERE, 1) if line.endswith("# <- REDUCE"))


def _gloo_worker(rank: int, world: int, port: int, env: dict[str, str], conn: Connection) -> None:
    os.environ.update(env)
    install_stack_dumper()
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    conn.send(rank)
    if rank == 1:
        time.sleep(120)  # <- SLEEP
    else:
        dist.all_reduce(torch.ones(1))  # <- REDUCE


def _gloo_worker_of_the_zygote(
    fds: list[int], rank: int, world: int, port: int, env: dict[str, str]
) -> None:
    _gloo_worker(rank, world, port, env, Connection(fds[0], readable=False))


@pytest.fixture(scope="module")
def gloo_job(
    tmp_path_factory: pytest.TempPathFactory, zygote: Zygote
) -> Iterator[tuple[dict[int, int], Path]]:
    """Four gloo workers: ranks 0,2,3 blocked in all_reduce waiting for rank 1, which sleeps.
    Forked by the session's zygote: forked from this process, a worker could inherit a lock
    that one of its threads held (see rallypoint.testing._zygote)."""
    directory = tmp_path_factory.mktemp("stacks")
    env = stacks_env(directory)
    port = free_port()
    pipes = [_ctx.Pipe(duplex=False) for _ in range(4)]
    procs = []
    for r in range(4):
        procs.append(
            zygote.fork(_gloo_worker_of_the_zygote, (r, 4, port, env), [1, 2, pipes[r][1].fileno()])
        )
        pipes[r][1].close()
    try:
        for r, (recv, _) in enumerate(pipes):
            assert recv.poll(30), f"rank {r} did not join the process group"
            recv.recv()
        yield {r: p.pid for r, p in enumerate(procs)}, directory
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(10)


def _collect_until_grouped(pids: dict[int, int], directory: Path) -> dict[int, StackDump]:
    """Collect until every worker is blocked: ranks 0,2,3 inside all_reduce, rank 1 asleep,
    and each rank's stack unchanged since the previous collection (a loaded machine may
    still have a rank on its way into the collective)."""
    deadline = time.monotonic() + 20
    previous: dict[int, object] = {}
    while True:
        stacks = collect_stacks(pids, timedelta(seconds=5), directory=directory)
        summaries = {
            r: stack_summary(d.main.frames) if d.main else d.error for r, d in stacks.items()
        }
        current = {r: d.main.frames if d.main else None for r, d in stacks.items()}
        reduce_ok = all(str(summaries[r]).startswith("all_reduce") for r in (0, 2, 3))
        if reduce_ok and str(summaries[1]).startswith("sleep") and current == previous:
            return stacks
        previous = dict(current)
        assert time.monotonic() < deadline, f"workers never reached all_reduce: {summaries}"
        time.sleep(0.2)


@pytest.mark.timeout(90)
def test_gloo_hang_two_groups(gloo_job: tuple[dict[int, int], Path]) -> None:
    pids, directory = gloo_job
    stacks = _collect_until_grouped(pids, directory)
    name = Path(__file__).name
    for r in (0, 2, 3):
        main = stacks[r].main
        assert main is not None
        assert stack_summary(main.frames) == f"all_reduce at {name}:{REDUCE_LINE}"
        assert any(f.name == "_fork_worker" for f in main.frames)  # the whole stack: the zygote
    main1 = stacks[1].main
    assert main1 is not None and stack_summary(main1.frames) == f"sleep at {name}:{SLEEP_LINE}"
    text = format_grouped_stacks(stacks)
    lines = text.splitlines()
    assert lines[0] == f"ranks 0,2,3: all_reduce at {name}:{REDUCE_LINE}"
    assert f"rank 1: sleep at {name}:{SLEEP_LINE}" in lines
    assert text.count("dist.all_reduce(torch.ones(1))") == 1  # the full stack once per group
    assert text.count("time.sleep(120)") == 1
    assert f"(pid {pids[2]})" in text
    # the workers are still alive and answer again (the handler stays installed)
    again = collect_stacks(pids, 5.0, directory=directory)
    assert all(d.error is None for d in again.values())


@pytest.mark.timeout(90)
def test_group_across_nodes_through_json(gloo_job: tuple[dict[int, int], Path]) -> None:
    pids, directory = gloo_job
    node_a = _collect_until_grouped(pids, directory)
    # a second "node" whose dumps came through the store as JSON, global ranks 4..7
    node_b = {}
    for r, d in node_a.items():
        record = json.loads(json.dumps(d.to_json()))
        record.update(rank=r + 4, host="nodeB")
        node_b[r + 4] = StackDump.from_json(record)
    assert StackDump.from_json(node_a[0].to_json()) == node_a[0]
    text = format_grouped_stacks({**node_a, **node_b})
    name = Path(__file__).name
    assert text.splitlines()[0] == f"ranks 0,2-4,6,7: all_reduce at {name}:{REDUCE_LINE}"
    assert f"ranks 1,5: sleep at {name}:{SLEEP_LINE}" in text
    assert "; nodeB: 4 (pid" in text


def _sleeper(env: dict[str, str], conn: Connection) -> None:
    os.environ.update(env)
    conn.send(install_stack_dumper())
    time.sleep(60)


@pytest.mark.timeout(60)
def test_workers_without_dump(tmp_path: Path) -> None:
    env = stacks_env(tmp_path)
    recv, send = _ctx.Pipe(duplex=False)
    stopped = _ctx.Process(target=_sleeper, args=(env, send), daemon=True)
    stopped.start()
    assert recv.poll(10)
    assert recv.recv() == str(tmp_path / f"{stopped.pid}.stacks")
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / f"{gone.pid}.stacks").write_text("")  # a stale file from an exited worker
    assert stopped.pid is not None
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        start = time.monotonic()
        stacks = collect_stacks(
            {0: stopped.pid, 1: plain.pid, 2: gone.pid}, 0.3, directory=tmp_path, host="h1"
        )
        assert time.monotonic() - start < 30  # its 0.3 s and no more: a bound, not a speed
        assert stacks[0].error == "no dump within 0.3 s"
        assert stacks[1].error is not None and "no stack dump handler" in stacks[1].error
        assert stacks[2].error == "process has exited"
        assert plain.poll() is None  # never signalled: still alive
        text = format_grouped_stacks(stacks)
        assert "rank 0: no stack: no dump within 0.3 s" in text
        assert "rank 1: no stack: no stack dump handler" in text
        assert "on h1: 2 (pid" in text
        os.kill(stopped.pid, signal.SIGCONT)
        stacks = collect_stacks({0: stopped.pid}, 5.0, directory=tmp_path)
        main = stacks[0].main
        assert main is not None and stack_summary(main.frames).startswith("sleep at")
    finally:
        plain.kill()
        plain.wait()
        stopped.kill()
        stopped.join(10)


def test_install_without_env_is_noop() -> None:
    assert install_stack_dumper({}) is None


def test_signal_choice(tmp_path: Path) -> None:
    assert stacks_env(tmp_path) == {
        STACKS_DIR_ENV: str(tmp_path),
        STACKS_SIGNAL_ENV: str(DEFAULT_STACKS_SIGNAL),
    }
    assert DEFAULT_STACKS_SIGNAL not in (signal.SIGUSR1, signal.SIGUSR2)
    assert stacks_env(tmp_path, signal.SIGUSR1)[STACKS_SIGNAL_ENV] == str(int(signal.SIGUSR1))
    with pytest.raises(ValueError, match="cannot be used for stack dumps"):
        stacks_env(tmp_path, signal.SIGKILL)
    with pytest.raises(ValueError, match="out of range"):
        stacks_env(tmp_path, 999)
    with pytest.raises(ValueError, match="is not a signal"):
        install_stack_dumper({STACKS_DIR_ENV: str(tmp_path), STACKS_SIGNAL_ENV: "SIGBOGUS"})
    with pytest.raises(ValueError, match="timeout must be positive"):
        collect_stacks({}, 0, directory=tmp_path)
    assert collect_stacks({}, 1.0, directory=tmp_path) == {}
    assert format_grouped_stacks({}) == ""


DUMP = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/lib/threading.py", line 320 in wait
  <no Python frame>

Current thread 0x00007f0000000002 (most recent call first):
  File "/app/train.py", line 42 in step
  File "/app/train.py", line ??? in main
  ...
"""


def test_parse_dump() -> None:
    threads = parse_faulthandler_dump(DUMP)
    assert [t.thread_id for t in threads] == ["0x00007f0000000001", "0x00007f0000000002"]
    assert [t.current for t in threads] == [False, True]
    assert threads[0].frames == (Frame("/lib/threading.py", 320, "wait"),)
    assert threads[1].frames == (
        Frame("/app/train.py", 42, "step"),
        Frame("/app/train.py", 0, "main"),
    )
    single = parse_faulthandler_dump(
        'Stack (most recent call first):\n  File "a.py", line 1 in f\n'
    )
    assert single[0].frames == (Frame("a.py", 1, "f"),)
    with pytest.raises(ValueError, match="not a faulthandler dump"):
        parse_faulthandler_dump("Traceback (most recent call last):\n  oops\n")


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="malformed stack dump record"):
        StackDump.from_json({"rank": 0})
    with pytest.raises(ValueError, match="malformed stack dump record"):
        StackDump.from_json({"rank": "x", "host": "", "pid": None, "error": None, "threads": []})


def test_summary_rules() -> None:
    lib = sysconfig.get_paths()["purelib"] + "/torch/distributed/"
    user = Frame("/app/train.py", 42, "step", "loss = model(next(batch))")
    # decorator frames and private helpers are skipped: the public name user code called
    frames = (
        Frame(lib + "c10d.py", 9, "_inner_work"),
        Frame(lib + "c10d.py", 5, "barrier"),
        Frame(lib + "logger.py", 3, "wrapper"),
        user,
    )
    assert stack_summary(frames) == "barrier at train.py:42"
    # only private library frames: the one called directly
    assert stack_summary((Frame(lib + "x.py", 1, "_private"), user)) == "_private at train.py:42"
    # blocked in C: the call on the source line (outermost call of the statement)
    assert stack_summary((user,)) == "model at train.py:42"
    assert stack_summary((Frame("/app/t.py", 7, "main", "while True:"),)) == "in main at t.py:7"
    assert stack_summary((Frame("/app/t.py", 8, "main", "x = f(1"),)) == "f at t.py:8"
    assert stack_summary((Frame(lib + "q.py", 2, "get"),)) == "get at q.py:2"
    assert stack_summary(()) == "no Python frames"


def _agent_loop(
    port: int,
    node_rank: int,
    collect: Callable[[], Mapping[int, StackDump]],
    stop: threading.Event,
    ready: threading.Barrier,
) -> None:
    import torch.distributed as dist

    store = dist.PrefixStore("rallypoint/job1/", dist.TCPStore("127.0.0.1", port, is_master=False))
    # requests from before this agent started are not its
    answers = StacksAnswers(answered=latest_stacks_request(store))
    publish_node_count(store, 2)
    ready.wait(30)
    while not stop.is_set():
        answer_stacks_request(store, node_rank=node_rank, answers=answers, collect=collect)
        time.sleep(0.01)


@pytest.mark.timeout(90)
def test_exchange_across_nodes_through_tcpstore(gloo_job: tuple[dict[int, int], Path]) -> None:
    import torch.distributed as dist

    pids, directory = gloo_job
    _collect_until_grouped(pids, directory)  # steady state first
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    same_files = threading.Lock()  # both "nodes" dump the same workers into the same files

    def collector(node: int) -> Callable[[], Mapping[int, StackDump]]:
        def collect() -> dict[int, StackDump]:
            with same_files:
                local = collect_stacks(pids, 5.0, directory=directory, host=f"node{node}")
            # node 1 pretends its workers are global ranks 4..7
            return {r + 4 * node: replace(d, rank=r + 4 * node) for r, d in local.items()}

        return collect

    stops = [threading.Event(), threading.Event()]
    ready = threading.Barrier(3)
    agents = [
        threading.Thread(target=_agent_loop, args=(master.port, n, collector(n), stops[n], ready))
        for n in (0, 1)
    ]
    requester = dist.PrefixStore(
        "rallypoint/job1/", dist.TCPStore("127.0.0.1", master.port, is_master=False)
    )
    try:
        for a in agents:
            a.start()
        ready.wait(30)
        dumps, missing = request_stacks(requester, timeout=20)
        assert missing == {}
        assert sorted(dumps) == list(range(8))
        text = format_grouped_stacks(dumps)
        name = Path(__file__).name
        assert text.splitlines()[0] == f"ranks 0,2-4,6,7: all_reduce at {name}:{REDUCE_LINE}"
        assert "on node0: 0 (pid" in text and "; node1: 4 (pid" in text

        # node 1's agent dies: its answer is missing after the timeout, node 0 still answers
        # (within 3 s: it collects 4 workers' stacks, slow on a loaded host)
        stops[1].set()
        agents[1].join(10)
        start = time.monotonic()
        dumps, missing = request_stacks(requester, timeout=3)
        assert time.monotonic() - start < 10
        assert missing == {1: "no answer within 3 s"}
        assert sorted(dumps) == [0, 1, 2, 3]

        # garbage under our keys is reported, never a crash or a hang
        latest = requester.add("stacks/request", 0)
        requester.set(f"stacks/{latest + 1}/node/1", "{not json")
        dumps, missing = request_stacks(requester, timeout=3)
        assert sorted(dumps) == [0, 1, 2, 3]
        assert missing[1].startswith("unreadable answer")
    finally:
        for s in stops:
            s.set()
        for a in agents:
            if a.is_alive():
                a.join(10)


def test_request_without_agents() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    with pytest.raises(ValueError, match="is it running"):
        request_stacks(store, timeout=0.1)
    store.set("stacks/nnodes", "two")
    with pytest.raises(ValueError, match="bad node count 'two'"):
        request_stacks(store, timeout=0.1)
    with pytest.raises(ValueError, match="timeout must be positive"):
        request_stacks(store, timeout=0, nnodes=1)
    # no request pending: answering is one cheap read and calls nothing
    answers = StacksAnswers()
    answer_stacks_request(store, node_rank=0, answers=answers, collect=dict)
    assert answers.answered == 0


@pytest.mark.timeout(30)
def test_a_node_counted_twice_does_not_end_the_request_before_the_others_answer() -> None:
    """Two threads of one agent may answer the same request (its store checks and a hang
    report's loop): the count then reaches the node count before the last node answered.
    The requester still waits for every node's answer, not for the count alone."""
    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    dump = {0: StackDump(rank=0, host="a", pid=10, threads=())}
    result: dict[str, Any] = {}
    requester = threading.Thread(
        target=lambda: result.update(r=request_stacks(store, timeout=15, nnodes=2))
    )
    requester.start()
    deadline = time.monotonic() + 10
    while store.add("stacks/request", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    for answers in (StacksAnswers(), StacksAnswers()):  # node 0, answering from two threads
        answer_stacks_request(store, node_rank=0, answers=answers, collect=lambda: dump)
    assert store.add("stacks/1/count", 0) == 2  # as many as there are nodes
    while store.check(["stacks/1/node/0"]):  # the requester read node 0's answer (and
        time.sleep(0.01)  # deleted it); it must wait on for node 1's
    late = {2: StackDump(rank=2, host="b", pid=20, threads=())}
    answer_stacks_request(store, node_rank=1, answers=StacksAnswers(), collect=lambda: late)
    requester.join(20)
    dumps, missing = result["r"]
    assert sorted(dumps) == [0, 2] and missing == {}


def _huge_stacks() -> dict[int, StackDump]:
    """Two ranks whose stacks hold a 4 MiB source line each."""
    frame = Frame("/app/train.py", 7, "main", "x" * (4 << 20))
    thread = ThreadStack("0x1", True, (frame,))
    return {r: StackDump(rank=r, host="h", pid=100 + r, threads=(thread,)) for r in (0, 1)}


@pytest.mark.timeout(60)
def test_a_flood_of_requests_cannot_make_an_agent_store_much() -> None:
    """Any store client can bump the request counter: the agent answers the newest request
    at most once per MIN_ANSWER_INTERVAL, within MAX_ANSWER_BYTES (cut, with a note), keeps
    at most MAX_KEPT answers in the store and removes the ones nobody collects."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore("job1", dist.TCPStore("127.0.0.1", master.port))  # "job1/" + key
    attacker = dist.TCPStore("127.0.0.1", master.port, is_master=False)
    collected: list[int] = []

    def collect() -> dict[int, StackDump]:
        collected.append(1)
        return _huge_stacks()

    def flood(answers: StacksAnswers, requests: int) -> None:
        for _ in range(requests):
            attacker.add("job1/stacks/request", 1)
            answer_stacks_request(store, node_rank=0, answers=answers, collect=collect)

    def answers_kept() -> list[bytes]:
        latest = attacker.add("job1/stacks/request", 0)
        keys = [f"stacks/{n}/node/0" for n in range(1, latest + 1)]
        return [store.get(k) for k in keys if store.check([k])]

    start = time.monotonic()
    flood(StacksAnswers(answered=latest_stacks_request(store)), 200)
    assert 1 <= len(collected) <= 1 + (time.monotonic() - start) / MIN_ANSWER_INTERVAL
    assert 1 <= len(answers_kept()) <= MAX_KEPT

    eager = StacksAnswers(answered=latest_stacks_request(store), min_interval=0.0)
    collected.clear()
    flood(eager, 20)
    assert len(collected) == 20  # without the interval: each request answered...
    kept = answers_kept()
    assert len(kept) <= MAX_KEPT + 1  # ...and only the newest few kept (one from above)
    for raw in kept:
        answer = json.loads(raw)
        assert len(raw) <= MAX_ANSWER_BYTES
        assert answer["note"].endswith("only main threads, no source lines"), answer["note"]
    assert master.num_keys() <= 2 + 2 * (MAX_KEPT + 1)  # request, answers and their counts

    brief = StacksAnswers(answered=latest_stacks_request(store), min_interval=0.0, keep_for=0.0)
    flood(brief, 1)
    answer_stacks_request(store, node_rank=0, answers=brief, collect=collect)  # a tick later
    latest = attacker.add("job1/stacks/request", 0)
    assert not store.check([f"stacks/{latest}/node/0"]), "nobody collected it: removed"


@pytest.mark.timeout(60)
def test_rallypoint_stacks_leaves_no_answer_in_the_store(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch.distributed as dist

    from rallypoint._cli._stacks import stacks_main
    from rallypoint._elastic._rendezvous import create_rendezvous, run_store_namespace

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{master.port}"
    conf = {"is_host": "false", "read_timeout": "10"}
    handler = create_rendezvous("c10d", endpoint, "job1", 1, 1, conf)
    store = handler.open_run_store(run_store_namespace("job1"))
    answers = StacksAnswers(answered=latest_stacks_request(store))
    publish_node_count(store, 1)
    before = master.num_keys()
    stop = threading.Event()

    def agent() -> None:
        while not stop.is_set():
            answer_stacks_request(store, node_rank=0, answers=answers, collect=_huge_stacks)
            time.sleep(0.01)

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    try:
        code = stacks_main(["--rdzv-endpoint", endpoint, "--rdzv-id", "job1", "--timeout", "20"])
    finally:
        stop.set()
        thread.join(10)
    out = capsys.readouterr().out
    assert "ranks 0,1: " in out and "train.py:7" in out
    assert "node 0: answered in part: over 1048576 bytes: only main threads" in out
    assert code == 1  # a node answered in part
    assert master.num_keys() == before, "the answer and the request's count are gone"
