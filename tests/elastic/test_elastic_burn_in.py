"""The burn-in's verdict (``_elastic._burn_in.slow_node``) on made-up link times; the real
measurement runs in ``tests/elastic/test_agent_burn_in.py``."""

from __future__ import annotations

import pytest
import torch

from rallypoint._elastic._health._burn_in import LinkTimes, gemm_seconds, slow_node

FAST = 0.01


def _times(n: int, slow_out: int | None = None, slow_in: int | None = None) -> LinkTimes:
    """Receive times when node ``slow_out`` sends slowly / ``slow_in`` receives slowly."""
    forward, backward = [], []
    for g in range(n):
        fwd_from, bwd_from = (g - 1) % n, (g + 1) % n
        forward.append(1.5 if slow_in == g or slow_out == fwd_from else FAST)
        backward.append(1.5 if slow_in == g or slow_out == bwd_from else FAST)
    return LinkTimes(forward=forward, backward=backward)


def test_a_slow_sender_or_receiver_is_named_not_its_neighbours() -> None:
    for n in (3, 4, 8):
        for g in range(n):
            for slow in (_times(n, slow_out=g), _times(n, slow_in=g)):
                verdict = slow_node(slow)
                assert verdict is not None and verdict[0] == g
                assert verdict[1].startswith("its link took 1.50 s in the burn-in")


def test_nobody_is_named_without_a_slow_link() -> None:
    assert slow_node(_times(5)) is None
    jitter = LinkTimes(forward=[0.01, 0.05, 0.012, 0.011], backward=[0.01, 0.011, 0.06, 0.01])
    assert slow_node(jitter) is None, "tiny times vary by large factors: under SLOW_SECONDS"


def test_two_nodes_cannot_tell_which_side_is_slow() -> None:
    assert slow_node(_times(2, slow_out=1)) is None


def test_a_slow_gpu_is_named_and_nodes_without_gpus_never() -> None:
    times = _times(4)
    gemm = LinkTimes(times.forward, times.backward, gemm=[0.010, 0.0102, 0.025, 0.0099])
    verdict = slow_node(gemm)
    assert verdict is not None and verdict[0] == 2 and "GPU took 25.0 ms" in verdict[1]
    assert (
        slow_node(LinkTimes(times.forward, times.backward, gemm=[0.01, 0.0103, 0.0101, 0.01]))
        is None
    )
    assert slow_node(LinkTimes(times.forward, times.backward, gemm=[0.0, 0.0, 0.0, 0.0])) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gemm_seconds_on_a_real_gpu() -> None:
    t = gemm_seconds()
    assert 0 < t < 1.0, t


def test_gemm_seconds_is_zero_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gemm_seconds() == 0.0


def test_the_gemm_child_runs_and_says_when_there_is_no_gpu() -> None:
    """The child the burn-in starts on GPU nodes really runs (a broken script would make
    every GPU node's GEMM time 0.0, silently)."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: test_gemm_seconds_on_a_real_gpu covers it")
    done = subprocess.run(
        [sys.executable, "-m", "rallypoint._elastic._health._gpu_probe", "--gemm"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 5 and "no GPU visible" in done.stdout, done.stdout + done.stderr


def test_burn_in_takes_only_a_bool() -> None:
    from rallypoint.launcher import LaunchConfig

    assert LaunchConfig(burn_in=True).burn_in is True
    with pytest.raises(TypeError, match="burn_in must be True or False, got 'yes'"):
        LaunchConfig(burn_in="yes")  # type: ignore[arg-type]
