"""Same-host tensor transfer through shared memory (memfd segments passed as fds).

The sender copies a tensor into a free segment of its pool (:class:`SegmentPool`) and
sends only a descriptor; each segment's fd travels once per connection (``SCM_RIGHTS``).
The receiver maps it once and hands out a tensor that views the segment
(:class:`RemoteSegments`): no copy through the socket and none on receipt. When that
tensor is freed, the sender may reuse the segment. Segments have no name, so a crash
leaks nothing. A received tensor sent back whole to its segment's owner is not copied
again: both sides remap the pages copy-on-write, so the receiver's tensor never aliases
the sender's, as in torch's RPC.
"""

from __future__ import annotations

import concurrent.futures
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
_LENT = 0  # header byte: the peer holds a view (set by the owner, cleared by the peer)
_RETURNED = 1  # header byte: the peer handed the segment back (cleared by the owner)
_PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10  # Linux; memfd segments are Linux-only anyway
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


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
        return self.mm[_LENT] == 0 and self.mm[_RETURNED] == 0

    def returned_view(self, nbytes: int) -> torch.Tensor:
        """The bytes a peer handed back: a copy-on-write mapping of this segment."""
        mm = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_PRIVATE, offset=HEADER_BYTES)
        slot = _slot_type(nbytes).from_buffer(mm)
        weakref.finalize(slot, _clear, self.mm, _RETURNED)
        return torch.frombuffer(slot, dtype=torch.uint8)

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
        self._by_id: dict[int, Segment] = {}
        self._bytes = 0
        self._next_id = 1
        self._lock = threading.Lock()

    def put(self, raw: torch.Tensor) -> Segment | None:
        """Copy ``raw`` (uint8, contiguous) into a free segment; ``None`` if the pool is full."""
        nbytes = raw.numel()
        with self._lock:
            segment = self._find(nbytes)
            if segment is None:
                return None
            segment.mm[_LENT] = 1
        copy_in(segment.view[:nbytes], raw)
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
                    del self._by_id[seg.id]
                    self._bytes -= seg.capacity
                    seg.close()
            if self._bytes + capacity > self._max_bytes:
                return None
        seg = Segment(self._next_id, capacity)
        self._next_id += 1
        self._segments.append(seg)
        self._by_id[seg.id] = seg
        self._bytes += capacity
        return seg

    def returned(self, seg_id: int, nbytes: int) -> torch.Tensor:
        """A tensor for segment ``seg_id`` that a peer handed back (see :class:`RemoteSegments`)."""
        with self._lock:
            seg = self._by_id.get(seg_id)
        if seg is None or not seg.mm[_RETURNED] or nbytes > seg.capacity:
            raise KeyError(f"segment {seg_id} was not handed back")
        return seg.returned_view(nbytes)

    def segments(self) -> list[Segment]:
        """The segments the pool holds now (free or busy)."""
        with self._lock:
            return list(self._segments)

    def close(self) -> None:
        with self._lock:
            for seg in self._segments:
                seg.close()
            self._segments.clear()
            self._by_id.clear()
            self._bytes = 0


PARALLEL_COPY_BYTES = 8 << 20
"""Copies of at least this many bytes into a segment are split across threads."""
_MAX_COPY_THREADS = 4


