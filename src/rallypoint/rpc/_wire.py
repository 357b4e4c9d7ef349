"""Wire format: frame headers and pickling with out-of-band tensors.

A frame is::

    header (24 bytes)  magic b"RP", kind, flags, tensor count, request id, pickle length
    pickle             the message, tensors replaced by references into the table
    descriptors        16 bytes per tensor: where (inline / shared memory / handed back),
                       new-fd flag, segment id, byte count
    inline bytes       the raw bytes of every inline tensor, in order

Tensors never go through pickle: the pickler swaps each dense tensor for a small
reference (dtype, shape, target device) and hands its bytes to the transport, which sends
them raw after the pickle (across hosts) or places them in a shared-memory segment (same
host). Nothing here is unpickled before the connection has authenticated.
"""

from __future__ import annotations

import enum
import io
import pickle
import struct
import threading
from collections.abc import Callable
from typing import Any

import torch

from rallypoint.rpc._device_maps import DeviceMap

MAGIC = b"RP"
HEADER = struct.Struct("<2sBBIQQ")
DESC = struct.Struct("<BBHIQ")


class FrameKind(enum.IntEnum):
    """What a frame carries (the header's kind byte)."""

    CALL = 1  # (func, args, kwargs); the callee replies with REPLY or ERROR
    REPLY = 2  # the call's return value
    ERROR = 3  # an ErrorReply: the call raised
    ONEWAY = 4  # (func, args, kwargs); no reply


KINDS: dict[int, FrameKind] = {int(kind): kind for kind in FrameKind}

WHERE_INLINE = 0
WHERE_SHM = 1
WHERE_RETURNED = 2  # the receiver's own segment, handed back (see _shm)

MAX_PICKLE_BYTES = 1 << 34
MAX_TENSORS = 1 << 20

_RAW = torch.uint8
_state = threading.local()

ReduceValue = tuple[Callable[..., Any], tuple[Any, ...]]


def _send_device(tensor: torch.Tensor, device_map: DeviceMap | None, dst: str) -> str | None:
    device = tensor.device
    if device.type == "cpu":
        if device_map and device in device_map and device_map[device].type != "cpu":
            return str(device_map[device])
        return None
    if device_map is None or device not in device_map:
        raise RuntimeError(
            f"cannot send a tensor on {device} to {dst}: there is no device map entry for "
            f"{device}; call set_device_map({dst!r}, {{{str(device)!r}: ...}}) on the "
            "options or move the tensor to CPU first"
        )
    return str(device_map[device])


class _Encoder(pickle.Pickler):
    def __init__(
        self,
        file: io.BytesIO,
        tensors: list[torch.Tensor],
        device_map: DeviceMap | None,
        dst: str,
        rref_type: type | None,
        rref_hook: Callable[[Any], ReduceValue] | None,
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self._device_map = device_map
        self._dst = dst
        self._rref_type = rref_type
        self._rref_hook = rref_hook

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
                return NotImplemented
            if obj.device.type == "meta":
                return NotImplemented
            target = _send_device(obj, self._device_map, self._dst)
            raw = obj.detach()
            if raw.device.type != "cpu":
                raw = raw.cpu()
            raw = (
                raw.contiguous().reshape(-1).view(_RAW)
                if raw.numel()
                else raw.new_empty(0, dtype=_RAW)
            )
            self._tensors.append(raw)
            args = (
                len(self._tensors) - 1,
                obj.dtype,
                tuple(obj.shape),
                bool(obj.requires_grad),
                target,
                kind is torch.nn.Parameter,
            )
            return (_rebuild_tensor, args)
        if self._rref_type is not None and kind is self._rref_type and self._rref_hook is not None:
            return self._rref_hook(obj)
        return NotImplemented


_ATOMIC = frozenset({int, float, bool, str, bytes, type(None), complex})
_PLAIN_FUNCTIONS = frozenset({type(len), type(_send_device)})


def _is_simple(obj: Any) -> bool:
    """A call or reply with only atomic values (no tensors, no RRefs) pickles directly."""
    kind = type(obj)
    if kind in _ATOMIC:
        return True
    if kind is tuple and len(obj) == 3 and type(obj[1]) is tuple and type(obj[2]) is dict:
        func, args, kwargs = obj
        if type(func) not in _PLAIN_FUNCTIONS:
            return False
        for a in args:
            if type(a) not in _ATOMIC:
                return False
        return not kwargs or all(type(v) in _ATOMIC for v in kwargs.values())
    return False


def encode(
    obj: Any,
    *,
    dst: str = "",
    device_map: DeviceMap | None = None,
    rref_type: type | None = None,
    rref_hook: Callable[[Any], ReduceValue] | None = None,
) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj``; its dense tensors come back separately as raw ``uint8`` tensors."""
    if _is_simple(obj):
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), []
    buffer = io.BytesIO()
    tensors: list[torch.Tensor] = []
    _Encoder(buffer, tensors, device_map, dst, rref_type, rref_hook).dump(obj)
    return buffer.getvalue(), tensors


def decode(data: bytes | memoryview, tensors: list[torch.Tensor]) -> Any:
    """Unpickle a message produced by :func:`encode` with its raw tensors."""
    if not tensors:
        return pickle.loads(data)
    saved = getattr(_state, "tensors", None)
    _state.tensors = tensors
    try:
        return pickle.loads(data)
    finally:
        _state.tensors = saved


def _rebuild_tensor(
    index: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    requires_grad: bool,
    device: str | None,
    is_parameter: bool,
) -> torch.Tensor:
    tensors = getattr(_state, "tensors", None)
    if tensors is None:
        raise RuntimeError("rallypoint RPC tensors can only be unpickled by the RPC agent")
    raw = tensors[index]
    tensor = torch.empty(shape, dtype=dtype) if raw.numel() == 0 else raw.view(dtype).reshape(shape)
    if device is not None:
        target = torch.device(device)
        if target.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"tensor was mapped to {target} but this worker has no CUDA")
        tensor = tensor.to(target)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if (requires_grad and tensor.is_floating_point()) or (requires_grad and tensor.is_complex()):
        tensor.requires_grad_(True)
    return tensor
