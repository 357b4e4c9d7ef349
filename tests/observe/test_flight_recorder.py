"""The Flight Recorder is on in every worker of ``rallypoint run``, sized by
``--flight-recorder N|off``, and the user's own ``TORCH_FR_*`` settings win."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from _support import cli_zygote
from rallypoint._cli._args import config_from_args
from rallypoint._cli._parser import UsageError, build_parser
from rallypoint._watch._flight._recorder import DEFAULT_BUFFER, flight_recorder_env, parse_buffer
from rallypoint.launcher import LaunchConfig

SHOWS_ITS_RECORDER = """
import os
fifo = os.path.join(os.environ["RALLYPOINT_STACKS_DIR"], f"{os.getpid()}.fr")
print(f"buffer={os.environ.get('TORCH_FR_BUFFER_SIZE')} dumper={os.path.exists(fifo)}")
"""


def test_worker_env_defaults_and_the_users_settings_win() -> None:
    nccl = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": "/d/nccl_trace_rank_"}
    assert flight_recorder_env({}, DEFAULT_BUFFER, "/d") == {
        "TORCH_FR_BUFFER_SIZE": "2000", **nccl
    }  # fmt: skip
    assert flight_recorder_env({"PATH": "/bin"}, None, "/d") == {"TORCH_FR_BUFFER_SIZE": "0"}
    assert flight_recorder_env({"TORCH_FR_BUFFER_SIZE": "5"}, 100, "/d") == nccl
    assert flight_recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, 100, "/d") == {}
    mine = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_DUMP_TEMP_FILE": "/mine/x"}
    assert flight_recorder_env(mine, 100, "/d") == {"TORCH_FR_BUFFER_SIZE": "100"}
    # straggler detection on: NCCL measures each collective's time on the GPU
    timed = flight_recorder_env({}, 100, "/d", timing=True)
    assert timed["TORCH_NCCL_ENABLE_TIMING"] == "1"
    assert "TORCH_NCCL_ENABLE_TIMING" not in flight_recorder_env(
        {"TORCH_NCCL_ENABLE_TIMING": "0"}, 100, "/d", timing=True
    )
    assert "TORCH_NCCL_ENABLE_TIMING" not in flight_recorder_env({}, None, "/d", timing=True)


def test_the_option_in_the_config_and_on_the_command_line(tmp_path: Path) -> None:
    assert parse_buffer("off") is None and parse_buffer(0) is None and parse_buffer("64") == 64
    assert LaunchConfig(nproc=1).flight_recorder == DEFAULT_BUFFER
    assert LaunchConfig(nproc=1, flight_recorder="off").flight_recorder is None
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    for value, expected in (("off", None), ("500", 500)):
        config, _ = config_from_args(
            build_parser().parse_args(["--flight-recorder", value, str(script)])
        )
        assert config.flight_recorder == expected
    for bad in ("-1", "lots"):
        with pytest.raises(UsageError, match="--flight-recorder must be a number"):
            config_from_args(build_parser().parse_args(["--flight-recorder", bad, str(script)]))
    with pytest.raises(ValueError, match="flight_recorder must be a number"):
        LaunchConfig(nproc=1, flight_recorder="big")


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_workers_record_by_default_and_users_setting_wins(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text(SHOWS_ITS_RECORDER)
    cases = (
        ([], {}, "buffer=2000 dumper=True"),
        (["--flight-recorder", "off"], {}, "buffer=0 dumper=False"),
        ([], {"TORCH_FR_BUFFER_SIZE": "7"}, "buffer=7 dumper=True"),
    )
    for flags, extra, expected in cases:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FR_")}
        proc = cli_zygote.run(
            [
                sys.executable,
                "-m",
                "rallypoint",
                "run",
                "--nproc-per-node",
                "1",
                *flags,
                str(script),
            ],
            capture_output=True,
            text=True,
            timeout=50,
            env={**env, **extra},
        )
        assert proc.returncode == 0, proc.stderr
        assert expected in proc.stdout, (flags, extra, proc.stdout)
