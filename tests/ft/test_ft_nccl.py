"""Per-step quorum on GPUs (marked ``cuda``): across two GPUs with NCCL, and on one GPU.

Each replica group runs on its own GPU (``CUDA_VISIBLE_DEVICES``) with torchft's
``ProcessGroupNCCL`` across the groups. One group's worker is SIGKILLed: the other's
NCCL communicator is aborted at once (the agent's notice), it goes on alone without a
pause past the goal, and the killed group comes back, heals over our transport, and ends
with the same parameters. NCCL refuses two ranks of one communicator on one GPU, so a
machine with one GPU skips that case (docs/ft.md says what ran where).

On one GPU, two groups each keep their model and gradients on ``cuda:0`` and reduce across
groups over gloo, which takes CUDA tensors; one group is SIGKILLed mid-run, the other keeps
stepping, and the killed one heals back onto the GPU with the same parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _groups import finish, lighthouse, longest_pause, never_back, same_parameters, start_group
from _groups import steps as group_steps

STEPS = 35
FAULT = 10


def _gpus() -> int:
    try:
        import torch
        import torch.distributed as dist

        return torch.cuda.device_count() if dist.is_nccl_available() else 0
    except ImportError:
        return 0


def _one_group_killed(tmp_path: Path, **env: str) -> None:
    """Groups 0 and 1 with ``env``; group 1's worker SIGKILLed after step FAULT: group 0
    keeps stepping, group 1 heals from it, and both end with the same parameters."""
    house = lighthouse("--min_replicas", "1", "--join_timeout_ms", "3000")
    try:
        groups = [
            start_group(tmp_path, g, house.address, STEPS, FT_KILL=f"1:{FAULT}",
                        **{"CUDA_VISIBLE_DEVICES": str(g), **env})
            for g in (0, 1)
        ]  # fmt: skip
        texts = finish(groups)
    finally:
        screen = house.stop()
    assert all(p.returncode == 0 for p in groups), "\n".join(t[-3000:] for t in texts)
    assert "group 1 left: rank 0 killed by SIGKILL" in screen, screen
    assert "group 1 healed from group 0" in texts[1], texts[1][-3000:]
    for g in (0, 1):
        never_back(group_steps(tmp_path, g))
        assert group_steps(tmp_path, g)[-1][1] == STEPS
    worst, median = longest_pause(group_steps(tmp_path, 0), after=2)
    assert worst <= 3 * median + 1.0, f"group 0 paused {worst:.2f} s (a step: {median:.3f} s)"
    same_parameters(tmp_path, [0, 1])


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_a_group_killed_on_its_gpu_the_other_keeps_stepping_and_it_heals(tmp_path: Path) -> None:
    if _gpus() < 2:
        pytest.skip(f"needs two NVIDIA GPUs with NCCL; this machine has {_gpus()}")
    _one_group_killed(tmp_path, FT_BACKEND="nccl")  # each group on its own GPU


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_two_groups_on_one_gpu_over_gloo_a_killed_one_heals_onto_the_gpu(tmp_path: Path) -> None:
    if _gpus() < 1:
        pytest.skip("needs an NVIDIA GPU")
    _one_group_killed(tmp_path, FT_BACKEND="cuda-gloo", CUDA_VISIBLE_DEVICES="0", FT_TOGETHER="2")
    for g in (0, 1):  # its parameters and gradients, healed or not
        assert (tmp_path / f"devices-{g}").read_text() == "cuda:0", g
