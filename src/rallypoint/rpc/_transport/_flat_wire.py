"""The flat wire form of flat messages: plain data and whole CPU tensors.

Most messages are flat: a call whose arguments are numbers, strings and tensors, or a
reply of one tensor or a tuple of them. The general form (``_wire``) pickles with a
``Pickler`` subclass whose hook runs in Python for every object; this form describes the
tensors in a small header (starting with ``b"L"``) and pickles the rest with the plain C
pickler, the tensors travelling as the transport's raw bytes. Only whole, contiguous,
plain CPU tensors that share no storage qualify (:func:`describe`); anything else takes
the general form, which keeps views and shared storages. Distributed autograd hooks in as
in the general form. The layout: :func:`encode`.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
from collections.abc import Callable
from typing import Any

import torch

MAGIC = ord("L")
"""The first byte of the lean form::

    b"L", shape kind (u8), tensor count (u16)
    per tensor: slot (u16), dtype code (u8), requires grad (u8), ndim (u8), shape (i64 each)
    pickle of the message with ``None`` in each tensor's slot

The slots of a call are its positional arguments, then its keyword arguments' values; of a
tuple or list reply, its items. Each tensor travels viewed as bytes, in slot order. Slots
may also hold RRefs and containers of plain data (:func:`dumps_data`)."""
_HEAD = struct.Struct("<BBH")  # magic, shape kind, tensor count
_SLOT = struct.Struct("<HBBB")  # slot, dtype code, requires grad, ndim

_CALL, _TUPLE, _LIST, _TENSOR = 1, 2, 3, 4
_MAX_SLOTS = 64  # more arguments than this: the general form

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
_RAW = torch.uint8
_Tensor = torch.Tensor


_DIMS = [struct.Struct(f"<{ndim}q") for ndim in range(9)]


def _dims(ndim: int) -> struct.Struct:
    """The struct of a shape of ``ndim`` dimensions (int64 each)."""
    return _DIMS[ndim] if ndim < len(_DIMS) else struct.Struct(f"<{ndim}q")


Described = tuple[bytes, torch.Tensor, int, bool]
"""A tensor's slot header, its bytes (a ``uint8`` view), its data address, requires grad."""


def describe(tensor: torch.Tensor, position: int) -> Described | None:
    """A tensor (exactly ``torch.Tensor``) in slot ``position``, described for the lean form,
    or ``None`` if it cannot take it."""
    if not 0 <= position <= 0xFFFF:
        raise ValueError("bad lean slot")
    if not tensor.is_cpu or tensor.layout != torch.strided or tensor.is_quantized:
        return None
    if tensor.is_nested or tensor.dtype not in _CODES or tensor.is_conj() or tensor.is_neg():
        return None
    if tensor.storage_offset() or not tensor.is_contiguous():
        return None
    nbytes = tensor.nbytes
    if not nbytes or tensor.untyped_storage().nbytes() != nbytes:
        return None
    needs_grad = tensor.requires_grad
    data = tensor.detach() if needs_grad else tensor
    dims = data.shape
    ndim = len(dims)
    if ndim > 255:
        return None
    head = _SLOT.pack(position, _CODES[data.dtype], needs_grad, ndim) + _dims(ndim).pack(*dims)
    raw = data.view(_RAW) if ndim else data.view(1).view(_RAW)  # 1 view, any shape
    return head, raw, tensor.data_ptr(), needs_grad


Views = tuple[int, list[int], list[torch.Tensor], list[int]]
"""After the slot headers: the offset, the slots, the tensors, those that require grad."""


