"""An HTTP client for etcd v3's JSON gateway: endpoint failover, auth tokens, a watch stream.

etcd serves its v3 API as JSON over HTTP, so the standard library's ``http.client`` is
all the client needs: no grpcio/protobuf (whose versions fight with torch's) and nothing
to compile. :class:`EtcdGateway` knows HTTP, endpoints, tokens and etcd's error replies,
nothing of keys or leases (``kv`` maps those onto it). Every try is bounded and a
failed one moves to the next endpoint, and every request asks for a member with a leader,
so a member cut off from the others or gone silent costs one bounded try.
:meth:`EtcdGateway.post` and :meth:`EtcdGateway.watch_put` say how.
"""

from __future__ import annotations

import http.client
import json
import random
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from rallypoint.rendezvous._kv import KVConnectionError, KVError

# gRPC status codes that etcd's gateway puts in the ``code`` field of an error reply (or in
# ``error.grpc_code`` inside a streamed answer: lease keep-alive, watch). What etcd 3.4 says
# during a leader election or a member loss (measured on a 3-member cluster):
# - UNAVAILABLE (HTTP 503): "etcdserver: leader changed" (a read that straddled the
#   election), "etcdserver: no leader" (the member has none; at once with ``hasleader``),
#   "etcdserver: request timed out" and its "possibly due to previous leader failure" /
#   "connection lost" variants (a write proposed to a leader that died: after 5 s + 2
#   election timeouts), "etcdserver: server stopped";
# - UNKNOWN (HTTP 500) "context deadline exceeded": a write to a member without a leader
#   when the request lacks ``hasleader``;
# - DEADLINE_EXCEEDED (HTTP 504).
GRPC_UNKNOWN = 2
GRPC_DEADLINE_EXCEEDED = 4
GRPC_NOT_FOUND = 5  # e.g. "etcdserver: requested lease not found"
GRPC_UNAVAILABLE = 14
GRPC_UNAUTHENTICATED = 16

HTTP_OK = 200
HTTP_UNAUTHORIZED = 401
HTTP_BAD_GATEWAY = 502
HTTP_SERVICE_UNAVAILABLE = 503
HTTP_GATEWAY_TIMEOUT = 504

_RETRY_STATUSES = frozenset({HTTP_BAD_GATEWAY, HTTP_SERVICE_UNAVAILABLE, HTTP_GATEWAY_TIMEOUT})
_RETRY_CODES = frozenset({GRPC_UNKNOWN, GRPC_UNAVAILABLE, GRPC_DEADLINE_EXCEEDED})
_MAX_BACKOFF = 0.5  # seconds between sweeps over the endpoints
ATTEMPT_TIMEOUT = 2.0
"""Seconds one try at one member may take at first (doubled after each sweep that timed out)."""
WATCH_SLICE = 3.0
"""Seconds a watch stream is trusted before the key is read again (a member that went silent
holds a watch forever: no event, no error)."""
_HEADERS = {"Content-Type": "application/json", "Grpc-Metadata-Hasleader": "true"}


