"""``rallypoint run`` end to end: real scripts, real workers, real signals.

Most tests call the CLI in-process (``run_main``): its warm process is then forked from
this already-warm test process, which keeps the suite fast. A few run the real console
script in a subprocess (one-line errors, signal forwarding, ``python -m rallypoint``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rallypoint._cli._run import run_main

_C10_LOG = re.compile(r"\[[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ \S+:\d+\] ")
"""A line of c10's own log (``[W1128 18:12:37.701673903 socket.cpp:207] ...``)."""

pytestmark = pytest.mark.timeout(60)

RALLYPOINT = [sys.executable, "-m", "rallypoint"]

ALLREDUCE = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"hello {dist.get_rank()} sum={t.item():.0f} argv={sys.argv[1:]} main={__name__}")
print(f"err {dist.get_rank()}", file=sys.stderr)
dist.destroy_process_group()
"""


@pytest.fixture
def allreduce_script(tmp_path: Path) -> Path:
    path = tmp_path / "allreduce.py"
    path.write_text(ALLREDUCE)
    return path


def test_prefixed_lines_and_script_args(
    allreduce_script: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert run_main(["--nproc-per-node", "3", str(allreduce_script), "--x", "1"]) == 0
    out, err = capfd.readouterr()
    lines = sorted(line for line in out.splitlines() if "hello" in line)
    assert lines == [
        f"[rank{r}]: hello {r} sum=3 argv=['--x', '1'] main=__main__" for r in range(3)
    ]
    assert sorted(line for line in err.splitlines() if line.startswith("[rank")) == [
        f"[rank{r}]: err {r}" for r in range(3)
    ]


def test_custom_prefix_no_prefix_and_filter(
    allreduce_script: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["--nproc-per-node", "2", "--prefix", "<${role_name}:${local_rank}> "]
    assert run_main([*argv, "--role", "w", str(allreduce_script)]) == 0
    out, _ = capfd.readouterr()
    assert "<w:0> hello 0" in out and "<w:1> hello 1" in out
    argv = ["--nproc-per-node", "2", "--no-prefix", "--local-ranks-filter", "1"]
    assert run_main([*argv, str(allreduce_script)]) == 0
    out, _ = capfd.readouterr()
    assert "hello 1 sum=2" in out.splitlines()[0] and out.startswith("hello 1")
    assert "hello 0" not in out


def test_log_dir_and_redirects(
    allreduce_script: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    logs = tmp_path / "logs"
    argv = ["--nproc-per-node", "2", "--log-dir", str(logs), "--rdzv-id", "job1", "-r", "0:1"]
    assert run_main([*argv, str(allreduce_script)]) == 0
    out, _ = capfd.readouterr()
    assert "hello 0" not in out, "local rank 0's stdout is redirected to its file only"
    assert "[rank1]: hello 1" in out
    [run_dir] = logs.glob("job1_*")  # a fresh directory per launch, as torchrun's
    for rank in (0, 1):
        rank_dir = run_dir / "attempt_0" / str(rank)
        assert (rank_dir / "stdout.log").read_text().startswith(f"hello {rank} sum=2")
        # the worker's own lines, all of them; c10's log lines are the worker's too (a
        # reverse lookup of a peer that this sandbox's name server never answers, say)
        lines = (rank_dir / "stderr.log").read_text().splitlines()
        assert [line for line in lines if not _C10_LOG.match(line)] == [f"err {rank}"], lines


def test_lines_never_interleave(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(
        "import os, sys\n"
        "r = os.environ['RANK']\n"
        "for i in range(400):\n"
        "    sys.stdout.write(r * 50)\n"
        "    sys.stdout.write(r * 50 + '\\n')\n"
    )
    assert run_main(["--nproc-per-node", "3", str(script)]) == 0
    out, _ = capfd.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("[rank")]
    assert len(lines) == 1200
    for line in lines:
        prefix, body = line.split(": ", 1)
        assert body == prefix[5] * 100


FAILING = """
import os, sys, time, subprocess
rank = int(os.environ["RANK"])
if rank == 1:
    time.sleep(0.2)
    raise KeyError("missing thing")
time.sleep(30)
"""


def test_failure_summary_for_an_exception(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    assert run_main(["--nproc-per-node", "3", str(script)]) == 1
    _, err = capfd.readouterr()
    summary = err[err.index("=" * 72) :]
    assert "FAILED" in summary
    assert "rank      : 1 (local_rank: 1)" in summary
    assert "exitcode  : 1 (exited with 1)" in summary
    assert f"host      : {socket.gethostname()}" in summary
    assert "KeyError: 'missing thing'" in summary
    assert f'File "{script}", line 6, in <module>' in summary
    assert "rank 0 (local_rank: 0" in summary and "rank 2 (local_rank: 2" in summary
    assert "stopped by rallypoint with SIGTERM" in summary
    assert err.rstrip().endswith("=" * 72), "the summary is the last screen"


RESTART = """
import os
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt < 2 and dist.get_rank() == 0:
    os._exit(5)
