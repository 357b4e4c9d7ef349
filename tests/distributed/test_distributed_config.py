"""DistributedConfig: validation in __post_init__ and resolve() against explicit environments."""

from __future__ import annotations

import pickle
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rallypoint.distributed import DistributedConfig
from rallypoint.distributed._config import check_layout

LAUNCHED = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}


def test_resolve_reads_the_launcher_environment() -> None:
    config = DistributedConfig(tensor_parallel=2).resolve(LAUNCHED)
    assert (config.rank, config.local_rank, config.world_size, config.local_world_size) == (
        3,
        1,
        4,
        2,
    )
    assert (config.master_addr, config.master_port) == ("10.0.0.1", 29500)
    assert config.init_method == "env://"
    assert config.backend == "gloo"
    assert config.timeout == timedelta(minutes=30)
    assert config.data_parallel == 2
    assert config.mesh_shape == (1, 2, 1, 2)
    assert config.sizes == {"pp": 1, "dp": 2, "cp": 1, "tp": 2}


def test_explicit_fields_win_over_the_environment() -> None:
    config = DistributedConfig(rank=0, master_port=1234, backend="GLOO").resolve(LAUNCHED)
    assert config.rank == 0
    assert config.master_port == 1234
    assert config.backend == "gloo"
    assert config.master_addr == "10.0.0.1"


def test_backend_env_overrides_auto_selection_and_argument_overrides_env() -> None:
    env = {**LAUNCHED, "TORCH_DISTRIBUTED_BACKEND": "cpu:gloo"}
    assert DistributedConfig().resolve(env).backend == "cpu:gloo"
    assert DistributedConfig(backend="gloo").resolve(env).backend == "gloo"


def test_single_process_defaults_need_no_environment() -> None:
    config = DistributedConfig().resolve({})
    assert (config.rank, config.world_size, config.local_rank, config.local_world_size) == (
        0,
        1,
        0,
        1,
    )
    assert config.master_addr == "127.0.0.1"
    assert config.master_port is not None and 0 < config.master_port < 65536
    assert config.data_parallel == 1


def test_local_rank_defaults_to_rank_modulo_local_world_size() -> None:
    env = {k: v for k, v in LAUNCHED.items() if k != "LOCAL_RANK"}
    assert DistributedConfig().resolve(env).local_rank == 1


def test_tcp_init_method_needs_no_master_env() -> None:
    config = DistributedConfig(init_method="tcp://127.0.0.1:4567", rank=1, world_size=2).resolve({})
    assert (config.master_addr, config.master_port) == ("127.0.0.1", 4567)


def test_missing_master_addr_is_a_clear_error() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match=r"MASTER_ADDR is not set .*rallypoint run"):
        DistributedConfig().resolve(env)