def views(data: bytes | memoryview, raws: list[torch.Tensor], offset: int) -> Views:
    """The tensors of a lean frame, rebuilt from their slot headers at ``offset`` of
    ``data``."""
    positions: list[int] = []
    rebuilt: list[torch.Tensor] = []
    grads: list[int] = []  # indices into rebuilt that require grad
    size = len(data)
    for raw in raws:
        if offset + _SLOT.size > size:
            raise ValueError("bad lean header (truncated)")
        position, code, needs_grad, ndim = _SLOT.unpack_from(data, offset)
        offset += _SLOT.size
        if offset + 8 * ndim > size:
            raise ValueError("bad lean header (truncated)")
        dims = _dims(ndim).unpack_from(data, offset)
        offset += 8 * ndim
        if code >= len(_DTYPES):
            raise ValueError(f"bad lean dtype code {code}")
        tensor = raw.view(_DTYPES[code]).view(dims)  # raw is contiguous: views suffice
        if needs_grad and (tensor.is_floating_point() or tensor.is_complex()):
            tensor.requires_grad_(True)
            grads.append(len(rebuilt))
        positions.append(position)
        rebuilt.append(tensor)
    return offset, positions, rebuilt, grads


CONTAINERS = frozenset({tuple, list, dict})


class _NotData(Exception):
    """Raised while pickling something only the general form's pickler hook can take."""


class _OnlyData(dict[type, Any]):
    """A pickler's dispatch table that refuses every type it does not list.

    The C pickler takes ``None``, bools, ints, floats, strings, bytes, tuples, lists,
    dicts, sets, classes and Python functions (by name) without asking its table; it asks
    for every other type, so a tensor, an RRef or any other object raises ``_NotData``."""

    def __missing__(self, kind: type) -> Any:
        raise _NotData


def _reduce_as_usual(obj: Any) -> Any:
    return obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


_data_picklers: dict[frozenset[type], type[pickle.Pickler]] = {}


def dumps_data(obj: Any, functions: frozenset[type]) -> bytes | None:
    """``obj``'s plain pickle if it holds only data (what the C pickler takes itself,
    complex numbers, and objects of the types in ``functions``, pickled as usual); ``None``
    if anything in it needs the general form. Checking costs nothing beyond the pickling:
    no walk in Python, however deep or long the data."""
    pickler = _data_picklers.get(functions)
    if pickler is None:
        table = _OnlyData({kind: _reduce_as_usual for kind in functions})
        table[complex] = copyreg.dispatch_table[complex]
        table[Reduced] = Reduced.__reduce__
        pickler = type("_DataPickler", (pickle.Pickler,), {"dispatch_table": table})
        _data_picklers[functions] = pickler
    buffer = io.BytesIO()
    try:
        pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except _NotData:
        return None
    return buffer.getvalue()


class Reduced:
    """Pickles as the reduce value it holds: an RRef's fork (or a grad table entry)."""

    __slots__ = ("value",)

    def __init__(self, value: tuple[Callable[..., Any], tuple[Any, ...]]) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return self.value


