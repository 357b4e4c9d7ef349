"""Frames on a socket: the buffered reader that parses them, and the vectored send.

A frame is a 24-byte header (:data:`rallypoint.rpc._transport._wire.HEADER`), the pickle, and, for
each tensor, a descriptor and (inline) its bytes. On a Unix socket a tensor may instead
live in a shared-memory segment whose file descriptor travels as ``SCM_RIGHTS``
ancillary data (:mod:`rallypoint.rpc._transport._shm`). :class:`FrameReader` parses many frames per
``recv``; :func:`sendmsg_all` sends one or more frames' buffers with as few ``sendmsg``
calls as the kernel allows.
"""

from __future__ import annotations

import array
import collections
import ctypes
import socket
from dataclasses import dataclass

import torch

from rallypoint.rpc._errors import RpcProtocolError
from rallypoint.rpc._transport import _wire
from rallypoint.rpc._transport._shm import RemoteSegments, SegmentPool

_BUFFER = 1 << 18
_IOV_MAX = 512
_ANC = socket.CMSG_SPACE(253 * 4)
_CTRUNC = int(socket.MSG_CTRUNC)  # an int: ``flags & IntFlag`` runs enum code in Python


@dataclass(slots=True)
class Frame:
    kind: _wire.FrameKind
    flags: int
    request_id: int
    data: bytes
    tensors: list[torch.Tensor]


