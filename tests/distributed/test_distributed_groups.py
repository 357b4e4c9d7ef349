"""Parallel groups on 4 real gloo processes, checked against the layout in docs/distributed.md."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import rallypoint.distributed as rd
from rallypoint.testing import run_workers

# The pictures in docs/distributed.md, written out: for each layout, the groups of each
# dimension (a rank's group is the one that contains it).
LAYOUTS: dict[str, tuple[dict[str, int], dict[str, list[list[int]]]]] = {
    "tp2xdp2": (
        {"tensor_parallel": 2},
        {
            "tp": [[0, 1], [2, 3]],
            "dp": [[0, 2], [1, 3]],
            "pp": [[0], [1], [2], [3]],
            "cp": [[0], [1], [2], [3]],
        },
    ),
    "pp2xdp2": (
        {"pipeline_parallel": 2},
        {
            "pp": [[0, 2], [1, 3]],
            "dp": [[0, 1], [2, 3]],
            "tp": [[0], [1], [2], [3]],
            "cp": [[0], [1], [2], [3]],
        },
    ),
    "cp2xtp2": (
        {"context_parallel": 2, "tensor_parallel": 2, "dim_backends": {"tp": "gloo"}},
        {
            "tp": [[0, 1], [2, 3]],
            "cp": [[0, 2], [1, 3]],
            "dp": [[0], [1], [2], [3]],
            "pp": [[0], [1], [2], [3]],
        },
    ),
}


def _layout_checks(sizes: dict[str, Any]) -> dict[str, Any]:
    groups = rd.init_parallel_groups(**sizes)
    rank = dist.get_rank()
    out: dict[str, Any] = {
        "ranks": {dim: groups.ranks(dim) for dim in rd.DIM_NAMES},
        "coordinate": groups.coordinate,
        "sizes": groups.sizes,
        "short": (groups.dp_size, groups.tp_size, groups.pp_size, groups.cp_size),
        "short_ranks": (groups.dp_rank, groups.tp_rank, groups.pp_rank, groups.cp_rank),
        "stages": (groups.is_first_stage, groups.is_last_stage),
        "mesh": (tuple(groups.mesh.shape), groups.mesh.mesh_dim_names),
        "same_object": rd.init_parallel_groups(**sizes) is groups,
        "current": rd.get_parallel_groups() is groups,
        "group_props": [
            groups.dp_group is groups.group("dp"),
            groups.tp_group is groups.group("tp"),
            groups.pp_group is groups.group("pp"),
            groups.cp_group is groups.group("cp"),
        ],
    }
    # collectives inside each group: a sum and a gather of global ranks, in group order
    out["sum"], out["gather"] = {}, {}
    for dim in rd.DIM_NAMES:
        group = groups.group(dim)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        out["sum"][dim] = t.item()
        gathered = [torch.zeros(1) for _ in range(groups.size(dim))]
        dist.all_gather(gathered, torch.tensor([float(rank)]), group=group)
        out["gather"][dim] = [int(g.item()) for g in gathered]
    try:
        rd.init_parallel_groups(tensor_parallel=4)
    except rd.AlreadyInitializedError as exc:
        out["other_layout"] = str(exc)
    try:
        groups.group("ep")
    except ValueError as exc:
        out["bad_dim"] = str(exc)
    out["repr"] = repr(groups)
    rd.destroy_process_group()
    try:
        rd.get_parallel_groups()
    except rd.NotInitializedError:
        out["cleared"] = True
    return out


@pytest.mark.timeout(40)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_group_membership_matches_the_documented_layout(layout: str) -> None:
    sizes, expected = LAYOUTS[layout]
    results = run_workers(_layout_checks, 4, sizes, timeout=30)
    for rank, out in enumerate(results):
        for dim in rd.DIM_NAMES:
            (mine,) = [g for g in expected[dim] if rank in g]
            assert out["ranks"][dim] == mine, (rank, dim)
            assert out["gather"][dim] == mine, (rank, dim)
            assert out["sum"][dim] == float(sum(mine)), (rank, dim)
            assert out["coordinate"][dim] == mine.index(rank)
            assert out["sizes"][dim] == len(mine)
        # rank = ((pp * DP + dp) * CP + cp) * TP + tp: tensor parallel innermost
        c, s = out["coordinate"], out["sizes"]
        assert rank == ((c["pp"] * s["dp"] + c["dp"]) * s["cp"] + c["cp"]) * s["tp"] + c["tp"]
        assert out["short"] == (s["dp"], s["tp"], s["pp"], s["cp"])
        assert out["short_ranks"] == (c["dp"], c["tp"], c["pp"], c["cp"])
        assert out["stages"] == (c["pp"] == 0, c["pp"] == s["pp"] - 1)
        assert out["mesh"] == (tuple(s[d] for d in rd.DIM_NAMES), rd.DIM_NAMES)
        assert out["same_object"] and out["current"] and all(out["group_props"])
        assert "parallel groups already exist" in out["other_layout"]
        assert "destroy_process_group() first" in out["other_layout"]
        assert "unknown parallel dimension 'ep': use one of pp, dp, cp, tp" in out["bad_dim"]
        assert out["repr"].startswith("ParallelGroups(pp=")
        assert out["cleared"]


def _coordinates() -> tuple[dict[str, list[int]], dict[str, int]]:
    groups = rd.init_parallel_groups(pipeline_parallel=2, tensor_parallel=2)
    out = ({dim: groups.ranks(dim) for dim in rd.DIM_NAMES}, groups.coordinate)
    rd.destroy_process_group()
    return out


@pytest.mark.timeout(40)
def test_three_dimensions_on_eight_processes_match_the_picture() -> None:
    # docs/distributed.md, "pipeline 2 x data 2 x tensor 2 (8 ranks)"
    expected = {
        "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
        "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
        "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    }
    for rank, (ranks, coordinate) in enumerate(run_workers(_coordinates, 8, timeout=30)):
        for dim, dim_groups in expected.items():
            (mine,) = [g for g in dim_groups if rank in g]
            assert ranks[dim] == mine, (rank, dim)
        assert ranks["cp"] == [rank]
        assert coordinate == {"pp": rank // 4, "dp": rank // 2 % 2, "cp": 0, "tp": rank % 2}


def _indivisible() -> None:
    rd.init_parallel_groups(tensor_parallel=3)


@pytest.mark.timeout(20)
def test_sizes_that_do_not_divide_the_world_fail_on_every_rank() -> None:
    results = run_workers(_indivisible, 4, timeout=15, return_exceptions=True)
    for exc in results:
        assert isinstance(exc, ValueError)
        assert "world_size 4 is not divisible by tensor_parallel = 3" in str(exc)


def test_bad_arguments_to_init_parallel_groups() -> None:
    with pytest.raises(TypeError, match=r"config must be a DistributedConfig"):
        rd.init_parallel_groups({"tensor_parallel": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"tensor_parallel must be >= 1"):
        rd.init_parallel_groups(tensor_parallel=0)
    with pytest.raises(ValueError, match=r"unknown backend 'glooo' \(dim_backends\['dp'\]\)"):
        rd.init_parallel_groups(dim_backends={"dp": "glooo"})
    assert not dist.is_initialized()


SLOW_RANK = 3
SLOW_BY = 2.0


def _slow_group_creation() -> dict[str, float]:
    """Rank 3 creates its tensor-parallel group SLOW_BY seconds late. torch's new_group does
    not synchronise the ranks (no barrier unless TORCH_DIST_INIT_BARRIER=1), and ranks 0
    and 1 share no tp group with rank 3, so without a barrier they would return from
    init_parallel_groups (and could go on, exit, and close their sockets) while rank 3 is
    still connecting the pairs of its groups."""
    import torch.distributed.device_mesh as device_mesh

    rd.init_process_group()
    rank = dist.get_rank()
    created: dict[str, float] = {}
    if rank == SLOW_RANK:
        make_group = device_mesh.new_group

        def slow_new_group(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group_desc") == "mesh_tp":
                time.sleep(SLOW_BY / 2)  # once per tp group: [0, 1], then [2, 3]
            group = make_group(*args, **kwargs)
            created["last_group"] = time.time()
            return group

        device_mesh.new_group = slow_new_group  # type: ignore[attr-defined]
    rd.init_parallel_groups(tensor_parallel=2)
    out = {"returned": time.time(), **created}
    t = torch.ones(1)
    dist.all_reduce(t, group=rd.get_parallel_groups().tp_group)
    out["tp_sum"] = t.item()
    rd.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_no_rank_leaves_init_parallel_groups_before_every_rank_created_every_group() -> None:
    results = run_workers(_slow_group_creation, 4, timeout=50)
    done = results[SLOW_RANK]["last_group"]
    for rank, out in enumerate(results):
        assert out["returned"] >= done, (rank, out["returned"] - done)
        assert out["tp_sum"] == 2.0
