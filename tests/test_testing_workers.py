"""The forked worker harness that the multi-process tests of every part rely on."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rallypoint.testing import WorkerError, _workers, run_workers
from rallypoint.testing._zygote import Zygote, ZygoteError
from rallypoint.testing._zygote import _send as _zygote_send
from test_core_forking import held_by_another_thread


def _all_reduce_rank() -> float:
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return float(t.item())


def test_gloo_all_reduce_in_forked_workers() -> None:
    assert run_workers(_all_reduce_rank, 3, timeout=30) == [3.0, 3.0, 3.0]


def _env() -> tuple[str, str, str]:
    return os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["EXTRA"]


def test_env_per_rank() -> None:
    out = run_workers(_env, 2, env=lambda r: {"EXTRA": f"x{r}"}, timeout=30)
    assert out == [("0", "2", "x0"), ("1", "2", "x1")]


def _fail_on_one() -> int:
    if os.environ["RANK"] == "1":
        raise KeyError("boom")
    return 7


def test_exception_names_rank_and_keeps_type() -> None:
    with pytest.raises(WorkerError, match="rank 1: KeyError") as info:
        run_workers(_fail_on_one, 2, timeout=30)
    assert isinstance(info.value.exception, KeyError)
    assert "_fail_on_one" in info.value.remote_traceback
    out = run_workers(_fail_on_one, 2, timeout=30, return_exceptions=True)
    assert out[0] == 7 and isinstance(out[1], KeyError)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_killed_worker_is_reported() -> None:
    with pytest.raises(WorkerError, match="SIGKILL"):
        run_workers(_die, 1, timeout=30)


def _sleep() -> None:
    import time

    time.sleep(60)


def test_timeout_kills_and_names_ranks(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(TimeoutError, match=r"\[0, 1\]") as caught:
        run_workers(_sleep, 2, timeout=1)
    # each worker said where it hung before it was killed: in full on stderr, in short
    # (its innermost frames, one line per rank) in the error, which a CI log keeps
    err = capfd.readouterr().err
    assert err.count(" in _sleep\n") == 2, err
    lines = [line for line in str(caught.value).splitlines()[1:] if " native: " not in line]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], lines
    assert all(re.search(r"_sleep \(test_testing_workers\.py:\d+\)", line) for line in lines)


def _blocked_in_c() -> None:
    import threading

    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # for good, inside C: no Python frame says on what


@pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb")
def test_timeout_names_where_a_worker_hung_in_native_code() -> None:
    with pytest.raises(TimeoutError) as caught:
        run_workers(_blocked_in_c, 1, timeout=1)
    native = [line for line in str(caught.value).splitlines() if line.startswith("rank 0 native:")]
    if not native:
        pytest.skip("gdb could not attach to the worker here")
    # the thread waits in the C lock's acquire (a semaphore or futex wait in libc)
    assert re.search(r"sem_|futex|lock", native[0], re.IGNORECASE), native


def test_bad_world_size() -> None:
    with pytest.raises(ValueError, match="world_size"):
        run_workers(_env, 0)


def _abort() -> None:
    """Die by SIGABRT quietly: the workers' faulthandler would dump every thread's stack
    (a green run of the suite prints dots, not hundreds of ``Fatal Python error`` lines)."""
    import faulthandler

    faulthandler.disable()
    os.kill(os.getpid(), signal.SIGABRT)


def _aborts_on_the_first_runs(marker: str, times: int = 1) -> int:
    if int(os.environ["RANK"]) == 1:
        with open(marker, "a") as fp:
            fp.write("x")
        with open(marker) as fp:
            if len(fp.read()) <= times:
                _abort()
    return int(os.environ["RANK"])


def _peer_aborts_first(marker: str) -> int:
    """Rank 1 aborts on the first run, but its report pipe stays open (a child of it holds
    it) so rank 0's error, raised once rank 1 is gone, is the failure reported first: as
    when a TensorPipe worker aborts and its peer's next call fails with ``eof``."""
    import time

    if int(os.environ["RANK"]) == 1:
        with open(marker, "a") as fp:
            fp.write("x")
        with open(marker) as fp:
            if len(fp.read()) == 1:
                if os.fork() == 0:  # holds the pipe open for a while
                    time.sleep(3)
                    os._exit(0)
                _abort()
        return 1
    with open(marker + ".rank0", "a") as fp:  # rank 0 counts its own runs
        fp.write("x")
    with open(marker + ".rank0") as fp:
        first_run = len(fp.read()) == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until rank 1 wrote for this run
        if os.path.exists(marker):
            if first_run:
                time.sleep(0.5)  # rank 1 aborts meanwhile
                raise RuntimeError("eof (the peer is gone)")
            with open(marker) as fp:
                if len(fp.read()) == 2:
                    return 0
        time.sleep(0.01)
    return 0


