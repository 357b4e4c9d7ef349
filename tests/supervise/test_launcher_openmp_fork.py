"""launch(fn) after the calling process ran parallel torch ops: GNU OpenMP is not
fork-safe, and forked workers must not hang in their first parallel op.

Every program runs in a fresh interpreter: the pytest process must not start OpenMP
threads itself (that would make later forked workers hang).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent(
    """
    import sys, torch, rallypoint

    def work():
        torch.ones(1 << 20).mul_(2.0)  # a parallel op: hangs on a broken OpenMP team
        return torch.get_num_threads()

    if __name__ == "__main__":
        torch.set_num_threads(2)
        if sys.argv[1] == "ran-ops":
            a = torch.randn(512, 512)
            a @ a  # starts this process's OpenMP team
        print("RESULT", rallypoint.launch(work, start_method=sys.argv[2]), flush=True)
    """
)


def _run(tmp_path, before: str, start_method: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    script = tmp_path / "program.py"
    script.write_text(_PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.run(
        [sys.executable, str(script), before, start_method],
        capture_output=True, text=True, timeout=90, env=env, check=False,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_workers_forked_after_parallel_ops_run_with_one_thread_and_say_why(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _run(tmp_path, "ran-ops", "fork")
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [1]" in proc.stdout
    assert "GNU OpenMP is not fork-safe" in proc.stderr
    assert "start_method='spawn'" in proc.stderr


@pytest.mark.timeout(120)
def test_workers_forked_before_any_parallel_op_keep_their_threads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _run(tmp_path, "no-ops", "fork")
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [2]" in proc.stdout
    assert "fork-safe" not in proc.stderr


@pytest.mark.timeout(120)
def test_spawned_workers_are_not_limited(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = _run(tmp_path, "ran-ops", "spawn")
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [" in proc.stdout  # a function of the launching script, in a new interpreter
    assert "fork-safe" not in proc.stderr


@pytest.mark.timeout(60)
def test_probe_tells_a_broken_team_from_a_working_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    code = textwrap.dedent(
        """
        import torch
        from rallypoint._supervise._warm._fork_probe import openmp_survives_fork
        torch.set_num_threads(2)
        fresh = openmp_survives_fork(2)
        a = torch.randn(512, 512); a @ a
        print(fresh, openmp_survives_fork(1), openmp_survives_fork(2, timeout=1.0))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True", "False"]
