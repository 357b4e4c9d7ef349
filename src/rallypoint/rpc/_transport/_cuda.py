"""Moving CUDA tensors: torch's CUDA IPC handles on one host, pinned-memory staging elsewhere.

Every function here runs only for a tensor on, or mapped to, a CUDA device; the route is
chosen by :mod:`rallypoint.rpc._transport._cuda_routes`. IPC (same host): the sender
shares a private copy with torch's own ``reduce_tensor`` (:func:`share`), so later writes
never show on the receiver, and the receiver rebuilds it (:func:`open_shared`) after
waiting on the sender's event, as TensorPipe does; torch keeps the memory until the
receiver frees it. Staging (another host, a map to the CPU): the bytes go through pinned
host memory (:func:`to_host`, :func:`to_device`). Either way the receiver's work is
ordered after the sender's writes, and a value decoded on one thread and used on another
is ordered by :class:`StreamSync`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.multiprocessing import reductions

__all__ = ["StreamSync", "collect", "open_shared", "release", "share", "to_device", "to_host"]

_REBUILD_ARGS = 15  # torch's rebuild_cuda_tensor arguments
_DEVICE, _COUNTER, _COUNTER_OFFSET = 6, 11, 12  # their positions we use


def share(tensor: torch.Tensor, receiver_index: int) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor``'s arguments for a private copy of ``tensor``, to be opened
    on the receiver's ``cuda:receiver_index``."""
    src = tensor.detach()
    if src.is_conj():
        src = src.resolve_conj()
    if src.is_neg():
        src = src.resolve_neg()
    copy = src.clone(memory_format=torch.contiguous_format)
    rebuild, args = reductions.reduce_tensor(copy)  # type: ignore[no-untyped-call]
    if rebuild is not reductions.rebuild_cuda_tensor or len(args) != _REBUILD_ARGS:
        raise RuntimeError(
            "this torch shares CUDA tensors in a way rallypoint does not know; set "
            "cuda_ipc=False in the RPC options"
        )
    shared = list(args)
    shared[_DEVICE] = receiver_index
    return tuple(shared)


def counter_of(args: tuple[Any, ...]) -> tuple[bytes, int]:
    """The reference-counter slot of a shared tensor (its receiver's count)."""
    return args[_COUNTER], args[_COUNTER_OFFSET]


def release(counters: Iterable[tuple[bytes, int]]) -> None:
    """Give up the receivers' counts of tensors shared for a message that was not sent."""
    for handle, offset in counters:
        torch.UntypedStorage._release_ipc_counter_cuda(handle, offset)


def open_shared(args: tuple[Any, ...]) -> torch.Tensor:
    """The receiver's tensor over a shared copy (its current stream waits for the sender)."""
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
    return tensor


def collect() -> None:
    """Free the shared copies whose receivers are done with them (torch's limbo)."""
    torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor, complete when this returns."""
    src = tensor.detach().resolve_conj().resolve_neg()
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    host.copy_(src, non_blocking=True)
    torch.cuda.current_stream(src.device).synchronize()
    return host


def to_device(tensor: torch.Tensor, target: torch.device) -> torch.Tensor:
    """A received host tensor on ``target``, copied on its current stream through pinned
    memory (the copy is ordered before any later work of this thread on that stream)."""
    if target.type != "cuda" or tensor.numel() == 0:
        return tensor.to(target)
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    pinned.copy_(tensor)
    return pinned.to(target, non_blocking=True)


class StreamSync:
    """Events on the decoding thread's current streams, for the thread that uses the value."""

    __slots__ = ("_events",)

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self._events: list[tuple[torch.device, torch.cuda.Event]] = []
        for device in devices:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(device))
            self._events.append((device, event))

    def wait(self, value: object = None) -> None:
        """Make the calling thread's current streams wait (a future's unwrap function)."""
        for device, event in self._events:
            torch.cuda.current_stream(device).wait_event(event)
