"""The collective-level analysis of a hang on hand-made Flight Recorder traces."""

from __future__ import annotations

import json

from rallypoint._watch._flight._analysis import RootKind, analyse
from rallypoint._watch._flight._format import format_hang_report, hang_report
from rallypoint._watch._flight._recorder import merged_dumps, trace_from_dump
from rallypoint._watch._flight._records import FlightEntry, GroupTrace, RankTrace
from rallypoint._watch._stacks import StackDump

USER = ("/home/u/train.py", 15, "<module>")


def _entry(seq: int, op: str = "all_reduce", size: int = 4, done: bool = True) -> FlightEntry:
    return FlightEntry(seq, op, ((size,),), ("Float",), 1000 * seq, done, (USER,))


def _group(name: str, ranks: tuple[int, ...], issued: int, done: int, **kw: object) -> GroupTrace:
    op = str(kw.get("op", "all_reduce"))
    size = int(kw.get("size", 4))  # type: ignore[call-overload]
    entries = tuple(
        _entry(s, op if s == issued else "all_reduce", size if s == issued else 4, s <= done)
        for s in range(1, issued + 1)
    )
    return GroupTrace(name, ranks, issued, done, entries, world=name == "0")


def _world(rank: int, issued: int, done: int, **kw: object) -> RankTrace:
    return RankTrace(rank, (_group("0", (0, 1, 2, 3), issued, done, **kw),))


def test_a_rank_that_never_issued_is_the_root() -> None:
    traces = {r: _world(r, 5, 4) for r in (0, 1, 3)} | {2: _world(2, 4, 4)}
    diag = analyse(traces)
    assert diag.root is not None
    assert (diag.root.rank, diag.root.kind, diag.root.group.stuck_seq) == (
        2, RootKind.NEVER_ISSUED, 5
    )  # fmt: skip
    assert diag.root.group.missing == (2,) and diag.root.group.waiting == (0, 1, 3)


def test_the_root_is_followed_across_groups() -> None:
    # world [0-3] at #4: ranks 0,1 wait; rank 2 waits in group [2, 3] #1; rank 3 in neither
    def trace(rank: int, world: tuple[int, int], pair: tuple[int, int]) -> RankTrace:
        name, ranks = ("1", (0, 1)) if rank < 2 else ("2", (2, 3))
        return RankTrace(rank, (_group("0", (0, 1, 2, 3), *world), _group(name, ranks, *pair)))

    traces = {
        0: trace(0, (4, 3), (1, 1)),
        1: trace(1, (4, 3), (1, 1)),
        2: trace(2, (3, 3), (1, 0)),
        3: trace(3, (3, 3), (0, 0)),
    }
    diag = analyse(traces)
    assert diag.root is not None and diag.root.rank == 3
    assert diag.root.group.ranks == (2, 3) and diag.root.group.stuck_seq == 1
    assert diag.root.led_from == 3  # ranks 0, 1 and 2 all end at rank 3
    assert [r.rank for r in diag.roots] == [3]  # rank 2 is a victim, not a root


def test_a_mismatch_when_everyone_waits() -> None:
    traces = {r: _world(r, 7, 6) for r in (0, 2, 3)} | {1: _world(1, 7, 6, op="broadcast")}
    diag = analyse(traces)
    assert diag.root is not None
    assert (diag.root.rank, diag.root.kind, diag.root.group.stuck_seq) == (
        1, RootKind.MISMATCH, 7
    )  # fmt: skip
    traces = {r: _world(r, 7, 6) for r in (0, 1, 2)} | {3: _world(3, 7, 6, size=8)}
    root = analyse(traces).root
    assert root is not None and (root.rank, root.group.mismatched) == (3, (3,))


def test_report_text_json_round_trip_and_fallback() -> None:
    traces = {r: _world(r, 5, 4) for r in (0, 1, 3)} | {2: _world(2, 4, 4)}
    dumps = {
        r: StackDump(rank=r, host="h", pid=100 + r, flight=RankTrace.from_json(
            json.loads(json.dumps(t.to_json()))))
        for r, t in traces.items()
    }  # fmt: skip
    text = format_hang_report(dumps)
    lines = text.splitlines()
    assert lines[:4] == [
        "Root cause (Flight Recorder):",
        "  rank       : 2",
        "  host       : h (pid 102)",
        "  collective : all_reduce #5 of world [0, 1, 2, 3]: rank 2 never issued it",
    ]
    assert "  issued at  : train.py:15 (ranks 0,1,3)" in lines
    # the failure summary's one line, from the same analysis
    assert hang_report(dumps) == (
        text,
        "rank 2 on h (pid 102): all_reduce #5 of world [0, 1, 2, 3]: rank 2 never issued it",
        2,
    )
    off = {r: StackDump(rank=r, host="h", pid=1, flight=RankTrace(r, error="recording off"))
           for r in range(2)}  # fmt: skip
    assert format_hang_report(off).startswith("No Flight Recorder data (recording off)")
    assert hang_report(off).culprit == "" and hang_report(off).rank is None
    assert analyse({r: _world(r, 4, 4) for r in range(4)}).root is None


