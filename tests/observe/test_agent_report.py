"""rallypoint report: a realistic two-node job with a failure, a restart and a hang."""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rallypoint._cli._report import report_main
from rallypoint.observe._events import Event, EventLog, read_events
from rallypoint.observe._report import render_report, timeline_svg
from rallypoint.observe._timeline import build_timeline


def _write_job(directory: Path) -> list[Path]:
    """Two agents, each writing its own file, as on two machines."""
    now = [1_700_000_000.0]

    def clock() -> float:
        return now[0]

    paths = [directory / "nodeA.jsonl", directory / "nodeB.jsonl"]
    a = EventLog(paths[0], node="nodeA", clock=clock)
    b = EventLog(paths[1], node="nodeB", clock=clock)
    pid = iter(range(1000, 2000))
    for rnd, log_world in ((0, 4), (1, 4)):
        for log in (a, b):
            log.emit("round", round=rnd, world_size=log_world, run_id="job7")
        a.emit("members", round=rnd, members=["nodeA", "nodeB"])
        now[0] += 0.2
        pids = {}
        for rank in range(4):
            log, lr = (a, rank) if rank < 2 else (b, rank - 2)
            pids[rank] = next(pid)
            log.emit("worker_start", rank=rank, local_rank=lr, round=rnd, pid=pids[rank])
            now[0] += 0.05
        if rnd == 0:
            now[0] += 3.0
            b.emit(
                "worker_exit",
                rank=3,
                local_rank=1,
                round=0,
                pid=pids[3],
                state="failed",
                exitcode=-9,
                signal="SIGKILL",
            )
            b.emit("failure", rank=3, round=0, exitcode=-9, message="killed by SIGKILL")
            now[0] += 0.3
            for rank in range(3):
                log = a if rank < 2 else b
                log.emit(
                    "worker_exit",
                    rank=rank,
                    local_rank=rank % 2,
                    round=0,
                    pid=pids[rank],
                    state="terminated",
                    exitcode=-15,
                )
            a.emit("restart", round=1, restart_count=1, reason="rank 3 failed")
        else:
            now[0] += 2.0
            a.emit("hang", round=1, idle_s=1.5, action="stacks printed, waiting")
            now[0] += 2.0
            for rank in (0, 1, 2):  # rank 3 never reports an exit: drawn to job end
                log = a if rank < 2 else b
                log.emit(
                    "worker_exit",
                    rank=rank,
                    local_rank=rank % 2,
                    round=1,
                    pid=pids[rank],
                    state="succeeded",
                    exitcode=0,
                )
            now[0] += 0.1
            a.emit("job_end", status="succeeded", exitcode=0)
    a.close()
    b.close()
    return paths


@pytest.fixture
def job(tmp_path: Path) -> list[Path]:
    return _write_job(tmp_path)


def test_timeline_model(job: list[Path]) -> None:
    tl = build_timeline(read_events(job))
    assert tl.ranks == [0, 1, 2, 3]
    assert tl.title == "rallypoint job job7"
    assert len(tl.bars) == 8
    states = sorted((b.rank, b.state) for b in tl.bars)
    assert states.count((3, "failed")) == 1
    assert [s for r, s in states if r == 0] == ["succeeded", "terminated"]
    open_bar = [b for b in tl.bars if b.rank == 3 and b.state == "terminated"]
    assert open_bar and open_bar[0].label.endswith("no exit recorded")
    kinds = sorted(m.kind for m in tl.marks)
    assert kinds == ["failure", "hang", "job_end", "restart", "round", "round"]  # once per round
    failure = next(m for m in tl.marks if m.kind == "failure")
    assert failure.rank == 3
    assert failure.label == "root cause: rank 3 on nodeB: killed by SIGKILL"
    failed = next(b for b in tl.bars if b.state == "failed")
    assert "killed by SIGKILL" in failed.label and "on nodeB" in failed.label


def test_html_is_self_contained_svg(job: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "t.html"
    assert render_report(read_events(job), out) == str(out)
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>")
    svg = text[text.index("<svg") : text.index("</svg>") + 6]
    root = ET.fromstring(svg)  # well-formed
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text or "" for t in root.iter(f"{ns}title")]
    assert any("killed by SIGKILL" in t for t in titles)
    assert any(t.startswith("restart 1: rank 3 failed") for t in titles)
    assert any("hang (2 s without progress)" in t for t in titles)
    bars = [g for g in root.iter(f"{ns}g") if g.get("id", "").startswith("bar-")]
    assert len(bars) == 8
    assert all(g.find(f"{ns}title") is not None for g in bars)  # a tooltip on each
    # no external assets: the only URL is the SVG namespace
    assert re.findall(r"https?://[^\"' ]+", text) == ["http://www.w3.org/2000/svg"]
    assert "<script" not in text and "<link" not in text
    for label in ("rank 0", "rank 3", "worker failed", "root-cause failure", "restart"):
        assert label in text