dist.all_reduce(t)
print(f"attempt {attempt} rank {dist.get_rank()} ok {t.item():.0f}")
dist.destroy_process_group()
"""


def test_restarts_recover(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "restart.py"
    script.write_text(RESTART)
    assert run_main(["--nproc-per-node", "3", "--max-restarts", "3", str(script)]) == 0
    out, err = capfd.readouterr()
    assert sorted(line for line in out.splitlines() if "ok" in line) == [
        f"[rank{r}]: attempt 2 rank {r} ok 9" for r in range(3)
    ]
    assert err.count("restarting the worker group") == 2


def test_module_target_and_bad_module(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    pkg = tmp_path / "mypkg_launch_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "main.py").write_text("import sys, os\nprint('module', os.environ['RANK'], sys.argv)\n")
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert run_main(["--nproc-per-node", "2", "-m", "mypkg_launch_test.main", "a"]) == 0
        out, _ = capfd.readouterr()
        assert "module 1 [" in out and "'a']" in out
        assert (
            run_main(["--nproc-per-node", "2", "--max-restarts", "3", "-m", "no_such_mod_q"]) == 2
        )
        _, err = capfd.readouterr()
        assert err.strip().splitlines()[-1] == (
            "rallypoint run: error: No module named 'no_such_mod_q'"
        )
        assert "restarting" not in err
    finally:
        os.chdir(old)


def test_no_python_and_spawn(allreduce_script: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert run_main(["--nproc-per-node", "2", "--no-python", "sh", "-c", "echo r=$RANK"]) == 0
    out, _ = capfd.readouterr()
    assert sorted(out.split()) == ["[rank0]:", "[rank1]:", "r=0", "r=1"]
    argv = ["--nproc-per-node", "2", "--start-method", "spawn", str(allreduce_script)]
    assert run_main(argv) == 0
    out, _ = capfd.readouterr()
    assert "[rank1]: hello 1 sum=2" in out


def _one_line_error(argv: list[str]) -> str:
    proc = subprocess.run([*RALLYPOINT, "run", *argv], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("")
    assert "unrecognized arguments: --bogus" in _one_line_error(["--bogus", str(script)])
    assert "nproc" in _one_line_error(["--nproc-per-node", "abc", str(script)])
    assert "does not exist" in _one_line_error(["missing.py"])
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        port = sock.getsockname()[1]
        line = _one_line_error(["--master-port", str(port), str(script)])
    assert str(port) in line and "in use" in line
    line = _one_line_error(["--preload", "no_such_preload_zz", str(script)])
    assert "no_such_preload_zz" in line


def test_unknown_command_and_help() -> None:
    proc = subprocess.run([*RALLYPOINT, "nope"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown command 'nope'" in proc.stderr
    proc = subprocess.run(
        [*RALLYPOINT, "run", "--help"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0 and "--nproc-per-node" in proc.stdout


SIGNAL_SCRIPT = """
import os, signal, sys, time, subprocess
from pathlib import Path
out = Path(sys.argv[1])
def on_signal(signum, frame):
    (out / f"term{os.environ['RANK']}").write_text(str(signum))
    sys.exit(0)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, on_signal)
child = subprocess.Popen(["sleep", "60"], start_new_session=True)
(out / f"child{os.environ['RANK']}").write_text(str(child.pid))
(out / f"ready{os.environ['RANK']}").write_text("")
time.sleep(60)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_are_forwarded_and_nothing_is_left(tmp_path: Path, signum: int) -> None:
    import psutil

    script = tmp_path / "sig.py"
    script.write_text(SIGNAL_SCRIPT)
    proc = subprocess.Popen(
        [*RALLYPOINT, "run", "--nproc-per-node", "2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
        time.sleep(0.05)
    launcher = psutil.Process(proc.pid)
    tree = launcher.children(recursive=True)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signum, err
    assert f"received {signal.Signals(signum).name}" in err
    for r in (0, 1):
        assert (tmp_path / f"term{r}").read_text() == str(int(signum))
    _gone, alive = psutil.wait_procs(tree, timeout=5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive


RECORDED = """
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    raise RuntimeError("recorded by torch's @record")

main()
"""


def test_torch_record_users_still_get_their_error_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    logs = tmp_path / "logs"
    argv = ["--nproc-per-node", "1", "--log-dir", str(logs), "--rdzv-id", "rec", str(script)]
    assert run_main(argv) == 1
    _, err = capfd.readouterr()
    assert "RuntimeError: recorded by torch's @record" in err[err.index("Root cause") :]
    [run_dir] = logs.glob("rec_*")
    error_file = run_dir / "attempt_0" / "0" / "error.json"
    assert "recorded by torch's @record" in error_file.read_text()


def test_tee_without_log_dir_uses_a_temporary_one(
    allreduce_script: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert run_main(["--nproc-per-node", "2", "--tee", "1", str(allreduce_script)]) == 0
    out, err = capfd.readouterr()
    assert "[rank0]: hello 0" in out, "tee keeps the console copy"
    line = next(line for line in err.splitlines() if "log directory is" in line)
    root = Path(line.rsplit(" ", 1)[1])
    assert (root / "attempt_0" / "1" / "stdout.log").read_text().startswith("hello 1")
    assert not (root / "attempt_0" / "1" / "stderr.log").exists(), "tee 1 is stdout only"
    import shutil

    shutil.rmtree(root.parent)


DEMO = Path(__file__).resolve().parents[2] / "examples" / "train.py"


@pytest.mark.timeout(90)
def test_demo_restarts_from_its_checkpoint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["--nproc-per-node", "2", "--max-restarts", "1", "--preload", "torch._dynamo"]
    script = [str(DEMO), "--epochs", "3", "--crash-at-epoch", "1"]
    assert run_main([*argv, *script, "--checkpoint-dir", str(tmp_path / "ckpt")]) == 0
    out, err = capfd.readouterr()
    assert "[rank1]: rank 1: simulated crash in epoch 1" in out
    assert "restarting the worker group (restart 1 of 1)" in err
    assert "after epoch 0 (restart 1)" in out
    epochs = [line.split()[2] for line in out.splitlines() if line.startswith("[rank0]: epoch")]
    assert epochs == ["0", "1", "2"]
    assert (tmp_path / "ckpt" / "last.pt").exists()
