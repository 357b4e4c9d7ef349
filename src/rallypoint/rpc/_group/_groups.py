"""Group membership in the store: worker records, static and dynamic groups.

Every worker publishes a :class:`WorkerRecord` in the rendezvous store, as JSON, never
pickle, because a TCPStore is open to anyone who can reach its port. A static group
(``world_size`` given) waits for every rank's record, naming the missing ranks at the
timeout. A dynamic group (``world_size=None``) changes membership under a ``token`` key
taken with ``compare_set`` and released in a ``finally`` even when the change fails. The
first worker sets ``group_kind``, and a worker of the other kind is refused (torch's
"mixes statically and dynamically initialized members" error).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rallypoint._core.net import local_address_towards as local_address_towards
from rallypoint.rpc._device_maps import DeviceMap, device_maps_from_json, device_maps_to_json
from rallypoint.rpc._errors import RpcError
from rallypoint.rpc._group._store import wait_for_keys
from rallypoint.rpc._transport._cuda_routes import CudaInfo
from rallypoint.rpc._transport._spin import WAITS
from rallypoint.rpc._worker_info import WorkerInfo

if TYPE_CHECKING:
    from rallypoint._core.store import Store

TOKEN_KEY = "token"
MEMBERS_KEY = "members"
KIND_KEY = "group_kind"
_NO_TIMEOUT = 1800.0


# ---- what a record says about this process -----------------------------------------------
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


def device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What a worker publishes about itself: identity, addresses and devices."""

    name: str
    rank: int
    host: str
    port: int
    uds: str
    host_key: str
    device_count: int
    device_maps: dict[str, DeviceMap]
    devices: list[torch.device]
    cuda: CudaInfo | None = None  # None: a worker that did not say (staged CUDA tensors)

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.name, self.rank)

    def to_json(self) -> str:
        return json.dumps(
            {
                "name": self.name,
                "rank": self.rank,
                "host": self.host,
                "port": self.port,
                "uds": self.uds,
                "host_key": self.host_key,
                "device_count": self.device_count,
                "device_maps": device_maps_to_json(self.device_maps),
                "devices": [str(d) for d in self.devices],
                "cuda": None if self.cuda is None else self.cuda.to_json(),
            }
        )

    @classmethod
    def from_json(cls, data: str | bytes) -> WorkerRecord:
        raw: dict[str, Any] = json.loads(data)
        return cls(
            name=str(raw["name"]),
            rank=int(raw["rank"]),
            host=str(raw["host"]),
            port=int(raw["port"]),
            uds=str(raw["uds"]),
            host_key=str(raw["host_key"]),
            device_count=int(raw["device_count"]),
            device_maps=device_maps_from_json(raw["device_maps"]),
            devices=[torch.device(d) for d in raw["devices"]],
            cuda=None if raw.get("cuda") is None else CudaInfo.from_json(raw["cuda"]),
        )


def claim_kind(store: Store, static: bool) -> None:
    """Record whether the group is static or dynamic; a worker of the other kind is
    refused with torch's error (the first worker to join decides)."""
    kind = "static" if static else "dynamic"
    current = store.compare_set(KIND_KEY, "", kind)
    found = current.decode() if isinstance(current, bytes) else str(current)
    if found != kind:
        raise RuntimeError(
            "RPC group mixes statically and dynamically initialized members which is not "
            f"supported. This worker joins a {kind} group (world_size="
            f"{'given' if static else 'None'}) whose members are {found}; start every "
            "worker with world_size, or none of them"
        )


# ---- static groups ---------------------------------------------------------------------
def publish_static(store: Store, record: WorkerRecord) -> None:
    store.set(f"worker/{record.rank}", record.to_json())


def published_ranks(store: Store, world_size: int) -> list[int]:
    """The ranks that have published their record so far."""
    return [r for r in range(world_size) if store.check([f"worker/{r}"])]


def gather_static(store: Store, world_size: int, timeout: float) -> list[WorkerRecord]:
    rank_of = {f"worker/{r}": r for r in range(world_size)}
    keys = list(rank_of)
    deadline = time.monotonic() + (timeout if timeout > 0 else _NO_TIMEOUT)
    missing = wait_for_keys(store, keys, deadline)
    if missing:
        ranks = sorted(rank_of[k] for k in missing)
        raise RpcError(
            f"init_rpc: ranks {ranks} did not join within {timeout:.1f} s "
            f"(world_size={world_size}); start every rank or lower world_size"
        )
    records = [WorkerRecord.from_json(store.get(k)) for k in keys]
    seen: dict[str, int] = {}
    for record in records:
        if record.name in seen:
            raise RpcError(
                f"worker name {record.name!r} is used by ranks {seen[record.name]} and "
                f"{record.rank}: the name is not unique; every worker needs a unique name"
            )
        seen[record.name] = record.rank
    return records


# ---- dynamic groups --------------------------------------------------------------------
@contextmanager
def membership_token(store: Store, name: str, timeout: float) -> Iterator[None]:
    """Hold the group's membership token; always released, even when the body fails."""
    mine = f"{name}:{os.getpid()}:{time.monotonic_ns()}"
    deadline = time.monotonic() + (timeout if timeout > 0 else _NO_TIMEOUT)
    delay = 0.0005
    while True:
        current = store.compare_set(TOKEN_KEY, "", mine)
        holder = current.decode() if isinstance(current, bytes) else str(current)
        if holder == mine:
            break
        if time.monotonic() >= deadline:
            raise RpcError(
                f"{name}: could not take the group membership token within {timeout:.1f} s; "
                f"it is held by {holder.rsplit(':', 2)[0]!r}"
            )
        WAITS.sleep(delay)
        delay = min(delay * 2, 0.02)
    try:
        yield
    finally:
        store.compare_set(TOKEN_KEY, mine, "")


def read_members(store: Store) -> list[str]:
    if not store.check([MEMBERS_KEY]):
        return []
    data = store.get(MEMBERS_KEY)
    return list(json.loads(data)) if data else []


def write_members(store: Store, names: Sequence[str]) -> None:
    store.set(MEMBERS_KEY, json.dumps(list(names)))


def read_record(store: Store, name: str) -> WorkerRecord:
    return WorkerRecord.from_json(store.get(f"member/{name}"))


def write_record(store: Store, record: WorkerRecord) -> None:
    store.set(f"member/{record.name}", record.to_json())


def delete_record(store: Store, name: str) -> None:
    store.delete_key(f"member/{name}")
