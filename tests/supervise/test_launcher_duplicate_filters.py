"""``--duplicate-stdout-filters`` / ``--duplicate-stderr-filters``: lines of tee'd streams
that contain a filter string are copied to ``attempt_N/filtered_std{out,err}.log``; checked
against torchrun in the same test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rallypoint._launch._values import filters
from rallypoint.launcher import LaunchConfig, launch

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import os, sys
rank = os.environ["RANK"]
for fruit in ("apple pie", "orange juice", "a, comma", "plain bread"):
    print(f"{fruit} from {rank}", flush=True)
    print(f"err {fruit} from {rank}", file=sys.stderr, flush=True)
"""

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
RALLYPOINT = [sys.executable, "-m", "rallypoint", "run"]


def _start(launcher: list[str], flags: list[str], out: Path, script: Path) -> subprocess.Popen[str]:
    argv = [*launcher, "--nproc-per-node", "2", "--log-dir", str(out), "--rdzv-id", "job"]
    argv += [*flags, str(script)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _filtered(out: Path) -> dict[str, list[str]]:
    """Each filtered file of attempt 0 (torchrun's run directory is ``RUN_ID_<random>``):
    its lines without the console prefix (``[default0]:`` there, ``[rank0]: `` here),
    sorted (the ranks' lines interleave as they come)."""
    return {
        f.name: sorted(line.split("]:", 1)[1].lstrip(" ") for line in f.read_text().splitlines())
        for f in sorted(out.glob("*/attempt_0/filtered_*.log"))
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        [
            "--tee",
            "3",
            "--duplicate-stdout-filters",
            "apple,juice",
            "--duplicate_stderr_filters",
            "a,, c",
        ],
        ["--tee", "0:1", "--duplicate-stdout-filters", "apple"],  # only rank 0's stdout is tee'd
        ["--duplicate-stdout-filters", "apple"],  # nothing tee'd: the file is there, empty
        ["--tee", "3"],  # no filters: no files
    ],
)
def test_filtered_files_hold_what_torchruns_hold(tmp_path: Path, flags: list[str]) -> None:
    script = tmp_path / "fruit.py"
    script.write_text(SCRIPT)
    procs = {
        name: _start(cmd, flags, tmp_path / name, script)
        for name, cmd in (("torchrun", TORCHRUN), ("rallypoint", RALLYPOINT))
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, (name, err)
    theirs, ours = _filtered(tmp_path / "torchrun"), _filtered(tmp_path / "rallypoint")
    assert ours == theirs
    if "a,, c" in flags:  # spelled out once: ',,' is a comma, matched within lines
        assert ours["filtered_stderr.log"] == ["err a, comma from 0", "err a, comma from 1"]
        assert ours["filtered_stdout.log"] == [
            "apple pie from 0",
            "apple pie from 1",
            "orange juice from 0",
            "orange juice from 1",
        ]


def test_filter_lists_parse_as_torchruns() -> None:
    flag = "--duplicate-stdout-filters"
    assert filters(None, flag) == ()
    assert filters("apple,orange", flag) == ("apple", "orange")
    assert filters("a,,b,c", flag) == ("a,b", "c")
    assert filters("", flag) == ("",)  # an empty filter matches every line, as in torch


def _talk() -> None:
    print(f"apple from {os.environ['RANK']}", flush=True)
    print(f"pear from {os.environ['RANK']}", flush=True)


def test_launch_api_takes_torchs_list(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    launch(
        _talk,
        nproc=2,
        log_dir=str(tmp_path),
        run_id="api",
        tee="3",
        duplicate_stdout_filters=["pear"],
    )
    capfd.readouterr()
    [run_dir] = tmp_path.glob("api_*")
    lines = (run_dir / "attempt_0" / "filtered_stdout.log").read_text().splitlines()
    assert sorted(lines) == ["[rank0]: pear from 0", "[rank1]: pear from 1"]
    assert not (run_dir / "attempt_0" / "filtered_stderr.log").exists()
    with pytest.raises(TypeError, match="duplicate_stdout_filters must be a list of strings"):
        LaunchConfig(duplicate_stdout_filters=[1])  # type: ignore[list-item]