def encode(
    obj: Any,
    atomic: frozenset[type],
    functions: frozenset[type],
    grad_sink: list[torch.Tensor] | None,
    rref_type: type | None = None,
    rref_hook: Callable[[Any], tuple[Callable[..., Any], tuple[Any, ...]]] | None = None,
) -> tuple[bytes, list[torch.Tensor]] | None:
    """The lean form of ``obj`` (:data:`MAGIC`), or ``None`` when it needs the general form.

    An RRef in a slot (``rref_type``) is forked with ``rref_hook`` and travels in the
    plain pickle as the hook's reduce value; a message with RRefs and no tensors is that
    plain pickle alone (no header), as a message with neither takes the plain pickle."""
    kind = type(obj)
    if kind is _Tensor:
        shape, slots = _TENSOR, (obj,)
    elif kind is tuple and len(obj) == 3 and type(obj[1]) is tuple and type(obj[2]) is dict:
        if type(obj[0]) not in functions:
            return None
        shape, slots = _CALL, (*obj[1], *obj[2].values())
    elif kind is tuple or kind is list:
        shape, slots = (_TUPLE if kind is tuple else _LIST), obj
    else:
        return None
    if len(slots) > _MAX_SLOTS:
        return None
    header = bytearray(_HEAD.size)
    raws: list[torch.Tensor] = []
    positions: list[int] = []
    rrefs: list[int] = []
    needs_grad_tensors: list[torch.Tensor] = []
    storages: set[int] = set()
    nested: list[Any] = []  # containers: data only, or the general form
    for position, item in enumerate(slots):
        item_kind = type(item)
        if item_kind in atomic:
            continue
        if item_kind in CONTAINERS:
            nested.append(item)
            continue
        if item_kind is rref_type and rref_hook is not None and shape != _TENSOR:
            rrefs.append(position)
            continue
        if item_kind is not _Tensor:
            return None
        described = describe(item, position)
        if described is None:
            return None
        head, raw, address, needs_grad = described
        if address in storages:
            return None  # shared storage: the general form shares it on arrival too
        storages.add(address)
        if needs_grad:
            needs_grad_tensors.append(item)
        header += head
        raws.append(raw)
        positions.append(position)
    if not raws and not rrefs:
        return None  # data only: the plain pickle is leaner still
    # checked before anything is collected or forked (the general form does that again)
    if nested and dumps_data(nested, functions) is None:
        return None
    # only now: a message that falls back to the general form collects its tensors there
    if grad_sink is not None:
        grad_sink.extend(needs_grad_tensors)
    if shape == _TENSOR:
        _HEAD.pack_into(header, 0, MAGIC, shape, len(raws))
        return bytes(header), raws
    # forked only now: a message that falls back to the general form forks its RRefs there
    replace: list[tuple[int, Any]] = [(p, None) for p in positions]
    if rrefs and rref_hook is not None:
        replace += [(p, Reduced(rref_hook(slots[p]))) for p in rrefs]
    message = _replaced(obj, shape, replace, bool(raws))
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if not raws:
        return body, raws
    _HEAD.pack_into(header, 0, MAGIC, shape, len(raws))
    return bytes(header) + body, raws


def _replaced(obj: Any, shape: int, replace: list[tuple[int, Any]], lean: bool) -> Any:
    """The message to pickle: each replaced slot's value swapped in (``None`` for a tensor
    sent raw). A plain pickle (no tensors: not ``lean``) keeps the message's own types."""
    if shape == _CALL:
        func, args, kwargs = obj
        args = list(args)
        n_args = len(args)
        if kwargs and any(p >= n_args for p, _ in replace):
            kwargs = dict(kwargs)
            keys = list(kwargs)
        for position, value in replace:
            if position < n_args:
                args[position] = value
            else:
                kwargs[keys[position - n_args]] = value
        return (func, args, kwargs) if lean else (func, tuple(args), kwargs)
    message = list(obj)
    for position, value in replace:
        message[position] = value
    return tuple(message) if not lean and shape == _TUPLE else message


def decode(
    data: bytes | memoryview,
    tensors: list[torch.Tensor],
    recv_hook: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None,
) -> Any:
    """The message of a lean frame (``data[0] == MAGIC``) and its raw tensors."""
    magic, shape, count = _HEAD.unpack_from(data)
    if magic != MAGIC or count != len(tensors) or not count:
        raise ValueError(f"bad lean header ({count} tensors for {len(tensors)})")
    offset, positions, rebuilt, grads = views(data, tensors, _HEAD.size)
    if grads and recv_hook is not None:
        wrapped = recv_hook([rebuilt[i] for i in grads])
        for i, tensor in zip(grads, wrapped, strict=True):
            rebuilt[i] = tensor
    if shape == _TENSOR:
        return rebuilt[0]
    body = pickle.loads(memoryview(data)[offset:])
    if shape == _CALL:
        func, args, kwargs = body
        n_args = len(args)
        keys = list(kwargs) if positions[-1] >= n_args else []
        for position, tensor in zip(positions, rebuilt, strict=True):
            if position < n_args:
                args[position] = tensor
            else:
                kwargs[keys[position - n_args]] = tensor
        return func, tuple(args), kwargs
    for position, tensor in zip(positions, rebuilt, strict=True):
        body[position] = tensor
    return tuple(body) if shape == _TUPLE else body
