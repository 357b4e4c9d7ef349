"""``--snapshot-dir`` failures never end a healthy job: a read-only or full directory, partial
checkpoints, damaged checkpoints on restore, and jobs that share a directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _jobs import TRAIN, run, same_params, starts

from _support import cli_zygote
from rallypoint._core import envvars


def _mount(target: Path, options: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB file system of its own (filled or made read-only by the test)."""
    mnt = tmp_path / "mnt"
    _mount(mnt, "size=4m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _steps(ns: Path) -> list[str]:
    return sorted(p.name for p in ns.glob("step-*"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sub", ["", "not-yet-made"])
def test_a_read_only_snapshot_dir_at_start_is_one_line_and_exit_2(tmp_path: Path, sub: str) -> None:
    ro = tmp_path / "ro"
    _mount(ro, "size=1m,ro")
    try:
        script = tmp_path / "train.py"
        script.write_text("raise SystemExit('the job must not start')\n")
        target = ro / sub if sub else ro
        done = cli_zygote.run(
            [sys.executable, "-m", "rallypoint", "run", "--snapshot-dir", str(target), str(script)],
            capture_output=True,
            text=True,
            timeout=100,
        )
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "--snapshot-dir" in done.stderr and "Read-only file system" in done.stderr
    assert "must not start" not in done.stdout + done.stderr


@pytest.mark.timeout(180)
def test_a_disk_that_fills_mid_run_is_one_line_and_the_job_goes_on(
    tmp_path: Path, tmpfs: Path, reference: Path
) -> None:
    ck, filler = tmpfs / "ck", tmpfs / "filler"
    text = run(
        2,
        tmp_path,
        "fill",
        60,
        snapshot_dir=ck,
        every=5,
        extra_env={"SNAPSHOT_TEST_FILL": str(filler)},
    )
    # steps 20, 25 and 30 failed (full), said once; 35 to 60 were written again
    lines = [line for line in text.splitlines() if "failed" in line]
    assert len(lines) == 1, text
    assert f"persisting step 20 to {ck}/run-" in lines[0], lines[0]
    assert "No space left on device" in lines[0], lines[0]
    assert re.search(r"[\d.]+ (B|KiB|MiB|GiB) free", lines[0]), lines[0]
    same_params(tmp_path / "final.pt", reference)
    # the failed saves left no partial checkpoint behind
    [ns] = ck.glob("run-*")
    assert _steps(ns) == ["step-000000000055", "step-000000000060"]
    assert all((ns / name / ".metadata").is_file() for name in _steps(ns))


@pytest.mark.timeout(180)
def test_a_dir_made_read_only_mid_run_is_one_line_and_the_job_succeeds(
    tmp_path: Path, tmpfs: Path, reference: Path
) -> None:
    ck = tmpfs / "ck"
    env = {"SNAPSHOT_TEST_MOUNT": str(tmpfs)}
    text = run(2, tmp_path, "readonly", 60, snapshot_dir=ck, every=5, extra_env=env)
    # nine checkpoints (20 to 60) failed within a minute: one line
    lines = [line for line in text.splitlines() if "failed" in line]
    assert len(lines) == 1, text
    assert "persisting step 20" in lines[0] and "Read-only file system" in lines[0], lines[0]
    same_params(tmp_path / "final.pt", reference)
    [ns] = ck.glob("run-*")
    assert _steps(ns) == ["step-000000000010", "step-000000000015"]


@pytest.mark.timeout(180)
def test_partial_checkpoints_left_by_a_crash_are_pruned(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    partial = [ck / "run-crashed" / "step-000000000070", ck / "step-000000000080"]
    for path in partial:  # a job killed while DCP wrote (no .metadata)
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"\0" * 4096)
    text = run(2, tmp_path / "a", "none", 20, snapshot_dir=ck, every=5)
    assert starts(tmp_path / "a") == [(0, 0, 2), (0, 0, 2)], text  # neither was restored
    assert not any(p.exists() for p in partial), list(ck.rglob("*"))
    [ns] = ck.glob("run-*")
    assert _steps(ns) == ["step-000000000015", "step-000000000020"]


@pytest.mark.timeout(240)
def test_restore_falls_back_to_the_newest_checkpoint_every_rank_can_load(
    tmp_path: Path, reference: Path
) -> None:
    ck = tmp_path / "ck"
    run(2, tmp_path / "a", "none", 45, snapshot_dir=ck)  # persisted 30 and 40
    [newest] = ck.rglob("step-000000000040")
    for data in newest.glob("*.distcp"):
        data.unlink()  # listed as complete (it has .metadata), but its data is gone
    text = run(2, tmp_path / "b", "none", 60, snapshot_dir=ck)
    assert "cannot load the checkpoint" in text and "tries the next complete one" in text, text
    assert "restored step 30 from disk on every rank" in text, text
    assert starts(tmp_path / "b") == [(30, 30, 2), (30, 30, 2)]
    same_params(tmp_path / "b" / "final.pt", reference)


@pytest.fixture
def held_job(tmp_path: Path) -> Iterator[Callable[[Path, str], subprocess.Popen[str]]]:
    """Starts ``rallypoint run`` of 30 steps that waits at step 4 (its checkpoint written)
    until ``OUT/go`` exists: a job that is live for as long as the test needs (stopped at
    the end of the test if it still runs)."""
    procs: list[subprocess.Popen[str]] = []

    def start(ck: Path, rdzv_id: str) -> subprocess.Popen[str]:
        out = tmp_path / rdzv_id
        out.mkdir()
        cmd = [
            sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", "2",
            "--rdzv-id", rdzv_id, "--snapshot-dir", str(ck), "--snapshot-every", "2",
            str(TRAIN), str(out), "hold", "30",
        ]  # fmt: skip
        proc = cli_zygote.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        deadline = time.monotonic() + 100
        while not (out / "held").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()  # the launcher stops its workers
            proc.communicate(timeout=60)


def _release(proc: subprocess.Popen[str], out: Path) -> str:
    (out / "go").touch()
    text = proc.communicate(timeout=100)[0]
    assert proc.returncode == 0, text
    return text


def _resume(
    tmp_path: Path, name: str, ck: Path, steps: int, source: str | None = None, restarts: int = 0
) -> str:
    env = {} if source is None else {envvars.SNAPSHOT_RESUME_FROM: source}
    return run(2, tmp_path / name, "none", steps, snapshot_dir=ck, every=2, run_id=name,
               extra_env=env, max_restarts=restarts)  # fmt: skip


@pytest.mark.timeout(300)
def test_a_live_job_never_reads_another_live_jobs_checkpoints(
    tmp_path: Path, held_job: Callable[[Path, str], subprocess.Popen[str]]
) -> None:
    ck = tmp_path / "ck"
    a = held_job(ck, "job-a")  # live, with the checkpoints of steps 2 and 4
    text = _resume(tmp_path, "job-b", ck, 8)
    assert "restored" not in text, text  # another live job's checkpoints are another training
    assert starts(tmp_path / "job-b") == [(0, 0, 2), (0, 0, 2)], text
    assert _steps(ck / "run-job-b") == ["step-000000000006", "step-000000000008"]
    # a's own run id while a runs: refused before a worker starts (it would restore a's
    # checkpoints and train the same run twice), as launch() and as rallypoint run
    said = (
        f"--rdzv-id job-a: a job with this run id is running and writing {ck}/run-job-a "
        f"(--snapshot-dir {ck}); this one would restore its checkpoints: give it its own "
        "--rdzv-id, or start it once that job ended"
    )
    with pytest.raises(ValueError) as refused:
        run(2, tmp_path / "same", "none", 6, snapshot_dir=ck, every=2, run_id="job-a")
    assert str(refused.value) == said
    assert not list((tmp_path / "same").glob("start-*"))
    assert _one_line(["--rdzv-id", "job-a", "--snapshot-dir", str(ck)], tmp_path) == (
        f"rallypoint run: error: {said}"
    )
    _release(a, tmp_path / "job-a")
    assert _steps(ck / "run-job-a") == ["step-000000000028", "step-000000000030"]
    assert _steps(ck / "run-job-b") == ["step-000000000006", "step-000000000008"]


@pytest.mark.timeout(300)
def test_a_relaunch_resumes_from_an_ended_job_and_an_explicit_choice_wins(
    tmp_path: Path,
) -> None:
    ck = tmp_path / "ck"
    _resume(tmp_path, "job-a", ck, 30)  # ended at 30
    _resume(tmp_path, "job-b", ck, 12, source="none")  # a fresh start: 0 -> 12
    assert starts(tmp_path / "job-b") == [(0, 0, 2), (0, 0, 2)]
    # explicit choices win over the newest checkpoint (a's step 30)
    _resume(tmp_path, "job-c", ck, 14, source="job-b")
    assert starts(tmp_path / "job-c") == [(12, 12, 2), (12, 12, 2)]
    path = ck / "run-job-b" / "step-000000000010"
    text = _resume(tmp_path, "job-d", ck, 12, source=str(path))
    assert starts(tmp_path / "job-d") == [(10, 10, 2), (10, 10, 2)]
    assert "restored step 10 from disk on every rank (2 ranks; " in text, text
    assert f"): {path} (--snapshot-resume-from {path})" in text, text
    # no choice: the newest checkpoint of the jobs that ended, and which job's it is
    text = _resume(tmp_path, "job-e", ck, 32)
    assert starts(tmp_path / "job-e") == [(30, 30, 2), (30, 30, 2)]
    line = f"{ck}/run-job-a/step-000000000030, a checkpoint of job 'job-a', which ended"
    assert line in text, text


def _one_line(flags: list[str], cwd: Path) -> str:
    """``rallypoint run FLAGS``: exit status 2 and one line on stderr, before any worker
    starts; returns that line."""
    script = cwd / "never.py"
    script.write_text("raise SystemExit('the job must not start')\n")
    cmd = [sys.executable, "-m", "rallypoint", "run", *flags, str(script)]
    done = cli_zygote.run(cmd, capture_output=True, text=True, timeout=100, cwd=cwd)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert not done.stdout, done.stdout
    return lines[0]


def _usage_error(ck: Path, source: str, cwd: Path) -> str:
    """``rallypoint run --snapshot-resume-from SOURCE``: see :func:`_one_line`."""
    return _one_line(["--snapshot-dir", str(ck), "--snapshot-resume-from", source], cwd)


@pytest.mark.timeout(300)
def test_resume_from_a_live_or_unknown_job_or_an_empty_path_is_one_line_and_exit_2(
    tmp_path: Path, held_job: Callable[[Path, str], subprocess.Popen[str]]
) -> None:
    from rallypoint.launcher import launch

    ck = tmp_path / "ck"
    held_job(ck, "job-a")  # live, with the checkpoints of steps 2 and 4
    line = _usage_error(ck, "job-a", tmp_path)
    assert line.startswith(
        f"rallypoint run: error: --snapshot-resume-from job-a: job 'job-a' is still running "
        f"({ck}/run-job-a)"
    ), line
    line = _usage_error(ck, "job-z", tmp_path)
    assert line == (
        f"rallypoint run: error: --snapshot-resume-from job-z: no checkpoint of job 'job-z' in "
        f"{ck} ({ck}/run-job-z holds no complete checkpoint); run ids with checkpoints there: "
        "job-a"
    ), line
    (tmp_path / "empty").mkdir()
    line = _usage_error(ck, "./empty", tmp_path)
    assert f"--snapshot-resume-from {tmp_path}/empty: no complete checkpoint in " in line, line
    env = {envvars.SNAPSHOT_DIR: str(ck), envvars.SNAPSHOT_RESUME_FROM: "job-z"}
    with pytest.raises(ValueError, match="no checkpoint of job 'job-z'"):
        launch(print, nproc=1, env=env)  # launch() checks it too, before a worker starts


def _damage(step: Path, how: str) -> str:
    """Damage the checkpoint ``step`` as ``how`` says; returns what the line says of it."""
    data = sorted(step.glob("*.distcp"))[-1]
    if how == "metadata":
        (step / ".metadata").write_bytes(b"not a checkpoint")  # still listed as complete
        return "its .metadata does not load: UnpicklingError: "
    if how == "truncated":
        size = data.stat().st_size
        os.truncate(data, 100)
        return f"its data file {data.name} is truncated (100 bytes; its .metadata lists {size})"
    if how == "missing":
        data.unlink()
        return f"its data file {data.name} cannot be read (No such file or directory)"
    assert how == "zeroed"  # the same size, other bytes: the ranks' skeletons are read
    for path in step.glob("*.distcp"):
        path.write_bytes(b"\0" * path.stat().st_size)
    return "its meta/0, meta/1 do not load: UnpicklingError: invalid load key"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["metadata", "truncated", "missing", "zeroed"])
def test_a_damaged_explicit_choice_is_one_line_naming_it_and_exit_2(
    tmp_path: Path, how: str
) -> None:
    """Checked by the launcher before a worker starts: not a traceback from every rank,
    nor "rank 0 raised FatalError"."""
    from rallypoint.launcher import launch

    ck = tmp_path / "ck"
    _resume(tmp_path, "job-a", ck, 4)  # ended, with the checkpoints of steps 2 and 4
    newest, older = ck / "run-job-a" / "step-000000000004", ck / "run-job-a" / "step-000000000002"
    says = _damage(newest, how)
    # by its path: that checkpoint alone
    flag = f"--snapshot-resume-from {newest}"
    line = _usage_error(ck, str(newest), tmp_path)
    assert line.startswith(
        f"rallypoint run: error: {flag}: cannot load the checkpoint {newest}: "
    ), line
    assert says in line and line.endswith("repair it, or name another one"), line
    # by its job: the older one still loads (the workers fall back to it) ...
    _resume(tmp_path, "job-b", ck, 6, source="job-a")
    assert starts(tmp_path / "job-b") == [(2, 2, 2), (2, 2, 2)]
    # ... until it is damaged too
    _damage(older, how)
    line = _usage_error(ck, "job-a", tmp_path)
    head = f"--snapshot-resume-from job-a: cannot load the checkpoint {newest}: "
    assert line.startswith(f"rallypoint run: error: {head}") and " (and 1 older); " in line, line
    env = {envvars.SNAPSHOT_DIR: str(ck), envvars.SNAPSHOT_RESUME_FROM: "job-a"}
    with pytest.raises(ValueError, match=f"^{re.escape(head)}"):
        launch(print, nproc=1, env=env)  # launch() checks it too, before a worker starts


@pytest.mark.timeout(300)
def test_an_explicit_choice_that_cannot_load_fails_the_restore_not_a_fresh_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers' own check, behind the launcher's (a checkpoint damaged after the
    launcher looked, or storage that a node sees otherwise)."""
    from rallypoint._launch import _run_job
    from rallypoint.launcher import WorkerFailedError

    monkeypatch.setattr(_run_job, "resume_problem", lambda *args: "")
    ck = tmp_path / "ck"
    _resume(tmp_path, "job-a", ck, 4)  # ended, with the checkpoints of steps 2 and 4
    for metadata in ck.glob("run-job-a/step-*/.metadata"):
        metadata.write_bytes(b"not a checkpoint")  # damaged, still listed as complete
    newest = ck / "run-job-a" / "step-000000000004"
    for name, source, older in [("job-b", "job-a", 1), ("job-c", str(newest), 0)]:
        with pytest.raises(WorkerFailedError) as failed:
            _resume(tmp_path, name, ck, 8, source=source, restarts=3)
        assert not list((tmp_path / name).glob("start-*"))  # no rank trained from scratch
        summary = failed.value.summary
        assert (
            f"ExplicitResumeError: --snapshot-resume-from {source}: cannot load the checkpoint "
            f"{newest} (UnpicklingError: " in summary
        ), summary
        assert "exited with 122" in summary, summary  # a FatalError: the job ends at once
        assert "FAILED (attempt 1 of 4)" in summary, summary  # none of the 3 restarts used
        assert ("(and 1 older)" in summary) == bool(older), summary
