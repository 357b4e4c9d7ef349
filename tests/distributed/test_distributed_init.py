"""init_process_group / destroy_process_group in real forked worker processes (gloo)."""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import rallypoint.distributed as rd
from rallypoint._core.net import free_port, free_ports
from rallypoint.testing import WorkerError, run_workers


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _env_init_checks() -> dict[str, Any]:
    records = _Records()
    logger = logging.getLogger("rallypoint.distributed")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    rank = int(os.environ["RANK"])
    group = rd.init_process_group()
    out: dict[str, Any] = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "log": list(records.messages),
    }
    # same settings (none, or the ones in effect): the existing group, no new rendezvous
    out["noop"] = rd.init_process_group() is group
    out["noop_explicit"] = rd.init_process_group("gloo", rank=rank, world_size=4) is group
    try:
        rd.init_process_group(timeout=timedelta(seconds=5), rank=(rank + 1) % 4)
    except rd.AlreadyInitializedError as exc:
        out["differs"] = str(exc)
    # the group works
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    out["sum"] = t.item()
    rd.destroy_process_group()
    rd.destroy_process_group()  # a second teardown is a no-op
    out["after"] = dist.is_initialized()
    return out


@pytest.mark.timeout(30)
def test_env_init_is_idempotent_and_rejects_other_settings() -> None:
    results = run_workers(_env_init_checks, 4, timeout=25)
    for rank, out in enumerate(results):
        assert (out["rank"], out["world"], out["backend"]) == (rank, 4, "gloo")
        assert out["noop"] and out["noop_explicit"]
        assert "already initialised by rallypoint.distributed.init_process_group" in out["differs"]
        assert "timeout: datetime.timedelta(seconds=1800) now" in out["differs"]
        assert f"rank: {rank} now, {(rank + 1) % 4} requested" in out["differs"]
        assert "destroy_process_group()" in out["differs"]
        assert out["sum"] == 6.0
        assert out["after"] is False
        (message,) = out["log"]
        assert f"rank {rank} of 4 (local {rank} of 4), backend gloo, init env://" in message


def _missing_master_addr() -> None:
    os.environ.pop("MASTER_ADDR")
    rd.init_process_group()


@pytest.mark.timeout(20)
def test_missing_master_addr_fails_fast_on_every_rank() -> None:
    start = time.monotonic()
    results = run_workers(_missing_master_addr, 4, timeout=15, return_exceptions=True)
    assert time.monotonic() - start < 10
    for exc in results:
        assert isinstance(exc, ValueError)
        assert "MASTER_ADDR is not set and world_size is 4" in str(exc)


