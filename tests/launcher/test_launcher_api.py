"""rallypoint.launch: real workers forked from a copy of the test process, gloo on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist

import rallypoint
from rallypoint._core.net import free_port
from rallypoint.launcher import (
    LaunchConfig,
    LaunchError,
    LaunchTimeoutError,
    PortInUseError,
    WorkerFailedError,
    launch,
)

pytestmark = pytest.mark.timeout(60)

TORCHRUN_VARS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
    "RALLYPOINT_RPC_SECRET",
]


def _env_and_allreduce() -> dict[str, Any]:
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out = {name: os.environ.get(name) for name in TORCHRUN_VARS}
    out["sum"] = t.item()
    out["elastic"] = dist.is_torchelastic_launched()
    out["threads"] = torch.get_num_threads()
    out["pid"] = os.getpid()
    out["sid"] = os.getsid(0)
    out["argv"] = list(sys.argv)
    out["cwd"] = os.getcwd()
    out["sigterm_default"] = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    out["sigint_python"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    dist.destroy_process_group()
    return out


def test_env_matches_torchrun_and_results_come_back_by_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("RALLYPOINT_RPC_SECRET", raising=False)
    res = launch(
        _env_and_allreduce,
        nproc=3,
        max_restarts=2,
        role="trainer",
        run_id="job7",
        cwd=str(tmp_path),
    )
    assert [r["RANK"] for r in res] == ["0", "1", "2"]
    assert [r["LOCAL_RANK"] for r in res] == ["0", "1", "2"]
    ports = {r["MASTER_PORT"] for r in res}
    assert len(ports) == 1 and int(ports.pop()) > 0
    secrets = {r["RALLYPOINT_RPC_SECRET"] for r in res}
    assert len(secrets) == 1
    (secret,) = secrets
    assert secret is not None and len(secret) == 64 and int(secret, 16) >= 0
    for r in res:
        assert r["sum"] == 6.0
        assert r["elastic"] is True
        assert r["WORLD_SIZE"] == r["LOCAL_WORLD_SIZE"] == r["ROLE_WORLD_SIZE"] == "3"
        assert r["GROUP_RANK"] == "0" and r["GROUP_WORLD_SIZE"] == "1"
        assert r["ROLE_RANK"] == r["RANK"] and r["ROLE_NAME"] == "trainer"
        assert r["MASTER_ADDR"] == "127.0.0.1"
        assert r["TORCHELASTIC_RUN_ID"] == "job7"
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert r["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert r["TORCHELASTIC_ERROR_FILE"].endswith(f"/{r['LOCAL_RANK']}/error.json")
        assert r["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert r["OMP_NUM_THREADS"] == "1" and r["threads"] == 1
        assert r["sid"] == r["pid"], "each worker leads its own session"
        assert r["cwd"] == str(tmp_path)
        assert r["sigterm_default"] and r["sigint_python"]
        assert r["pid"] != os.getpid()


def test_user_secret_and_env_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RALLYPOINT_RPC_SECRET", "feedface")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = launch(_env_and_allreduce, nproc=2, env={"OMP_NUM_THREADS": "2"})
    assert {r["RALLYPOINT_RPC_SECRET"] for r in res} == {"feedface"}
    # kept, unless an earlier test ran parallel ops in this process: then forked workers
    # get one thread, with the warning (test_launcher_openmp_fork.py)
    broken = any("not fork-safe" in str(w.message) for w in caught)
    assert {r["OMP_NUM_THREADS"] for r in res} == ({"1"} if broken else {"2"})


def _boom(rank_to_fail: int) -> None:
    if int(os.environ["RANK"]) == rank_to_fail:
        raise ValueError("boom from the worker")
    time.sleep(30)


def test_exception_names_first_failed_rank_with_remote_traceback() -> None:
    with pytest.raises(WorkerFailedError) as info:
        launch(_boom, 1, nproc=3, shutdown_timeout=timedelta(seconds=2))
    err = info.value
    assert err.rank == 1 and err.local_rank == 1 and err.exitcode == 1
    assert "ValueError: boom from the worker" in err.remote_traceback
    assert "in _boom" in err.remote_traceback
    assert "_worker.py" not in err.remote_traceback, "launcher frames are hidden"
    assert isinstance(err.__cause__, ValueError)
    assert "Root cause" in str(err) and "rank      : 1" in str(err)
    assert {o.rank for o in err.others} == {0, 2}
    assert all(o.state == "terminated" and "SIGTERM" in o.detail for o in err.others)


def _die(how: str) -> None:
    if os.environ["LOCAL_RANK"] == "0":
        if how == "exit3":
            sys.exit(3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segv":
            import ctypes

            ctypes.string_at(0)
    time.sleep(30)


@pytest.mark.parametrize(
    ("how", "code", "text"),
    [("exit3", 3, "exited with 3"), ("sigkill", -9, "SIGKILL"), ("segv", -11, "SIGSEGV")],
)
def test_exit_code_and_signal_deaths_are_reported(how: str, code: int, text: str) -> None:
    with pytest.raises(WorkerFailedError) as info:
        launch(_die, how, nproc=2)
    err = info.value
    assert err.rank == 0 and err.exitcode == code
    assert text in str(err)
    if how == "segv":  # faulthandler's Python stack, without decorating anything
        assert "Segmentation fault" in err.remote_traceback
        assert "in _die" in err.remote_traceback


def _spawn_grandchild(pidfile: str) -> None:
    if os.environ["LOCAL_RANK"] == "1":
        # escapes the worker's process group on purpose
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        Path(pidfile).write_text(str(child.pid))
        raise RuntimeError("leaving a grandchild behind")
    time.sleep(30)


def test_failed_worker_leaves_no_orphan(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(WorkerFailedError):
        launch(_spawn_grandchild, str(pidfile), nproc=2)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {pid} survived the failed job")


def _flaky(fail_until: int) -> tuple[str, float]:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt < fail_until and dist.get_rank() == 1:
        os._exit(7)  # dies right after its first all_reduce
    dist.all_reduce(t)
    dist.destroy_process_group()
    return os.environ["TORCHELASTIC_RESTART_COUNT"], t.item()


@pytest.mark.timeout(60)
def test_restarts_recover_every_time_with_a_fresh_store() -> None:
    res = launch(_flaky, 2, nproc=3, max_restarts=2, timeout=timedelta(seconds=40))
    assert res == [("2", 9.0)] * 3


def test_restarts_exhausted_raise() -> None:
    with pytest.raises(WorkerFailedError) as info:
        launch(_flaky, 5, nproc=2, max_restarts=1, timeout=timedelta(seconds=30))
    assert info.value.rank == 1 and info.value.exitcode == 7
    assert "attempt 2 of 2" in str(info.value)


def _torn_down_first(path: str) -> None:
    """Rank 1 tears its process group down (as a fatal error's cleanup would), then exits
    with 7 only after rank 0, which fails in a collective because of it, is gone: the
    consequence exits, and is reported, before its cause."""
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    rank = dist.get_rank()
    Path(path, f"pid{rank}").write_text(str(os.getpid()))
    if rank == 0:
        dist.all_reduce(t)  # "Connection closed by peer" once rank 1 tore down
        return
    while not Path(path, "pid0").exists():
        time.sleep(0.01)
    first = int(Path(path, "pid0").read_text())
    dist.destroy_process_group()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if psutil.Process(first).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.005)
    os._exit(7)


@pytest.mark.timeout(60)
def test_a_peer_loss_reported_before_its_cause_is_not_the_root_cause(tmp_path: Path) -> None:
    """Rank 0 failed only because rank 1 vanished under it, but its exit reached the
    launcher first (in CI, on a busy host, the warm process reported the two exits one
    at a time): the launcher stopped rank 1 and named rank 0 the root cause."""
    with pytest.raises(WorkerFailedError) as info:
        launch(_torn_down_first, str(tmp_path), nproc=2, timeout=timedelta(seconds=40))
    assert info.value.rank == 1 and info.value.exitcode == 7, info.value.summary
    assert "rank 0 (local_rank: 0" in info.value.summary  # listed among the others


def _sleep_forever() -> None:
    time.sleep(60)


def test_timeout_kills_the_workers() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeoutError):
        launch(_sleep_forever, nproc=2, timeout=timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 10


def _rank_sum() -> tuple[int, float]:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return dist.get_world_size() if False else int(os.environ["WORLD_SIZE"]), t.item()


def test_two_launches_share_one_world() -> None:
    port = free_port()
    other: list[Any] = []

    def second() -> None:
        other.extend(
            launch(
                _rank_sum,
                nproc=2,
                rank_offset=2,
                world_size=4,
                master_port=port,
                timeout=timedelta(seconds=30),
            )
        )

    thread = threading.Thread(target=second)
    thread.start()
    first = launch(
        _rank_sum, nproc=2, world_size=4, master_port=port, timeout=timedelta(seconds=30)
    )
    thread.join(30)
    assert first == other == [(4, 4.0)] * 2


def _module_level_add(a: int, b: int) -> int:
    return a + b + int(os.environ["RANK"])


def test_spawn_start_method_runs_fresh_interpreters() -> None:
    assert launch(_module_level_add, 1, 2, nproc=2, start_method="spawn") == [3, 4]


def test_spawn_needs_a_picklable_fn() -> None:
    with pytest.raises(TypeError, match="picklable"):
        launch(lambda: threading.Lock(), nproc=1, start_method="spawn")


def test_unpicklable_result_is_a_worker_failure() -> None:
    with pytest.raises(WorkerFailedError, match="pickle"):
        launch(lambda: threading.Lock(), nproc=1)


def test_busy_explicit_port_is_a_clear_error() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(PortInUseError, match=str(port)) as info:
            launch(_module_level_add, 1, 2, nproc=1, master_port=port)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"nproc": 0}, ValueError, "nproc must be >= 1"),
        ({"nproc": "abc"}, TypeError, "nproc must be an int"),
        ({"nproc": 2, "nnodes": "2"}, ValueError, "needs a rendezvous endpoint"),
        ({"nproc": 2, "hang_timeout": 3}, TypeError, "hang_timeout must be a datetime.timedelta"),
        ({"nproc": 2, "on_hang": "ignore"}, ValueError, "on_hang must be"),
        ({"nproc": 1, "bogus": 1}, TypeError, "LaunchConfig fields"),
        ({"nproc": 1, "max_restarts": -1}, ValueError, "max_restarts"),
        ({"nproc": 1, "timeout": 5}, TypeError, "timedelta"),
        ({"nproc": 1, "master_port": 70000}, ValueError, "master_port"),
        ({"nproc": 1, "start_method": "forkserver"}, ValueError, "start_method"),
        ({"nproc": 1, "redirects": "9"}, ValueError, "redirects"),
        ({"nproc": 1, "rank_offset": 1, "world_size": 2}, ValueError, "master_port"),
        ({"nproc": 2, "world_size": 1}, ValueError, "exceeds"),
        ({"nproc": 1, "preload": ("not a module",)}, ValueError, "preload"),
        ({"nproc": 1, "local_ranks_filter": frozenset()}, ValueError, "local_ranks_filter"),
        ({"nproc": 1, "cwd": "/does/not/exist"}, ValueError, "cwd"),
    ],
)
def test_bad_options_raise_before_anything_starts(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        launch(_module_level_add, 1, 2, **kwargs)


def test_not_callable_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="callable"):
        launch("train.py", nproc=1)  # type: ignore[arg-type]


def test_bad_preload_is_a_launch_error() -> None:
    with pytest.raises(LaunchError, match="no_such_module_xyz"):
        launch(_module_level_add, 1, 2, nproc=1, preload=("no_such_module_xyz",))


def test_public_surface() -> None:
    assert rallypoint.launch is launch
    assert rallypoint.LaunchConfig is LaunchConfig
    assert issubclass(rallypoint.WorkerFailedError, rallypoint.LaunchError)
    cfg = LaunchConfig(nproc=2, monitor_interval=timedelta(seconds=1))
    assert cfg.total_world_size == 2
    assert set(rallypoint.launcher.__all__) >= {"launch", "LaunchConfig", "LaunchError"}


def _pg_ready() -> tuple[bool, int]:
    return dist.is_initialized(), dist.get_world_size()


def test_parallel_hook_wraps_fn() -> None:
    assert launch(_pg_ready, nproc=2, parallel=True) == [(True, 2)] * 2
    with pytest.raises(TypeError, match="parallel"):
        launch(_pg_ready, nproc=2, parallel=42)
