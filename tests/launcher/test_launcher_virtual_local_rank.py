"""``--virtual-local-rank`` / ``virtual_local_rank=``: the workers' ``LOCAL_RANK`` and
``CUDA_VISIBLE_DEVICES`` as torchrun sets them, checked against torchrun in the same test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from _support import cli_zygote
from rallypoint.launcher import LaunchConfig, launch

pytestmark = pytest.mark.timeout(120)

SCRIPT = """
import json, os, sys
from pathlib import Path
names = ["RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "RALLYPOINT_LOCAL_RANK"]
out = {name: os.environ.get(name) for name in names}
Path(sys.argv[1], os.environ["RANK"]).write_text(json.dumps(out))
"""

NPROC = 3


def _start(
    launcher: list[str], flags: list[str], tmp_path: Path, cuda: str | None, nproc: int = NPROC
) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "env.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if cuda is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda
    argv = [*launcher, "--nproc-per-node", str(nproc), *flags, str(script), str(out)]
    proc = cli_zygote.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    return proc, out


def _runs(*starts: tuple[subprocess.Popen[str], Path]) -> list[tuple[int, str, dict[str, Any]]]:
    """Wait for launchers started together: exit status, stderr, each rank's variables."""
    done = []
    for proc, out in starts:
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            for other, _ in starts:
                other.kill()
            raise
        seen = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
        done.append((proc.returncode, err, seen))
    return done


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
RALLYPOINT = [sys.executable, "-m", "rallypoint", "run"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "cuda"),
    [
        (["--virtual-local-rank"], None),
        (["--virtual_local_rank"], " 2, 3 ,5,9"),
        ([], "4,6,7"),  # without the flag the list is inherited, LOCAL_RANK is real
    ],
)
def test_workers_see_what_torchrun_gives_them(
    tmp_path: Path, cuda: str | None, flags: list[str]
) -> None:
    # both at once: what is compared is what each sets, not timing
    theirs_run, ours_run = _runs(
        *(_start(cmd, flags, tmp_path, cuda) for cmd in (TORCHRUN, RALLYPOINT))
    )
    for name, (code, err, _) in (("torchrun", theirs_run), ("rallypoint", ours_run)):
        assert code == 0, (name, err)
    torch_seen, ours = theirs_run[2], ours_run[2]
    assert sorted(ours) == sorted(torch_seen) == [str(r) for r in range(NPROC)]
    for rank, theirs in torch_seen.items():
        mine = ours[rank]
        assert mine["LOCAL_RANK"] == theirs["LOCAL_RANK"], (rank, mine, theirs)
        assert mine["CUDA_VISIBLE_DEVICES"] == theirs["CUDA_VISIBLE_DEVICES"], (rank, mine, theirs)
        assert mine["RALLYPOINT_LOCAL_RANK"] == rank  # the real one, in every mode
    if flags:  # what torch's rule gives, spelled out
        expected = (cuda or "0,1,2").split(",")
        assert [ours[str(r)]["CUDA_VISIBLE_DEVICES"] for r in range(NPROC)] == [
            e.strip() for e in expected[:NPROC]
        ]
        assert {ours[str(r)]["LOCAL_RANK"] for r in range(NPROC)} == {"0"}


@pytest.mark.slow
def test_too_few_visible_gpus_is_a_usage_error_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = ["--virtual-local-rank"]
    monkeypatch.setenv("PET_VIRTUAL_LOCAL_RANK", "1")  # the variable torchrun reads for it
    theirs, mine, by_env = _runs(
        _start(TORCHRUN, flag, tmp_path, "4,6"),
        _start(RALLYPOINT, flag, tmp_path, "4,6"),
        _start(RALLYPOINT, [], tmp_path, "4", nproc=2),
    )
    monkeypatch.delenv("PET_VIRTUAL_LOCAL_RANK")
    (plain,) = _runs(_start(RALLYPOINT, [], tmp_path, "4"))  # without it one GPU is fine
    assert theirs[0] != 0  # torch's agent raises ValueError for local rank 2
    code, err, seen = mine
    assert code == 2 and seen == {}, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (
        "rallypoint run: error: virtual_local_rank: 3 workers per node, but "
        "CUDA_VISIBLE_DEVICES='4,6' lists 2 GPUs (one per worker is needed)"
    ), lines[0]
    assert by_env[0] == 2 and "lists 1 GPU (one" in by_env[1], by_env[1]
    assert plain[0] == 0 and len(plain[2]) == NPROC, plain[1]


def _env() -> dict[str, str | None]:
    names = ["LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "RALLYPOINT_LOCAL_RANK"]
    return {name: os.environ.get(name) for name in names}


def test_launch_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert launch(_env, nproc=2, virtual_local_rank=True) == [
        {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "3", "RALLYPOINT_LOCAL_RANK": "0"},
        {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1", "RALLYPOINT_LOCAL_RANK": "1"},
    ]
    # env= counts as the launcher's environment
    assert [
        r["CUDA_VISIBLE_DEVICES"]
        for r in launch(_env, nproc=2, virtual_local_rank=True, env={"CUDA_VISIBLE_DEVICES": "8,9"})
    ] == ["8", "9"]
    assert launch(_env, nproc=2) == [
        {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "3,1", "RALLYPOINT_LOCAL_RANK": "0"},
        {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "3,1", "RALLYPOINT_LOCAL_RANK": "1"},
    ]
    assert LaunchConfig(nproc=2, virtual_local_rank=True).virtual_local_rank is True


def test_bad_virtual_local_rank_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match=r"virtual_local_rank must be True or False, got 'yes'"):
        LaunchConfig(virtual_local_rank="yes")  # type: ignore[arg-type]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match=r"2 workers per node, but CUDA_VISIBLE_DEVICES='0'"):
        launch(_env, nproc=2, virtual_local_rank=True)
