"""``HTTPTransport``: a rank's state served over HTTP to the groups that heal from it.

torchft's signature (``HTTPTransport(timeout, num_chunks)``) and URLs
(``<metadata><step>/full``, ``/metadata``, ``/<chunk>``), with two differences: what is
served is typed JSON and raw tensor bytes (``rallypoint.ft._state.encoding``), never a pickle, so
a receiver runs no code a peer sent; and the address carries a random token of this
transport's (a request without it gets 403), so only those who read the address from the
lighthouse's store can fetch the state. It is plain HTTP: anyone on the path can read the
bytes. rallypoint's default transport authenticates both ends (docs/ft.md, "Transports").

Requests block while the state is not offered (before the first ``send_checkpoint``, and
from ``disallow_checkpoint`` to the next), up to ``timeout``; so does a request for a later
step than the one offered (its source has not reached that step's ``send_checkpoint`` yet,
as rallypoint's own heal server waits). A request for an earlier step gets 400: that state
is gone. (torchft answers 400 to a later step too: its own multi-rank test, whose receiver
asks as soon as a barrier lets it, failed so in 2 runs of 8 on a loaded machine.)
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import struct
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar, cast

import torch

from rallypoint.ft._state.encoding import (
    MAX_HEADER,
    empty_tensors,
    header_bytes,
    pack,
    parse_header,
    raw_bytes,
    unpack,
)
from rallypoint.ft._state.rwlock import RWLock
from rallypoint.ft.checkpointing.transport import CheckpointTransport

__all__ = ["HTTPTransport"]

T = TypeVar("T")
_LEN = struct.Struct("<Q")
_CHUNK = 8 << 20


class HTTPTransport(CheckpointTransport[T]):
    """Serves this rank's state over HTTP (see the module docstring).

    Args:
        timeout: how long a request may wait for the state, and each fetch's timeout
        num_chunks: fetch the tensors in this many parallel requests (0: one request)
    """

    def __init__(self, timeout: timedelta, num_chunks: int) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be 0 or more, got {num_chunks}")
        self._checkpoint_lock = RWLock(timeout=timeout.total_seconds())
        self._disallowed = False
        self._step = -1
        self._offered = threading.Condition()  # notified when a new step is offered
        self._timeout = timeout
        self._num_chunks = num_chunks
        self._token = secrets.token_urlsafe(16)
        self._header: dict[str, Any] = {}
        self._tensors: list[torch.Tensor] = []
        self.disallow_checkpoint()  # nothing is served before the first send_checkpoint
        self._server = _server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="rallypoint-ft-http", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ serving
    def address(self) -> str:
        """``http://host:port/checkpoint/<token>/``: append the step to fetch."""
        port = self._server.socket.getsockname()[1]
        return f"http://{_host()}:{port}/checkpoint/{self._token}/"

    def metadata(self) -> str:
        return self.address()

    def allow_checkpoint(self, step: int) -> None:
        """Serve the state staged last, as the state of ``step``."""
        with self._offered:
            self._step = step
            self._offered.notify_all()
        if self._disallowed:
            self._disallowed = False
            self._checkpoint_lock.w_release()

    def disallow_checkpoint(self) -> None:
        """Stop serving; waits for the requests under way (then the state may change)."""
        if not self._disallowed:
            self._disallowed = True
            self._checkpoint_lock.w_acquire()

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        header, tensors = pack(state_dict)
        header["chunks"] = self._num_chunks
        self._header, self._tensors = header, tensors
        self.allow_checkpoint(step)

    def shutdown(self, wait: bool = True) -> None:
        if wait:
            self._server.shutdown()
            self._thread.join()
        else:
            threading.Thread(target=self._server.shutdown, daemon=True).start()
        self._server.server_close()

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        """Answer GET ``request.path``, holding the read lock until the last byte is sent."""
        parts = request.path.split("/")
        if len(parts) != 5 or parts[1] != "checkpoint":
            request.send_error(400, "invalid url format, expected /checkpoint/token/step/key")
            return
        if not hmac.compare_digest(parts[2].encode(), self._token.encode()):
            request.send_error(403, "not this transport's address")
            return
        self._wait_for_step(parts[3])
        with self._checkpoint_lock.r_lock():
            status, error, body = self._body(parts[3], parts[4])
            if status != 200:
                request.send_error(status, error)
                return
            request.send_response(200)
            request.send_header("Content-type", "application/octet-stream")
            request.send_header("Content-Length", str(sum(len(b) for b in body)))
            request.end_headers()
            with contextlib.suppress(OSError):
                for part in body:
                    for start in range(0, len(part), _CHUNK):
                        request.wfile.write(part[start : start + _CHUNK])

    def _wait_for_step(self, step_text: str) -> None:
        """Until a step at or past ``step_text`` is offered (``TimeoutError`` after the
        timeout): a peer that asks for a step its source has not offered yet is early, not
        wrong."""
        if not step_text.isdigit():
            return  # answered by _body
        step, timeout = int(step_text), self._timeout.total_seconds()
        with self._offered:
            if not self._offered.wait_for(lambda: self._step >= step, timeout):
                raise TimeoutError(f"step {step} was not offered within {timeout:g} s")

    def _body(self, step_text: str, key: str) -> tuple[int, str, list[bytes | memoryview]]:
        """``(status, error, body parts)`` for ``step_text`` and ``key`` (under the lock)."""
        try:
            step = int(step_text)
        except ValueError:
            return 400, f"invalid step {step_text!r}", []
        if step != self._step:
            return 400, f"invalid checkpoint requested, serving {self._step} but got {step=}", []
        if key == "full":
            return 200, "", [*_framed(self._header), *map(raw_bytes, self._tensors)]
        if key == "metadata":
            return 200, "", _framed(self._header)
        chunks = max(1, self._num_chunks)
        if not key.isdigit() or int(key) >= chunks:
            return 400, f"invalid chunk {key!r}", []
        return 200, "", [raw_bytes(t) for t in self._tensors[int(key) :: chunks]]

    # ------------------------------------------------------------------ fetching
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        base = f"{metadata}{step}"
        if self._num_chunks == 0:
            with _open(f"{base}/full", timeout) as f:
                header = _read_header(f)
                tensors = empty_tensors(header)
                for t in tensors:
                    _read_into(f, raw_bytes(t))
            return cast(T, unpack(header, tensors))
        with _open(f"{base}/metadata", timeout) as f:
            header = _read_header(f)
        tensors = empty_tensors(header)
        chunks = max(1, int(header.get("chunks", 1)))

        def fetch(i: int) -> None:
            with _open(f"{base}/{i}", timeout) as f:
                for t in tensors[i::chunks]:
                    _read_into(f, raw_bytes(t))

        with ThreadPoolExecutor(max_workers=chunks) as pool:
            for done in [pool.submit(fetch, i) for i in range(chunks)]:
                done.result()
        return cast(T, unpack(header, tensors))