def _raises(marker: str) -> int:
    with open(marker, "a") as fp:
        fp.write("x")
    raise ValueError("a real failure")


@pytest.mark.timeout(60)
def test_a_reference_run_is_repeated_twice_when_a_worker_dies_by_a_signal(tmp_path: Any) -> None:
    from rallypoint.testing._workers import run_reference_workers

    twice = str(tmp_path / "twice")
    assert run_reference_workers(_aborts_on_the_first_runs, 2, twice, 2, timeout=30) == [0, 1]
    with pytest.raises(WorkerError, match="died by signal SIGABRT"):  # not a third time
        run_reference_workers(_aborts_on_the_first_runs, 2, str(tmp_path / "3"), 3, timeout=30)
    with pytest.raises(WorkerError, match="died by signal SIGABRT"):  # the code under test
        run_workers(_aborts_on_the_first_runs, 2, str(tmp_path / "again"), timeout=30)
    with pytest.raises(WorkerError, match="a real failure"):  # not repeated
        run_reference_workers(_raises, 1, str(tmp_path / "count"), timeout=30)
    assert (tmp_path / "count").read_text() == "x"


@pytest.mark.timeout(60)
def test_a_reference_run_is_repeated_when_a_peer_of_the_failing_rank_died_by_a_signal(
    tmp_path: Any,
) -> None:
    from rallypoint.testing._workers import run_reference_workers

    with pytest.raises(WorkerError, match="the peer is gone") as info:  # the code under test
        run_workers(_peer_aborts_first, 2, str(tmp_path / "once"), timeout=30)
    assert info.value.rank == 0 and info.value.signalled == [1]
    assert run_reference_workers(_peer_aborts_first, 2, str(tmp_path / "ref"), timeout=30) == [
        0,
        1,
    ]
    assert (tmp_path / "ref").read_text() == "xx"


_AFTER_PARALLEL_OPS = """
import torch
from rallypoint.testing import run_workers

def work():
    torch.ones(1 << 20).mul_(2.0)  # a parallel op: hangs on a broken OpenMP team
    return torch.get_num_threads()

if __name__ == "__main__":
    torch.set_num_threads(2)
    a = torch.randn(512, 512)
    a @ a  # this process's OpenMP team now exists
    print("RESULT", run_workers(work, 2, timeout=30), flush=True)
"""


