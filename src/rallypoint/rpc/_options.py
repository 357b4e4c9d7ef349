"""Backend options: the base class and the rallypoint backend's options.

``RpcBackendOptions`` carries what every backend needs (``rpc_timeout`` and
``init_method``), as torch's class of the same name does. ``RallypointRpcBackendOptions``
adds device maps (torch's API: ``device_maps``, ``devices``, ``set_device_map``,
``set_devices``) and the transport and security settings of the rallypoint backend.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from rallypoint._core.checks import check_int, check_seconds
from rallypoint.rpc._device_maps import (
    DeviceLike,
    DeviceMap,
    to_device_list,
    to_device_map,
)
from rallypoint.rpc.constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
)

__all__ = ["RallypointRpcBackendOptions", "RpcBackendOptions"]

_INIT_SCHEMES = ("env://", "tcp://", "file://")


@dataclass(kw_only=True, slots=True)
class RpcBackendOptions:
    """Options every RPC backend accepts.

    ``rpc_timeout``: default timeout of a call in seconds (or a ``timedelta``); ``0``
    means no timeout. ``init_method``: ``env://`` (``MASTER_ADDR``/``MASTER_PORT``),
    ``tcp://host:port`` or ``file:///path``: the store used to find the other workers.
    """

    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC
    init_method: str = DEFAULT_INIT_METHOD

    def __post_init__(self) -> None:
        # 0 means no timeout
        seconds = check_seconds(self.rpc_timeout, "rpc_timeout", allow_zero=True, numbers=True)
        assert seconds is not None
        self.rpc_timeout = seconds
        if not isinstance(self.init_method, str) or not self.init_method.startswith(_INIT_SCHEMES):
            raise ValueError(
                f"init_method must start with one of {', '.join(_INIT_SCHEMES)}, "
                f"got {self.init_method!r}"
            )


@dataclass(kw_only=True, slots=True)
class RallypointRpcBackendOptions(RpcBackendOptions):
    """Options of the rallypoint backend (the default).

    - ``num_worker_threads``: most requests run on the connection's reader thread; a
      request that blocks for more than a few milliseconds hands reading over to a new
      thread, so nested and blocking calls never deadlock. This bounds those threads.
    - ``device_maps`` / ``devices``: as in torch's ``TensorPipeRpcBackendOptions``.
    - ``secret_file``: file holding the job's RPC secret (else ``RALLYPOINT_RPC_SECRET``).
    - ``allow_store_secret``: without a secret, let rank 0 generate one and share it through
      the rendezvous store (the store becomes the trust root). Also enabled by
      ``RALLYPOINT_RPC_ALLOW_STORE_SECRET=1``.
    - ``listen_addr``: address other hosts use to reach this worker (default: the local
      address that routes to the store host; ``RALLYPOINT_RPC_ADDR`` overrides).
    - ``unix_socket``: reach workers on the same host through an abstract Unix socket
      (needed for shared memory); ``False`` uses TCP everywhere.
    - ``shared_memory``: send tensors to workers on the same host through shared memory.
    - ``shm_threshold``: tensors of at least this many bytes go through shared memory.
    - ``shm_pool_bytes``: most shared memory one worker keeps for outgoing tensors.
    - ``busy_poll_us``: microseconds a waiting thread (a caller for its reply, a reader
      for the next request, ``dist_autograd.backward`` for its credit) busy-polls,
      yielding the CPU between polls, before it sleeps (``0``: never). Only while every
      other thread of the process waits too (never beside user code), and only while
      most of the process's recent waits ended within the window, so it costs CPU only
      where it pays; TensorPipe's threads busy-poll all the time.
    - ``cuda_ipc``: send mapped CUDA tensors to workers on the same host by CUDA IPC
      (torch's handles; the receiver maps a private copy in the sender's memory);
      ``False`` stages them through pinned host memory, as between hosts.
    - ``cuda_ipc_threshold``: CUDA tensors of at least this many bytes go by CUDA IPC;
      smaller ones travel inline with the message through pinned host memory, which
      costs less than opening and closing an IPC handle per call.
    """

    num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS
    device_maps: dict[str, dict[DeviceLike, DeviceLike]] | dict[str, DeviceMap] = field(
        default_factory=dict
    )
    devices: list[DeviceLike] | list[torch.device] = field(default_factory=list)
    secret_file: str | os.PathLike[str] | None = None
    allow_store_secret: bool = False
    listen_addr: str | None = None
    unix_socket: bool = True
    shared_memory: bool = True
    shm_threshold: int = 64 * 1024
    shm_pool_bytes: int = 1 << 30
    busy_poll_us: float = 1000.0
    cuda_ipc: bool = True
    cuda_ipc_threshold: int = 256 * 1024

    def __post_init__(self) -> None:
        RpcBackendOptions.__post_init__(self)
        check_int(self.num_worker_threads, "num_worker_threads", minimum=1)
        if not isinstance(self.device_maps, dict):
            raise TypeError(
                "device_maps must be a dict {worker name: {local device: remote device}}"
            )
        maps: dict[str, DeviceMap] = {}
        for name, map_ in self.device_maps.items():
            if not isinstance(name, str) or not isinstance(map_, dict):
                raise TypeError(
                    "device_maps must be a dict {worker name: {local device: remote device}}"
                )
            maps[name] = to_device_map(map_)  # type: ignore[arg-type]
        self.device_maps = maps
        self.devices = to_device_list(self.devices)
        check_int(self.shm_threshold, "shm_threshold (bytes)", minimum=0)
        check_int(self.shm_pool_bytes, "shm_pool_bytes (bytes)", minimum=0)
        check_int(self.cuda_ipc_threshold, "cuda_ipc_threshold (bytes)", minimum=0)
        spin = self.busy_poll_us
        if isinstance(spin, bool) or not isinstance(spin, int | float) or not 0 <= spin <= 1e6:
            raise ValueError(
                f"busy_poll_us must be microseconds from 0 to 1,000,000 (0: never busy-poll), "
                f"got {spin!r}"
            )
        if not isinstance(self.cuda_ipc, bool):
            raise TypeError(f"cuda_ipc must be True or False, got {self.cuda_ipc!r}")
        if self.secret_file is not None and not os.path.isfile(self.secret_file):
            raise ValueError(
                f"secret_file {os.fspath(self.secret_file)!r} does not exist; "
                "write the job's secret into it or leave secret_file unset"
            )

    def set_device_map(self, to: str, device_map: dict[DeviceLike, DeviceLike]) -> None:
        """Add mappings from this worker's devices to worker ``to``'s (torch's rules)."""
        full = to_device_map(device_map)
        maps: dict[str, DeviceMap] = self.device_maps  # type: ignore[assignment]
        current = maps.get(to, {})
        for k, v in full.items():
            if k in current and v != current[k]:
                raise ValueError(
                    "`set_device_map` only supports 1-to-1 mapping, trying"
                    f" to map {k} to {v} and {current[k]}"
                )
        maps[to] = {**current, **full}

    def set_devices(self, devices: list[DeviceLike]) -> None:
        """Set the local (CUDA) devices this worker uses for RPC."""
        self.devices = to_device_list(devices)

    @classmethod
    def from_tensorpipe(cls, options: Any) -> RallypointRpcBackendOptions:
        """torch's ``TensorPipeRpcBackendOptions`` as ours: the fields both have carry over
        (``num_worker_threads``, ``rpc_timeout``, ``init_method``, device maps, devices);
        TensorPipe's transports and channels have no meaning here."""
        return cls(
            num_worker_threads=options.num_worker_threads,
            rpc_timeout=options.rpc_timeout,
            init_method=options.init_method,
            device_maps={name: dict(map_) for name, map_ in options.device_maps.items()},
            devices=list(options.devices),
        )

    def replace(self, **changes: object) -> RallypointRpcBackendOptions:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
