"""Connections: length-prefixed frames over TCP or an abstract Unix socket.

One connection per caller -> callee pair. Hot-path rules: ``TCP_NODELAY``, one
``sendmsg`` per frame (queued frames combined), buffered reads that parse many frames per
``recv``, and requests run directly on the callee's reader thread. A request that blocks
would stall every later frame, so a monitor hands the reader role to a fresh thread once
the current one has been busy for :data:`STALL_SECONDS`: fast calls pay no hand-off and
blocking ones cannot deadlock the connection. On the caller's side a thread in
``rpc_sync`` reads its own reply (:meth:`Connection.read_until`), so the reply wakes the
one thread that needs it; ``rpc_async`` calls get a reader thread while any is pending
(:meth:`Connection.expect_reply`).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from rallypoint.rpc._errors import RpcConnectionError, RpcProtocolError
from rallypoint.rpc._transport import _wire
from rallypoint.rpc._transport._framing import Frame, FrameReader, sendmsg_all, tensor_view
from rallypoint.rpc._transport._reader_pool import ReaderPool
from rallypoint.rpc._transport._shm import Segment, SegmentPool
from rallypoint.rpc._transport._spin import WAITS

logger = logging.getLogger("rallypoint.rpc")

STALL_SECONDS = 0.005
COPIED_BYTES = 32 << 10
"""Tensors of a frame that add up to at most this many bytes (and stay out of shared
memory) are copied into one buffer with the frame, not sent from their own memory: for
small tensors the copy costs less than another buffer to send and keep alive."""
_POLL_MS = 50  # a thread reading its own reply checks this often whether its call ended
_TAKE_IF_FREE = -1  # a reader generation: take the reader role if nobody holds it


OnFrame: TypeAlias = "Callable[[Connection, Frame], None]"
"""Runs a frame that arrived (on the connection's reader thread)."""
OnLost: TypeAlias = "Callable[[Connection, BaseException | None], None]"
"""Told once when the connection closes (``None``: closed on purpose)."""


class ReadInterrupted(RpcConnectionError):
    """This worker closed the connection: an exception interrupted it mid-frame."""


class Connection:
    """One authenticated socket: framed sends from any thread, one reader at a time."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        peer_name: str,
        peer_id: int,
        uds: bool,
        on_frame: OnFrame,
        on_lost: OnLost,
        pool: SegmentPool | None,
        shm_threshold: int,
        stats: dict[str, int],
        outbound: bool = False,
        limiter: threading.Semaphore | None = None,
        gate: threading.Event | None = None,
        readers: ReaderPool | None = None,
    ) -> None:
        self.sock = sock
        self.peer_name = peer_name
        self.peer_id = peer_id
        self.uds = uds
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._pool = pool if uds else None
        self._threshold = shm_threshold
        self._stats = stats
        self._reader = FrameReader(sock, uds, self._pool)
        # frames waiting for a sendmsg: buffers in order, fds to pass, tensors to keep alive
        self._bufs: list[bytes | memoryview] = []
        self._fds: list[int] = []
        self._keep: list[torch.Tensor] = []
        self._qlock = threading.Lock()
        self._sending = False  # a thread is sending the queue (see flush)
        self._state_lock = threading.Lock()
        self._sent_segments: set[int] = set()
        self._exec_since = 0.0
        self._generation = 0
        self.closed = False
        self.outbound = outbound  # we opened it (our calls go out on it)
        self.limiter = limiter  # bounds the readers handed off by check_stall
        self._gate = gate  # readers wait for it before the first frame
        self._readers = readers  # where reader threads come from (else: a new thread each)
        self._handed_off: set[int] = set()
        self._spawn_failed = False  # a hand-over found no thread (logged once)
        self._reading = False  # a thread holds the reader role (reads the next frame)
        self._abandoned: tuple[int, bool] | None = None  # see read_until
        self._unread = -1  # see check_reading
        self.closing_on_purpose = False  # the peer said it closes this connection, alive
        self._fd = sock.fileno()
        self._poller = select.poll()
        self._poller.register(self._fd, select.POLLIN)
        self.pending: dict[int, torch.futures.Future[Any]] = {}  # the caller's calls on it
        self.site: object = None  # what the reader ran last (see rpc._spin's sites)

    # ---- sending -------------------------------------------------------------------
    def send_frame(
        self,
        kind: _wire.FrameKind,
        request_id: int,
        data: bytes,
        raws: list[torch.Tensor],
        *,
        flush: bool = True,
    ) -> None:
        if not raws:  # fast path: header and pickle in one bytes object
            frame = _wire.HEADER.pack(_wire.MAGIC, kind, 0, 0, request_id, len(data)) + data
            with self._qlock:
                if self.closed:
                    raise RpcConnectionError(
                        f"connection to {self.peer_name} is closed", peer=self.peer_name
                    )
                self._bufs.append(frame)
            if flush:
                self.flush()
            return
        sizes = [raw.numel() for raw in raws]
        if sum(sizes) <= COPIED_BYTES and (not self.uds or max(sizes) < self._threshold):
            self._send_copied(kind, request_id, data, raws, sizes, flush)
            return
        segments: list[Segment | int | None] = []  # ours, the peer's handed back, or inline
        for raw in raws:
            seg: Segment | int | None = None
            if self.uds and raw.numel() >= self._threshold and raw.numel():
                seg = self._reader.segments.hand_back(raw)
                if seg is None and self._pool is not None:
                    seg = self._pool.put(raw)
            segments.append(seg)
        header = _wire.HEADER.pack(_wire.MAGIC, kind, 0, len(raws), request_id, len(data))
        buffers = [memoryview(header), memoryview(data)]
        inline: list[memoryview] = []
        fds: list[int] = []
        descs = bytearray()
        with self._qlock:
            if self.closed:
                for seg in segments:
                    if isinstance(seg, Segment):
                        seg.mm[0] = 0
                    elif isinstance(seg, int):
                        self._reader.segments.keep(seg)
                raise RpcConnectionError(
                    f"connection to {self.peer_name} is closed", peer=self.peer_name
                )
            for raw, seg in zip(raws, segments, strict=True):
                if seg is None:
                    descs += _wire.DESC.pack(_wire.WHERE_INLINE, 0, 0, 0, raw.numel())
                    inline.append(tensor_view(raw))
                    self._stats["inline_tensor_bytes"] += raw.numel()
                elif isinstance(seg, int):
                    descs += _wire.DESC.pack(_wire.WHERE_RETURNED, 0, 0, seg, raw.numel())
                    self._stats["returned_tensor_bytes"] = (
                        self._stats.get("returned_tensor_bytes", 0) + raw.numel()
                    )
                else:
                    new = seg.id not in self._sent_segments
                    if new:
                        self._sent_segments.add(seg.id)
                        fds.append(seg.fd)
                    descs += _wire.DESC.pack(_wire.WHERE_SHM, int(new), 0, seg.id, raw.numel())
                    self._stats["shm_tensor_bytes"] += raw.numel()
            if descs:
                buffers.append(memoryview(descs))
            buffers.extend(inline)
            self._bufs.extend(buffers)
            self._fds.extend(fds)
            self._keep.extend(raws)
        if flush:
            self.flush()

    def _send_copied(
        self,
        kind: _wire.FrameKind,
        request_id: int,
        data: bytes,
        raws: list[torch.Tensor],
        sizes: list[int],
        flush: bool,
    ) -> None:
        """A frame whose tensors are small and all inline, as one bytes object: its
        tensors' bytes are copied now, as the frame of a call without tensors is (one
        buffer to send, nothing to keep alive until it is sent)."""
        header = _wire.HEADER.pack(_wire.MAGIC, kind, 0, len(raws), request_id, len(data))
        descs = [_wire.DESC.pack(_wire.WHERE_INLINE, 0, 0, 0, size) for size in sizes]
        frame = b"".join([header, data, *descs, *map(tensor_view, raws)])
        with self._qlock:
            if self.closed:
                raise RpcConnectionError(
                    f"connection to {self.peer_name} is closed", peer=self.peer_name
                )
            self._bufs.append(frame)
            self._stats["inline_tensor_bytes"] += sum(sizes)
        if flush:
            self.flush()

    def flush(self) -> None:
        """Send what is queued, unless another thread is sending (it sends it next).

        The claim is taken and dropped inside ``with`` blocks, never between a call and
        a ``try``: a signal handler that raises in the main thread cannot leave it taken.
        """
        if not self._bufs:  # read without the lock: a frame queued meanwhile is flushed by
            return  # the thread that queued it, its reader, or the monitor's next tick
        while True:
            claimed = False
            try:
                with self._qlock:
                    if self._sending or not self._bufs:
                        return
                    self._sending = claimed = True
                    buffers, fds, keep = self._bufs, self._fds, self._keep
                    self._bufs, self._fds, self._keep = [], [], []
                if not keep and len(buffers) > 1:  # small frames only: one buffer
                    buffers = [b"".join(buffers)]
                sendmsg_all(self.sock, buffers, fds)
                del keep
            except OSError as exc:
                if self.outbound:
                    self._broken(exc)
                else:  # the reader decides: frames before the EOF may say "on purpose"
                    with contextlib.suppress(OSError):
                        self.sock.shutdown(socket.SHUT_WR)
                return
            finally:
                if claimed:
                    with self._qlock:
                        self._sending = False

    # ---- reading -------------------------------------------------------------------
    def frame_buffered(self) -> bool:
        """Whether the next frame has arrived whole (reading it will not block)."""
        return self._reader.buffered_frame()

    def start(self) -> None:
        """Start reading the peer's calls (a connection we opened reads on demand)."""
        if self.outbound:
            return
        with self._state_lock:
            self._reading = True
        self._spawn_reader(self._generation)

    def expect_reply(self) -> None:
        """A call on this connection is pending and its caller does not read: make sure a
        reader thread does (one that finds the role taken, or nothing pending, leaves)."""
        if not self._reading and not self.closed:
            self._spawn_reader(_TAKE_IF_FREE)

    def read_until(
        self, future: torch.futures.Future[Any], *, more: bool = False, site: object = None
    ) -> None:
        """Read frames on this thread until ``future`` (a call pending on this connection)
        is complete, unless another thread reads the connection already. Then a reader
        thread takes the calls still pending, unless ``more``: this thread reads again.

        On the main thread a signal handler may raise (``KeyboardInterrupt``) at any line.
        The handler below then only records how far reading got, in one statement that
        cannot itself be interrupted, and :meth:`check_reading` finishes the job (here,
        or on the monitor's next tick): the role is freed (a reader thread takes over
        pending calls), or, if the exception cut into a frame and the stream position is
        lost, the connection closes (its pending calls fail; the next call opens a new one).
        """
        took = in_frame = False
        try:
            with self._state_lock:
                if self._reading or self.closed:
                    return
                self._reading = took = True
                generation = self._generation
            while not future.done():
                if self._bufs and not self._reader.buffered_frame():
                    self.flush()
                if not self._reader.buffered_bytes() and not WAITS.wait_readable(
                    self._fd, self._poller, _POLL_MS, site
                ):
                    continue
                in_frame = True
                if self._run(self._reader.read_frame(), generation):
                    took = False
                    return  # a stalled frame: another thread holds the role now
                in_frame = False
            with self._state_lock:
                took = False
                if generation == self._generation:
                    self._reading = False
            if self.pending and not more:
                self.expect_reply()  # other calls wait for replies
        except (OSError, EOFError, RpcProtocolError, ValueError, KeyError) as exc:
            if took:
                self._lost_while_reading(generation, exc)
        except BaseException:  # Ctrl-C too: a half-read frame marks the connection
            if took:
                self._abandoned = (generation, in_frame)
                self.check_reading()
            raise

    def upkeep(self, now: float) -> None:
        """The monitor's tick: :meth:`check_stall`, :meth:`check_reading` and :meth:`flush`,
        each only where it may have work (most ticks find none: a few attribute reads)."""
        if self._exec_since:
            self.check_stall(now)
        if self._abandoned is not None or self._unread != -1 or self.pending:
            self.check_reading()
        if self._bufs:
            self.flush()

    def check_reading(self) -> None:
        """Finish what an interrupted reading caller left, and give pending calls a reader
        if nobody reads (the monitor calls this every tick)."""
        if self._abandoned is None and self._unread == -1 and not self.pending:
            return  # the usual tick: nothing was left, no call waits
        marker, self._abandoned = self._abandoned, None
        if marker is not None:
            generation, in_frame = marker
            with self._state_lock:
                current = generation == self._generation
                if current and not in_frame:
                    self._reading = False
            if current and in_frame:
                with contextlib.suppress(RpcConnectionError):  # the peer must not think us dead
                    self.send_frame(_wire.FrameKind.CLOSING, 0, b"", [])
                self._broken(ReadInterrupted("reading a reply was interrupted mid-frame"))
                return
        # a caller takes the role within microseconds of sending: heal only a call that
        # stayed unread for a whole tick
        unread = -1
        if self.outbound and self.pending and not self._reading:
            try:
                unread = next(iter(self.pending), -1)
            except RuntimeError:  # a caller added a call, or a reader took one, meanwhile
                unread = -1  # (the interpreter switched threads): look again next tick
        if unread != -1 and unread == self._unread:
            self.expect_reply()
        self._unread = unread

    def _spawn_reader(self, generation: int) -> None:
        name = f"rpc-reader-{self.peer_name}"
        if self._readers is not None:
            self._readers.run(name, self._read_loop, generation)
            return
        threading.Thread(target=self._read_loop, args=(generation,), name=name, daemon=True).start()

    def _read_loop(self, generation: int) -> None:
        if generation == _TAKE_IF_FREE:
            with self._state_lock:
                if self._reading or self.closed or not self.pending:
                    return
                self._reading = True
                generation = self._generation
        try:
            if self._gate is not None:
                with WAITS.blocked():
                    self._gate.wait()
            while True:
                if self._bufs and not self._reader.buffered_frame():
                    self.flush()
                if not self._reader.buffered_bytes():
                    WAITS.wait_readable(self._fd, self._poller, -1, self.site)
                if self._run(self._reader.read_frame(), generation):
                    return
                if self.outbound:
                    with self._state_lock:
                        if not self.pending and generation == self._generation:
                            self._reading = False  # no reply is due: leave until one is
                            return
        except (OSError, EOFError, RpcProtocolError, ValueError, KeyError) as exc:
            self._lost_while_reading(generation, exc)
        except (
            BaseException
        ) as exc:  # pragma: no cover - bug guard: never lose a connection silently
            logger.exception("rallypoint.rpc: reader for %s crashed", self.peer_name)
            self._broken(exc)

    def _run(self, frame: Frame, generation: int) -> bool:
        """Run one frame as the reader of ``generation``; whether the role was handed to
        another thread meanwhile (then this thread stops reading)."""
        if frame.kind is _wire.FrameKind.CLOSING:
            self.closing_on_purpose = True
            return False
        with self._state_lock:
            self._exec_since = time.monotonic()
        try:
            self._on_frame(self, frame)
        finally:
            del frame  # do not pin the frame's tensors (and segments) until the next one
            with self._state_lock:
                stolen = generation != self._generation
                if not stolen:
                    # after a hand-over the clock is the new reader's: leave it
                    self._exec_since = 0.0
        if stolen:
            self.flush()
            if generation in self._handed_off:
                self._handed_off.discard(generation)
                if self.limiter is not None:
                    self.limiter.release()
        return stolen

    def _lost_while_reading(self, generation: int, exc: BaseException) -> None:
        with self._state_lock:
            current = generation == self._generation
        if current:
            self._broken(exc)

    def check_stall(self, now: float) -> None:
        """Called by the monitor: hand reading to a new thread if the reader is stuck.

        The connection's ``limiter`` bounds the threads busy with requests that blocked (the
        agent's ``num_worker_threads``); the thread that blocked releases it when done.
        """
        since = self._exec_since  # read without the lock first: most ticks find nothing
        if not since or now - since < STALL_SECONDS:
            return
        limiter = self.limiter
        with self._state_lock:
            since = self._exec_since
            if self.closed or not since or now - since < STALL_SECONDS:
                return
            if limiter is not None:
                if not limiter.acquire(blocking=False):
                    return
                self._handed_off.add(self._generation)
            self._generation += 1
            self._exec_since = 0.0
            # started under the lock: the stuck reader learns of the hand-over only once
            # the new reader exists (it stops reading when its request ends)
            try:
                self._spawn_reader(self._generation)
            except RuntimeError as exc:  # "can't start new thread": the old reader stays
                self._generation -= 1
                self._exec_since = since
                if limiter is not None:
                    self._handed_off.discard(self._generation)
                    limiter.release()
                if not self._spawn_failed:
                    self._spawn_failed = True
                    logger.warning(
                        "rallypoint.rpc: could not start a reader for %s while a request "
                        "on it blocks (%s); its next frames wait until that request ends",
                        self.peer_name,
                        exc,
                    )

    # ---- closing -------------------------------------------------------------------
    def _broken(self, exc: BaseException | None) -> None:
        with self._qlock:
            if self.closed:
                return
            self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._on_lost(self, exc)

    def close(self) -> None:
        self._broken(None)
        self._reader.close()


def connect(
    address: tuple[str, int] | str,
    *,
    timeout: float,
) -> tuple[socket.socket, bool]:
    """Open a socket to ``address`` (``(host, port)`` for TCP, a str for a Unix socket)."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(address)
        return sock, True
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, False
