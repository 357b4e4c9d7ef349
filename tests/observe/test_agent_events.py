"""The --events JSON-lines log: writing from threads and processes, strict reading."""

from __future__ import annotations

import json
import math
import multiprocessing
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint.observe._events import Event, EventLog, EventLogError, read_events


def test_emit_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "ev.jsonl"
    times = iter([100.0, 101.5, 99.0])
    with EventLog(path, node="hostA", clock=lambda: next(times)) as log:
        e1 = log.emit("round", round=0, world_size=4)
        log.emit("worker_start", rank=3, local_rank=1, pid=123, round=0)
        log.emit("members", node="hostB", members=["hostA", "hostB"])
    assert e1 == Event(ts=100.0, kind="round", node="hostA", fields={"round": 0, "world_size": 4})
    lines = path.read_text().splitlines()
    assert json.loads(lines[1]) == {
        "ts": 101.5,
        "kind": "worker_start",
        "node": "hostA",
        "rank": 3,
        "local_rank": 1,
        "pid": 123,
        "round": 0,
    }
    events = read_events(path)
    assert [e.kind for e in events] == ["members", "round", "worker_start"]  # sorted by ts
    assert events[0].node == "hostB"
    assert events[2].rank == 3 and events[2].local_rank == 1 and events[2].get("pid") == 123
    assert events[2].get("missing", "d") == "d"
    assert events[1].to_dict() == json.loads(lines[0])


def test_merge_several_files(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"ts": 3, "kind": "x"}\n\n{"ts": 1, "kind": "y"}\n')
    b.write_text('{"ts": 2, "kind": "z", "node": "n2"}\n')
    assert [e.kind for e in read_events([a, str(b)])] == ["y", "z", "x"]


def _writer(path: str, wid: int, n: int) -> None:
    with EventLog(path, node=f"p{wid}") as log:
        for i in range(n):
            log.emit("tick", rank=wid, i=i, pad="x" * 500)


def test_concurrent_threads_and_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "ev.jsonl")
    log = EventLog(path, node="main")
    threads = [
        threading.Thread(target=lambda t=t: [log.emit("t", rank=t, i=i) for i in range(200)])
        for t in range(4)
    ]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, 10 + p, 200)) for p in range(2)]
    for w in [*threads, *procs]:
        w.start()
    for t in threads:
        t.join()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    log.close()
    events = read_events(path)  # every line parses: no interleaving
    assert len(events) == 4 * 200 + 2 * 200
    for wid in (10, 11):
        assert [e.get("i") for e in events if e.rank == wid] == list(range(200))


def test_emit_bad_input(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "e.jsonl")
    with pytest.raises(ValueError, match="non-empty str"):
        log.emit("")
    with pytest.raises(ValueError, match=r"'ts' is set by EventLog\.emit"):
        log.emit("x", ts=1.0)
    with pytest.raises(ValueError, match="rank must be a non-negative int"):
        log.emit("x", rank=-1)
    with pytest.raises(ValueError, match="local_rank must be a non-negative int"):
        log.emit("x", local_rank=True)
    with pytest.raises(TypeError, match="cannot be written as JSON"):
        log.emit("x", obj=object())
    with pytest.raises(ValueError, match="cannot be written as JSON"):
        log.emit("x", v=math.nan)
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError, match="is closed"):
        log.emit("x")
    with pytest.raises(TypeError, match="node must be a str"):
        EventLog(tmp_path / "f.jsonl", node=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot open events file"):
        EventLog(tmp_path / "no" / "such" / "dir.jsonl")
    assert (tmp_path / "e.jsonl").read_text() == ""  # nothing half-written


@pytest.mark.parametrize(
    ("content", "lineno", "message"),
    [
        ('{"ts": 1, "kind": "a"}\n{"ts": 2, "kind": "b"\n', 2, "not valid JSON"),
        ("[1, 2]\n", 1, "expected a JSON object, got list"),
        ('{"kind": "a"}\n', 1, "'ts' must be a finite number"),
        ('{"ts": "now", "kind": "a"}\n', 1, "'ts' must be a finite number"),
        ('{"ts": true, "kind": "a"}\n', 1, "'ts' must be a finite number"),
        ('{"ts": NaN, "kind": "a"}\n', 1, "not valid JSON (NaN is not a JSON value)"),
        ('{"ts": 1, "kind": "a", "x": -Infinity}\n', 1, "-Infinity is not a JSON value"),
        ('{"ts": 1e999, "kind": "a"}\n', 1, "'ts' must be a finite number"),
        ('\n\n{"ts": 1}\n', 3, "'kind' must be a non-empty string"),
        ('{"ts": 1, "kind": "a", "node": 5}\n', 1, "'node' must be a string"),
        ('{"ts": 1, "kind": "a", "rank": "0"}\n', 1, "'rank' must be an integer"),
        ('{"ts": 1, "kind": "a", "local_rank": -2}\n', 1, "'local_rank' must be >= 0"),
    ],
)
def test_read_malformed(tmp_path: Path, content: str, lineno: int, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(EventLogError) as info:
        read_events(path)
    assert info.value.lineno == lineno
    assert str(info.value).startswith(f"{path}:{lineno}: ")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_read_unreadable(tmp_path: Path) -> None:
    with pytest.raises(EventLogError, match="cannot read events file"):
        read_events(tmp_path / "missing.jsonl")
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"ts": 1, "kind": "a"}\n\xff\xfe\n')
    with pytest.raises(EventLogError, match="not UTF-8"):
        read_events(path)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.builds(
                lambda d: json.dumps(d).encode(),
                st.dictionaries(
                    st.sampled_from(["ts", "kind", "node", "rank", "local_rank", "x"]),
                    st.one_of(
                        st.none(),
                        st.booleans(),
                        st.integers(-3, 3),
                        st.floats(),
                        st.text(max_size=4),
                    ),
                ),
            ),
        ),
        max_size=6,
    )
)
def test_reader_never_crashes(tmp_path_factory: pytest.TempPathFactory, lines: list[bytes]) -> None:
    """Arbitrary bytes: either valid events or an EventLogError naming a line, nothing else."""
    path = tmp_path_factory.mktemp("fuzz") / "e.jsonl"
    path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
    try:
        events = read_events(path)
    except EventLogError as exc:
        assert 0 <= exc.lineno <= len(lines) + 1
        return
    for e in events:
        assert math.isfinite(e.ts) and e.kind
        json.dumps(e.to_dict(), allow_nan=False)
