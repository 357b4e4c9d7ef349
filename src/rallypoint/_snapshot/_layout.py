"""The bytes of one snapshot: a header, every tensor at an aligned offset, then the meta.

::

    0        8          16         24        32                      meta_offset   total
    | magic  | meta_off | meta_len | total   | ...   tensors ...      | meta (pickle) |

The same bytes live in a worker's slot (shared memory), travel to the replica as they are,
and come back on restore; nothing else describes a snapshot. The meta (:class:`Meta`) holds
the rank, the world size, the generation and step, the pickled state skeleton and one
:class:`Entry` per tensor (path, dtype, shape, offset, device). Only workers of the job
ever unpickle it; the node servers only move bytes.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN",
    "HEADER_SIZE",
    "Entry",
    "Meta",
    "decode_meta",
    "encode_meta",
    "exact_views",
    "plan",
    "read_meta",
    "views",
    "write_meta",
]

MAGIC = b"RPSNAP01"
_HEADER = struct.Struct("<8sQQQ")
HEADER_SIZE = 64
ALIGN = 64
"""Tensor offsets are multiples of this (cache lines; any dtype's alignment)."""


@dataclass(frozen=True, slots=True)
class Entry:
    """Where one tensor lives in a snapshot."""

    path: str
    """Where it sits in the state (``model/fc.weight``); the key in a DCP checkpoint."""
    dtype: str
    """``torch.float32`` -> ``"float32"``."""
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    device: str


@dataclass(frozen=True, slots=True)
class Meta:
    """What a snapshot is: whose, which step, and how to rebuild the state from its bytes."""

    rank: int
    world: int
    gen: str
    step: int
    skeleton: bytes
    """The pickled state with a placeholder for every tensor (``_flatten``)."""
    entries: tuple[Entry, ...]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan(tensors: Sequence[torch.Tensor], paths: Sequence[str]) -> tuple[tuple[Entry, ...], int]:
    """An entry per tensor (contiguous copies, aligned offsets) and where the data ends."""
    entries = []
    offset = HEADER_SIZE
    for tensor, path in zip(tensors, paths, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(
            Entry(
                path=path,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=tuple(tensor.shape),
                offset=offset,
                nbytes=nbytes,
                device=str(tensor.device),
            )
        )
        offset = _align(offset + nbytes)
    return tuple(entries), offset


def encode_meta(meta: Meta) -> bytes:
    return pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)


def decode_meta(data: object) -> Meta:
    """A meta from its bytes; ``ValueError`` if they are not one."""
    meta = pickle.loads(data) if isinstance(data, bytes | bytearray | memoryview) else data
    if not isinstance(meta, Meta):
        raise ValueError("not a rallypoint snapshot (bad meta)")
    return meta


def write_meta(buf: memoryview, data_end: int, meta: bytes) -> int:
    """Write ``meta`` after the data and the header in front; returns the total size."""
    total = data_end + len(meta)
    buf[data_end:total] = meta
    _HEADER.pack_into(buf, 0, MAGIC, data_end, len(meta), total)
    return total


def read_meta(buf: memoryview | bytes) -> Meta:
    """The meta of a complete snapshot; ``ValueError`` if these bytes are not one."""
    if len(buf) < HEADER_SIZE:
        raise ValueError("snapshot too short for its header")
    magic, offset, length, total = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or not HEADER_SIZE <= offset <= offset + length == total <= len(buf):
        raise ValueError("not a rallypoint snapshot (bad header)")
    return decode_meta(buf[offset:total])


def views(base: torch.Tensor, entries: Sequence[Entry]) -> list[torch.Tensor]:
    """CPU tensors over ``base`` (a flat ``uint8`` tensor of the snapshot's bytes)."""
    import torch

    out = []
    for e in entries:
        dtype = getattr(torch, e.dtype)
        raw = base[e.offset : e.offset + e.nbytes]
        out.append(raw.view(dtype).view(e.shape) if e.nbytes else torch.empty(e.shape, dtype=dtype))
    return out


def exact_views(mm: object, entries: Sequence[Entry]) -> list[torch.Tensor]:
    """Like :func:`views`, over ``mm`` (a buffer), but each tensor's storage is exactly its
    own bytes (DCP copies a tensor whose storage is larger before writing it)."""
    import torch

    out = []
    for e in entries:
        dtype = getattr(torch, e.dtype)
        if e.nbytes:
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=e.nbytes, offset=e.offset)
            out.append(raw.view(dtype).view(e.shape))
        else:
            out.append(torch.empty(e.shape, dtype=dtype))
    return out
