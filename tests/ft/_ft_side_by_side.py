"""One scenario of ``test_ft_arguments.py`` on one stack: ``python _ft_side_by_side.py STACK
SCENARIO``, STACK ``torchft`` or ``rallypoint``. Replica groups of one rank run as threads
of this process (each its own TCPStore, one in-process lighthouse), as torchft's
``manager_integ_test.py`` runs them; the last line printed is the scenario's JSON result."""

from __future__ import annotations

import importlib
import itertools
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STACK = sys.argv[1]
ft: Any = importlib.import_module("torchft" if STACK == "torchft" else "rallypoint.ft")
coordination: Any = importlib.import_module(f"{ft.__name__}.coordination")
manager_mod: Any = importlib.import_module(f"{ft.__name__}.manager")
ckpt: Any = importlib.import_module(f"{ft.__name__}.checkpointing")
pg_transport: Any = importlib.import_module(f"{ft.__name__}.checkpointing.pg_transport")


STORES: list[Any] = []


def _manager(lighthouse: Any, replica: int, state: dict[str, torch.Tensor], **kw: Any) -> Any:
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    STORES.append(store)  # kept: torchft's process group meets in the group's store
    kw.setdefault("min_replica_size", 1)
    kw.setdefault("timeout", timedelta(seconds=20))
    return ft.Manager(
        pg=kw.pop("pg", None) or ft.ProcessGroupGloo(),
        load_state_dict=lambda sd: state["w"].copy_(sd["w"]),
        state_dict=lambda: {"w": state["w"]},
        replica_id=str(replica),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse.address(),
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=timedelta(seconds=20),
        **kw,
    )


def _groups(n: int, fn: Any) -> list[Any]:
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=n)
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            return [
                f.result(timeout=120) for f in [pool.submit(fn, lighthouse, i) for i in range(n)]
            ]
    finally:
        lighthouse.shutdown()


def spares(lighthouse: Any, replica: int) -> dict[str, Any]:
    """FIXED_WITH_SPARES with min_replica_size 1 and 2 groups: who takes part, the average."""
    state = {"w": torch.zeros(1)}
    manager = _manager(
        lighthouse,
        replica,
        state,
        init_sync=False,
        use_async_quorum=False,
        world_size_mode=manager_mod.WorldSizeMode.FIXED_WITH_SPARES,
    )
    steps = []
    try:
        for _ in range(3):
            manager.start_quorum()
            t = torch.tensor([float(replica + 1)])
            manager.allreduce(t).wait()
            steps.append(
                {
                    "participants": manager.num_participants(),
                    "participating": manager.is_participating(),
                    "average": t.item(),
                    "commit": manager.should_commit(),
                }
            )
        return {"replica": replica, "steps": steps, "step": manager.current_step()}
    finally:
        manager.shutdown(wait=False)


class Recording(ckpt.CheckpointTransport):  # type: ignore[misc,name-defined]
    """A user's transport: states kept in this process, every call recorded."""

    shelf: dict[tuple[str, int], Any] = {}
    lock = threading.Lock()

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def metadata(self) -> str:
        return f"shelf:{self.name}"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: Any
    ) -> None:
        self.calls.append(["send", list(dst_ranks), step])
        with self.lock:
            self.shelf[(self.name, step)] = {
                "user": {"default": {"w": state_dict["user"]["default"]["w"].clone()}},
                "torchft": dict(state_dict["torchft"]),
            }

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
        self.calls.append(["recv", src_rank, metadata, step])
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline:
            with self.lock:
                got = self.shelf.get((metadata.removeprefix("shelf:"), step))
            if got is not None:
                return got
            time.sleep(0.01)
        raise TimeoutError("timed out waiting for the state")

    def disallow_checkpoint(self) -> None:
        if not self.calls or self.calls[-1] != ["disallow"]:
            self.calls.append(["disallow"])

    def shutdown(self, wait: bool = True) -> None:
        self.calls.append(["shutdown"])


def _heal_with(transport: Any, lighthouse: Any, replica: int) -> dict[str, Any]:
    """2 groups, init_sync: group 1 heals from group 0 at step 0, over ``transport``."""
    state = {"w": torch.full((4,), float(replica + 10))}
    manager = _manager(
        lighthouse, replica, state, checkpoint_transport=transport, use_async_quorum=False
    )
    try:
        for _ in range(2):
            manager.start_quorum()
            grad = torch.ones(4)
            manager.allreduce(grad).wait()
            if manager.should_commit():
                state["w"] -= grad
        return {"replica": replica, "w": state["w"].tolist(), "step": manager.current_step()}
    finally:
        manager.shutdown(wait=True)


def user_transport(lighthouse: Any, replica: int) -> dict[str, Any]:
    transport = Recording(str(replica))
    out = _heal_with(transport, lighthouse, replica)
    return {**out, "calls": transport.calls}


def http_transport(lighthouse: Any, replica: int) -> dict[str, Any]:
    transport = ckpt.HTTPTransport(timeout=timedelta(seconds=20), num_chunks=2)
    return _heal_with(transport, lighthouse, replica)


def pg_transport_heal(lighthouse: Any, replica: int) -> dict[str, Any]:
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20))
    transport = pg_transport.PGTransport(
        pg, timeout=timedelta(seconds=20), device=torch.device("cpu")
    )
    state = {"w": torch.full((4,), float(replica + 10))}
    manager = _manager(
        lighthouse, replica, state, pg=pg, checkpoint_transport=transport, use_async_quorum=False
    )
    try:
        for _ in range(2):
            manager.start_quorum()
            grad = torch.ones(4)
            manager.allreduce(grad).wait()
            if manager.should_commit():
                state["w"] -= grad
        return {"replica": replica, "w": state["w"].tolist(), "step": manager.current_step()}
    finally:
        manager.shutdown(wait=True)