def test_torchs_dump_becomes_a_trace() -> None:
    frames = [
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 1},
        {"name": "<module>", "filename": "/home/u/train.py", "line": 9},
    ]
    dump = {
        "pg_status": {
            "0": {"last_enqueued_collective": 2, "last_completed_collective": 1},
            "1": {"last_enqueued_collective": 1, "last_completed_collective": -1},
        },
        "entries": [
            {"pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": s,
             "profiling_name": "gloo:all_reduce", "time_created_ns": s, "input_sizes": [[4]],
             "input_dtypes": ["Float"], "retired": s == 1, "frames": frames, "is_p2p": False}
            for s in (1, 2)
        ] + [
            {"pg_id": 1, "process_group": ("1", "undefined"), "collective_seq_id": 1,
             "profiling_name": "gloo:broadcast", "time_created_ns": 5, "input_sizes": [[2]],
             "input_dtypes": ["Float"], "retired": False, "frames": frames, "is_p2p": False},
            {"pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 0,
             "p2p_seq_id": 1, "profiling_name": "gloo:send", "time_created_ns": 6,
             "input_sizes": [[2]], "input_dtypes": ["Float"], "is_p2p": True, "frames": []},
        ],
    }  # fmt: skip
    trace = trace_from_dump(1, dump, {"0": ((0, 1), True), "1": ((1, 3), False)})
    world, pair = trace.groups
    assert (world.name, world.world, world.issued, world.completed) == ("0", True, 2, 1)
    assert [e.seq for e in world.entries] == [1, 2] and world.entries[1].op == "all_reduce"
    assert (pair.ranks, pair.issued, pair.completed) == ((1, 3), 1, 0)  # -1: none completed
    assert pair.entries[0].frames[1] == ("/home/u/train.py", 9, "<module>")


def _nccl_entry(seq: int, state: str) -> dict[str, object]:
    # the shape torch 2.11+cu130's NCCL recorder gave on an H200
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ("0", "default_pg"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "profiling_name": "nccl:all_reduce",
            "time_created_ns": 100 + seq, "input_sizes": [[1024]], "input_dtypes": ["Float"],
            "state": state, "time_discovered_started_ns": None, "retired": False,
            "is_p2p": False}  # fmt: skip


def test_nccls_recorder_is_merged_and_its_lagging_status_is_not_believed() -> None:
    """NCCL keeps its own recorder (``_dump_nccl_trace``), whose status still said nothing
    completed while its entries said ``completed`` (seen on an H200)."""
    gloo = {"entries": [], "pg_status": {}}
    nccl = {
        "pg_status": {"0": {"last_enqueued_collective": 3, "last_completed_collective": -1}},
        "entries": [{**_nccl_entry(1, "completed"), "duration_ms": 0.002496},
                    _nccl_entry(2, "completed"), _nccl_entry(3, "started")],
    }  # fmt: skip
    dump = merged_dumps([gloo, nccl])
    assert dump["pg_status"] == nccl["pg_status"] and len(dump["entries"]) == 3
    (world,) = trace_from_dump(0, dump, {"0": ((0, 1), True)}).groups
    assert (world.issued, world.completed) == (3, 2)
    assert [e.completed for e in world.entries] == [True, True, False]
    assert [e.duration_ns for e in world.entries] == [2496, None, None]  # duration_ms, in ns
    assert FlightEntry.from_json(world.entries[0].to_json()) == world.entries[0]
    assert FlightEntry.from_json(world.entries[0].to_json()[:7]).duration_ns is None  # older
    newer = {"0": {"last_enqueued_collective": 5, "last_completed_collective": 5}}
    merged = merged_dumps([{"pg_status": newer}, nccl])
    assert merged["pg_status"] == newer  # the recorder that saw more of the group wins


def test_a_member_without_data_is_the_suspect() -> None:
    # rank 2 did not answer (a busy loop under load): the others wait in #5
    traces = {r: _world(r, 5, 4) for r in (0, 1, 3)} | {2: RankTrace(2, error="no dump")}
    diag = analyse(traces)
    assert diag.root is not None
    assert (diag.root.rank, diag.root.kind, diag.root.group.stuck_seq) == (
        2, RootKind.NO_DATA, 5
    )  # fmt: skip
    dumps = {r: StackDump(rank=r, host="h", pid=r, flight=t) for r, t in traces.items()}
    text = format_hang_report(dumps)
    assert "  rank       : 2" in text and "all_reduce #5 of world" in text
    assert "rank 2 sent no Flight Recorder data" in text
    assert "no Flight Recorder data from rank 2: no dump" in text


def test_a_rank_proven_never_to_issue_beats_one_that_sent_nothing() -> None:
    # rank 2 never issued #5 (its trace says so); rank 0, a waiter, did not answer in time
    # (a loaded machine): the evidence names rank 2, rank 0 is only a suspect after it
    traces = {r: _world(r, 5, 4) for r in (1, 3)} | {2: _world(2, 4, 4)}
    traces[0] = RankTrace(0, error="no Flight Recorder dump within 10 s")
    diag = analyse(traces)
    assert [(r.rank, r.kind) for r in diag.roots] == [
        (2, RootKind.NEVER_ISSUED),
        (0, RootKind.NO_DATA),
    ]
