"""``rallypoint run`` argument parsing: torchrun's options, both spellings, PET_ defaults."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from rallypoint._cli._args import config_from_args, parse_nproc
from rallypoint._cli._parser import UsageError, build_parser


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def parse(argv: list[str]):  # type: ignore[no-untyped-def]
    return config_from_args(build_parser().parse_args(argv))


@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc_per_node"])
def test_both_spellings(script: str, spelling: str) -> None:
    config, target = parse([spelling, "3", "--max_restarts", "2", script, "--lr", "0.1"])
    assert config.nproc == 3 and config.max_restarts == 2
    assert target.kind == "script" and target.name == script
    assert target.args == ("--lr", "0.1"), "options after the script belong to the script"


def test_all_torchrun_options_are_accepted(script: str, tmp_path: Path) -> None:
    config, _ = parse(
        [
            "--nnodes=1:1",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            "--rdzv-id=abc",
            "--rdzv-conf=timeout=10",
            "--standalone",
            "--max-restarts=1",
            "--monitor-interval=0.5",
            "--start-method=spawn",
            "--role=trainer",
            f"--log-dir={tmp_path}",
            "-r",
            "0:1,1:2",
            "-t",
            "3",
            "--local-ranks-filter=0",
            "--master-addr=127.0.0.1",
            "--node-rank=0",
            "--signals-to-handle=SIGTERM,SIGUSR1",
            "--shutdown-timeout=3",
            "--preload=json,csv",
            "--no-prefix",
            "--timeout=60",
            script,
        ]
    )
    assert config.nproc == 2
    assert config.run_id == "abc"
    assert config.monitor_interval == timedelta(seconds=0.5)
    assert config.start_method == "spawn"
    assert config.role == "trainer"
    assert config.std_mask("redirects", 0) == 1 and config.std_mask("redirects", 1) == 2
    assert config.std_mask("tee", 5) == 3
    assert config.local_ranks_filter == frozenset({0})
    assert config.shutdown_timeout == timedelta(seconds=3)
    assert config.preload == ("json", "csv")
    assert config.prefix is None
    assert config.timeout == timedelta(seconds=60)
    assert config.master_port is None  # --standalone: a free port


def test_pet_environment_defaults(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")
    monkeypatch.setenv("PET_MAX_RESTARTS", "3")
    monkeypatch.setenv("PET_MASTER_PORT", "29555")
    monkeypatch.setenv("PET_MODULE", "1")
    config, target = parse(["pkg.mod"])
    assert config.nproc == 4 and config.max_restarts == 3 and config.master_port == 29555
    assert target.kind == "module"
    config, _ = parse(["--nproc-per-node", "2", "pkg.mod"])
    assert config.nproc == 2, "the command line wins over PET_"


def test_module_no_python_and_rdzv_endpoint(script: str) -> None:
    _, target = parse(["-m", "json.tool", "x"])
    assert (target.kind, target.name, target.args) == ("module", "json.tool", ("x",))
    _, target = parse(["--no-python", "echo", "hello"])
    assert (target.kind, target.name) == ("exec", "echo")
    config, _ = parse(["--rdzv-endpoint", "localhost:29411", script])
    assert (config.master_addr, config.master_port) == ("127.0.0.1", 29411)


def test_nproc_values() -> None:
    assert parse_nproc("3") == 3
    assert parse_nproc("cpu") >= 1
    assert parse_nproc("auto") >= 1


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--nproc-per-node", "0", "{script}"], "must be >= 1"),
        (["--nproc-per-node", "abc", "{script}"], "Unsupported nproc_per_node value: 'abc'"),
        (["--bogus", "{script}"], "unrecognized arguments: --bogus"),
        ([], "the following arguments are required: training_script"),
        (["does_not_exist.py"], "script 'does_not_exist.py' does not exist"),
        (["--nnodes", "2", "{script}"], "static multi-node job needs --master-port"),
        (["--nnodes", "3:2", "--rdzv-backend", "c10d", "{script}"], "0 < MIN <= MAX"),
        (["--nnodes", "1:4", "--rdzv-backend", "c10d", "{script}"], "needs a rendezvous endpoint"),
        (["--node-rank", "1", "{script}"], "needs a multi-node job"),
        (["--rdzv-conf", "join_timeout", "{script}"], "key=value"),
        (["-m", "--no-python", "x"], "at the same time"),
        (["--no-python", "no-such-command-xyz"], "not found"),
        (["--max-restarts", "x", "{script}"], "invalid int value"),
        (["--max-restarts", "-1", "{script}"], "max_restarts must be >= 0"),
        (["--master-port", "99999", "{script}"], "master_port"),
        (["--redirects", "7", "{script}"], "redirects"),
        (["--local-ranks-filter", "a,b", "{script}"], "comma-separated list of integers"),
        (["--start-method", "thread", "{script}"], "invalid choice"),
        (["--rdzv-endpoint", "nohostport", "{script}"], "HOST:PORT"),
        (["--preload", "a b", "{script}"], "preload"),
        (
            ["--numa-binding", "nodes", "{script}"],
            r"invalid choice: 'nodes' \(choose from 'node', 'socket', 'exclusive', "
            r"'core-complex'\)",
        ),
        (["--logs-specs", "x", "{script}"], "--logs-specs is not supported"),
    ],
)
def test_bad_input(script: str, argv: list[str], match: str) -> None:
    argv = [a.replace("{script}", script) for a in argv]
    with pytest.raises((UsageError, ValueError, TypeError), match=match):
        parse(argv)


def test_the_launcher_process_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from rallypoint._cli import _args, _parser, _run\n"
        "from rallypoint._elastic import _coordinator, _one_node\n"
        "from rallypoint._supervise import _supervisor\n"
        "from rallypoint._supervise._warm import _process, _server\n"
        "from rallypoint.launcher import LaunchConfig\n"
        "import rallypoint.__main__\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.timeout(120)
def test_a_single_node_job_fails_restarts_and_ends_without_torch_in_the_launcher(
    tmp_path: Path,
) -> None:
    """The restart loop of one node keeps its rounds in memory: a failed attempt, its
    claim and decision, a restart and the end of the job import no torch in the agent."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import os, sys\n"
        "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    sys.exit(3)\n"
    )
    code = (
        "import sys\n"
        "from rallypoint._cli._run import run_main\n"
        f"rc = run_main(['--nproc-per-node', '2', '--max-restarts', '1', {str(script)!r}])\n"
        "print(rc, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.stdout.strip().splitlines()[-1:] == ["0 False"], out.stdout + out.stderr
    assert "rank 1 exited with 3; restarting the worker group (restart 1 of 1)" in out.stderr


def test_slurm_and_pet_defaults_configure_a_multi_node_run(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NNODES": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }.items():
        monkeypatch.setenv(name, value)
    config, _ = parse(["--nproc-per-node", "4", script])
    assert config.multi_node and config.nnodes == "2" and config.nproc == 4
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "gpu07:29400"
    assert config.run_id == "slurm-77.0"
    # PET_* beats SLURM, a flag beats both
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "etcd0:2379")
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd")
    config, _ = parse(["--rdzv-id", "mine", script])
    assert config.rdzv_backend == "etcd" and config.rdzv_endpoint == "etcd0:2379"
    assert config.run_id == "mine"
    monkeypatch.setenv("RALLYPOINT_IGNORE_SLURM", "1")
    monkeypatch.delenv("PET_RDZV_ENDPOINT")
    config, _ = parse([script])
    assert not config.multi_node


def test_multi_node_options_reach_the_config(script: str) -> None:
    config, _ = parse(
        ["--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n0:29400",
         "--rdzv-conf", "join_timeout=5, last_call_timeout=0.5", "--hang-timeout", "30",
         "--on-hang", "fail", "--events", "e.jsonl", script]
    )  # fmt: skip
    assert (config.min_nodes, config.max_nodes) == (2, 4)
    assert dict(config.rdzv_conf) == {"join_timeout": "5", "last_call_timeout": "0.5"}
    assert config.hang_timeout == timedelta(seconds=30) and config.on_hang == "fail"
    assert str(config.events) == "e.jsonl"
    static, _ = parse(["--nnodes", "2", "--node-rank", "1", "--master-port", "29500", script])
    assert static.rdzv_backend == "static" and static.node_rank == 1
    assert static.rdzv_endpoint == "127.0.0.1:29500"
    assert not parse(["--standalone", "--nnodes", "2", script])[0].multi_node