class FrameReader:
    """Buffered frame parser over a blocking socket (collects passed fds on Unix sockets)."""

    def __init__(self, sock: socket.socket, uds: bool, pool: SegmentPool | None = None) -> None:
        self._sock = sock
        self._uds = uds
        self._pool = pool  # ours: the segments a peer may hand back
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self.fds: collections.deque[int] = collections.deque()
        self.segments = RemoteSegments()

    def _recv_into(self, view: memoryview) -> int:
        if not self._uds:
            n = self._sock.recv_into(view)
        else:
            n, ancdata, flags, _ = self._sock.recvmsg_into([view], _ANC)
            for level, kind, data in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
                    self.fds.extend(fds)
            if flags & _CTRUNC:
                raise RpcProtocolError("file descriptors were truncated on the connection")
        if n == 0:
            raise EOFError("peer closed the connection")
        return n

    def _fill(self, need: int) -> None:
        """Make at least ``need`` bytes available in the buffer (need <= buffer size)."""
        while self._end - self._start < need:
            if self._start and (len(self._buf) - self._start < need or self._start == self._end):
                count = self._end - self._start
                self._buf[:count] = self._buf[self._start : self._end]
                self._start, self._end = 0, count
            self._end += self._recv_into(self._view[self._end :])

    def buffered_bytes(self) -> bool:
        """Whether any unparsed byte is buffered (then the next frame has begun to arrive:
        wait for it in ``read_frame``, not for the socket to become readable)."""
        return self._end > self._start

    def buffered_frame(self) -> bool:
        """Whether a complete frame is already buffered (then reading will not block)."""
        avail = self._end - self._start
        if avail < _wire.HEADER.size:
            return False
        header = _wire.HEADER.unpack_from(self._buf, self._start)
        return (
            avail >= _wire.HEADER.size + header[5] + _wire.DESC.size * header[3] and not header[3]
        )

    def _take(self, n: int) -> bytes:
        if n <= len(self._buf):
            self._fill(n)
            out = bytes(self._view[self._start : self._start + n])
            self._start += n
            return out
        out_buf = bytearray(n)
        self._read_into(memoryview(out_buf))
        return bytes(out_buf)

    def _read_into(self, target: memoryview) -> None:
        have = min(self._end - self._start, len(target))
        target[:have] = self._view[self._start : self._start + have]
        self._start += have
        pos = have
        while pos < len(target):
            pos += self._recv_into(target[pos:])

    def _take_tensor(self, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        start = self._start
        if self._end - start >= nbytes:  # buffered already (small tensors): one copy
            self._start = start + nbytes
            return copy_out(self._view, start, nbytes)
        storage = bytearray(nbytes)
        self._read_into(memoryview(storage))
        return torch.frombuffer(storage, dtype=torch.uint8)

    def _descriptors(self, count: int) -> list[tuple[int, int, int, int, int]]:
        """The next ``count`` tensor descriptors, parsed in the buffer if they fit it."""
        size = _wire.DESC.size
        if size * count > len(self._buf):
            table = self._take(size * count)
            return [_wire.DESC.unpack_from(table, i * size) for i in range(count)]
        self._fill(size * count)
        start = self._start
        self._start = start + size * count
        return [_wire.DESC.unpack_from(self._buf, start + i * size) for i in range(count)]

    def read_frame(self) -> Frame:
        self._fill(_wire.HEADER.size)
        magic, kind_byte, flags, count, request_id, size = _wire.HEADER.unpack_from(
            self._buf, self._start
        )
        kind = _wire.KINDS.get(kind_byte)
        if magic != _wire.MAGIC or kind is None:
            raise RpcProtocolError(
                f"bad frame header {bytes(self._view[self._start : self._start + 4])!r}"
            )
        if size > _wire.MAX_PICKLE_BYTES or count > _wire.MAX_TENSORS:
            raise RpcProtocolError(f"frame too large ({size} bytes, {count} tensors)")
        self._start += _wire.HEADER.size
        data = self._take(size)
        tensors: list[torch.Tensor] = []
        if count:
            for where, new_fd, _, seg_id, nbytes in self._descriptors(count):
                if where == _wire.WHERE_INLINE:
                    tensors.append(self._take_tensor(nbytes))
                elif where == _wire.WHERE_SHM and self._uds:
                    if new_fd:
                        if not self.fds:
                            raise RpcProtocolError("shared-memory segment arrived without its fd")
                        self.segments.add(seg_id, self.fds.popleft())
                    tensors.append(self.segments.tensor(seg_id, nbytes))
                elif where == _wire.WHERE_RETURNED and self._pool is not None:
                    tensors.append(self._pool.returned(seg_id, nbytes))
                else:
                    raise RpcProtocolError(f"bad tensor descriptor (where={where})")
        return Frame(kind, flags, request_id, data, tensors)

    def close(self) -> None:
        self.segments.close()


def sendmsg_all(sock: socket.socket, buffers: list[bytes | memoryview], fds: list[int]) -> None:
    """Send ``buffers`` (bytes, or byte-format memoryviews) in order; ``fds`` go with the first."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    if len(buffers) == 1 and not anc:
        sent = sock.send(buffers[0])
        if sent == len(buffers[0]):
            return
        buffers = [memoryview(buffers[0])[sent:]]
    buffers = [b for b in buffers if len(b)]
    index = 0
    while index < len(buffers):
        sent = sock.sendmsg(buffers[index : index + _IOV_MAX], anc)
        anc = []
        while sent and index < len(buffers):
            size = len(buffers[index])
            if sent >= size:
                sent -= size
                index += 1
            else:
                buffers[index] = memoryview(buffers[index])[sent:]
                sent = 0


def tensor_view(raw: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy (the caller keeps it alive while it
    uses them)."""
    nbytes = raw.nbytes
    if nbytes == 0:
        return memoryview(b"")
    if not raw.is_cpu or not raw.is_contiguous():
        raise ValueError("not a contiguous CPU tensor")
    array_type = ctypes.c_ubyte * nbytes
    return memoryview(array_type.from_address(raw.data_ptr())).cast("B")


def copy_out(buffer: memoryview, start: int, nbytes: int) -> torch.Tensor:
    """A new ``uint8`` tensor holding ``nbytes`` bytes of ``buffer`` from ``start``."""
    if start < 0 or nbytes < 0 or start + nbytes > len(buffer):
        raise ValueError("bytes out of range")
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(buffer[start : start + nbytes]), dtype=torch.uint8)