def test_svg_output(job: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "t.svg"
    render_report(read_events(job), out)
    ET.fromstring(out.read_text())


def test_png(job: list[Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    backend = matplotlib.get_backend()
    had_pyplot = "matplotlib.pyplot" in sys.modules
    out = tmp_path / "t.png"
    render_report(read_events(job), out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    assert matplotlib.get_backend() == backend  # global state untouched
    assert had_pyplot or "matplotlib.pyplot" not in sys.modules  # no pyplot state machine


def test_png_odd_text(tmp_path: Path) -> None:
    """User-chosen names with '$' or '<' are drawn literally (no mathtext, no markup)."""
    pytest.importorskip("matplotlib")
    events = [
        Event(ts=0.0, kind="round", fields={"round": "$x^$", "run_id": "job $1 <b>"}),
        Event(ts=1.0, kind="worker_start", rank=0, node="n$", fields={"pid": 5}),
        Event(ts=2.0, kind="hang", fields={"idle_s": "$"}),
    ]
    render_report(events, tmp_path / "odd.png")
    render_report(events, tmp_path / "odd.svg")
    svg = (tmp_path / "odd.svg").read_text()
    ET.fromstring(svg)
    assert "job $1 &lt;b&gt;" in svg


def test_cli(job: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(job[0]), str(job[1]), "-o", str(tmp_path / "x.html")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'x.html'} (25 events, 4 ranks)"
    assert report_main([str(job[0])]) == 0  # default output next to the input
    assert (job[0].parent / "nodeA.html").exists()


def test_cli_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ts": 1, "kind": "round"}\n{"ts": 2\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    good = tmp_path / "good.jsonl"
    good.write_text('{"ts": 1, "kind": "worker_start", "rank": 0}\n')
    cases = [
        ([str(bad)], f"{bad}:2: not valid JSON"),
        ([str(tmp_path / "missing.jsonl")], "cannot read events file"),
        ([str(empty)], "no events in"),
        ([str(good), "-o", str(tmp_path / "x.pdf")], "must end in .png, .html or .svg"),
        ([str(good), "-o", str(tmp_path / "no/dir/x.html")], "cannot write"),
    ]
    for argv, message in cases:
        assert report_main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("rallypoint report: error: ")
        assert message in err
        assert err.count("\n") == 1  # one line, no traceback
    assert report_main([]) == 2  # argparse: usage + error
    assert "EVENTS_FILE" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no events"):
        build_timeline([])


_kinds = st.sampled_from(
    [
        "round",
        "members",
        "worker_start",
        "worker_exit",
        "restart",
        "hang",
        "failure",
        "job_end",
        "x",
    ]
)
_field_values = st.one_of(
    st.none(), st.integers(-20, 20), st.text(max_size=5), st.sampled_from(["failed", "succeeded"])
)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.builds(
            Event,
            ts=st.floats(0, 1e4, allow_nan=False),
            kind=_kinds,
            node=st.sampled_from([None, "a", "b"]),
            rank=st.one_of(st.none(), st.integers(0, 5)),
            local_rank=st.one_of(st.none(), st.integers(0, 2)),
            fields=st.dictionaries(
                st.sampled_from(
                    ["round", "pid", "state", "exitcode", "signal", "idle_s", "world_size"]
                ),
                _field_values,
            ),
        ),
        min_size=1,
        max_size=25,
    )
)
def test_any_events_render(events: list[Event]) -> None:
    """Whatever mix of events (unpaired exits, failures without a rank, odd fields), the
    timeline builds and the SVG is well-formed."""
    tl = build_timeline(events)
    assert all(b.start <= b.end + 1e-9 for b in tl.bars)
    ET.fromstring(timeline_svg(tl))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("suffix", [".html", ".png", ".svg"])
def test_without_matplotlib_one_line_says_what_to_install(
    job: list[Path], tmp_path: Path, suffix: str
) -> None:
    import subprocess

    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # as if the plot extra were not installed\n"
        "from rallypoint.__main__ import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    out = tmp_path / f"t{suffix}"
    proc = subprocess.run(
        [sys.executable, "-c", code, "report", str(job[0]), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line, no traceback
    assert proc.stderr.startswith("rallypoint report: error: ")
    assert "pip install 'rallypoint[plot]'" in proc.stderr
    assert not out.exists()