def wrap_future_timeout(lighthouse: Any, replica: int) -> dict[str, Any]:
    """A future that never completes, wrapped with a 0.5 s timeout: the default, an error."""
    manager = _manager(lighthouse, replica, {"w": torch.zeros(1)})
    try:
        began = time.monotonic()
        never: torch.futures.Future[int] = torch.futures.Future()
        value = manager.wrap_future(never, 7, timeout=timedelta(seconds=0.5)).wait()
        error = manager.errored()
        fine: torch.futures.Future[int] = torch.futures.Future()
        wrapped = manager.wrap_future(fine, 7, timeout=timedelta(seconds=5))
        fine.set_result(3)
        return {
            "value": value,
            # after its timeout, not long after (a loaded machine: torchft's took 0.6 s)
            "after the timeout": 0.5 <= time.monotonic() - began < 2.0,
            "errored": error is not None
            and "TimeoutError"
            in type(error.original_exception).__name__ + repr(error.original_exception),
            "completed": wrapped.wait(),
        }
    finally:
        manager.shutdown(wait=False)


def state_reads(lighthouse: Any, replica: int) -> dict[str, Any]:
    """disallow_state_dict_read: a heal's read of the state waits, then times out (1 s)."""
    manager = _manager(lighthouse, replica, {"w": torch.zeros(1)}, timeout=timedelta(seconds=1))
    try:
        manager.disallow_state_dict_read()
        began = time.monotonic()
        try:
            manager._manager_state_dict()
            refused = ""
        except Exception as exc:
            refused = type(exc).__name__
        waited = 1.0 <= time.monotonic() - began < 3.0  # its timeout (a loaded machine)
        manager.allow_state_dict_read()
        return {
            "refused": refused,
            "waited its timeout": waited,
            "after": sorted(manager._manager_state_dict()),
        }
    finally:
        manager.shutdown(wait=False)


def port(lighthouse: Any, replica: int) -> dict[str, Any]:
    """port=: rank 0 listens there (torchft's manager server; rallypoint's heal server)."""
    import socket

    from rallypoint._core.net import free_port

    free = free_port()
    manager = _manager(lighthouse, replica, {"w": torch.zeros(1)}, port=free)
    try:
        with socket.create_connection(("127.0.0.1", free), timeout=5):
            return {"listens": True}
    except OSError:
        return {"listens": False}
    finally:
        manager.shutdown(wait=False)


def _stepping(
    manager: Any, state: dict[str, torch.Tensor], last: list[float], committed: list[float]
) -> None:
    """Steps up to step ``last[0]`` (set once the groups have trained long enough), with
    the time of each committed step."""
    while manager.current_step() < last[0]:
        manager.start_quorum()
        grad = torch.ones(4)
        manager.allreduce(grad).wait()
        if manager.should_commit():
            state["w"] -= grad
            committed.append(time.monotonic())
        time.sleep(0.02)


def late_setup() -> dict[str, Any]:
    """Two groups train; a third makes its manager, then sets up for 5 s before its first
    step (a model built, compiled, loaded), under the command line's 60 s join timeout. Do
    the two pause for its set-up? (torchft's fast quorum does not wait for it.)"""
    setup = 5.0
    lighthouse = coordination.LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60000)
    last = [float("inf")]
    states = [{"w": torch.zeros(4)} for _ in range(3)]
    committed: list[list[float]] = [[], [], []]
    managers: list[Any] = []

    def group(replica: int) -> list[float]:
        manager = _manager(lighthouse, replica, states[replica], use_async_quorum=False)
        managers.append(manager)
        try:
            if replica == 2:
                time.sleep(setup)
            _stepping(manager, states[replica], last, committed[replica])
            return states[replica]["w"].tolist()
        finally:
            manager.shutdown(wait=False)

    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            early = [pool.submit(group, r) for r in (0, 1)]
            deadline = time.monotonic() + 60
            while min(len(c) for c in committed[:2]) < 10:  # both train (together)
                assert time.monotonic() < deadline, "the first two groups never stepped"
                time.sleep(0.05)
            began = time.monotonic()
            late = pool.submit(group, 2)
            time.sleep(setup + 3.0)  # its set-up, its heal and a few steps together
            last[0] = max(m.current_step() for m in managers) + 10  # all end there, equal
            final = [f.result(timeout=60) for f in [*early, late]]
    finally:
        lighthouse.shutdown()
    # the longest gap between commits while it set up (its joining step, later, costs the
    # others its first forward and backward: up to 2 s on a loaded machine, docs/ft.md)
    window = [
        [began, *(t for t in c if began < t < began + setup), began + setup] for c in committed[:2]
    ]
    pauses = [max(b - a for a, b in itertools.pairwise(t)) for t in window]
    return {
        "healthy groups paused under half the set-up": max(pauses) < setup / 2,
        "the late group stepped": len(committed[2]) >= 3,
        "same parameters": final[0] == final[1] == final[2],
    }


SCENARIOS = {
    "state_reads": (1, state_reads),
    "port": (1, port),
    "spares": (2, spares),
    "user_transport": (2, user_transport),
    "http_transport": (2, http_transport),
    "pg_transport": (2, pg_transport_heal),
    "wrap_future_timeout": (1, wrap_future_timeout),
}
ALONE = {"late_setup": late_setup}
"""Scenarios that make their own lighthouse."""

if __name__ == "__main__":
    if sys.argv[2] in ALONE:
        print(json.dumps([ALONE[sys.argv[2]]()]), flush=True)
    else:
        n, fn = SCENARIOS[sys.argv[2]]
        print(json.dumps(_groups(n, fn)), flush=True)