class GatewayError(KVError):
    """etcd answered a request with an error that retrying does not cure."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        status, code = _status_and_code(status, body)
        super().__init__(f"etcd answered {status}: {_reason(body)}")
        self.status = status
        """The HTTP status (a streamed answer's own, not the stream's 200)."""
        self.body = body
        self.code: int | None = code
        """The gRPC status code of the answer (``None`` if it had none)."""


class WatchBroken(KVError):
    """A watch stream failed or was cancelled before a put or the timeout."""


class _Retry(Exception):
    """Internal: an answer that another try may cure (carries it for the final message)."""

    def __init__(self, cause: GatewayError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Reply(Enum):
    """What :meth:`EtcdGateway.post` does with an answer."""

    DONE = "done"
    TOKEN_REJECTED = "token rejected"  # authenticate again, retry
    RETRY = "retry"  # unavailable or deadline exceeded: another endpoint, or later
    FAIL = "fail"


def _reason(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):  # a streamed answer's error
        return str(error.get("message") or "")
    return str(error or body.get("message") or "")


def _status_and_code(status: int, body: dict[str, Any]) -> tuple[int, Any]:
    """The HTTP status and gRPC code of an answer; a streamed answer (lease keep-alive,
    watch) arrives as 200 with ``{"error": {"http_code": .., "grpc_code": ..}}``."""
    error = body.get("error")
    if isinstance(error, dict):
        return int(error.get("http_code") or HTTP_SERVICE_UNAVAILABLE), error.get("grpc_code")
    return status, body.get("code")


class EtcdGateway:
    """JSON requests to one etcd cluster through its gateway (thread-safe).

    :meth:`post` retries, until its timeout, the failures another try may cure (a failed
    connection, "unavailable", a rejected token), each retry on the next endpoint, backing
    off (jittered, at most 0.5 s) after a sweep of all. Each try is bounded on its own
    (``attempt_timeout``, doubled after a sweep in which a try ran out of time), so a silent
    member or a write etcd holds for its request timeout costs one bounded try; a failed
    endpoint is moved off the shared preference at once. Every request carries the
    ``hasleader`` gRPC metadata, so a member without a leader answers "no leader" at once
    and cancels a watch; a member silent altogether cannot say so, so :meth:`watch_put` is
    called for short slices (:data:`WATCH_SLICE`) between bounded re-reads. Connections are
    per thread (``http.client`` is not thread-safe); the token and the last good endpoint
    are shared under one lock, and a rejected token is refreshed once for every thread
    that used it.

    Args:
        endpoints: ``(host, port)`` of each member; requests go to the one that answered
            last and fail over to the others.
        ssl_context: TLS settings (CA, client certificate), or ``None`` for plain HTTP.
        username, password: etcd user credentials, or ``None`` without auth.
        timeout: seconds a request keeps retrying before :class:`KVConnectionError`.
        attempt_timeout: seconds one try at one member may take at first.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        ssl_context: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 60.0,
        attempt_timeout: float = ATTEMPT_TIMEOUT,
    ) -> None:
        if not endpoints:
            raise ValueError("etcd needs at least one endpoint (host:port).")
        if not attempt_timeout > 0:
            raise ValueError(f"attempt_timeout ({attempt_timeout!r}) must be positive.")
        self._endpoints = list(endpoints)
        self._ssl = ssl_context
        self._username = username
        self._password = password
        self._timeout = timeout
        self._attempt_timeout = attempt_timeout
        scheme = "https" if ssl_context is not None else "http"
        self.endpoint = ",".join(f"{scheme}://{h}:{p}" for h, p in self._endpoints)
        """Every endpoint as a URL, for messages."""
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _token and _preferred
        self._auth_lock = threading.Lock()  # one authentication at a time
        self._token: str | None = None
        self._preferred = 0
        self.authentications = 0
        """How many tokens this client has obtained (one per expiry, not per thread)."""

    # ------------------------------------------------------------------ requests

    def post(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any:
        """POST ``body`` as JSON to ``path`` and return the decoded answer.

        Raises:
            GatewayError: etcd refused the request (a bad request, a failed precondition).
            KVConnectionError: no endpoint gave an answer within ``timeout`` seconds (the
                client's timeout by default), naming the endpoints and the last failure.
        """
        limit = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        payload = json.dumps(body)
        last: BaseException | None = None
        attempt = 0
        timed_out = False  # in this sweep over the endpoints
        bound = self._attempt_timeout
        with self._lock:
            first = self._preferred
        while True:
            index = (first + attempt) % len(self._endpoints)
            remaining = deadline - time.monotonic()
            try:
                return self._post_once(index, path, payload, max(0.05, min(bound, remaining)))
            except _Retry as retry:
                last = retry.cause
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self._drop_connection(index)
                timed_out = timed_out or isinstance(exc, TimeoutError)
                last = exc
            self._avoid(index)
            attempt += 1
            if time.monotonic() >= deadline:
                raise KVConnectionError(
                    f"Cannot reach etcd at {self.endpoint} within {limit:g} s: "
                    f"{type(last).__name__}: {last}"
                ) from last
            if attempt % len(self._endpoints) == 0:
                if timed_out:  # every member was slow, not silent: give the next sweep longer
                    bound, timed_out = 2 * bound, False
                time.sleep(min(_MAX_BACKOFF, 0.05 * attempt) * random.uniform(0.5, 1.0))

    def _avoid(self, index: int) -> None:
        """Endpoint ``index`` just failed: new requests of every thread start elsewhere."""
        with self._lock:
            if self._preferred == index:
                self._preferred = (index + 1) % len(self._endpoints)

    def _post_once(self, index: int, path: str, payload: str, limit: float) -> Any:
        """One request to endpoint ``index`` within ``limit`` seconds; raises
        :class:`_Retry` for what may pass."""
        conn = self._connection(index, limit)
        token = self._current_token(conn)
        headers = dict(_HEADERS)
        if token is not None:
            headers["Authorization"] = token
        conn.request("POST", path, payload, headers)
        resp = conn.getresponse()
        raw = resp.read()
        data: dict[str, Any] = json.loads(raw) if raw else {}
        match self._classify(resp.status, data):
            case _Reply.DONE:
                with self._lock:
                    self._preferred = index
                return data
            case _Reply.TOKEN_REJECTED:
                self._invalidate(token)
                raise _Retry(GatewayError(resp.status, data))
            case _Reply.RETRY:
                raise _Retry(GatewayError(resp.status, data))
            case _Reply.FAIL:
                raise GatewayError(resp.status, data)

    def _classify(self, http_status: int, data: dict[str, Any]) -> _Reply:
        status, code = _status_and_code(http_status, data)
        if status == HTTP_OK:
            return _Reply.DONE
        if self._username is not None and (
            status == HTTP_UNAUTHORIZED or code == GRPC_UNAUTHENTICATED or "token" in _reason(data)
        ):
            return _Reply.TOKEN_REJECTED
        if status in _RETRY_STATUSES or code in _RETRY_CODES:
            return _Reply.RETRY
        return _Reply.FAIL

    # ------------------------------------------------------------------ connections

    def _connection(self, index: int, limit: float) -> http.client.HTTPConnection:
        """This thread's connection to endpoint ``index`` (made on first use), its
        connect and reads bounded by ``limit`` seconds."""
        conns: dict[int, http.client.HTTPConnection] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(index)
        if conn is None:
            conn = conns[index] = self._connect(index, limit)
        else:
            conn.timeout = limit
            if conn.sock is not None:
                conn.sock.settimeout(limit)
        return conn

    def _drop_connection(self, index: int) -> None:
        conns: dict[int, http.client.HTTPConnection] = self._local.__dict__.get("conns", {})
        conn = conns.pop(index, None)
        if conn is not None:
            conn.close()

    def _connect(self, index: int, timeout: float) -> http.client.HTTPConnection:
        """A connected client for endpoint ``index``."""
        host, port = self._endpoints[index]
        conn: http.client.HTTPConnection
        if self._ssl is not None:
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.connect()
        except BaseException:  # Ctrl-C too: the connection is closed
            conn.close()
            raise
        return conn

    # ------------------------------------------------------------------ auth

    def _current_token(self, conn: http.client.HTTPConnection) -> str | None:
        """The token to send (authenticating through ``conn`` when there is none)."""
        if self._username is None:
            return None
        with self._lock:
            token = self._token
        if token is not None:
            return token
        with self._auth_lock:
            with self._lock:
                token = self._token
            if token is None:  # no other thread got one while we waited
                token = self._authenticate(conn)
                with self._lock:
                    self._token = token
                    self.authentications += 1
        return token

    def _invalidate(self, token: str | None) -> None:
        """Forget ``token`` unless another thread has already replaced it."""
        with self._lock:
            if self._token == token:
                self._token = None

    def _authenticate(self, conn: http.client.HTTPConnection) -> str:
        body = json.dumps({"name": self._username, "password": self._password})
        conn.request("POST", "/v3/auth/authenticate", body, _HEADERS)
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
        if resp.status != HTTP_OK or "token" not in data:
            raise KVConnectionError(
                f"etcd at {self.endpoint} rejected user {self._username!r}: {_reason(data)}"
            )
        return str(data["token"])

    # ------------------------------------------------------------------ watch

    def watch_put(
        self, key: str, timeout: float, *, present: Callable[[], bool] | None = None
    ) -> bool:
        """Stream ``/v3/watch`` on ``key`` (base64) from now until a put arrives (``True``)
        or ``timeout`` seconds pass (``False``).

        ``present`` (a read of the key) runs once the watch is made, and its ``True`` ends
        the watch at once: a wait that watches from now and then reads misses no put. A
        watch from the revision a wait read would not do: etcd hands such a watch, when
        anything was written since (one behind its head), every event, old and new, on its
        catch-up loop, every 100 ms, so a put came up to 100 ms late (a lighthouse round on
        etcd took 55-90 ms, mostly that).

        Uses its own connection to the preferred member (a watch holds it for the whole
        stream). Raises :class:`WatchBroken` when the stream fails, the member loses its
        leader, or etcd cancels the watch; that member is moved off the preference, and
        the caller watches again (on another member) and reads the key once that watch is
        made. A silent member looks like a quiet key: keep ``timeout`` short
        (:data:`WATCH_SLICE`) and watch again between calls.
        """
        deadline = time.monotonic() + timeout
        with self._lock:
            index = self._preferred
        conn: http.client.HTTPConnection | None = None
        try:
            conn = self._connect(index, max(0.05, min(self._attempt_timeout, timeout)))
            token = self._current_token(conn)
            headers = dict(_HEADERS)
            if token is not None:
                headers["Authorization"] = token
            request = {"create_request": {"key": key}}
            conn.request("POST", "/v3/watch", json.dumps(request), headers)
            resp = conn.getresponse()
            if resp.status != HTTP_OK:
                if resp.status == HTTP_UNAUTHORIZED:
                    self._invalidate(token)
                raise WatchBroken(f"watch answered {resp.status}")
            if conn.sock is not None:  # events may take until the deadline
                conn.sock.settimeout(max(0.05, deadline - time.monotonic()))
            return self._read_events(resp, present)
        except TimeoutError:  # socket.timeout: the watch creation or the slice ran out
            if time.monotonic() >= deadline - 0.01:
                return False
            self._avoid(index)
            raise WatchBroken(f"watch on {self._url(index)} was not created in time") from None
        except (OSError, http.client.HTTPException, ValueError, KVError) as exc:
            self._avoid(index)
            if isinstance(exc, WatchBroken):
                raise
            raise WatchBroken(f"watch stream failed: {type(exc).__name__}: {exc}") from exc
        finally:
            if conn is not None:
                conn.close()

    def _url(self, index: int) -> str:
        host, port = self._endpoints[index]
        return f"{'https' if self._ssl is not None else 'http'}://{host}:{port}"

    @staticmethod
    def _read_events(resp: http.client.HTTPResponse, present: Callable[[], bool] | None) -> bool:
        while True:
            line = resp.readline()
            if not line:
                raise WatchBroken("watch stream closed")
            answer = json.loads(line)
            if "error" in answer:  # e.g. "etcdserver: no leader" (hasleader)
                raise WatchBroken(f"watch ended: {_reason(answer)}")
            result = answer.get("result", {})
            if result.get("created") and present is not None and present():
                return True
            for event in result.get("events") or []:
                if event.get("type", "PUT") == "PUT":
                    return True
            if result.get("canceled"):
                raise WatchBroken(f"watch cancelled: {result.get('cancel_reason')}")
