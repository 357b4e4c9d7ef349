"""Bootstrap and membership: the store, worker records, static and dynamic groups.

Every worker publishes a JSON record (name, rank, TCP address, abstract Unix socket,
host key, device count, device maps, devices) in the rendezvous store; records are
JSON, never pickle, because a TCPStore is open to anyone who can reach its port.

- Static group (``world_size`` given): each rank writes ``worker/<rank>`` and waits for
  all ranks (with the init timeout, naming the missing ranks when it expires).
- Dynamic group (``world_size=None``): membership changes take the ``token`` key with
  ``compare_set``; the token is released in a ``finally`` even when the change fails
  (torch's is not exception-safe). ``members`` lists the current names.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist_module

from rallypoint.rpc._errors import RpcError

# torch.distributed does not re-export its store classes in its stubs
dist: Any = dist_module

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_:")
TOKEN_KEY = "token"
MEMBERS_KEY = "members"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's name and id (its rank), as in ``torch.distributed.rpc.WorkerInfo``."""

    name: str
    id: int

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    __str__ = __repr__


def validate_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"worker name must be a str, got {type(name).__name__}")
    if not name or len(name) >= 128 or not set(name) <= _NAME_CHARS:
        raise ValueError(
            "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter "
            f"than 128 chars, got {name!r}"
        )
    return name


def host_key() -> str:
    """Identifies 'same host and same network namespace' (abstract sockets reach)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}:{netns}"


def local_address_towards(host: str) -> str:
    """The local IP address the kernel would use to reach ``host``."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def create_store(
    init_method: str, rank: int, world_size: int | None, timeout: float
) -> tuple[Any, int, str]:
    """A c10d store for ``init_method``; returns (store, rank, store host)."""
    delta = timedelta(seconds=timeout if timeout > 0 else 1800.0)
    url = urlparse(init_method)
    if url.scheme == "env":
        addr = os.environ.get("MASTER_ADDR")
        port = os.environ.get("MASTER_PORT")
        if not addr or not port:
            missing = "MASTER_ADDR" if not addr else "MASTER_PORT"
            raise ValueError(
                f"init_method env:// needs the environment variable {missing}; set "
                "MASTER_ADDR and MASTER_PORT, or pass tcp://host:port or file:///path"
            )
        if rank < 0:
            env_rank = os.environ.get("RANK")
            if env_rank is None:
                raise ValueError("init_rpc: pass rank= or set the RANK environment variable")
            rank = int(env_rank)
        host, port_num = addr, int(port)
    elif url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise ValueError(f"init_method {init_method!r} must look like tcp://host:port")
        if rank < 0:
            raise ValueError("init_rpc with tcp:// needs rank=")
        host, port_num = url.hostname, url.port
    elif url.scheme == "file":
        if rank < 0:
            raise ValueError("init_rpc with file:// needs rank=")
        path = url.path
        if not path:
            raise ValueError(f"init_method {init_method!r} must look like file:///path")
        return dist.FileStore(path, world_size if world_size else -1), rank, "127.0.0.1"
    else:
        raise ValueError(
            f"init_method must start with env://, tcp:// or file://, got {init_method!r}"
        )
    key = (host, port_num, rank == 0)
    cached = _STORES.get(key)
    if cached is not None:
        try:
            cached.check(["rallypoint/ping"])
            return cached, rank, host
        except RuntimeError:
            del _STORES[key]
    store = dist.TCPStore(
        host,
        port_num,
        world_size,
        rank == 0,
        timeout=delta,
        wait_for_workers=False,
    )
    _STORES[key] = store
    return store, rank, host


# One TCPStore per endpoint and process, kept across init_rpc/shutdown cycles (each cycle
# uses its own key prefix, as in torch): re-creating it would race with peers that still
# talk to the previous one.
_STORES: dict[tuple[str, int, bool], Any] = {}


_POLL_MAX = 0.002


def wait_for_keys(
    store: Any, keys: Sequence[str], deadline: float, *, dead: Any = None
) -> list[str]:
    """Wait until every key exists or the deadline passes; return the missing keys.

    ``dead`` (a callable that says whether all the missing keys belong to workers known
    to have died) ends the wait early. Without it the store wakes the wait as soon as the
    last key is set; with it, the keys are polled every 0.25 to 2 ms (a ``store.wait``
    that times out makes c10d log a warning, so it cannot be sliced to check ``dead``).
    """
    keys = list(keys)
    if dead is None:
        remaining = deadline - time.monotonic()
        if remaining > 0:
            with contextlib.suppress(RuntimeError):  # timed out (c10d's DistStoreError)
                store.wait(keys, timedelta(seconds=remaining))
                return []
        return [k for k in keys if not store.check([k])]
    delay = 0.00025
    while True:
        if store.check(keys):
            return []
        missing = [k for k in keys if not store.check([k])]
        if not missing:
            return []
        if time.monotonic() >= deadline or dead(missing):
            # a worker may have set its key and exited (closed its connections) between
            # the check above and ``dead``: only keys still missing now count
            return [k for k in missing if not store.check([k])]
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX)


def device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def publish_static(store: Any, rank: int, record: dict[str, Any]) -> None:
    store.set(f"worker/{rank}", json.dumps(record))


def gather_static(store: Any, world_size: int, timeout: float) -> list[dict[str, Any]]:
    keys = [f"worker/{r}" for r in range(world_size)]
    deadline = time.monotonic() + (timeout if timeout > 0 else 1800.0)
    missing = wait_for_keys(store, keys, deadline)
    if missing:
        ranks = sorted(int(k.split("/")[1]) for k in missing)
        raise RpcError(
            f"init_rpc: ranks {ranks} did not join within {timeout:.1f} s "
            f"(world_size={world_size}); start every rank or lower world_size"
        )
    records = [json.loads(store.get(k)) for k in keys]
    seen: dict[str, int] = {}
    for record in records:
        name = record["name"]
        if name in seen:
            raise RpcError(
                f"worker name {name!r} is used by ranks {seen[name]} and {record['rank']}; "
                "every worker needs a unique name"
            )
        seen[name] = record["rank"]
    return records


@contextmanager
def membership_token(store: Any, name: str, timeout: float) -> Iterator[None]:
    """Hold the group's membership token; always released, even when the body fails."""
    mine = f"{name}:{os.getpid()}:{time.monotonic_ns()}"
    deadline = time.monotonic() + (timeout if timeout > 0 else 1800.0)
    delay = 0.0005
    while True:
        current = store.compare_set(TOKEN_KEY, "", mine)
        holder = current.decode() if isinstance(current, bytes) else str(current)
        if holder == mine:
            break
        if time.monotonic() >= deadline:
            raise RpcError(
                f"{name}: could not take the group membership token within {timeout:.1f} s; "
                f"it is held by {holder.split(':')[0]!r}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    try:
        yield
    finally:
        store.compare_set(TOKEN_KEY, mine, "")


def read_members(store: Any) -> list[str]:
    if not store.check([MEMBERS_KEY]):
        return []
    data = store.get(MEMBERS_KEY)
    return list(json.loads(data)) if data else []


def write_members(store: Any, names: Sequence[str]) -> None:
    store.set(MEMBERS_KEY, json.dumps(list(names)))


def read_record(store: Any, name: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads(store.get(f"member/{name}"))
    return record


def write_record(store: Any, name: str, record: dict[str, Any]) -> None:
    store.set(f"member/{name}", json.dumps(record))


def delete_record(store: Any, name: str) -> None:
    store.delete_key(f"member/{name}")
