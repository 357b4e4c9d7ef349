"""Dynamic groups (world_size=None): join and leave at runtime, token always released."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from rallypoint import rpc
from rallypoint.rpc._agent._agent import current_rallypoint_agent

SECRET = {"RALLYPOINT_RPC_SECRET": "groups-secret"}


def _name() -> str:
    return str(rpc.get_worker_info().name)


_DONE: list[str] = []


def _mark_done(name: str) -> None:
    _DONE.append(name)


def _done_count() -> int:
    return len(_DONE)


def _members() -> list[str]:
    return sorted(i.name for i in current_rallypoint_agent().get_worker_infos())


def _wait_members(n: int, timeout: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while len(_members()) != n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"expected {n} members, have {_members()}")
        time.sleep(0.02)
    return _members()


def _wait_for_member(name: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    # the test knows the key layout: the store prefix of the first init_rpc, then member/<name>
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        None,
        False,
        timedelta(seconds=20),
    )
    deadline = time.monotonic() + 20
    while not store.check([f"rpc_prefix_0/member/{name}"]) and time.monotonic() < deadline:
        time.sleep(0.01)


def _dynamic_scenario() -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    time.sleep(0.15 * rank)  # join one after another (the token serialises overlaps anyway)
    maps = {"worker0": {"cpu": "cpu"}} if rank == 1 else {}
    opts = rpc.RallypointRpcBackendOptions(rpc_timeout=20, device_maps=maps)
    out: dict[str, Any] = {}
    if rank == 3:
        # a duplicate name is refused, and the membership token is released anyway
        _wait_for_member("worker0")
        with pytest.raises(RuntimeError, match="worker name 'worker0' is already in the group"):
            rpc.init_rpc("worker0", rank=3, world_size=None, rpc_backend_options=opts)
        start = time.monotonic()
        rpc.init_rpc("worker3", rank=3, world_size=None, rpc_backend_options=opts)
        out["rejoin_s"] = time.monotonic() - start
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=None, rpc_backend_options=opts)
    everyone = _wait_members(4)
    out["seen"] = everyone
    out["calls"] = [rpc.rpc_sync(peer, _name) for peer in everyone]
    if rank == 3:
        deadline = time.monotonic() + 45  # the workers' own timeout is 50 s
        while len(_DONE) < 3:  # until the others' calls to it are through, however slow
            assert time.monotonic() < deadline, f"only {sorted(_DONE)} called worker3"
            time.sleep(0.01)
        rpc.shutdown()  # leave while the others keep working
        return out
    rpc.rpc_sync("worker3", _mark_done, args=(f"worker{rank}",))
    remaining = _wait_members(3)
    out["after_leave"] = remaining
    out["calls_after"] = [rpc.rpc_sync(peer, _name) for peer in remaining]
    with pytest.raises(RuntimeError, match="Unknown destination worker 'worker3'"):
        rpc.rpc_sync("worker3", _name)
    if rank == 0:
        # worker1 maps onto worker0: worker3 leaving must not erase that reverse map
        out["reverse_maps"] = sorted(current_rallypoint_agent().peers.reverse_maps)
    rpc.rpc_sync("worker0", _mark_done, args=(f"worker{rank}",))
    deadline = time.monotonic() + 45
    while rpc.rpc_sync("worker0", _done_count) < 3:
        assert time.monotonic() < deadline, "the others never finished with worker0"
        time.sleep(0.01)
    rpc.shutdown()  # rank 0 hosts the store: its leave waits until the others have left
    return out


@pytest.mark.timeout(60)
def test_dynamic_join_and_leave() -> None:
    from rallypoint.testing import run_workers

    results = run_workers(_dynamic_scenario, 4, timeout=50, env=SECRET)
    names = ["worker0", "worker1", "worker2", "worker3"]
    for rank, out in enumerate(results):
        assert out["seen"] == names
        assert out["calls"] == names
        if rank < 3:
            assert out["after_leave"] == names[:3]
            assert out["calls_after"] == names[:3]
    assert results[3]["rejoin_s"] < 15.0  # the failed join released the token
    assert results[0]["reverse_maps"] == ["worker1"]


def test_membership_token_is_released_when_the_change_fails(tmp_path: Any) -> None:
    import torch.distributed as dist

    from rallypoint.rpc._group import _groups

    store = dist.FileStore(str(tmp_path / "store"), -1)  # type: ignore[attr-defined]
    with pytest.raises(KeyError), _groups.membership_token(store, "a", 2.0):
        raise KeyError("the change failed")
    assert store.get(_groups.TOKEN_KEY) == b""
    with _groups.membership_token(store, "b", 2.0):
        start = time.monotonic()
        with (
            pytest.raises(RuntimeError, match="held by 'b'"),
            _groups.membership_token(store, "c", 0.2),
        ):
            pass
        assert time.monotonic() - start < 10.0
    with _groups.membership_token(store, "c", 2.0):
        pass


def _joiner(i: int, graceful: bool, report: int) -> None:
    """A short-lived member: join, call both long-lived members, leave (maybe abruptly)."""
    try:
        opts = rpc.RallypointRpcBackendOptions(rpc_timeout=10)
        rpc.init_rpc(f"j{i}", rank=10 + i, world_size=None, rpc_backend_options=opts)
        names = [rpc.rpc_sync(peer, _name) for peer in ("w0", "w1")]
        rpc.shutdown(graceful=graceful)
        os.write(report, f"ok {names}".encode())
    except BaseException as exc:
        os.write(report, f"error {exc!r}".encode())
    finally:
        os._exit(0)


def _run_joiner(i: int, graceful: bool) -> str:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _joiner(i, graceful, write)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as fh:
        return fh.read()


def _wait_for_files(*paths: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, f"not all of {paths} within {timeout} s"
        time.sleep(0.02)


def _leave_and_join_loop(flags: str) -> Any:
    rank = int(os.environ["RANK"])
    opts = rpc.RallypointRpcBackendOptions(rpc_timeout=10)
    done = Path(flags, "done")
    if rank < 2:
        time.sleep(0.2 * rank)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=None, rpc_backend_options=opts)
        _wait_for_files(done, timeout=50)
        members = _members()
        Path(flags, f"seen{rank}").touch()
        # both looked before either leaves (a leaver is gone from the view)
        _wait_for_files(Path(flags, "seen0"), Path(flags, "seen1"), timeout=30)
        rpc.shutdown()
        return members
    _wait_for_member("w1")
    # every other joiner leaves with graceful=False: it stays in the membership until the
    # next joiner finds its address refusing connections and removes it
    outcomes = [_run_joiner(i, graceful=i % 2 == 1) for i in range(6)]
    done.touch()
    return outcomes


@pytest.mark.timeout(90)
def test_join_right_after_a_member_left_with_graceful_false(tmp_path: Path) -> None:
    from rallypoint.testing import run_workers

    results = run_workers(_leave_and_join_loop, 3, str(tmp_path), timeout=75, env=SECRET)
    assert results[2] == ["ok ['w0', 'w1']"] * 6, results[2]
    assert results[0] == results[1] == ["w0", "w1"]  # the abrupt leavers are gone


def _static_then_dynamic(which: str) -> str:
    """Ranks 0 and 1 form a static group; then rank 2 tries to join it dynamically."""
    import torch.distributed as dist
    import torch.distributed.rpc as torch_rpc

    api: Any = torch_rpc if which == "torch" else rpc
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=3)  # shares MASTER_PORT's store
    if rank < 2:
        api.init_rpc(f"worker{rank}", rank=rank, world_size=2)
    dist.barrier()
    out = ""
    if rank == 2:
        try:
            api.init_rpc("worker2", rank=2)  # world_size=None: dynamic
        except RuntimeError as exc:
            out = str(exc)
    dist.barrier()
    if rank < 2:  # the static group is unharmed
        out = str(api.rpc_sync(f"worker{1 - rank}", max, args=(rank, 1 + rank)))
        api.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_a_dynamic_worker_cannot_join_a_static_group_as_in_torch() -> None:
    from rallypoint.testing import run_workers
    from rallypoint.testing._workers import run_reference_workers

    theirs = run_reference_workers(_static_then_dynamic, 3, "torch", timeout=50, env=SECRET)
    ours = run_workers(_static_then_dynamic, 3, "ours", timeout=50, env=SECRET)
    phrase = "RPC group mixes statically and dynamically initialized members which is not supported"
    assert theirs[:2] == ours[:2] == ["1", "2"]
    assert phrase in theirs[2] and phrase in ours[2], (theirs[2], ours[2])
    assert "world_size" in ours[2]  # and says what to change