def _backend_override_checks(second_port: int, third_port: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not torch.cuda.is_available():
        os.environ["TORCH_DISTRIBUTED_BACKEND"] = "nccl"
        try:
            rd.init_process_group()
        except rd.BackendUnavailableError as exc:
            out["nccl"] = str(exc)
        # an explicit argument beats the environment variable
        rd.init_process_group("gloo")
        out["explicit"] = str(dist.get_backend())
        rd.destroy_process_group()
    os.environ["TORCH_DISTRIBUTED_BACKEND"] = "cpu:gloo"
    os.environ["MASTER_PORT"] = str(second_port)
    rd.init_process_group()
    out["env"] = dist.get_backend_config()
    rd.destroy_process_group()
    # a per-device spec naming nccl for CUDA still works on a machine without CUDA
    # (when this torch build has NCCL at all; otherwise a clear error, before the network)
    os.environ["MASTER_PORT"] = str(third_port)
    try:
        rd.init_process_group("cpu:gloo,cuda:nccl")
    except rd.BackendUnavailableError as exc:
        out["composite"] = str(exc)
    else:
        groups = rd.init_parallel_groups()
        out["composite"] = (dist.get_backend_config(), groups.ranks("dp"))
        rd.destroy_process_group()
    return out


@pytest.mark.timeout(30)
def test_torch_distributed_backend_env_overrides_auto_selection() -> None:
    results = run_workers(_backend_override_checks, 2, *free_ports(2), timeout=25)
    for out in results:
        assert out["env"] == "cpu:gloo"
        if dist.is_nccl_available():
            assert out["composite"][1] == [0, 1]
            assert "cpu:gloo" in out["composite"][0]
        else:
            assert "backend 'nccl' is not available in this torch build" in out["composite"]
        if not torch.cuda.is_available():
            assert "backend 'nccl' needs CUDA" in out["nccl"]
            assert out["explicit"] == "gloo"


def _torch_initialised(ports: tuple[int, int]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict[str, Any] = {"same": rd.init_process_group("gloo") is dist.group.WORLD}
    try:
        rd.init_process_group(world_size=3)
    except rd.AlreadyInitializedError as exc:
        out["differs"] = str(exc)
    groups = rd.init_parallel_groups(tensor_parallel=2)
    out["tp"] = groups.ranks("tp")
    rd.destroy_process_group()
    # made by us, destroyed and re-made with torch behind our back: no stale groups
    os.environ["MASTER_PORT"] = str(ports[0])
    rd.init_parallel_groups(tensor_parallel=2)
    dist.destroy_process_group()
    try:
        rd.get_parallel_groups()
    except rd.NotInitializedError:
        out["stale_cleared"] = True
    os.environ["MASTER_PORT"] = str(ports[1])
    dist.init_process_group("gloo")
    out["torch_again"] = rd.init_parallel_groups(pipeline_parallel=2).ranks("pp")
    try:
        rd.init_process_group(world_size=3)
    except rd.AlreadyInitializedError as exc:
        out["differs_again"] = "by torch.distributed.init_process_group" in str(exc)
    rd.destroy_process_group()
    out["rank"] = rank
    out["after"] = dist.is_initialized()
    return out


@pytest.mark.timeout(30)
def test_groups_on_top_of_a_group_torch_created() -> None:
    for out in run_workers(_torch_initialised, 2, tuple(free_ports(2)), timeout=25):
        assert out["same"]
        assert "by torch.distributed.init_process_group" in out["differs"]
        assert "world_size: 2 now, 3 requested" in out["differs"]
        assert out["tp"] == [0, 1]
        assert out["stale_cleared"] and out["differs_again"]
        assert out["torch_again"] == [0, 1]
        assert out["after"] is False


def _standalone() -> dict[str, Any]:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        os.environ.pop(name, None)
    os.environ.pop("MASTER_PORT")
    group = rd.init_process_group(timeout=timedelta(seconds=30))
    out = {"size": group.size(), "rank": dist.get_rank()}
    groups = rd.init_parallel_groups()
    out["sizes"] = groups.sizes
    rd.destroy_process_group()
    return out


@pytest.mark.timeout(20)
def test_a_script_run_without_a_launcher_is_a_world_of_one() -> None:
    (out,) = run_workers(_standalone, 1, timeout=15)
    assert out == {"size": 1, "rank": 0, "sizes": {"pp": 1, "dp": 1, "cp": 1, "tp": 1}}


def _missing_peer() -> float:
    os.environ["WORLD_SIZE"] = "3"  # the third rank never comes
    start = time.monotonic()
    try:
        rd.init_process_group(timeout=timedelta(seconds=1))
    except Exception:
        return time.monotonic() - start
    raise AssertionError("init_process_group returned without the third rank")


@pytest.mark.timeout(30)
def test_timeout_bounds_the_rendezvous() -> None:
    for elapsed in run_workers(_missing_peer, 2, timeout=25):
        assert elapsed < 15


def _tcp_init(port: int) -> list[int]:
    rd.init_process_group(init_method=f"tcp://127.0.0.1:{port}")
    groups = rd.init_parallel_groups(pipeline_parallel=2)
    ranks = groups.ranks("pp")
    rd.destroy_process_group()
    return ranks


@pytest.mark.timeout(30)
def test_tcp_init_method() -> None:
    assert run_workers(_tcp_init, 2, free_port(), timeout=25) == [[0, 1], [0, 1]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_is_a_clear_error_before_any_network() -> None:
    with pytest.raises(rd.BackendUnavailableError, match=r"backend 'nccl' needs CUDA.*gloo"):
        rd.init_process_group("nccl", rank=0, world_size=2, init_method="tcp://127.0.0.1:1")
    assert not dist.is_initialized()


def test_unknown_backend_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'mpi2': valid backends are .*gloo"):
        rd.init_process_group("mpi2")
    with pytest.raises(TypeError, match=r"config must be a DistributedConfig"):
        rd.init_process_group(config={"rank": 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"either store= or init_method="):
        rd.init_process_group(init_method="env://", store=dist.HashStore())
    assert not dist.is_initialized()


def test_parallel_groups_before_init_is_a_clear_error() -> None:
    with pytest.raises(rd.NotInitializedError, match=r"call rallypoint.distributed.init_parallel"):
        rd.get_parallel_groups()


def test_worker_errors_carry_the_original_exception() -> None:
    with pytest.raises(WorkerError) as info:
        run_workers(_missing_master_addr, 2, timeout=15)
    assert isinstance(info.value.exception, ValueError)


def _with_store(port: int) -> dict[str, Any]:
    os.environ.pop("MASTER_ADDR")  # a given store needs no MASTER_ADDR
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=20))
    group = rd.init_process_group(store=store)
    out = {"size": group.size(), "rank": dist.get_rank(), "same": rd.init_process_group() is group}
    rd.destroy_process_group()
    return out


@pytest.mark.timeout(30)
def test_explicit_store() -> None:
    results = run_workers(_with_store, 2, free_port(), timeout=25)
    assert results == [{"size": 2, "rank": r, "same": True} for r in range(2)]
