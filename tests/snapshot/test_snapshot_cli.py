"""``--snapshot-dir`` / ``--snapshot-every``: checked on the command line, given to workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from rallypoint._cli._args import config_from_args
from rallypoint._cli._parser import UsageError, build_parser


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def _env(argv: list[str]) -> dict[str, str]:
    config, _ = config_from_args(build_parser().parse_args(argv))
    return dict(config.workers.env)


def test_the_flags_reach_the_workers_environment(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # "rel" is made (and probed) where the job starts
    env = _env(["--snapshot-dir", str(tmp_path / "ck"), "--snapshot-every", "5", script])
    assert env == {
        "RALLYPOINT_SNAPSHOT_DIR": str(tmp_path / "ck"),
        "RALLYPOINT_SNAPSHOT_EVERY": "5",
    }
    assert _env(["--snapshot_dir", "rel", script])["RALLYPOINT_SNAPSHOT_DIR"] == str(
        Path("rel").resolve()
    )
    assert _env([script]) == {}


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--snapshot-every", "0", "--snapshot-dir", "d"], "--snapshot-every must be >= 1"),
        (["--snapshot-every", "3"], "--snapshot-every needs --snapshot-dir"),
        (["--snapshot-every", "x", "--snapshot-dir", "d"], "invalid int value"),
        (["--snapshot-resume-from", "none"], "--snapshot-resume-from needs --snapshot-dir"),
        (["--snapshot-resume-from", "", "--snapshot-dir", "d"], "needs a run id, a path or none"),
        (["--snapshot-resume-from", "./nowhere", "--snapshot-dir", "d"], "no such directory"),
    ],
)
def test_bad_flags_are_usage_errors(
    script: str, argv: list[str], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # "d" is made where the job starts
    with pytest.raises(UsageError, match=match):
        _env([*argv, script])


def test_a_file_is_not_a_snapshot_dir(script: str) -> None:
    with pytest.raises(UsageError, match="is not a directory"):
        _env(["--snapshot-dir", script, script])


def test_a_snapshot_dir_that_cannot_be_made_is_a_usage_error(script: str) -> None:
    with pytest.raises(UsageError, match=r"--snapshot-dir .*: cannot write there"):
        _env(["--snapshot-dir", f"{script}/ck", script])  # under a file: ENOTDIR


def test_resume_from_reaches_the_workers_a_path_made_absolute(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck" / "run-a").mkdir(parents=True)
    base = ["--snapshot-dir", "ck", "--snapshot-resume-from"]
    for value, want in [
        ("job-7", "job-7"),
        ("none", "none"),
        ("ck/run-a", str(tmp_path / "ck/run-a")),
    ]:
        assert _env([*base, value, script])["RALLYPOINT_SNAPSHOT_RESUME_FROM"] == want
