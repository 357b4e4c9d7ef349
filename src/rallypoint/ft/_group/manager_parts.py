"""The ``Manager``'s set-up and helpers: its group store and member id, its arguments'
checks, the spares of ``WorldSizeMode.FIXED_WITH_SPARES``, and the one thread that asks for
its quorums. Kept apart so that ``manager.py`` reads as the step's story."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import queue
import secrets
import socket
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from rallypoint._core.envvars import FT_NOTICE
from rallypoint._core.store import Store
from rallypoint._core.torch_c import PrefixStore, TCPStore
from rallypoint.ft._group.stopped import any_marked, mark_keys, until_running
from rallypoint.ft._plan import Plan
from rallypoint.ft._state.heal import HealServer

__all__ = [
    "Background",
    "advertised",
    "agree_on_member",
    "ask",
    "check_arguments",
    "group_store",
    "heal_server",
    "retries_of",
    "say",
    "spares_left_out",
    "tell_agent",
    "tensor_bytes",
    "transport_metadata",
    "triton_present",
    "with_timeout",
]

_TRANSPORT_METHODS = ("metadata", "send_checkpoint", "recv_checkpoint", "disallow_checkpoint")


def check_arguments(mode: Any, modes: Any, transport: Any, port: int | None) -> None:
    """``TypeError``/``ValueError`` in one line for an argument the manager cannot honour."""
    if not isinstance(mode, modes):
        raise TypeError(f"world_size_mode must be a WorldSizeMode, got {mode!r}")
    if transport is not None:
        missing = [
            m
            for m in (*_TRANSPORT_METHODS, "shutdown")
            if not callable(getattr(transport, m, None))
        ]
        if missing:
            raise TypeError(
                f"checkpoint_transport must be a CheckpointTransport; {type(transport).__name__} "
                f"has no {', '.join(missing)}"
            )
    if port is not None and not 0 <= port < 65536:
        raise ValueError(f"port must be a TCP port (0 to 65535), got {port}")


def transport_metadata(transport: Any) -> str:
    """The transport's ``metadata()``: a string short enough to travel in an ask."""
    found = transport.metadata()
    if not isinstance(found, str) or len(found) > 256:
        raise ValueError(
            f"{type(transport).__name__}.metadata() must be a string of at most 256 "
            f"characters (it travels in the group's asks), got {str(found)[:60]!r}..."
        )
    return found


def retries_of(given: int) -> int:
    """``quorum_retries``, or ``TORCHFT_QUORUM_RETRIES`` (which wins, as in torchft)."""
    raw = os.environ.get("TORCHFT_QUORUM_RETRIES")
    retries = int(raw) if raw else given
    if retries < 0:
        raise ValueError(f"quorum_retries must be 0 or more, got {retries}")
    return retries


def ask(client: Any, req: Any, wait: float, retries: int, replica_id: str) -> Any:
    """The quorum, asked for again up to ``retries`` times after a failed ask (torchft's
    ``quorum_retries``; the client also reconnects to a lighthouse that restarted)."""
    for attempt in range(retries + 1):
        try:
            return client.quorum(req, wait)
        except (TimeoutError, OSError) as exc:
            if attempt == retries:
                raise
            say(f"group {replica_id}: the quorum failed ({exc}); asking again")
    raise AssertionError("unreachable")


def spares_left_out(done: Plan, min_replica_size: int) -> Plan:
    """``WorldSizeMode.FIXED_WITH_SPARES``: the first ``min_replica_size`` members at the top
    step take part; the others are spares (they send zeros and step with the others)."""
    rank = done.participating_rank
    return dataclasses.replace(
        done,
        participating_size=min(done.participating_size, min_replica_size),
        participating_rank=rank if rank is not None and rank < min_replica_size else None,
    )


@functools.cache
def triton_present() -> bool:
    """Whether torchft would quantize an allreduce here (it needs triton)."""
    return importlib.util.find_spec("triton") is not None