class _CopyThreads:
    """Helper threads for large copies, started on first use (again after a fork: threads
    do not survive one)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        with self.lock:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    _MAX_COPY_THREADS - 1, thread_name_prefix="rpc-copy"
                )
            return self.pool

    def forget(self) -> None:
        self.lock = threading.Lock()
        self.pool = None


_copy_threads = _CopyThreads()
os.register_at_fork(after_in_child=_copy_threads.forget)


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for contiguous uint8 tensors (``dst`` 1-D); a large copy runs on up to 4
    of this process's CPUs at once, whatever torch's intra-op thread count is (one core
    alone makes a large tensor's copy a visible share of a call). The copies are plain
    ``memmove`` calls, which release the GIL and start no OpenMP team."""
    nbytes = src.numel()
    ways = min(
        _MAX_COPY_THREADS, len(os.sched_getaffinity(0)), nbytes // (PARALLEL_COPY_BYTES // 2)
    )
    if ways < 2 or not (src.is_contiguous() and dst.is_contiguous()):
        dst.copy_(src.reshape(-1))  # the lean form's raw tensors keep their shape
        return
    target, source = dst.data_ptr(), src.data_ptr()
    chunk = -(-nbytes // ways // _PAGE) * _PAGE
    spans = [(start, min(chunk, nbytes - start)) for start in range(0, nbytes, chunk)]
    pool = _copy_threads.get()
    helpers = [pool.submit(ctypes.memmove, target + at, source + at, n) for at, n in spans[1:]]
    ctypes.memmove(target, source, spans[0][1])
    for helper in helpers:
        helper.result()


@functools.lru_cache(maxsize=256)
def _slot_type(nbytes: int) -> type[ctypes.Array[ctypes.c_uint8]]:
    base = ctypes.c_uint8 * nbytes
    return type(f"Slot{nbytes}", (base,), {})


def _clear(mm: mmap.mmap, index: int) -> None:
    with contextlib.suppress(ValueError, IndexError):  # mapping already closed at shutdown
        mm[index] = 0


def _remap(address: int, length: int, flags: int, fd: int, offset: int) -> None:
    """Replace ``[address, address + length)`` by a mapping of ``fd`` (same addresses)."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = _libc.mmap(address, length, prot, flags | _MAP_FIXED, fd, offset)
    if got != address:
        raise OSError(ctypes.get_errno(), "mmap(MAP_FIXED) of a shared-memory view failed")


class _Mapped:
    """One peer segment as this worker maps it, and the view it currently lends out."""

    __slots__ = ("base", "fd", "mm", "private", "view_bytes")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.view_bytes = -1  # bytes of the live view (-1: none)
        self.private = 0  # bytes remapped copy-on-write while the view is handed back

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # still viewed by live tensors
            self.mm.close()
        os.close(self.fd)


class RemoteSegments:
    """The receiver's view of one peer's segments (mapped once, by id).

    Handing a received tensor back to its segment's owner: the receiver first remaps its
    view copy-on-write (``MAP_PRIVATE | MAP_FIXED`` over the same addresses, so its tensor
    keeps working and its later writes stay private) and sends a reference to the owner's
    segment; the owner gets a fresh copy-on-write mapping of it. The segment's second
    header byte says "handed back"; the owner clears it when that mapping dies, and reuses
    a segment only when both header bytes are clear.
    """

    def __init__(self) -> None:
        self._maps: dict[int, _Mapped] = {}
        self._lock = threading.RLock()  # _released may run from a GC pass inside hand_back

    def add(self, seg_id: int, fd: int) -> None:
        # under the lock: a thread sending on the connection may be in hand_back's loop
        try:
            mapped = _Mapped(fd)
        except BaseException:  # Ctrl-C too: the fd is closed
            os.close(fd)
            raise
        with self._lock:
            self._maps[seg_id] = mapped

    def tensor(self, seg_id: int, nbytes: int) -> torch.Tensor:
        mapped = self._maps.get(seg_id)
        if mapped is None:
            raise KeyError(f"unknown shared-memory segment {seg_id}")
        slot = _slot_type(nbytes).from_buffer(mapped.mm, HEADER_BYTES)
        mapped.view_bytes = nbytes
        weakref.finalize(slot, self._released, mapped)
        return torch.frombuffer(slot, dtype=torch.uint8)

    def _released(self, mapped: _Mapped) -> None:
        """The view died: share the pages again, then let the owner reuse the segment."""
        with self._lock:
            mapped.view_bytes = -1
            if mapped.private:
                with contextlib.suppress(OSError, ValueError):
                    if not mapped.mm.closed:
                        _remap(
                            mapped.base + HEADER_BYTES,
                            mapped.private,
                            mmap.MAP_SHARED,
                            mapped.fd,
                            HEADER_BYTES,
                        )
                mapped.private = 0
        _clear(mapped.mm, _LENT)

    def hand_back(self, raw: torch.Tensor) -> int | None:
        """If ``raw`` is exactly a live view of one of these segments, hand it back.

        Returns the segment id to send instead of the bytes, or ``None`` (send a copy).
        Afterwards this worker's view is copy-on-write and the owner may map the segment.
        """
        address, nbytes = raw.data_ptr(), raw.numel()
        with self._lock:
            for seg_id, mapped in self._maps.items():
                if address != mapped.base + HEADER_BYTES or mapped.view_bytes < nbytes:
                    continue
                if mapped.mm.closed or mapped.mm[_RETURNED]:
                    return None  # handed back already and still held there: copy
                if not mapped.private:
                    length = -(-mapped.view_bytes // _PAGE) * _PAGE
                    _remap(address, length, mmap.MAP_PRIVATE, mapped.fd, HEADER_BYTES)
                    mapped.private = length
                mapped.mm[_RETURNED] = 1
                return seg_id
        return None

    def keep(self, seg_id: int) -> None:
        """Undo :meth:`hand_back` (the frame was never sent): the owner will not map it."""
        mapped = self._maps.get(seg_id)
        if mapped is not None:
            _clear(mapped.mm, _RETURNED)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for mapped in maps.values():
            mapped.close()
