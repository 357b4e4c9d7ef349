"""Wire format: frame headers and pickling with out-of-band tensors.

A frame is a header (:data:`HEADER`), the pickle of the message, one descriptor per
tensor (:data:`DESC`) and the raw bytes of every inline tensor. Tensors never go through
pickle: the pickler swaps each for a small reference into its storage's bytes, which the
transport sends raw after the pickle (across hosts) or places in shared memory (same
host); each storage goes once per message. Flat messages take the lean form of
:mod:`rallypoint.rpc._transport._flat_wire` instead. CUDA tensors need a device map entry
(torch's rule) and go by IPC or staging (``_cuda``). Distributed autograd hooks in at both
ends (``encode(grad_sink=...)``, ``decode(recv_hook=...)``). Nothing here is unpickled
before the connection has authenticated.
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
import torch.jit._state

from rallypoint.rpc._builtins import BuiltinOp
from rallypoint.rpc._device_maps import DeviceMap
from rallypoint.rpc._transport import _cuda, _flat_wire
from rallypoint.rpc._transport._cuda_routes import CudaPath, CudaRouter

MAGIC = b"RP"
HEADER = struct.Struct("<2sBBIQQ")
"""24 bytes: magic ``b"RP"``, kind, flags, tensor count, request id, pickle length."""
DESC = struct.Struct("<BBHIQ")
"""16 bytes per tensor: where (inline, shared memory, handed back), new-fd flag, segment
id, byte count. A tensor's reference in the pickle holds its dtype, shape, strides, byte
offset and target device; a sparse tensor travels as its index and value tensors. When a
storage's span does not start at its first byte, the pickle is preceded by ``b"S"``, the
table size and each entry's start."""


class FrameKind(enum.IntEnum):
    """What a frame carries (the header's kind byte)."""

    CALL = 1  # (func, args, kwargs); the callee replies with REPLY or ERROR
    REPLY = 2  # the call's return value
    ERROR = 3  # an ErrorReply: the call raised
    ONEWAY = 4  # (func, args, kwargs); no reply
    CLOSING = 5  # the sender closes this connection on purpose; it is alive (no payload)


KINDS: dict[int, FrameKind] = {int(kind): kind for kind in FrameKind}

WHERE_INLINE = 0
WHERE_SHM = 1
WHERE_RETURNED = 2  # the receiver's own segment, handed back (see _shm)

MAX_PICKLE_BYTES = 1 << 34
MAX_TENSORS = 1 << 20

_RAW = torch.uint8
_ALIGN = 16  # the largest element size (complex128)
_PENDING = torch.empty(0, dtype=_RAW)
_SPANS = struct.Struct("<1sI")  # b"S", entries; then one int64 ``lo`` per table entry
_SPANS_MAGIC = b"S"
_GRADS = struct.Struct("<1sI")  # b"G", the grad table's pickle length; then that pickle
_GRADS_MAGIC = b"G"
_CUDA_MAGIC = b"C"  # the message places tensors on a GPU (no payload)
_state = threading.local()
_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)

ReduceValue = tuple[Callable[..., Any], tuple[Any, ...]]

_REDUCERS: dict[type, Callable[[Any], ReduceValue]] = {}


def register_reducer(cls: type, reducer: Callable[[Any], ReduceValue]) -> None:
    """Pickle instances of exactly ``cls`` with ``reducer`` in RPC messages only (as torch's
    ``_internal_rpc_pickler._register_reducer``): a class whose plain pickling fails on
    purpose can still travel over RPC."""
    _REDUCERS[cls] = reducer


def _send_device(
    tensor: torch.Tensor, device_map: DeviceMap | None, dst: str, response: bool = False
) -> str | None:
    """Where ``tensor`` lands on ``dst`` (``None``: the CPU, unmapped); torch's error when
    its device has no entry in the map of the message (``response``: a reply's)."""
    device = tensor.device
    if device.type == "cpu":
        if device_map and device in device_map and device_map[device].type != "cpu":
            return str(device_map[device])
        return None
    if device_map is None or device not in device_map:
        kind = "Response" if response else "Request"
        raise RuntimeError(
            "TensorPipe RPC backend only supports CPU tensors by default, please move your "
            "tensors to CPU before sending them over RPC, or call `set_device_map` on "
            "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
            f"{kind} device mapping is not available for destination {dst} for device "
            f"{device} but received a tensor on that device (with rallypoint: "
            f"set_device_map({dst!r}, {{{str(device)!r}: ...}}) on the "
            f"{'caller' if response else 'sender'}'s options)"
        )
    return str(device_map[device])