@pytest.mark.timeout(90)
def test_workers_of_a_parent_that_ran_parallel_ops_do_not_hang(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """In a fresh interpreter: the pytest process must not break its own OpenMP team."""
    script = tmp_path / "after_ops.py"
    script.write_text(_AFTER_PARALLEL_OPS)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=80, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RESULT [1, 1]" in proc.stdout  # OMP_NUM_THREADS=1 applied, as the launcher does


def _store_reset_on_the_first_run(marker: str) -> int:
    with open(marker, "a") as fp:
        fp.write("x")
    with open(marker) as fp:
        if len(fp.read()) == 1:  # torch's shutdown found the store host gone
            raise dist.DistNetworkError("Connection reset by peer")
    return 0


@pytest.mark.timeout(60)
def test_a_reference_run_is_repeated_when_torch_loses_its_store(tmp_path: Any) -> None:
    from rallypoint.testing._workers import run_reference_workers

    marker = str(tmp_path / "reset")
    assert run_reference_workers(_store_reset_on_the_first_run, 1, marker, timeout=30) == [0]
    assert (tmp_path / "reset").read_text() == "xx"
    with pytest.raises(WorkerError, match="Connection reset by peer"):  # the code under test
        run_workers(_store_reset_on_the_first_run, 1, str(tmp_path / "ours"), timeout=30)


# --- the worker zygote (tests/conftest.py holds one for the session) ---------------------

_HELD_BY_A_THREAD = threading.Lock()  # made at import, before the session's zygote


def _try_the_lock() -> bool:
    got = _HELD_BY_A_THREAD.acquire(timeout=1)
    if got:
        _HELD_BY_A_THREAD.release()
    return got


@pytest.mark.timeout(60)
def test_a_lock_another_thread_holds_is_free_in_workers_of_the_zygote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a thread of the test process holds a lock (as glibc's resolver lock is held by a
    # store's name lookup) while workers are forked
    with held_by_another_thread(_HELD_BY_A_THREAD):
        assert run_workers(_try_the_lock, 2, timeout=30) == [True, True]
        monkeypatch.setattr(_workers, "_ZYGOTE", None)  # forked from this process instead
        assert run_workers(_try_the_lock, 2, timeout=30) == [False, False]


def _parent_pid() -> int:
    return os.getppid()


def test_workers_are_children_of_the_zygote(zygote: Zygote, pytestconfig: Any) -> None:
    # made before any test started a thread; the one other thread allowed is the status
    # server pytest-rerunfailures starts in a run without xdist workers (pytest file.py)
    plugin = type(getattr(pytestconfig, "failures_db", None)).__name__ == "ServerStatusDB"
    assert zygote.threads_at_start == 1 + plugin
    assert run_workers(_parent_pid, 2, timeout=30) == [zygote.pid, zygote.pid]


def _where() -> tuple[str | None, str | None, str]:
    print(f"worker {os.environ['RANK']} says hello", flush=True)
    return os.environ.get("SET_LATER"), os.environ.get("HOME"), os.getcwd()


def test_workers_see_the_callers_environment_directory_and_output_as_they_are_now(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SET_LATER", "yes")
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    out = run_workers(_where, 2, timeout=30)
    assert out == [("yes", None, str(tmp_path))] * 2
    printed = capfd.readouterr().out
    assert "worker 0 says hello" in printed and "worker 1 says hello" in printed


def test_a_function_the_zygote_cannot_import_is_a_clear_error() -> None:
    def local() -> int:
        return 1

    with pytest.raises(TypeError, match="define the function at module level"):
        run_workers(local, 2, timeout=30)
    with pytest.raises(TypeError, match="pickle"):
        run_workers(_env, 1, threading.Lock(), timeout=30)


@pytest.mark.timeout(60)
def test_closing_a_zygote_kills_its_workers_and_a_closed_one_says_so() -> None:
    zygote = Zygote()
    child = zygote.fork(_zygote_sleeper, (), [1, 2])
    assert child.is_alive()
    zygote.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _pid_exists(child.pid):
        time.sleep(0.05)
    assert not _pid_exists(child.pid)
    with pytest.raises(ZygoteError, match="closed"):
        zygote.fork(_zygote_sleeper, (), [1, 2])


def _zygote_sleeper(fds: list[int]) -> None:
    time.sleep(60)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
def test_a_reply_left_unread_is_not_taken_for_the_next_one() -> None:
    zygote = Zygote()
    try:
        gone, running = (zygote.fork(_zygote_sleeper, (), [1, 2]) for _ in range(2))
        gone.kill()
        gone.join(10)
        assert gone.exitcode == -signal.SIGKILL
        # what an exception between sending a request and reading its reply leaves: the
        # zygote's answer about the dead worker, unread
        assert zygote._sock is not None
        zygote._asked += 1
        _zygote_send(zygote._sock, (zygote._asked, "status", gone.pid))
        assert zygote.status(running.pid) is None
        assert running.is_alive()
    finally:
        zygote.close()


def _thread_names() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as fp:
            names.append(fp.read().strip())
    return names


@pytest.mark.timeout(60)
def test_a_store_host_serves_from_another_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from _support.store_host import store_host

    for zygote in (_workers._ZYGOTE, None):  # forked by the zygote; a new interpreter
        monkeypatch.setattr(_workers, "_ZYGOTE", zygote)
        with store_host() as port:
            client = dist.TCPStore("127.0.0.1", port, is_master=False)
            client.set("k", "v")
            assert client.get("k") == b"v"
            # no server thread here (its name lookups would hold glibc's lock in this process)
            assert "pt_tcpstore_uv" not in _thread_names()
            del client
        with pytest.raises(dist.DistNetworkError):  # the server is gone with its process
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