def tensor_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (what a heal moved)."""
    if isinstance(state, torch.Tensor):
        local = getattr(state, "_local_tensor", state)
        return int(local.numel() * local.element_size())
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


def with_timeout(fut: Any, seconds: float) -> Any:
    """A future with ``fut``'s outcome, or ``TimeoutError`` if it is not done in ``seconds``
    (``fut`` itself is left to finish, as torchft's ``future_timeout`` leaves it)."""
    out: torch.futures.Future[Any] = torch.futures.Future()
    lock = threading.Lock()

    def finish(set_it: Callable[[], None]) -> None:
        with lock:
            if not out.done():
                set_it()

    def done(f: Any) -> None:
        try:
            value = f.value()
        except Exception as exc:
            error: Exception = exc
            finish(lambda: out.set_exception(error))
            return
        finish(lambda: out.set_result(value))

    timer = threading.Timer(
        seconds,
        finish,
        [lambda: out.set_exception(TimeoutError(f"future did not complete within {seconds} s"))],
    )
    timer.daemon = True
    timer.start()
    fut.add_done_callback(done)
    out.add_done_callback(lambda _: timer.cancel())
    return out


# ---------------------------------------------------------------------- set-up
def group_address(addr: str | None, port: int | None) -> tuple[str, int]:
    """Where the replica group's own store is (``store_addr``/``store_port`` or ``MASTER_*``)."""
    host = addr or os.environ.get("MASTER_ADDR", "")
    port_ = port or int(os.environ.get("MASTER_PORT", "0"))
    if not host or not port_:
        raise ValueError(
            "rallypoint.ft.Manager needs its replica group's store: run the group under "
            "rallypoint run (or torchrun), or pass store_addr and store_port"
        )
    return host, port_


def group_store(host: str, port: int, timeout: timedelta) -> Store:
    """The replica group's own store, the manager's keys under their prefix (the agent
    marks a stopped rank through the same: ``rallypoint.ft.agent.tell_stopped``)."""
    store = TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    return PrefixStore("rallypoint-ft/", store)


def heal_addresses(
    group: Store,
    world_size: int,
    rank: int,
    own: str,
    connect: timedelta,
    wait: float,
    replica_id: str,
) -> tuple[str, ...]:
    """Every rank's heal address (rank 0 asks with them; each written within ``connect``),
    once no other rank of the group is stopped: a group must not ask while one is, for up
    to ``wait`` seconds (``_group/stopped.py``)."""
    if world_size == 1:
        return (own,)
    keys = [f"heal/{r}" for r in range(world_size)]  # a rank restarted: its own again
    group.wait(keys, connect)
    marks = mark_keys(world_size, rank)  # each written before its rank's heal/<rank>
    values = group.multi_get(keys + marks)  # one round trip, when no rank is stopped
    if any_marked(values[len(keys) :]):
        told = f"group {replica_id} "
        until_running(group, world_size, rank, wait, lambda line: say(told + line))
        values = group.multi_get(keys)
    return tuple(bytes(v).decode() for v in values[: len(keys)])


def agree_on_member(
    group: Store, rank: int, replica_id: str, timeout: timedelta
) -> tuple[str, bytes, str]:
    """This group's member id and heal key, the same on every rank: ``(member, key,
    the key as asks carry it)``. With ``RALLYPOINT_FT_SECRET`` every group uses the
    job's secret and asks carry none; else each group makes its own, and its asks
    carry it to the groups that heal from it (the store is then the trust root), so
    that a lighthouse restarted with an empty store loses no group's key."""
    given = os.environ.get("RALLYPOINT_FT_SECRET", "")
    if rank == 0:
        member = f"{replica_id}:{secrets.token_hex(4)}"
        key = given or secrets.token_hex(32)
        group.set("secret", key)
        group.set("member", member)
    group.wait(["member"], timeout)
    member = bytes(group.get("member")).decode()
    key = bytes(group.get("secret")).decode()
    return member, key.encode(), "" if given else key


def heal_server(
    secret: bytes, timeout: timedelta, rank: int, port: int | None, replica_id: str
) -> HealServer:
    """This rank's heal server; rank 0's at ``port`` (or ``TORCHFT_MANAGER_PORT``): the
    server other groups reach this group at, as torchft's manager server. A port in use
    (another job, or two suites at once) is said in one line and another one is taken."""
    if port is None:
        port = int(os.environ.get("TORCHFT_MANAGER_PORT", "0"))
    seconds = timeout.total_seconds()
    if rank != 0 or not port:
        return HealServer(secret, timeout=seconds)
    try:
        return HealServer(secret, timeout=seconds, port=port)
    except OSError as exc:
        server = HealServer(secret, timeout=seconds)
        say(
            f"group {replica_id}: port {port} cannot be bound ({exc.strerror}); its rank 0 "
            f"serves at port {server.port} instead"
        )
        return server


def tell_agent(lighthouse: str, member: str, group_at: tuple[str, int]) -> None:
    """Where this worker's agent tells the others at once if the worker dies, and marks
    it stopped in its group's store (``_group/stopped.py``)."""
    path = os.environ.get(FT_NOTICE)
    if path:
        record = {"lighthouse": lighthouse, "member": member, "group_store": list(group_at)}
        with contextlib.suppress(OSError), open(path, "w") as fp:
            json.dump(record, fp)


class Background:
    """One daemon thread that runs a manager's quorums in turn (a quorum still being asked
    for must not keep a process that is failing alive: its peers would wait for its
    heartbeat to stop; and a thread started per step cost ~0.8 ms on a loaded machine)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...], Any] | None]
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._run, name="rallypoint-ft-quorum", daemon=True).start()

    def submit(self, fn: Callable[..., None], *args: Any) -> concurrent.futures.Future[None]:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._jobs.put((fn, args, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, future = job
            try:
                fn(*args)
                future.set_result(None)
            except BaseException as exc:  # handed to the thread that waits for the quorum
                future.set_exception(exc)


def advertised(hostname: str) -> str:
    """The address other hosts reach this one's heal server at."""
    try:
        return socket.gethostbyname(hostname)
    except OSError:
        return "127.0.0.1"


def say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"rallypoint.ft: {line}\n")