class Unreadable:
    """What a tolerant decode puts in place of a tensor it could not rebuild."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = f"{type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"Unreadable({self.error!r})"


class _Encoder(pickle.Pickler):
    def __init__(
        self,
        file: io.BytesIO,
        tensors: list[torch.Tensor],
        device_map: DeviceMap | None,
        dst: str,
        rref_type: type | None,
        rref_hook: Callable[[Any], ReduceValue] | None,
        grad_sink: list[torch.Tensor] | None,
        response: bool = False,
        cuda: CudaRouter | None = None,
    ) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensors = tensors
        self._device_map = device_map
        self._dst = dst
        self._response = response
        self._cuda = cuda
        self.places_cuda = False  # some tensor lands on a GPU
        self.counters: list[tuple[bytes, int]] = []  # tensors shared by CUDA IPC
        self._rref_type = rref_type
        self._rref_hook = rref_hook
        self._grad_sink = grad_sink
        self.grad_table: list[ReduceValue] = []  # how to rebuild each tensor of grad_sink
        # CPU storages seen in this message: (data_ptr, nbytes) -> [table index, lo, hi,
        # storage]; their tensors arrive as views of one shared copy of bytes lo..hi
        self.spans: dict[tuple[int, int], list[Any]] = {}

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            if obj.is_quantized or obj.is_nested or obj.device.type == "meta":
                return NotImplemented
            target = _send_device(obj, self._device_map, self._dst, self._response)
            if target is not None and target.startswith("cuda"):
                self.places_cuda = True
            if obj.layout in _SPARSE_LAYOUTS:
                rebuild = self._reduce_sparse(obj, target, kind is torch.nn.Parameter)
            elif obj.layout == torch.strided:
                rebuild = self._reduce_tensor(obj, target, kind is torch.nn.Parameter)
            else:
                return NotImplemented
            if self._grad_sink is not None and obj.requires_grad:
                self._grad_sink.append(obj)
                self.grad_table.append(rebuild)
                return (_received, (len(self.grad_table) - 1,))
            return rebuild
        if self._rref_type is not None and kind is self._rref_type and self._rref_hook is not None:
            return self._rref_hook(obj)
        if kind is _SCRIPT_FUNCTION:  # by its qualified name, as torch's RPC sends it
            return (_script_function, (obj.qualified_name,))
        reducer = _REDUCERS.get(kind)
        if reducer is not None:
            return reducer(obj)
        return NotImplemented

    def _reduce_tensor(self, obj: torch.Tensor, target: str | None, is_param: bool) -> Any:
        """How ``obj`` travels: a reference into the tensor table (or a CUDA IPC handle)."""
        if obj.device.type == "cpu" and obj.numel() and not (obj.is_conj() or obj.is_neg()):
            return self._view_of_storage(obj, target, is_param)
        raw = obj.detach()
        if raw.device.type == "cuda":
            shared = self._share_cuda(raw, target, is_param, bool(obj.requires_grad))
            if shared is not None:
                return shared
            raw = _cuda.to_host(raw)
        elif raw.device.type != "cpu":
            raw = raw.cpu()
        raw = raw.resolve_conj().resolve_neg()
        raw = (
            raw.contiguous().reshape(-1).view(_RAW) if raw.numel() else raw.new_empty(0, dtype=_RAW)
        )
        self._tensors.append(raw)
        args = (
            len(self._tensors) - 1,
            obj.dtype,
            tuple(obj.shape),
            bool(obj.requires_grad),
            target,
            is_param,
        )
        return (_rebuild_tensor, args)

    def _share_cuda(
        self, raw: torch.Tensor, target: str | None, is_param: bool, requires_grad: bool
    ) -> ReduceValue | None:
        """A CUDA tensor shared by CUDA IPC, if its route is IPC (else ``None``: staged)."""
        if self._cuda is None or target is None or not target.startswith("cuda"):
            return None
        if not raw.numel() or raw.numel() * raw.element_size() < self._cuda.ipc_threshold:
            return None  # small: inline, through pinned memory
        where = torch.device(target)
        route = self._cuda.route(self._dst, raw.device, where)
        if route.path is not CudaPath.IPC:
            return None
        args = _cuda.share(raw, route.index)
        self.counters.append(_cuda.counter_of(args))
        self._cuda.shared += 1
        place = None if where.index == route.index else target  # another GPU of the receiver
        return (_rebuild_cuda, (args, requires_grad, place, is_param))

    def _reduce_sparse(self, obj: torch.Tensor, target: str | None, is_param: bool) -> Any:
        """A sparse tensor travels as its index and value tensors (references into the
        tensor table, as dense tensors are) with its layout, size and ``requires_grad``:
        torch's own pickling drops ``requires_grad``, and its rebuild keeps every sparse
        tensor it makes in a list that only ``torch.load`` empties."""
        layout = obj.layout
        coalesced = False
        if layout == torch.sparse_coo:
            parts = [obj._indices(), obj._values()]
            coalesced = obj.is_coalesced()
        elif layout in (torch.sparse_csr, torch.sparse_bsr):
            parts = [obj.crow_indices(), obj.col_indices(), obj.values()]
        else:
            parts = [obj.ccol_indices(), obj.row_indices(), obj.values()]
        refs = tuple(
            _flat_wire.Reduced(self._reduce_tensor(p.detach(), target, False)) for p in parts
        )
        args = (layout, refs, tuple(obj.shape), coalesced, bool(obj.requires_grad), is_param)
        return (_rebuild_sparse, args)

    def _view_of_storage(self, obj: torch.Tensor, target: str | None, is_param: bool) -> Any:
        """A CPU tensor travels as (shape, strides, byte offset) into its storage's bytes,
        sent once per message for all its tensors: as in torch, views keep their strides
        and tensors that share a storage share it on arrival."""
        storage = obj.untyped_storage()
        size = obj.element_size()
        start = obj.storage_offset() * size
        shape, stride = tuple(obj.shape), obj.stride()
        end = start + (sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1) * size
        key = (storage.data_ptr(), storage.nbytes())
        span = self.spans.get(key)
        if span is None:
            self.spans[key] = [len(self._tensors), start, end, storage]
            self._tensors.append(_PENDING)  # the bytes are cut once every view is known
        else:
            span[1], span[2] = min(span[1], start), max(span[2], end)
        index = self.spans[key][0]
        return (
            _rebuild_view,
            (index, start, obj.dtype, shape, stride, bool(obj.requires_grad), target, is_param),
        )

    def cut_spans(self) -> list[int]:
        """Replace each storage's placeholder by its bytes lo..hi (16-byte aligned: every
        view's offset stays a multiple of its element size); the ``lo`` of every table
        entry (0 for tensors sent whole)."""
        los = [0] * len(self._tensors)
        for index, lo, hi, storage in self.spans.values():
            lo -= lo % _ALIGN
            hi = min(hi + (-hi) % _ALIGN, storage.nbytes())
            self._tensors[index] = torch.empty(0, dtype=_RAW).set_(storage, lo, (hi - lo,), (1,))
            los[index] = lo
        return los


_SCRIPT_FUNCTION: type = torch.jit.ScriptFunction


def _script_function(qualified_name: str) -> Any:
    """A ``@torch.jit.script`` function compiled in this process, by its qualified name."""
    function = torch.jit._state._python_cu.find_function(qualified_name)
    if function is None:
        raise RuntimeError(
            f"TorchScript function {qualified_name} is not compiled on this worker: define it "
            "with @torch.jit.script in a module that every worker imports"
        )
    return function


_ATOMIC: frozenset[type] = frozenset({int, float, bool, str, bytes, type(None), complex})
_PLAIN_FUNCTIONS: frozenset[type] = frozenset({type(len), type(_send_device)})
_LEAN_FUNCTIONS = _PLAIN_FUNCTIONS | {BuiltinOp}


def _plain_pickle(obj: Any) -> bytes | None:
    """The plain pickle of a call or reply that holds only data (no tensors, no RRefs: see
    :func:`_flat_wire.dumps_data`); ``None`` otherwise.

    A call's arguments are looked at in Python first: a tensor or another object among
    them means no, without pickling anything; containers among them are checked by
    pickling. A reply that is a container is checked by pickling it."""
    kind = type(obj)
    if kind in _ATOMIC:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if kind is tuple and len(obj) == 3 and type(obj[1]) is tuple and type(obj[2]) is dict:
        if type(obj[0]) not in _PLAIN_FUNCTIONS:
            return None
        nested = False
        for item in (*obj[1], *obj[2].values()):
            item_kind = type(item)
            if item_kind in _flat_wire.CONTAINERS:
                nested = True
            elif item_kind not in _ATOMIC:
                return None
        if not nested:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    elif kind not in _flat_wire.CONTAINERS:
        return None
    return _flat_wire.dumps_data(obj, _PLAIN_FUNCTIONS)


def encode(
    obj: Any,
    *,
    dst: str = "",
    device_map: DeviceMap | None = None,
    rref_type: type | None = None,
    rref_hook: Callable[[Any], ReduceValue] | None = None,
    grad_sink: list[torch.Tensor] | None = None,
    response: bool = False,
    cuda: CudaRouter | None = None,
) -> tuple[bytes, list[torch.Tensor]]:
    """Pickle ``obj``; its dense tensors come back separately as raw ``uint8`` tensors.

    ``grad_sink``, if given, receives every tensor that requires grad (dense or sparse), in
    order. ``response``: a reply (for torch's error text); ``cuda``: the routes of CUDA
    tensors (without it they are staged).
    """
    plain = _plain_pickle(obj)
    if plain is not None:
        return plain, []
    if not device_map:
        lean = _flat_wire.encode(obj, _ATOMIC, _LEAN_FUNCTIONS, grad_sink, rref_type, rref_hook)
        if lean is not None:
            return lean
    buffer = io.BytesIO()
    tensors: list[torch.Tensor] = []
    encoder = _Encoder(
        buffer, tensors, device_map, dst, rref_type, rref_hook, grad_sink, response, cuda
    )
    try:
        encoder.dump(obj)
    except BaseException:  # Ctrl-C too: shared CUDA copies are released
        _cuda.release(encoder.counters)  # the copies shared so far: nobody will open them
        raise
    body = buffer.getvalue()
    if encoder.grad_table:
        rebuilds = [_flat_wire.Reduced(value) for value in encoder.grad_table]
        table = pickle.dumps(rebuilds, protocol=pickle.HIGHEST_PROTOCOL)
        body = _GRADS.pack(_GRADS_MAGIC, len(table)) + table + body
    if encoder.spans:
        los = encoder.cut_spans()
        if any(los):
            body = _SPANS.pack(_SPANS_MAGIC, len(los)) + struct.pack(f"<{len(los)}q", *los) + body
    if encoder.places_cuda:
        body = _CUDA_MAGIC + body
    return body, tensors


def decode(
    data: bytes | memoryview,
    tensors: list[torch.Tensor],
    recv_hook: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None,
    *,
    devices: set[torch.device] | None = None,
    tolerant: bool = False,
) -> Any:
    """Unpickle a message produced by :func:`encode` with its raw tensors.

    ``recv_hook``, if given, gets all the received tensors that require grad at once (in
    the sender's order) and returns the tensors to use in their place. ``devices``, if
    given, gets the GPUs the message's tensors landed on. ``tolerant``: a tensor that
    cannot be rebuilt becomes an :class:`Unreadable` instead of failing the message.
    """
    on_gpu = bool(data) and data[0] == _CUDA_MAGIC[0]
    if on_gpu:
        data = memoryview(data)[1:]
    elif not tensors:
        return pickle.loads(data)
    elif data[0] == _flat_wire.MAGIC:
        return _flat_wire.decode(data, tensors, recv_hook)
    los: tuple[int, ...] | None = None
    if data[0] == _SPANS_MAGIC[0]:  # a pickle starts with 0x80: these are the spans' ``lo``
        magic, count = _SPANS.unpack_from(data)
        if magic != _SPANS_MAGIC or count != len(tensors):
            raise ValueError(f"bad span table ({count} entries for {len(tensors)} tensors)")
        los = struct.unpack_from(f"<{count}q", data, _SPANS.size)
        data = memoryview(data)[_SPANS.size + 8 * count :]
    saved = (
        getattr(_state, "tensors", None),
        getattr(_state, "received", None),
        getattr(_state, "los", None),
        getattr(_state, "devices", None),
        getattr(_state, "tolerant", False),
    )
    _state.tensors, _state.received, _state.los = tensors, None, los
    _state.devices, _state.tolerant = (devices if on_gpu else None), tolerant
    try:
        if data[0] == _GRADS_MAGIC[0]:
            magic, size = _GRADS.unpack_from(data)
            table = pickle.loads(memoryview(data)[_GRADS.size : _GRADS.size + size])
            if magic != _GRADS_MAGIC or type(table) is not list or not table:
                raise ValueError("bad grad table")
            _state.received = table if recv_hook is None else recv_hook(table)
            data = memoryview(data)[_GRADS.size + size :]
        return pickle.loads(data)
    finally:
        _state.tensors, _state.received, _state.los, _state.devices, _state.tolerant = saved


def _raw(index: int) -> torch.Tensor:
    """The ``index``-th raw tensor of the message being unpickled."""
    tensors = getattr(_state, "tensors", None)
    if tensors is None:
        raise RuntimeError("rallypoint RPC tensors can only be unpickled by the RPC agent")
    tensor: torch.Tensor = tensors[index]
    return tensor


def _rebuild_tensor(
    index: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    requires_grad: bool,
    device: str | None,
    is_parameter: bool,
) -> torch.Tensor | Unreadable:
    try:
        raw = _raw(index)
        tensor = (
            torch.empty(shape, dtype=dtype) if raw.numel() == 0 else raw.view(dtype).reshape(shape)
        )
        return _finish(tensor, requires_grad, device, is_parameter)
    except Exception as exc:
        return _unreadable(exc)


def _rebuild_view(
    index: int,
    start: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    device: str | None,
    is_parameter: bool,
) -> torch.Tensor | Unreadable:
    try:
        raw = _raw(index)
        los = getattr(_state, "los", None)
        offset = raw.storage_offset() + start - (los[index] if los else 0)
        size = torch.empty(0, dtype=dtype).element_size()
        if offset < 0 or offset % size:
            raise ValueError(f"bad tensor offset {start} into table entry {index}")
        storage = raw.untyped_storage()
        tensor = torch.empty(0, dtype=dtype).set_(storage, offset // size, shape, stride)
        return _finish(tensor, requires_grad, device, is_parameter)
    except Exception as exc:
        return _unreadable(exc)


def _rebuild_cuda(
    args: tuple[Any, ...], requires_grad: bool, device: str | None, is_parameter: bool
) -> torch.Tensor | Unreadable:
    """A tensor shared by CUDA IPC (see :mod:`._cuda`); ``device``: the GPU to copy it to,
    when the map sends it to another GPU than the one it is opened on."""
    try:
        tensor = _cuda.open_shared(args)
        devices = getattr(_state, "devices", None)
        if devices is not None:
            devices.add(tensor.device)
        return _finish(tensor, requires_grad, device, is_parameter)
    except Exception as exc:
        return _unreadable(exc)


def _unreadable(exc: Exception) -> Unreadable:
    """In a tolerant decode, what stands for a tensor that could not be rebuilt."""
    if not getattr(_state, "tolerant", False):
        raise exc
    return Unreadable(exc)


def _rebuild_sparse(
    layout: torch.layout,
    parts: tuple[torch.Tensor, ...],
    shape: tuple[int, ...],
    coalesced: bool,
    requires_grad: bool,
    is_parameter: bool,
) -> torch.Tensor:
    # unchecked, as torch's RPC and torch.load build them (the peer is authenticated)
    if layout == torch.sparse_coo:
        indices, values = parts
        tensor = torch.sparse_coo_tensor(
            indices, values, shape, is_coalesced=coalesced, check_invariants=False
        )
    elif layout in _SPARSE_LAYOUTS:
        compressed, plain, values = parts
        tensor = torch.sparse_compressed_tensor(
            compressed, plain, values, shape, layout=layout, check_invariants=False
        )
    else:
        raise ValueError(f"bad sparse layout {layout}")
    return _finish(tensor, requires_grad, None, is_parameter)


def _received(position: int) -> torch.Tensor:
    """The ``position``-th tensor of the message's grad table (see :func:`decode`)."""
    received = getattr(_state, "received", None)
    if received is None or not 0 <= position < len(received):
        raise ValueError(f"bad grad table reference {position}")
    tensor: torch.Tensor = received[position]
    return tensor


def _finish(
    tensor: torch.Tensor, requires_grad: bool, device: str | None, is_parameter: bool
) -> torch.Tensor:
    if device is not None:
        target = torch.device(device)
        if target.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"tensor was mapped to {target} but this worker has no CUDA")
            devices = getattr(_state, "devices", None)
            if devices is not None:
                devices.add(target)
        if tensor.device.type == "cpu":
            tensor = _cuda.to_device(tensor, target)
        else:  # opened on another GPU of this worker
            tensor = tensor.to(target)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if (requires_grad and tensor.is_floating_point()) or (requires_grad and tensor.is_complex()):
        tensor.requires_grad_(True)
    return tensor
