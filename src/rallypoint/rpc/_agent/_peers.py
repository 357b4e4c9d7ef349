"""The peer table: who is in this worker's group, by name and by rank, and how they map.

It owns the group as this worker last saw it (every member's :class:`WorkerRecord`),
the device maps in both directions, and what is known about peers that died. Readers
never lock: every membership change builds new dicts and swaps them in (one writer at a
time: the joiner itself, or the membership notices that arrive under the group's token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rallypoint.rpc._device_maps import (
    DeviceMap,
    create_device_list,
    create_reverse_mapping,
    validate_device_maps,
)
from rallypoint.rpc._errors import RpcError
from rallypoint.rpc._group._groups import WorkerRecord
from rallypoint.rpc._worker_info import WorkerInfo


class PeerTable:
    """This worker's group: records, names <-> ranks, device maps, dead peers."""

    def __init__(self, me: WorkerInfo, device_maps: dict[str, DeviceMap]) -> None:
        self.me = me
        self.device_maps = device_maps  # ours, for calls we send; fixed at start
        self.reverse_maps: dict[str, DeviceMap] = {}  # for replies; replaced, never mutated
        self._records: dict[str, WorkerRecord] = {}
        self._infos: dict[str, WorkerInfo] = {}
        self._by_rank: dict[int, str] = {}
        self._dead: dict[str, str] = {}
        self.devices: list[torch.device] = []

    # ---- changes -----------------------------------------------------------------------
    def set(self, records: Sequence[WorkerRecord], *, static: bool) -> None:
        """Replace the group (validating every worker's device maps, torch's rules)."""
        names = [r.name for r in records]
        maps = {r.name: r.device_maps for r in records}
        devices = {r.name: r.devices for r in records}
        counts = {r.name: r.device_count for r in records}
        validate_device_maps(names, counts, maps, devices, is_static_group=static)
        reverse = create_reverse_mapping(self.me.name, names, maps)
        self.devices = create_device_list(devices.get(self.me.name, []), self.device_maps, reverse)
        self.reverse_maps = reverse
        self._records = {r.name: r for r in records}
        self._infos = {r.name: r.info for r in records}
        self._by_rank = {r.rank: r.name for r in records}

    def add(self, record: WorkerRecord) -> None:
        """A worker joined (a dynamic group)."""
        others = [r for n, r in self._records.items() if n != record.name]
        self.set([*others, record], static=False)

    def remove(self, name: str) -> None:
        """A worker left (a dynamic group)."""
        self.set([r for n, r in self._records.items() if n != name], static=False)

    def mark_dead(self, name: str, reason: str) -> None:
        """Remember why ``name`` is gone (the first reason wins)."""
        self._dead.setdefault(name, reason)

    # ---- lookups -----------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._records

    def names(self) -> list[str]:
        return sorted(self._records)

    def record(self, name: str) -> WorkerRecord:
        record = self._records.get(name)
        if record is None:
            raise self._unknown(name)
        return record

    def infos(self) -> list[WorkerInfo]:
        """Every member, by rank."""
        return sorted(self._infos.values(), key=lambda info: info.id)

    def info(self, worker: str | int | None = None) -> WorkerInfo:
        """``get_worker_info``: by name, by rank, or this worker (``None``)."""
        if worker is None:
            return self.me
        if isinstance(worker, int) and not isinstance(worker, bool):
            name = self._by_rank.get(worker)
            if name is None:
                known = sorted(self._by_rank)
                raise RpcError(
                    f"Unknown destination worker rank {worker} (could not find destination "
                    f"id {worker}); known ranks: {known}"
                )
            worker = name
        if not isinstance(worker, str):
            raise ValueError(f"Cannot get WorkerInfo from name {worker}")
        info = self._infos.get(worker)
        if info is None:
            raise self._unknown(worker)
        return info

    def rank_of(self, name: str) -> int | None:
        """``name``'s rank, or ``None`` if it is not (or no longer) in the group."""
        info = self._infos.get(name)
        return None if info is None else info.id

    def resolve(self, to: Any) -> WorkerInfo:
        """The destination of a call: a name, a rank or a ``WorkerInfo``."""
        if type(to) is str:
            info = self._infos.get(to)
            if info is not None:
                return info
        if isinstance(to, WorkerInfo):
            if to.name not in self._records:
                raise self._unknown(to.name)
            return to
        if isinstance(to, str | int) and not isinstance(to, bool):
            return self.info(to)
        raise ValueError(f"Cannot get WorkerInfo from name {to}")

    def _unknown(self, name: str) -> RpcError:
        known = sorted(self._records)
        return RpcError(
            f"Unknown destination worker {name!r} (could not find destination name {name}); "
            f"known workers: {known}"
        )

    def dead_reason(self, name: str) -> str | None:
        return self._dead.get(name)

    def is_dead(self, name: str) -> bool:
        return name in self._dead

    def reachable(self, name: str) -> bool:
        """In the group and not known to be dead."""
        return name in self._records and name not in self._dead
