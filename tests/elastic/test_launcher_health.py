"""Health checks on one node: ``--health-check`` runs before the workers
start and before each restart; a failing or hanging check keeps the node out with exit
code 3 and a screen that names the check, its exit code or timeout and its last lines."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest

from _support import cli_zygote
from rallypoint._core.torch_c import HashStore
from rallypoint._elastic._exits import EXIT_UNHEALTHY
from rallypoint._elastic._health._builtin_checks import STORE_LATENCY_BOUND, check_store
from rallypoint._elastic._health._check_run import OUTPUT_LINE_LIMIT, HealthContext

RALLYPOINT = [sys.executable, "-m", "rallypoint", "run"]


def _run(argv: list[str], timeout: float = 60) -> tuple[int, str, str]:
    proc = cli_zygote.run(
        [*RALLYPOINT, *argv], capture_output=True, text=True, timeout=timeout, env=os.environ
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def hello(tmp_path: Path) -> Path:
    path = tmp_path / "hello.py"
    path.write_text("print('hello from the worker')\n")
    return path


@pytest.mark.timeout(60)
def test_a_failing_check_keeps_the_node_out(hello: Path) -> None:
    check = "echo probing gpu 0; echo 'gpu 0: ECC error' >&2; exit 7"
    code, out, err = _run(["--health-check", "true", "--health-check", check, str(hello)])
    assert code == EXIT_UNHEALTHY == 3, (code, out, err)
    assert "hello from the worker" not in out, "no worker may start"
    lines = err.strip().splitlines()
    assert lines[0] == f"rallypoint: health check failed: {check}", err
    assert lines[1] == "  exit code 7", err
    assert lines[3:5] == ["    probing gpu 0", "    gpu 0: ECC error"], err
    assert "this node stays out of the job; exit code 3" in lines[-1], err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_hanging_check_is_cut_at_its_timeout(hello: Path, tmp_path: Path) -> None:
    marker = tmp_path / "grandchild-alive"
    # the check and a child it started: both must be killed at the timeout
    check = f"echo started; (sleep 1.5; touch {marker}) & sleep 60"
    started = time.monotonic()
    code, out, err = _run(["--health-check", check, "--health-check-timeout", "1", str(hello)])
    took = time.monotonic() - started
    assert code == 3, (code, out, err)
    assert "  timed out after 1 s (--health-check-timeout); killed" in err, err
    assert "    started" in err, err
    assert took < 20, took
    time.sleep(2)
    assert not marker.exists(), "what the check started must be killed with it"


def _gone(pidfile: Path) -> bool:
    """Whether the process whose pid ``pidfile`` holds is gone (a zombie counts as gone)."""
    try:
        proc = psutil.Process(int(pidfile.read_text()))
        proc.wait(timeout=5)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return proc.status() == psutil.STATUS_ZOMBIE
    return True


@pytest.mark.timeout(60)
def test_nothing_a_check_started_outlives_it(hello: Path, tmp_path: Path) -> None:
    """What a check starts in a session of its own is killed with it, whether the check
    exits (a daemon it left behind, re-parented) or times out (a ``setsid sleep``
    must not stay behind under PID 1)."""
    daemon, own_session = tmp_path / "daemon.pid", tmp_path / "setsid.pid"

    def start(pidfile: Path, seconds: int) -> str:
        return f"setsid sh -c 'echo $$ > {pidfile}; exec sleep {seconds}'"

    def wait_for(pidfile: Path) -> str:
        return f"while [ ! -s {pidfile} ]; do sleep 0.01; done"

    exits = f"({start(daemon, 178)} &); {wait_for(daemon)}"
    hangs = f"{start(own_session, 177)} & {wait_for(own_session)}; echo started; sleep 60"
    argv = ["--health-check", exits, "--health-check", hangs, "--health-check-timeout", "3"]
    code, out, err = _run([*argv, str(hello)])
    assert code == 3, (code, out, err)
    assert "  timed out after 3 s (--health-check-timeout); killed" in err, err
    assert "    started" in err, err
    assert _gone(daemon), "the daemon of a check that exited outlived it"
    assert _gone(own_session), "what a timed-out check started in its own session outlived it"


@pytest.mark.timeout(60)
def test_check_output_is_fit_for_a_terminal(hello: Path) -> None:
    """A 200 KB line is cut and says by how much; escape sequences (clear screen, title)
    and control characters are gone."""
    check = (
        "head -c 200000 /dev/zero | tr '\\0' x; echo; "
        "printf 'a\\033[2J\\033[Hb\\033]0;pwned\\007c\\td\\r\\n'; exit 4"
    )
    code, out, err = _run(["--health-check", check, str(hello)])
    assert code == 3, (code, out, err)
    lines = err.splitlines()
    assert lines[3:5] == [
        "    " + "x" * OUTPUT_LINE_LIMIT + f" [... {200_000 - OUTPUT_LINE_LIMIT} bytes cut]",
        "    abc\td",
    ], err
    assert "\x1b" not in err and "\r" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_checks_run_before_the_workers_and_before_each_restart(tmp_path: Path) -> None:
    log = tmp_path / "checks.log"
    script = tmp_path / "fail_once.py"
    script.write_text(
        "import os\n"
        f"print('worker', open({str(log)!r}).read().count('check'), flush=True)\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    raise SystemExit(5)\n"
    )
    check = f"echo check >> {log}"
    code, out, err = _run(["--max-restarts", "2", "--health-check", check, str(script)])
    assert code == 0, (code, out, err)
    assert "worker 1" in out and "worker 2" in out, out  # the check ran before each start
    assert log.read_text().count("check") == 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_builtin_disk_fails_when_the_log_dir_turns_read_only(
    tmp_path: Path, small_disk: Any
) -> None:
    """The log disk fails mid-job (the kernel remounts it read-only): the check before the
    restart finds it, and the node stays out instead of restarting onto a broken disk."""
    small_disk.mount("size=1g")  # room above the free-space floor
    logs = small_disk.path
    script = tmp_path / "wait_then_fail.py"
    script.write_text(
        "import os, pathlib, time\n"
        f"pathlib.Path({str(tmp_path / 'ready')!r}).touch()\n"
        f"while not os.path.exists({str(tmp_path / 'go')!r}): time.sleep(0.05)\n"
        "raise SystemExit(5)\n"
    )
    argv = ["--log-dir", str(logs), "--health-check", "builtin:disk", "--max-restarts", "1"]
    proc = cli_zygote.Popen(
        [*RALLYPOINT, *argv, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        small_disk.read_only()
        (tmp_path / "go").touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 3, (proc.returncode, out, err)
    assert "rallypoint: health check failed: builtin:disk\n" in err, err
    assert f"--log-dir {logs}: cannot write there (Read-only file system)" in err, err
    assert "restarting the worker group" in err  # the check ran before the restart


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_builtin_disk_fails_below_the_free_space_floor(hello: Path, small_disk: Any) -> None:
    code, out, err = _run(
        ["--log-dir", str(small_disk.path), "--health-check", "builtin:disk", str(hello)]
    )
    assert code == 3, (code, out, err)
    assert f"--log-dir {small_disk.path}: " in err and "below the floor of 256 MiB" in err, err
    assert "hello from the worker" not in out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_builtins_pass_or_skip_with_one_line_on_a_healthy_node(hello: Path) -> None:
    argv = ["--health-check", "builtin:disk", "--health-check", "builtin:store"]
    code, out, err = _run([*argv, "--health-check", "builtin:gpu", str(hello)])
    assert code == 0, (code, out, err)
    assert "hello from the worker" in out
    store = "rallypoint: health check builtin:store skipped: no rendezvous store"
    assert err.count(store) == 1, err
    if not _has_gpu():
        gpu = "rallypoint: health check builtin:gpu skipped: no GPU visible to this node"
        assert err.count(gpu) == 1, err


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class _SlowStore(HashStore):
    """A store whose reads take ``delay`` seconds (a loaded or far-away store)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def get(self, key: str) -> bytes:
        time.sleep(self.delay)
        return super().get(key)


