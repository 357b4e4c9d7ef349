"""rallypoint.progress() in real worker processes, read back through the agent's board."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from rallypoint.observe import _progress
from rallypoint.observe._progress import (
    PROGRESS_FILE_ENV,
    PROGRESS_SLOT_ENV,
    ProgressBoard,
    progress,
)

_ctx = multiprocessing.get_context("fork")


def _in_child(env: dict[str, str], body: Callable[[], object]) -> object:
    """Run ``body`` in a forked child with ``env`` and return what it returns."""
    parent, child = _ctx.Pipe()

    def main() -> None:
        os.environ.pop(PROGRESS_FILE_ENV, None)
        os.environ.pop(PROGRESS_SLOT_ENV, None)
        os.environ.update(env)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = body()
        # a ResourceWarning is the garbage collector finding a file some earlier test of
        # this (forked) process left open: not the code under test
        said = [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]
        child.send((result, said))

    proc = _ctx.Process(target=main)
    proc.start()
    deadline = time.monotonic() + 20
    while not parent.poll(0.05):
        assert proc.is_alive() or parent.poll(0), f"child died: exit code {proc.exitcode}"
        assert time.monotonic() < deadline, "child did not answer"
    result = parent.recv()
    proc.join(10)
    assert proc.exitcode == 0
    return result


def _report_three_times() -> list[float]:
    stamps = []
    for _ in range(3):
        progress()
        stamps.append(time.monotonic())
        time.sleep(0.01)
    return stamps


def test_worker_progress_reaches_board() -> None:
    progress()  # this (warm) process has no board: a no-op that must not stick in children
    with ProgressBoard(3) as board:
        assert board.reported() == []
        assert board.last_progress(1) is None
        stamps, warns = _in_child(board.env(1), _report_three_times)  # type: ignore[misc]
        assert warns == []
        last = board.last_progress(1)
        assert last is not None
        assert stamps[1] <= last <= stamps[2]  # the last write is the third call's clock
        assert board.reported() == [1]
        assert board.seconds_since_progress(1) < 60  # a fresh stamp (a loaded machine)
        assert board.seconds_since_progress() == pytest.approx(
            board.seconds_since_progress(1), abs=0.5
        )
        board.reset()
        assert board.reported() == [] and board.last_progress(1) is None
        path = board.path
        assert os.path.exists(path)
    assert not os.path.exists(path)


def test_slot_defaults_to_local_rank() -> None:
    with ProgressBoard(4) as board:
        env = {PROGRESS_FILE_ENV: board.path, "LOCAL_RANK": "3"}
        _in_child(env, progress)
        assert board.reported() == [3]


def test_noop_without_board() -> None:
    def body() -> tuple[bool, bool]:
        for _ in range(3):
            progress()
        return _progress._view is None, _progress._disabled

    assert _in_child({}, body) == ((True, True), [])


@pytest.mark.parametrize(
    ("make_env", "message"),
    [
        (lambda d: {PROGRESS_FILE_ENV: f"{d}/missing", PROGRESS_SLOT_ENV: "0"}, "No such file"),
        (lambda d: {PROGRESS_FILE_ENV: f"{d}/junk", PROGRESS_SLOT_ENV: "0"}, "not a rallypoint"),
        (lambda d: {PROGRESS_FILE_ENV: f"{d}/tiny", PROGRESS_SLOT_ENV: "0"}, "too small"),
        (lambda d: {PROGRESS_FILE_ENV: "BOARD", PROGRESS_SLOT_ENV: "x"}, "invalid literal"),
        (lambda d: {PROGRESS_FILE_ENV: "BOARD", PROGRESS_SLOT_ENV: "2"}, "outside the board's 2"),
    ],
)
def test_bad_board_warns_once_and_noops(
    tmp_path: Path, make_env: Callable[[Path], dict[str, str]], message: str
) -> None:
    (tmp_path / "junk").write_bytes(b"x" * 64)
    (tmp_path / "tiny").write_bytes(b"x")
    with ProgressBoard(2) as board:
        env = {k: v.replace("BOARD", board.path) for k, v in make_env(tmp_path).items()}

        def body() -> int:
            for _ in range(5):
                progress()
            return len(board.reported())

        reported, warns = _in_child(env, body)  # type: ignore[misc]
        assert reported == 0
    assert len(warns) == 1
    assert "rallypoint.progress() is disabled" in warns[0]
    assert message in warns[0]


def test_seconds_since_progress_with_clock() -> None:
    now = [100.0]
    with ProgressBoard(2, clock=lambda: now[0]) as board:
        now[0] = 103.0
        assert board.seconds_since_progress() == 3.0  # counts from creation/reset
        assert not board.is_hung(timedelta(seconds=5))
        board._slots[0] = 102.0  # what a worker's progress() writes
        now[0] = 108.0
        assert board.seconds_since_progress() == 6.0
        assert board.seconds_since_progress(0) == 6.0
        assert board.seconds_since_progress(1) == 8.0
        assert board.is_hung(timedelta(seconds=5))
        board.reset()
        assert board.seconds_since_progress() == 0.0


def test_board_bad_input(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="nslots must be an int"):
        ProgressBoard("2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"nslots must be between 1 and 65536, got 0"):
        ProgressBoard(0)
    board = ProgressBoard(2, directory=tmp_path)
    assert os.path.dirname(board.path) == str(tmp_path)
    with pytest.raises(ValueError, match=r"local_rank must be in \[0, 2\), got 2"):
        board.env(2)
    with pytest.raises(TypeError, match="local_rank must be an int"):
        board.last_progress(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="timedelta"):
        board.is_hung(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be positive"):
        board.is_hung(timedelta(0))
    board.close()
    board.close()
    with pytest.raises(ValueError, match="closed"):
        board.seconds_since_progress()
    assert list(tmp_path.iterdir()) == []


def test_unclosed_board_is_removed_at_exit_but_not_by_forked_children(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from rallypoint.observe import ProgressBoard\n"
        f"b = ProgressBoard(2, directory={str(tmp_path)!r})\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)  # a child exiting normally runs atexit: must not remove the file\n"
        "os.waitpid(pid, 0)\n"
        "print(os.path.exists(b.path), flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "True"
    assert list(tmp_path.iterdir()) == []  # the owner's exit removed it


@pytest.mark.timeout(60)
def test_a_killed_agents_board_is_deleted_by_the_next_board_and_a_live_ones_is_kept(
    tmp_path: Path,
) -> None:
    """A SIGKILLed process cannot unlink its board; the next board made in the directory
    deletes it (nobody holds its lock), but not a live process's board, nor a file made
    a moment ago (its agent may not have locked it yet)."""
    code = (
        "import sys\n"
        "from rallypoint.observe import ProgressBoard\n"
        f"b = ProgressBoard(2, directory={str(tmp_path)!r})\n"
        "print(b.path, flush=True)\n"
        "sys.stdin.read()\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    try:
        killed, live = (Path(p.stdout.readline().strip()) for p in procs if p.stdout)
        procs[0].kill()
        procs[0].wait(10)
        fresh = tmp_path / "rallypoint-progress-justmade"
        fresh.write_bytes(b"")
        long_ago = time.time() - 120
        for path in (killed, live):
            os.utime(path, (long_ago, long_ago))
        board = ProgressBoard(1, directory=tmp_path)
        assert not killed.exists()
        assert live.exists() and fresh.exists()
        board.close()
        assert sorted(tmp_path.iterdir()) == sorted([live, fresh])
        procs[1].communicate("", timeout=30)  # its owner ends normally: it goes too
        assert procs[1].returncode == 0
        assert list(tmp_path.iterdir()) == [fresh]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
