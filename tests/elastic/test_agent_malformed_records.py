"""What any client of a job's store can write there does not end the job: a stacks request
counter that is not a number, and exclusion records with a bad field, each get one line on
stderr that names the key, and the job goes on. Real agents on a real TCPStore hosted in a
process of its own (``endpoint``)."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rallypoint._elastic._records import ExclusionRecord
from rallypoint._elastic._stores import RunStore

pytestmark = pytest.mark.slow

WORKER = """
import os, sys, time
import torch.distributed as dist
out = sys.argv[1]
dist.init_process_group("gloo")
open(os.path.join(out, "started"), "w").close()
while not os.path.exists(os.path.join(out, "finish")):
    time.sleep(0.05)
dist.destroy_process_group()
print("trained", flush=True)
"""
RUN = "rec"
JOB = f"rallypoint/{RUN}/job"


def _client(endpoint: str):  # type: ignore[no-untyped-def]
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported

    host, port = endpoint.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, wait_for_workers=False)


def _agent(endpoint: str, out: Path) -> subprocess.Popen[str]:
    (out / "worker.py").write_text(WORKER)
    cmd = [
        sys.executable, "-m", "rallypoint", "run", "--nnodes", "1:2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint, "--rdzv-id", RUN,
        "--rdzv-conf", "is_host=false,read_timeout=20,last_call_timeout=1",
        str(out / "worker.py"), str(out),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until(path: Path, agent: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert agent.poll() is None, agent.communicate()
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.05)


def _end(agent: subprocess.Popen[str], out: Path, *, after: float = 0.0) -> tuple[int, str]:
    time.sleep(after)  # some monitor ticks of the agent
    (out / "finish").write_text("")
    try:
        stdout, stderr = agent.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        agent.kill()
        raise AssertionError(f"the agent did not end: {agent.communicate()}") from None
    return agent.returncode, stdout + stderr


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("rallypoint: warning:")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["before", "during"])
def test_a_stacks_request_counter_that_is_no_number_is_one_line(
    tmp_path: Path, endpoint: str, when: str
) -> None:
    key = f"{JOB}/stacks/request"
    client = _client(endpoint)
    if when == "before":
        client.set(key, "x")
    agent = _agent(endpoint, tmp_path)
    try:
        _until(tmp_path / "started", agent)
        if when == "during":
            client.set(key, "not a count")
        code, text = _end(agent, tmp_path, after=1.0)
    finally:
        agent.kill()
    assert code == 0 and "trained" in text, text
    value = b"x" if when == "before" else b"not a count"
    assert _warnings(text) == [
        f"rallypoint: warning: the key {key!r} holds {value!r}, not a request count; requests "
        "for stacks are not answered while it does, the job goes on"
    ], text
    assert client.get(key) == value, "left as it was"


@pytest.mark.timeout(60)
def test_rallypoint_stacks_names_a_malformed_counter_and_keeps_its_connection(
    endpoint: str,
) -> None:
    from rallypoint._watch._stacks_exchange import MalformedRequestCounter, latest_stacks_request

    client = _client(endpoint)
    client.set(f"{JOB}/stacks/nnodes", "1")
    client.set(f"{JOB}/stacks/request", "1.5")
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint", "stacks", "--rdzv-endpoint", endpoint,
         "--rdzv-id", RUN, "--timeout", "5"],
        capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert proc.returncode == 2, proc
    assert proc.stderr.strip().splitlines() == [
        f"rallypoint stacks: error: the key '{JOB}/stacks/request' holds b'1.5', not a "
        "request count"
    ], proc.stderr
    # the cause: torch's server drops the connection of a client that adds to such a value;
    # the counter is read with compare_set, after which the connection still serves
    with pytest.raises(MalformedRequestCounter):
        latest_stacks_request(_prefixed(client))
    assert client.get(f"{JOB}/stacks/nnodes") == b"1"


def _prefixed(client):  # type: ignore[no-untyped-def]
    from torch.distributed import PrefixStore  # type: ignore[attr-defined]

    return PrefixStore(JOB, client)


@pytest.mark.timeout(120)
def test_exclusion_records_with_a_bad_field_are_ignored_with_one_line_each(
    tmp_path: Path, endpoint: str
) -> None:
    host = socket.gethostname()
    key = f"{JOB}/excluded"
    records = [
        {"node": "n1", "host": host, "reason": "r", "time": None},
        {"node": "n2", "host": host, "reason": "r", "time": 1e999},
        {"node": 3, "host": host, "reason": "r", "time": 1.5},
        {"node": "n4", "host": host, "reason": "r", "time": 86400.0},  # a good one
    ]
    _client(endpoint).set(key, json.dumps(records))  # 1e999 is written as Infinity
    agent = _agent(endpoint, tmp_path)
    try:
        _until(tmp_path / "started", agent)
        code, text = _end(agent, tmp_path)
    finally:
        agent.kill()
    assert code == 0 and "trained" in text, text
    start = f"rallypoint: warning: the key {key!r} holds a malformed exclusion record"
    assert _warnings(text) == [
        f"{start} (item 0): 'time' must be a Unix time, got None; it is ignored",
        f"{start} (item 1): 'time' must be a Unix time, got inf; it is ignored",
        f"{start} (item 2): 'node' must be a string, got 3; it is ignored",
    ], text
    assert f"agent n4 on this host ({host}) was excluded from job {RUN!r} at 1970-01-0" in text


@pytest.mark.timeout(10)
def test_an_exclusion_keeps_the_records_it_cannot_read() -> None:
    from torch.distributed import HashStore  # type: ignore[attr-defined]

    said: list[str] = []
    run = RunStore(HashStore(), "rallypoint/job1/job", say=said.append)
    bad = [{"node": "a", "host": "h", "reason": "r", "time": math.nan}, "junk"]
    run.store.set("excluded", json.dumps(bad))
    good = ExclusionRecord(node="b", host="h", reason="why", time=1.5)
    run.exclude(good)
    assert run.exclusions() == [good]
    stored = json.loads(bytes(run.store.get("excluded")))
    assert stored[1:] == ["junk", json.loads(good.to_json())], "kept as they were"
    assert math.isnan(stored[0]["time"])
    assert len(said) == 2 and all("'rallypoint/job1/job/excluded'" in s for s in said), said
    run.exclusions()
    assert len(said) == 2, "each said once"
