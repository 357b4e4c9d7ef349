"""Device-map rules: validation, reverse maps and device lists (pure functions).

These follow ``torch.distributed.rpc.backend_registry`` exactly (same checks, same
``ValueError`` messages), so a configuration torch rejects is rejected here with the same
words. A device map of worker ``A`` for worker ``B`` maps ``A``'s devices to ``B``'s; a
call uses the caller's map for the callee and a reply its inverse (:class:`Sent`), and
distributed autograd sends each received tensor's gradient back with the inverse of the
map that tensor came with (:func:`gradient_map`). ``devices`` lists the devices a worker
uses for RPC; when empty it is derived from its own maps and its peers' maps onto it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeAlias

import torch

DeviceLike: TypeAlias = int | str | torch.device
DeviceMap: TypeAlias = dict[torch.device, torch.device]

__all__ = [
    "DeviceMap",
    "Sent",
    "create_device_list",
    "create_reverse_mapping",
    "gradient_map",
    "send_map",
    "to_device",
    "to_device_list",
    "to_device_map",
    "validate_device_maps",
    "validate_devices",
]


def _device(device: DeviceLike) -> torch.device:
    # an int is a CUDA index (torch.device(int) needs an accelerator to be present)
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


def to_device(device: DeviceLike) -> torch.device:
    """A CUDA device for ``devices`` (torch's ``_to_device`` rule and message)."""
    dev = _device(device)
    if dev.type != "cuda":
        raise ValueError(
            f"`set_devices` expect a list of CUDA devices, but got device type {dev.type}."
        )
    return dev


def to_device_list(devices: Iterable[DeviceLike]) -> list[torch.device]:
    return [to_device(d) for d in devices]


def to_device_map(device_map: Mapping[DeviceLike, DeviceLike]) -> DeviceMap:
    """Normalise one worker-to-worker map; it must be one-to-one."""
    full: DeviceMap = {}
    reverse: DeviceMap = {}
    for key, value in device_map.items():
        src, dst = _device(key), _device(value)
        if dst in reverse:
            raise ValueError(
                "`device_map` only supports 1-to-1 mapping, "
                f"trying to map {src} and {reverse[dst]} to {dst}"
            )
        full[src] = dst
        reverse[dst] = src
    return full


def validate_devices(devices: Iterable[torch.device], device_count: int) -> bool:
    """CPU, or CUDA with an index below ``device_count``."""
    return all(
        d.type == "cpu"
        or (d.type == "cuda" and d.index is not None and 0 <= d.index < device_count)
        for d in devices
    )


def validate_device_maps(
    all_names: Sequence[str],
    all_device_counts: Mapping[str, int],
    all_device_maps: Mapping[str, Mapping[str, DeviceMap]],
    all_devices: Mapping[str, Sequence[torch.device]],
    is_static_group: bool = True,
) -> None:
    """Raise ``ValueError`` (torch's messages) if any worker's maps or devices are invalid.

    Unknown target names are only an error in static groups: in a dynamic group the
    target may simply not have joined yet.
    """
    for node in all_names:
        devices = all_devices[node]
        if len(set(devices)) != len(devices):
            raise ValueError(f"Node {node} has duplicated devices\ndevices = {devices}")
        if not validate_devices(devices, all_device_counts[node]):
            raise ValueError(
                f"Node {node} has devices with invalid indices\n"
                f"devices = {devices}\n"
                f"device count = {all_device_counts[node]}"
            )

    for source in all_names:
        maps = all_device_maps[source]
        if is_static_group and not set(maps.keys()).issubset(all_names):
            raise ValueError(
                f"Node {source} has invalid target node names in its device maps\n"
                f"device maps = {maps.keys()}\n"
                f"node names = {all_names}"
            )
        for target, map_ in maps.items():
            _validate_one_map(source, target, map_, all_device_counts, all_devices)


def _validate_one_map(
    source: str,
    target: str,
    map_: DeviceMap,
    all_device_counts: Mapping[str, int],
    all_devices: Mapping[str, Sequence[torch.device]],
) -> None:
    if len(set(map_.values())) != len(map_):
        raise ValueError(
            f"Node {source} has duplicated target devices "
            f"in its device map for {target}\n"
            f"device map = {map_}"
        )
    where = f"in its device map for {target}\ndevice map = {map_}"
    _check_side(
        source, "source", map_.keys(), all_devices[source], all_device_counts[source], where
    )
    _check_side(
        source,
        "target",
        map_.values(),
        all_devices.get(target, []),
        all_device_counts.get(target),
        where,
    )


def _check_side(
    source: str,
    side: str,
    used: Iterable[torch.device],
    devices: Sequence[torch.device],
    device_count: int | None,
    where: str,
) -> None:
    """One side of a map uses only the worker's ``devices`` (or valid indices without them).

    ``device_count`` is ``None`` for a target that has not joined (a dynamic group).
    """
    if devices:
        if not set(used).issubset(devices):
            raise ValueError(
                f"Node {source} has unexpected {side} devices {where}\ndevices = {devices}"
            )
    elif device_count is not None and not validate_devices(used, device_count):
        raise ValueError(
            f"Node {source} has {side} devices with invalid indices {where}\n"
            f"device count = {device_count}"
        )


def create_reverse_mapping(
    my_name: str,
    all_names: Iterable[str],
    all_device_maps: Mapping[str, Mapping[str, DeviceMap]],
) -> dict[str, DeviceMap]:
    """For each worker that maps devices onto ``my_name``: the inverse of that map."""
    reverse: dict[str, DeviceMap] = {}
    for node in all_names:
        if my_name in all_device_maps[node]:
            reverse[node] = {v: k for k, v in all_device_maps[node][my_name].items()}
    return reverse


class Sent(enum.Enum):
    """The kind of message a tensor travels in, which decides the device map that places it."""

    CALL = "call"  # a request (also a gradient on its way back): the sender's own map
    REPLY = "reply"  # a call's return value: the inverse of the caller's map


def send_map(
    kind: Sent,
    peer: str,
    own: Mapping[str, DeviceMap],
    reverse: Mapping[str, DeviceMap],
) -> DeviceMap:
    """The map that places the tensors of a message of ``kind`` to ``peer`` (``{}``: none).

    ``own`` are this worker's maps (``device_maps``), ``reverse`` the inverses of the
    peers' maps onto this worker (:func:`create_reverse_mapping`)."""
    return (own if kind is Sent.CALL else reverse).get(peer) or {}


def gradient_map(
    received: Sent,
    peer: str,
    own: Mapping[str, DeviceMap],
    reverse: Mapping[str, DeviceMap],
) -> DeviceMap:
    """The map the gradients of tensors received from ``peer`` in a message of kind
    ``received`` go back with: the inverse of the map they came with (torch's rule).

    A call from ``peer`` came with ``peer``'s map for this worker, whose inverse is the
    reverse map; a reply came with the inverse of this worker's own map for ``peer``."""
    back = Sent.REPLY if received is Sent.CALL else Sent.CALL
    return send_map(back, peer, own, reverse)


def create_device_list(
    my_devices: Sequence[torch.device],
    my_device_maps: Mapping[str, DeviceMap],
    reverse_device_maps: Mapping[str, DeviceMap],
) -> list[torch.device]:
    """The devices this worker uses: as given, else every non-CPU device its maps touch."""
    devices = list(my_devices)
    if not devices:
        found: set[torch.device] = set()
        for map_ in my_device_maps.values():
            found.update(map_.keys())
        for map_ in reverse_device_maps.values():
            found.update(map_.keys())
        found.discard(torch.device("cpu"))
        devices = list(found)
    return sorted(devices, key=lambda d: -1 if d.index is None else d.index)


def device_maps_to_json(maps: Mapping[str, DeviceMap]) -> dict[str, dict[str, str]]:
    return {peer: {str(k): str(v) for k, v in m.items()} for peer, m in maps.items()}


def device_maps_from_json(data: Mapping[str, Mapping[str, str]]) -> dict[str, DeviceMap]:
    return {
        peer: {torch.device(k): torch.device(v) for k, v in m.items()} for peer, m in data.items()
    }