def _server(transport: HTTPTransport[Any]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        timeout = transport._timeout.total_seconds()  # a silent client is dropped

        def do_GET(self) -> None:
            try:
                transport._serve(self)
            except TimeoutError as exc:  # the state was not offered in time
                with contextlib.suppress(OSError):
                    self.send_error(503, str(exc))

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a heal is logged by the manager, not per request

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        address_family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET

        def server_bind(self) -> None:
            if self.address_family == socket.AF_INET6:
                with contextlib.suppress(OSError):  # dual stack: IPv4 peers too
                    self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

    try:
        return Server(("", 0), Handler)
    except OSError:  # no IPv6 here
        Server.address_family = socket.AF_INET
        return Server(("", 0), Handler)


def _host() -> str:
    """The address other hosts reach this one at."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _framed(header: dict[str, Any]) -> list[bytes | memoryview]:
    body = header_bytes(header)
    return [_LEN.pack(len(body)) + body]


def _open(url: str, timeout: timedelta) -> Any:
    return urllib.request.urlopen(url, timeout=timeout.total_seconds())


def _read_header(f: Any) -> dict[str, Any]:
    size = bytearray(_LEN.size)
    _read_into(f, memoryview(size))
    (length,) = _LEN.unpack(size)
    if length > MAX_HEADER:
        raise ValueError(f"a state header of {length} bytes")
    body = bytearray(length)
    _read_into(f, memoryview(body))
    return parse_header(bytes(body))


def _read_into(f: Any, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ConnectionError(f"the state ended after {got} of {len(view)} bytes")
        got += n