@pytest.mark.timeout(30)
def test_builtin_store_fails_above_its_latency_bound() -> None:
    fast, slow = _SlowStore(0.0), _SlowStore(STORE_LATENCY_BOUND + 0.3)
    assert check_store(HealthContext(store=lambda: fast)) == ""
    problem = check_store(HealthContext(store=lambda: slow))
    assert "above the bound of 1 s" in problem, problem
    assert slow.num_keys() == 0, "the probe key is removed"


@pytest.mark.timeout(60)
def test_launch_raises_unhealthy_node_error() -> None:
    import rallypoint
    from rallypoint.launcher import UnhealthyNodeError

    with pytest.raises(UnhealthyNodeError, match="exit code 9") as info:
        rallypoint.launch(_never, health_check=["exit 9"], health_check_timeout=5.0)
    assert info.value.check == "exit 9"
    with pytest.raises(ValueError, match="unknown health check 'builtin:nope'"):
        rallypoint.launch(_never, health_check=["builtin:nope"])
    with pytest.raises(ValueError, match="health_check_timeout must be > 0"):
        rallypoint.launch(_never, health_check="true", health_check_timeout=timedelta(0))


def _never() -> None:
    raise AssertionError("a worker started on an unhealthy node")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--health-check", ""], {}, "--health-check needs a shell command"),
        (["--health-check", "builtin:cpu"], {}, "'builtin:cpu' is not a built-in check"),
        (["--health-check-timeout", "0"], {}, "--health_check_timeout: must be > 0, got 0"),
        ([], {"PET_HEALTH_CHECK": "builtin:gpus"}, "'builtin:gpus' is not a built-in check"),
    ],
)
def test_bad_health_check_input_is_one_line_exit_2(
    hello: Path, argv: list[str], env: dict[str, str], says: str
) -> None:
    proc = subprocess.run(
        [*RALLYPOINT, *argv, str(hello)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rallypoint run: error: "), proc.stderr
    assert says in lines[0], lines


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_builtin_gpu_checks_every_visible_gpu() -> None:
    if not _has_gpu():
        pytest.skip("no GPU here: builtin:gpu is checked where one is lent")
    import torch

    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint._elastic._health._gpu_probe"],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    for index in range(torch.cuda.device_count()):
        assert f"cuda:{index} (" in proc.stdout and "matmul in" in proc.stdout, proc.stdout


@pytest.mark.timeout(30)
def test_health_check_options_flags_beat_pet(hello: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rallypoint._cli._args import config_from_args
    from rallypoint._cli._parser import build_parser

    def parse(argv: list[str]) -> Any:
        return config_from_args(build_parser().parse_args([*argv, str(hello)]))[0]

    assert parse([]).health_check == ()
    assert parse([]).health_check_timeout == timedelta(seconds=60)
    monkeypatch.setenv("PET_HEALTH_CHECK", "builtin:disk\n/opt/check gpu 0\n")
    monkeypatch.setenv("PET_HEALTH_CHECK_TIMEOUT", "7.5")
    config = parse([])
    assert config.health_check == ("builtin:disk", "/opt/check gpu 0")
    assert config.health_check_timeout == timedelta(seconds=7.5)
    config = parse(["--health_check", "true", "--health-check", "builtin:store"])
    assert config.health_check == ("true", "builtin:store")  # flags beat PET_HEALTH_CHECK
