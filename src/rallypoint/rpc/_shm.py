"""Same-host tensor transfer through shared memory (memfd segments passed as fds).

The sender owns a pool of segments (``memfd_create`` files, mapped once). To send a
tensor it copies the bytes into a free segment, marks the segment busy in its first
byte, and sends only a descriptor; the segment's file descriptor travels once per
connection over the Unix socket (``SCM_RIGHTS``). The receiver maps the segment once and
hands the caller a tensor that *views* the segment: no copy through the socket and none
on receipt. When that tensor's storage is freed, the receiver clears the busy byte and
the sender can reuse the segment. Segments have no name in the filesystem, so a crash
leaks nothing.

Copy semantics are those of torch's RPC: the receiver's tensor never aliases the
sender's tensor (the sender copies once into the segment).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import threading
import weakref

import torch

HEADER_BYTES = 4096
_MIN_SEGMENT = 1 << 16


def _round_up(n: int) -> int:
    size = _MIN_SEGMENT
    while size < n:
        size <<= 1
    return size


class Segment:
    __slots__ = ("capacity", "fd", "id", "mm", "view")

    def __init__(self, seg_id: int, capacity: int) -> None:
        self.id = seg_id
        self.capacity = capacity
        self.fd = os.memfd_create(f"rallypoint-rpc-{seg_id}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, HEADER_BYTES + capacity)
        self.mm = mmap.mmap(self.fd, HEADER_BYTES + capacity)
        self.view = torch.frombuffer(self.mm, dtype=torch.uint8, offset=HEADER_BYTES)

    @property
    def free(self) -> bool:
        return self.mm[0] == 0

    def close(self) -> None:
        del self.view
        with contextlib.suppress(
            BufferError
        ):  # a local tensor still views it; the mapping dies with it
            self.mm.close()
        os.close(self.fd)


class SegmentPool:
    """The sender's segments: acquire one, copy a tensor in, send its descriptor."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._segments: list[Segment] = []
        self._bytes = 0
        self._next_id = 1
        self._lock = threading.Lock()

    def put(self, raw: torch.Tensor) -> Segment | None:
        """Copy ``raw`` (uint8, 1-D) into a free segment; ``None`` if the pool is full."""
        nbytes = raw.numel()
        with self._lock:
            segment = self._find(nbytes)
            if segment is None:
                return None
            segment.mm[0] = 1
        segment.view[:nbytes].copy_(raw)
        return segment

    def _find(self, nbytes: int) -> Segment | None:
        best: Segment | None = None
        for seg in self._segments:
            if (
                seg.capacity >= nbytes
                and seg.capacity <= 4 * max(nbytes, _MIN_SEGMENT)
                and seg.free
            ) and (best is None or seg.capacity < best.capacity):
                best = seg
        if best is not None:
            return best
        capacity = _round_up(nbytes)
        if self._bytes + capacity > self._max_bytes:
            # drop idle segments of the wrong size to make room
            for seg in list(self._segments):
                if seg.free and self._bytes + capacity > self._max_bytes:
                    self._segments.remove(seg)
                    self._bytes -= seg.capacity
                    seg.close()
            if self._bytes + capacity > self._max_bytes:
                return None
        seg = Segment(self._next_id, capacity)
        self._next_id += 1
        self._segments.append(seg)
        self._bytes += capacity
        return seg

    def segments(self) -> list[Segment]:
        """The segments the pool holds now (free or busy)."""
        with self._lock:
            return list(self._segments)

    def close(self) -> None:
        with self._lock:
            for seg in self._segments:
                seg.close()
            self._segments.clear()
            self._bytes = 0


@functools.lru_cache(maxsize=256)
def _slot_type(nbytes: int) -> type[ctypes.Array[ctypes.c_uint8]]:
    base = ctypes.c_uint8 * nbytes
    return type(f"Slot{nbytes}", (base,), {})


def _release(mm: mmap.mmap) -> None:
    with contextlib.suppress(ValueError, IndexError):  # mapping already closed at shutdown
        mm[0] = 0


class RemoteSegments:
    """The receiver's view of one peer's segments (mapped once, by id)."""

    def __init__(self) -> None:
        self._maps: dict[int, mmap.mmap] = {}

    def add(self, seg_id: int, fd: int) -> None:
        try:
            size = os.fstat(fd).st_size
            self._maps[seg_id] = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def tensor(self, seg_id: int, nbytes: int) -> torch.Tensor:
        mm = self._maps.get(seg_id)
        if mm is None:
            raise KeyError(f"unknown shared-memory segment {seg_id}")
        slot = _slot_type(nbytes).from_buffer(mm, HEADER_BYTES)
        weakref.finalize(slot, _release, mm)
        return torch.frombuffer(slot, dtype=torch.uint8)

    def close(self) -> None:
        for mm in self._maps.values():
            with contextlib.suppress(
                BufferError
            ):  # still viewed by live tensors; unmapped when they die
                mm.close()
        self._maps.clear()
