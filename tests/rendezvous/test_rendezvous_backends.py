"""Backends through the registry: c10d (TCPStore), file, static; bad input; real processes."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.elastic.rendezvous.static_tcp_rendezvous as torch_static

from rallypoint._core.net import free_port
from rallypoint.rendezvous import (
    DynamicRendezvousHandler,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    StaticRendezvousHandler,
    get_rendezvous_handler,
)
from rallypoint.testing._workers import run_workers

FAST = {"last_call_timeout": "0.3", "keep_alive_interval": "0.2", "use_agent_store": "false"}


def _rendezvous_all(handlers: list[RendezvousHandler]) -> list[tuple[int, int]]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    for h in handlers:
        if isinstance(h, DynamicRendezvousHandler):
            h._bg.stop()
    return sorted((i.rank, i.world_size) for i in infos)


def test_c10d_hosts_and_connects() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    handlers = [
        get_rendezvous_handler(RendezvousParameters("c10d", endpoint, "job", 3, 3, **FAST))
        for _ in range(3)
    ]
    assert {h.get_backend() for h in handlers} == {"c10d"}
    assert _rendezvous_all(handlers) == [(0, 3), (1, 3), (2, 3)]


def test_file_backend(tmp_path: Path) -> None:
    path = str(tmp_path / "rdzv")
    handlers = [
        get_rendezvous_handler(RendezvousParameters("file", path, "job", 2, 2, **FAST))
        for _ in range(2)
    ]
    assert {h.get_backend() for h in handlers} == {"file"}
    assert _rendezvous_all(handlers) == [(0, 2), (1, 2)]


def test_c10d_store_type_file(tmp_path: Path) -> None:
    params = RendezvousParameters(
        "c10d", str(tmp_path / "s"), "job", 1, 1, store_type="file", **FAST
    )
    assert _rendezvous_all([get_rendezvous_handler(params)]) == [(0, 1)]


@pytest.mark.parametrize(
    ("endpoint", "options", "error", "message"),
    [
        ("host:abc", {}, ValueError, "rendezvous endpoint 'host:abc'"),
        ("bad host:1", {}, ValueError, "hostname of the rendezvous endpoint"),
        ("127.0.0.1:1", {"store_type": "redis"}, ValueError, "Invalid store type"),
        ("127.0.0.1:1", {"read_timeout": "soon"}, ValueError, "'read_timeout'"),
        ("127.0.0.1:1", {"read_timeout": "-1"}, ValueError, "'read_timeout'"),
        ("127.0.0.1:1", {"join_timeout": "soon"}, ValueError, "'join_timeout'"),
        ("127.0.0.1:1", {"is_host": "perhaps"}, ValueError, "'is_host'"),
        ("127.0.0.1:1", {"keep_alive_max_attempt": "x"}, ValueError, "'keep_alive_max_attempt'"),
        ("127.0.0.1:1", {"keep_alive_interval": None}, TypeError, "keep_alive_interval=None"),
        ("127.0.0.1:1", {"use_agent_store": "sometimes"}, ValueError, "'use_agent_store'"),
    ],
)
def test_c10d_bad_input(
    endpoint: str, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    params = RendezvousParameters("c10d", endpoint, "job", 1, 1, **options)
    with pytest.raises(error, match=message):
        get_rendezvous_handler(params)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="'zookeeper' is not registered"):
        get_rendezvous_handler(RendezvousParameters("zookeeper", "", "job", 1, 1))


def test_unreachable_store_is_connection_error_naming_endpoint() -> None:
    port = free_port()
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "job", 1, 1, is_host="false", read_timeout="1"
    )
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        get_rendezvous_handler(params)
    assert time.monotonic() - start < 15


def test_static_two_nodes() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    handlers = [
        get_rendezvous_handler(RendezvousParameters("static", endpoint, "job", 2, 2, rank=r))
        for r in (0, 1)
    ]
    assert all(isinstance(h, StaticRendezvousHandler) for h in handlers)
    with ThreadPoolExecutor(2) as pool:
        infos = list(pool.map(lambda h: h.next_rendezvous(), handlers))
    assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)]
    infos[0].store.set("k", b"v")
    assert infos[1].store.get("k") == b"v"
    assert handlers[0].num_nodes_waiting() == 0 and not handlers[0].is_closed()
    assert handlers[0].use_agent_store is True


@pytest.mark.parametrize(
    ("endpoint", "config"),
    [("127.0.0.1:1", {}), ("", {"rank": 0}), ("127.0.0.1", {"rank": 0})],
)
def test_static_messages_match_torch(endpoint: str, config: dict[str, Any]) -> None:
    params = RendezvousParameters("static", endpoint, "job", 1, 1, **config)
    with pytest.raises(ValueError) as ours:
        get_rendezvous_handler(params)
    with pytest.raises(ValueError) as theirs:
        torch_static.create_rdzv_handler(params)  # type: ignore[arg-type]
    assert str(ours.value) == str(theirs.value)


def _join_and_allreduce(port: int) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "procs", 4, 4, is_host="false", **FAST
    )
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("pg", info.store),
        rank=info.rank,
        world_size=info.world_size,
    )
    value = torch.tensor([float(info.rank)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return info.rank, info.world_size, float(value.item())


@pytest.mark.timeout(60)
def test_processes_rendezvous_then_gloo() -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_workers(_join_and_allreduce, 4, server.port, timeout=50)
    assert sorted(r for r, _, _ in results) == [0, 1, 2, 3]
    assert {(w, s) for _, w, s in results} == {(4, 6.0)}


def _join_die_rejoin(port: int) -> tuple[int, int, int]:
    params = RendezvousParameters(
        "c10d",
        f"127.0.0.1:{port}",
        "dying",
        2,
        3,
        is_host="false",
        keep_alive_max_attempt="2",
        # all three must meet in the first round (3 of 3 completes it at once): a 3 s last
        # call lets a process start late on a loaded host
        **{**FAST, "last_call_timeout": "3"},
    )
    handler = get_rendezvous_handler(params)
    first = handler.next_rendezvous()
    if first.rank == 1:
        os._exit(0)  # a node dies without a word
    deadline = time.monotonic() + 20
    while handler.num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the dead node was never noticed"
        time.sleep(0.1)
    second = handler.next_rendezvous()
    return first.rank, second.rank, second.world_size


@pytest.mark.timeout(60)
def test_processes_dead_node_noticed_and_survivors_keep_rank0() -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_workers(_join_die_rejoin, 3, server.port, timeout=50, return_exceptions=True)
    survivors = [r for r in results if isinstance(r, tuple)]
    assert len(survivors) == 2, results
    assert {w for _, _, w in survivors} == {2}
    assert sorted(new for _, new, _ in survivors) == [0, 1]
    for old, new, _ in survivors:
        if old == 0:
            assert new == 0  # rank 0 (which hosts the workers' store) stays put


def test_read_timeout_option_reaches_the_store() -> None:
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{free_port()}", "job", 1, 1, read_timeout="2.5", **FAST
    )
    handler = get_rendezvous_handler(params)
    assert isinstance(handler, DynamicRendezvousHandler)
    assert handler.settings.last_call_timeout == timedelta(seconds=0.3)
    handler._bg.stop()


def test_port_zero_hosts_on_a_free_port_and_reports_it() -> None:
    params = RendezvousParameters("c10d", "127.0.0.1:0", "standalone", 1, 1, is_host="1", **FAST)
    handler = get_rendezvous_handler(params)
    assert isinstance(handler, DynamicRendezvousHandler)
    host, port = handler.store_endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    joiner = get_rendezvous_handler(
        RendezvousParameters("c10d", handler.store_endpoint, "standalone", 1, 1, **FAST)
    )
    assert handler.next_rendezvous().world_size == 1
    assert isinstance(joiner, DynamicRendezvousHandler)
    handler._bg.stop()


def test_config_from_parameters() -> None:
    from rallypoint.rendezvous import DynamicRendezvousConfig

    config = DynamicRendezvousConfig.from_parameters(
        RendezvousParameters("c10d", "", "r", 1, 3, join_timeout="7", keep_alive_max_attempt="4")
    )
    assert config.join_timeout == timedelta(seconds=7)
    assert (config.min_nodes, config.max_nodes, config.keep_alive_max_attempt) == (1, 3, 4)


@pytest.mark.parametrize(("rank", "message"), [("2", r"rank \(2\)"), ("x", "'rank'")])
def test_static_bad_rank(rank: str, message: str) -> None:
    params = RendezvousParameters("static", "127.0.0.1:1", "job", 2, 2, rank=rank)
    with pytest.raises(ValueError, match=message):
        get_rendezvous_handler(params)


def test_static_unreachable_master_is_connection_error() -> None:
    port = free_port()
    params = RendezvousParameters("static", f"127.0.0.1:{port}", "job", 2, 2, rank=1, timeout=1)
    with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
        get_rendezvous_handler(params).next_rendezvous()


def _scale_up(port: int) -> tuple[int, int, int, int]:
    # heartbeats every 1 s, not FAST's 0.2 s: no node may count as dead here, and a loaded
    # host (the agent tests before it) once held one back past FAST's 0.6 s
    conf = {**FAST, "keep_alive_interval": "1"}
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", "grow", 2, 3, is_host="false", **conf
    )
    from torch.distributed import TCPStore

    test_store = TCPStore("127.0.0.1", port, is_master=False)  # the test's own key
    if int(os.environ["RANK"]) == 2:
        test_store.wait(["test/first-round-done"], timedelta(seconds=30))  # arrives late
        info = get_rendezvous_handler(params).next_rendezvous()
        return -1, -1, info.rank, info.world_size
    handler = get_rendezvous_handler(params)
    first = handler.next_rendezvous()
    test_store.set("test/first-round-done", "1")
    deadline = time.monotonic() + 20
    while handler.num_nodes_waiting() == 0:  # what an agent's monitor loop does
        assert time.monotonic() < deadline, "the late node was never reported"
        time.sleep(0.05)
    second = handler.next_rendezvous()
    return first.rank, first.world_size, second.rank, second.world_size


@pytest.mark.timeout(60)
def test_processes_scale_up_admits_a_late_node() -> None:
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_workers(_scale_up, 3, server.port, timeout=50)
    members, late = results[:2], results[2]
    assert sorted((r, w) for r, w, _, _ in members) == [(0, 2), (1, 2)]
    for old, _, new, world in members:
        assert (new, world) == (old, 3)  # members keep their ranks
    assert late[2:] == (2, 3)
