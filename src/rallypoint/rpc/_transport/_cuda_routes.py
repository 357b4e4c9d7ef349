"""Which way a CUDA tensor travels to a peer: CUDA IPC on one host, else staged (pure logic).

A mapped CUDA tensor goes by CUDA IPC (:mod:`rallypoint.rpc._transport._cuda`) when both
workers allow it (``cuda_ipc=True``, no MIG device), the receiver is another process on
the same host in the same IPC namespace, and it sees the sender's GPU (each worker
publishes its ``CUDA_VISIBLE_DEVICES`` entries as :class:`CudaInfo`, read from the
environment so that no CUDA context is made). Otherwise, and for a tensor mapped to the
CPU, it is staged through pinned host memory, with one log line per peer and reason. A
tensor under ``cuda_ipc_threshold`` bytes is staged too, inline with its message: a
pinned copy each way costs less than opening and closing an IPC handle.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("rallypoint.rpc")

__all__ = ["CudaInfo", "CudaPath", "CudaRouter", "Peer", "Route", "choose"]


class CudaPath(enum.Enum):
    """How a CUDA tensor reaches its receiver."""

    IPC = "ipc"  # the receiver maps a private copy in the sender's memory
    STAGED = "staged"  # through pinned host memory and the connection's bytes


@dataclass(frozen=True, slots=True)
class Route:
    """The path of tensors from one of the sender's GPUs to one of the receiver's devices."""

    path: CudaPath
    index: int = -1  # IPC: the receiver's index of the sender's GPU (where it opens it)
    reason: str = ""  # STAGED: why not IPC


@dataclass(frozen=True, slots=True)
class CudaInfo:
    """What a worker publishes about its GPUs (JSON, in its group record)."""

    ipc: bool  # it takes part in CUDA IPC
    why_not: str  # when not, why
    ipc_ns: int  # its IPC namespace
    order: str  # CUDA_DEVICE_ORDER
    visible: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES entries (None: unset, all GPUs)

    @classmethod
    def of_this_process(cls, enabled: bool) -> CudaInfo:
        raw = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = None if raw is None else tuple(e.strip() for e in raw.split(",") if e.strip())
        why_not = ""
        if not enabled:
            why_not = "cuda_ipc=False in its options"
        elif visible is not None and any(e.startswith("MIG-") for e in visible):
            why_not = "its GPUs are MIG instances, which have no CUDA IPC"
        try:
            ipc_ns = os.stat("/proc/self/ns/ipc").st_ino
        except OSError:
            ipc_ns = 0
        order = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
        return cls(not why_not, why_not, ipc_ns, order, visible)

    def gpu(self, index: int) -> str | None:
        """A name of this worker's ``cuda:index`` that every worker of the host agrees on."""
        if self.visible is None:
            return f"{self.order}:{index}" if index >= 0 else None
        if not 0 <= index < len(self.visible):
            return None
        entry = self.visible[index]
        return f"{self.order}:{entry}" if entry.isdigit() else entry

    def index_of(self, gpu: str, limit: int) -> int | None:
        """This worker's index of the GPU named ``gpu`` (searched below ``limit``)."""
        count = limit if self.visible is None else min(limit, len(self.visible))
        for index in range(count):
            if self.gpu(index) == gpu:
                return index
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "ipc": self.ipc,
            "why_not": self.why_not,
            "ipc_ns": self.ipc_ns,
            "order": self.order,
            "visible": None if self.visible is None else list(self.visible),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> CudaInfo:
        visible = raw.get("visible")
        return cls(
            ipc=bool(raw["ipc"]),
            why_not=str(raw.get("why_not", "")),
            ipc_ns=int(raw["ipc_ns"]),
            order=str(raw["order"]),
            visible=None if visible is None else tuple(str(e) for e in visible),
        )


@dataclass(frozen=True, slots=True)
class Peer:
    """What the sender knows of a receiver: its name, host, GPUs and device count."""

    name: str
    host_key: str
    cuda: CudaInfo | None
    device_count: int


def choose(me: Peer, peer: Peer, source: int, target: torch.device) -> Route:
    """How a tensor on the sender's ``cuda:source`` reaches ``target`` on ``peer``."""
    if target.type != "cuda":
        return Route(CudaPath.STAGED, reason=f"the map sends it to {target}")
    if peer.name == me.name:
        return Route(CudaPath.STAGED, reason="the receiver is this process")
    if peer.host_key != me.host_key:
        return Route(CudaPath.STAGED, reason="the receiver is on another host")
    if me.cuda is None or not me.cuda.ipc:
        why = me.cuda.why_not if me.cuda is not None else "it published no GPU information"
        return Route(CudaPath.STAGED, reason=f"CUDA IPC is off on this worker: {why}")
    if peer.cuda is None or not peer.cuda.ipc:
        why = peer.cuda.why_not if peer.cuda is not None else "it published no GPU information"
        return Route(CudaPath.STAGED, reason=f"CUDA IPC is off on {peer.name}: {why}")
    if peer.cuda.ipc_ns != me.cuda.ipc_ns:
        return Route(CudaPath.STAGED, reason=f"{peer.name} is in another IPC namespace")
    gpu = me.cuda.gpu(source)
    index = None if gpu is None else peer.cuda.index_of(gpu, peer.device_count)
    if index is None:
        return Route(
            CudaPath.STAGED,
            reason=f"{peer.name} does not see this worker's cuda:{source} ({gpu or 'unknown'}; "
            "compare CUDA_VISIBLE_DEVICES)",
        )
    return Route(CudaPath.IPC, index=index)


class CudaRouter:
    """One worker's routes to its peers, chosen once per peer record, GPU and target."""

    def __init__(
        self, me: Peer, lookup: Callable[[str], Peer | None], ipc_threshold: int = 0
    ) -> None:
        self.me = me
        self.ipc_threshold = ipc_threshold  # smaller tensors are staged (inline)
        self._lookup = lookup  # a peer's current record, as a Peer (None: not in the group)
        self._routes: dict[tuple[str, int, int], tuple[Peer, Route]] = {}
        self._told: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self.shared = 0  # tensors sent by IPC since the last collect (see _cuda.collect)

    def route(self, dst: str, source: torch.device, target: torch.device) -> Route:
        peer = self._lookup(dst)
        if peer is None:
            return Route(CudaPath.STAGED, reason=f"{dst} is not in the group")
        key = (dst, source.index or 0, -1 if target.index is None else target.index)
        known = self._routes.get(key)
        if known is not None and known[0] == peer:
            return known[1]
        route = choose(self.me, peer, source.index or 0, target)
        with self._lock:
            self._routes[key] = (peer, route)
            told = (dst, route.reason)
            if route.path is CudaPath.IPC or told in self._told:
                return route
            self._told.add(told)
        if target.type == "cuda":
            expected = route.reason == "the receiver is on another host"
            logger.log(
                logging.INFO if expected else logging.WARNING,
                "rallypoint.rpc: CUDA tensors from %s to %s are staged through pinned host "
                "memory: %s",
                self.me.name,
                dst,
                route.reason,
            )
        return route
