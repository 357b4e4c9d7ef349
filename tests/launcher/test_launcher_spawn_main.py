"""start_method="spawn" with a function defined in the launching script or module: the
worker imports the caller's ``__main__`` as ``__mp_main__``, as torch.multiprocessing.spawn
does, so the function unpickles and the main block does not run again. Both tools run in
the same program."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent(
    """
    import os, sys
    import torch.multiprocessing as mp
    import rallypoint

    # runs again in every spawned worker; one write per line, so torch's two workers
    # (which share this stdout) cannot interleave within a line
    sys.stdout.write(f"TOP {__name__}\\n")
    sys.stdout.flush()

    SCALE = 10

    def work(rank=0, *extra):
        return (__name__, SCALE * (rank + 1))

    def torch_work(rank, out_dir):
        with open(os.path.join(out_dir, str(rank)), "w") as fp:
            fp.write(repr(work(rank)))

    if __name__ == "__main__":
        print("MAIN", flush=True)
        out = sys.argv[1]
        mp.spawn(torch_work, args=(out,), nprocs=2)
        print("TORCH", sorted(open(os.path.join(out, f)).read() for f in os.listdir(out)))
        print("RALLYPOINT", rallypoint.launch(work, nproc=2, start_method="spawn"), flush=True)
    """
)


def _lines(out: str, prefix: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(prefix)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["script", "module"])
def test_a_function_of_the_launching_program_runs_in_spawned_workers(tmp_path, how: str) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "prog.py").write_text(_PROGRAM)
    out = tmp_path / "out"
    out.mkdir()
    argv = [str(tmp_path / "prog.py")] if how == "script" else ["-m", "prog"]
    proc = subprocess.run(
        [sys.executable, *argv, str(out)],
        capture_output=True, text=True, timeout=100, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert _lines(proc.stdout, "MAIN") == ["MAIN"]  # neither tool re-ran the main block
    torch_line = _lines(proc.stdout, "TORCH")[0]
    assert torch_line == "TORCH " + repr([repr(("__mp_main__", 10)), repr(("__mp_main__", 20))])
    # torch passes the rank as the first argument, launch() passes the given args only
    assert _lines(proc.stdout, "RALLYPOINT") == [
        "RALLYPOINT [('__mp_main__', 10), ('__mp_main__', 10)]"
    ]
    # torch's 2 workers and rallypoint's 2 (their lines prefixed by rank) ran the top level
    tops = [line for line in proc.stdout.splitlines() if line.endswith("TOP __mp_main__")]
    assert len(tops) == 4, proc.stdout
