"""``rallypoint run`` failure paths on one node: bad ``--nnodes``, torchrun
parity of the workers' environment and of a script directory, the launcher SIGKILLed,
and workers that tools can tell apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rallypoint
from rallypoint._cli._run import run_main

RALLYPOINT = [sys.executable, "-m", "rallypoint"]


def _usage_error(argv: list[str], env: dict[str, str] | None = None) -> str:
    """Run the real CLI; assert exit status 2 and one line on stderr; return that line."""
    proc = subprocess.run(
        [*RALLYPOINT, "run", *argv],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "hello" not in proc.stdout, "the job must not run"
    return lines[0]


@pytest.fixture
def hello(tmp_path: Path) -> Path:
    path = tmp_path / "hello.py"
    path.write_text("print('hello')\n")
    return path


# ---------------------------------------------------------------------------- --nnodes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["abc", "-3", "0", " ", "2:x", "0:2"])
def test_bad_nnodes_is_a_usage_error(hello: Path, value: str) -> None:
    line = _usage_error(["--nnodes", value, str(hello)])
    assert line.startswith("rallypoint run: error: --nnodes"), line
    assert repr(value.strip()) in line or repr(value) in line, line


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", ["abc", "-3", "0", " "])
def test_bad_pet_nnodes_is_a_usage_error(hello: Path, value: str) -> None:
    line = _usage_error([str(hello)], env={"PET_NNODES": value})
    assert line.startswith("rallypoint run: error: "), line
    assert "PET_NNODES" in line, line


# ---------------------------------------------------------------------------- --rdzv-id
@pytest.mark.timeout(60)
def test_a_run_id_with_a_slash_names_rdzv_id_not_log_dir(hello: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    line = _usage_error(["--rdzv-id", "team/job-7", "--log-dir", str(logs), str(hello)])
    assert line.startswith("rallypoint run: error: --rdzv-id 'team/job-7' must not contain '/'")
    assert "--log-dir" not in line and "--rdzv-id team-job-7" in line, line
    line = _usage_error([str(hello)], env={"PET_RDZV_ID": "a/b"})
    assert "--rdzv-id 'a/b'" in line, line
    with pytest.raises(ValueError, match=r"^run_id 'x/y' must not contain '/'"):
        rallypoint.launch(print, nproc=1, run_id="x/y")  # the same for launch()
    assert not logs.exists()


# ---------------------------------------------------------------------------- torchrun parity
ENV_SCRIPT = """
import os
print("signals", os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE"))
"""


@pytest.mark.timeout(60)
def test_workers_get_torchelastic_signals_to_handle(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "env.py"
    script.write_text(ENV_SCRIPT)
    assert run_main(["--nproc-per-node", "1", str(script)]) == 0
    out, _ = capfd.readouterr()
    # torchrun's default, as torch.distributed.launcher.api sets it for the workers
    assert "[rank0]: signals SIGTERM,SIGINT,SIGHUP,SIGQUIT" in out, out
    argv = ["--nproc-per-node", "1", "--signals-to-handle", "SIGTERM,SIGUSR1", str(script)]
    assert run_main(argv) == 0
    out, _ = capfd.readouterr()
    assert "[rank0]: signals SIGTERM,SIGUSR1" in out, out


@pytest.mark.timeout(60)
def test_a_directory_without_main_gets_pythons_message(tmp_path: Path) -> None:
    package = tmp_path / "pkgdir"
    package.mkdir()
    line = _usage_error([str(package)])
    assert f"can't find '__main__' module in {str(package)!r}" in line, line
    assert "does not exist" not in line
    # with a __main__.py the directory runs, as with python
    (package / "__main__.py").write_text("print('hello from main')\n")
    proc = subprocess.run(
        [*RALLYPOINT, "run", "--nproc-per-node", "1", str(package)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "hello from main" in proc.stdout, proc.stderr


# ---------------------------------------------------------------------------- ps and environ
SLEEPER = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(60)
"""


def _wait_for_files(directory: Path, names: list[str], proc: subprocess.Popen[str]) -> None:
    import time

    deadline = time.monotonic() + 40
    while not all((directory / n).exists() for n in names):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_ps_and_proc_environ_show_each_workers_rank(tmp_path: Path, start_method: str) -> None:
    import psutil

    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    argv = ["--nproc-per-node", "2", "--start-method", start_method, str(script), str(tmp_path)]
    proc = subprocess.Popen(
        [*RALLYPOINT, "run", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for_files(tmp_path, ["pid0", "pid1"], proc)
        for rank in (0, 1):
            pid = int((tmp_path / f"pid{rank}").read_text())
            ps = subprocess.run(
                ["ps", "-ww", "-o", "args=", "-p", str(pid)],
                capture_output=True,
                text=True,
                timeout=10,
            )
            title = f"rallypoint worker rank {rank} (local {rank}) {script} {tmp_path}"
            assert ps.stdout.strip() == title, ps.stdout
            worker = psutil.Process(pid)
            assert worker.cmdline()[0] == f"rallypoint worker rank {rank} (local {rank})"
            env = worker.environ()  # what /proc/PID/environ says
            assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank), env
            assert env["WORLD_SIZE"] == "2" and "TORCHELASTIC_RUN_ID" in env
            assert worker.name().startswith("python"), "comm stays python (pgrep python)"
    finally:
        proc.kill()
        proc.communicate()


# ---------------------------------------------------------------------------- kill -9
FAMILY = """
import json, os, subprocess, sys, time
from pathlib import Path

out, rank = Path(sys.argv[1]), os.environ["RANK"]
# a child with a grandchild of its own
child = subprocess.Popen(
    [sys.executable, "-c",
     "import subprocess, time; p = subprocess.Popen(['sleep', '120']); print(p.pid, flush=True); "
     "time.sleep(120)"],
    stdout=subprocess.PIPE, text=True,
)
grandchild = int(child.stdout.readline())
# a child in its own session
session = subprocess.Popen(["sleep", "120"], start_new_session=True)
# a daemon: fork, setsid, fork again, the middle one exits
r, w = os.pipe()
middle = os.fork()
if middle == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, f"{os.getpid()}".encode())
        time.sleep(120)
    os._exit(0)
os.waitpid(middle, 0)
daemon = int(os.read(r, 64))
paths = [os.environ[k] for k in ("RALLYPOINT_STACKS_DIR", "RALLYPOINT_PROGRESS_FILE")]
paths.append(os.path.dirname(os.environ["RALLYPOINT_SNAPSHOT_SOCKET"]))  # the snapshot server's
family = [os.getpid(), child.pid, grandchild, session.pid, daemon]
(out / f"family{rank}.json").write_text(json.dumps({"pids": family, "paths": paths}))
time.sleep(120)
"""


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(90)
def test_launcher_sigkilled_leaves_no_process_and_no_temporary_files(tmp_path: Path) -> None:
    import json
    import signal
    import time

    import psutil

    script = tmp_path / "family.py"
    script.write_text(FAMILY)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = ["--nproc-per-node", "2", "--hang-timeout", "300", str(script), str(tmp_path)]
    proc = subprocess.Popen(
        [*RALLYPOINT, "run", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        _wait_for_files(tmp_path, ["family0.json", "family1.json"], proc)
        families = [json.loads((tmp_path / f"family{r}.json").read_text()) for r in (0, 1)]
        pids = {pid for f in families for pid in f["pids"]}
        pids |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert len(pids) >= 12, pids  # warm process, store process, 2 x 5 of the family
        paths = [Path(p) for f in families for p in f["paths"]]
        assert all(p.exists() for p in paths) and any(tmp.iterdir())
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10.0  # at once here; 10 s for 12 exits on a loaded host
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.02)
        survivors = [psutil.Process(pid).cmdline() for pid in pids if _running(pid)]
        assert not survivors, survivors
        while time.monotonic() < deadline and (
            any(tmp.iterdir()) or any(p.exists() for p in paths)
        ):
            time.sleep(0.02)
        assert not list(tmp.iterdir()), list(tmp.iterdir())
        assert not [p for p in paths if p.exists()]
    finally:
        proc.kill()
        proc.communicate()
        for f in tmp_path.glob("family*.json"):
            for pid in json.loads(f.read_text())["pids"]:
                with __import__("contextlib").suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


OTHER_RANKS = """
import ctypes, os, signal, sys, time
rank = int(os.environ["RANK"])
if rank == 0:
    time.sleep(0.5)
    raise RuntimeError("the root cause")
if rank == 1:  # its own failure, after rallypoint's SIGTERM, which it ignores
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1.5)
    raise ValueError("rank 1 failed on its own")
if rank == 2:  # a crash of its own, likewise
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(1.5)
    ctypes.string_at(0)
if rank == 3:  # a handler that stops when told to
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
time.sleep(30)  # rank 4: killed by the SIGTERM
"""


def test_other_ranks_that_failed_on_their_own_are_not_labelled_as_stopped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(OTHER_RANKS)
    assert run_main(["--nproc-per-node", "5", str(script)]) == 1
    _, err = capfd.readouterr()
    others = {
        int(line.split()[1]): line
        for line in err[err.index("Other ranks:") :].splitlines()[1:]
        if line.startswith("  rank ")
    }
    assert "exited with 1 (its own failure: ValueError: rank 1 failed on its own)" in others[1]
    assert "killed by SIGSEGV (its own failure" in others[2]
    assert "exited with 1 (stopped by rallypoint with SIGTERM)" in others[3]
    assert "killed by SIGTERM (stopped by rallypoint with SIGTERM)" in others[4]