def test_missing_master_port_and_rank_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"MASTER_PORT is not set"):
        DistributedConfig().resolve({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h"})
    with pytest.raises(ValueError, match=r"RANK is not set and world_size is 4"):
        DistributedConfig().resolve({"WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_non_integer_environment_is_named() -> None:
    with pytest.raises(ValueError, match=r"WORLD_SIZE='four' in the environment|WORLD_SIZE='four'"):
        DistributedConfig().resolve({"WORLD_SIZE": "four"})


def test_sizes_that_do_not_divide_name_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"world_size 6 is not divisible by tensor_parallel \* pipeline_parallel = 4",
    ):
        DistributedConfig(world_size=6, tensor_parallel=2, pipeline_parallel=2)
    with pytest.raises(ValueError, match=r"world_size 6 is not divisible by tensor_parallel = 4"):
        DistributedConfig(tensor_parallel=4).resolve({**LAUNCHED, "WORLD_SIZE": "6"})
    with pytest.raises(ValueError, match=r"= 8 does not equal world_size 4: set data_parallel=-1"):
        DistributedConfig(world_size=4, data_parallel=4, tensor_parallel=2)


def test_unknown_backend_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'glo': valid backends are .*gloo.*nccl"):
        DistributedConfig(backend="glo").resolve({})
    with pytest.raises(ValueError, match=r"unknown backend 'cpu:gloo,cuda:nope'"):
        DistributedConfig(backend="cpu:gloo,cuda:nope").resolve({})
    with pytest.raises(ValueError, match=r"unknown backend 'ncl' \(dim_backends\['tp'\]\)"):
        DistributedConfig(dim_backends={"tp": "ncl"}).resolve({})
    from_env = r"unknown backend 'NCCL,x' \(from TORCH_DISTRIBUTED_BACKEND\)"
    with pytest.raises(ValueError, match=from_env):
        DistributedConfig().resolve({"TORCH_DISTRIBUTED_BACKEND": "NCCL,x"})


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"rank": -1}, ValueError, r"rank must be >= 0"),
        ({"rank": True}, TypeError, r"rank must be an int"),
        ({"world_size": 0}, ValueError, r"world_size must be >= 1"),
        ({"rank": 4, "world_size": 4}, ValueError, r"rank 4 is out of range for world_size 4"),
        ({"local_rank": 2, "local_world_size": 2}, ValueError, r"local_rank 2 is out of range"),
        ({"local_world_size": 8, "world_size": 4}, ValueError, r"exceeds world_size 4"),
        ({"master_port": 70000}, ValueError, r"master_port must be <= 65535"),
        ({"master_port": 0}, ValueError, r"master_port must be >= 1"),
        ({"master_addr": ""}, TypeError, r"master_addr must be a non-empty str"),
        ({"init_method": "http://x"}, ValueError, r"use 'env://', 'tcp://HOST:PORT'"),
        ({"timeout": 30}, TypeError, r"timeout must be a datetime.timedelta"),
        ({"timeout": timedelta(0)}, ValueError, r"timeout must be positive"),
        ({"tensor_parallel": 0}, ValueError, r"tensor_parallel must be >= 1"),
        ({"data_parallel": 0}, ValueError, r"-1 to infer"),
        ({"pipeline_parallel": 1.5}, TypeError, r"pipeline_parallel must be an int"),
        ({"dim_backends": {"xx": "gloo"}}, ValueError, r"unknown dimension 'xx': use one of pp"),
        ({"dim_backends": [("tp", "gloo")]}, TypeError, r"dim_backends must be a mapping"),
        ({"backend": 3}, TypeError, r"backend must be a non-empty str"),
    ],
)
def test_bad_fields_raise_with_the_fix(
    kwargs: dict[str, object], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        DistributedConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_tcp_init_method() -> None:
    with pytest.raises(ValueError, match=r"tcp://HOST:PORT"):
        DistributedConfig(init_method="tcp://nohost").resolve({})


def test_config_pickles_and_copies_dim_backends() -> None:
    backends = {"tp": "gloo"}
    config = DistributedConfig(tensor_parallel=2, dim_backends=backends)
    backends["dp"] = "gloo"
    assert config.dim_backends == {"tp": "gloo"}
    assert pickle.loads(pickle.dumps(config)) == config
    assert config.replace(tensor_parallel=1).tensor_parallel == 1
    with pytest.raises(ValueError, match=r"call resolve\(\) first"):
        _ = config.mesh_shape


@given(
    world=st.integers(1, 64),
    tp=st.integers(1, 8),
    pp=st.integers(1, 8),
    cp=st.integers(1, 4),
    dp=st.sampled_from([-1, 1, 2, 3, 4]),
)
def test_layout_either_fills_the_world_exactly_or_says_why(
    world: int, tp: int, pp: int, cp: int, dp: int
) -> None:
    sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
    try:
        inferred = check_layout(world, sizes)
    except ValueError as exc:
        message = str(exc)
        assert f"world_size {world}" in message
        assert "not divisible" in message or "set data_parallel=-1" in message
    else:
        assert inferred * tp * pp * cp == world
        assert dp in (-1, inferred)
