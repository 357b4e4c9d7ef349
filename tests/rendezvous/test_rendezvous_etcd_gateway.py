"""The etcd gateway client and EtcdKV without etcd: a scripted HTTP server and a fake gateway.

The real-etcd behaviour (TLS, auth, leases, restarts) is in ``test_rendezvous_etcd.py``;
here each failure the client must handle is produced on purpose: an endpoint that is down,
one that answers "unavailable", a token the server stops accepting, a create whose read
finds nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rallypoint._core.net import free_port
from rallypoint.rendezvous import KVConnectionError, KVStateError
from rallypoint.rendezvous._etcd_gateway import (
    GRPC_UNAUTHENTICATED,
    GRPC_UNAVAILABLE,
    EtcdGateway,
    GatewayError,
)
from rallypoint.rendezvous._kv_etcd import _SET_IF_ABSENT_TRIES, EtcdKV, EtcdOptions

pytestmark = pytest.mark.timeout(60)


class Script:
    """What the fake etcd answers; shared by the server's handler threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unavailable = 0  # answer this many requests with 503 / UNAVAILABLE first
        self.bad_request = False
        self.auth = False  # require the newest token
        self.tokens = 0  # tokens handed out
        self.requests: list[str] = []

    def answer(self, path: str, headers: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.requests.append(path)
            if path == "/v3/auth/authenticate":
                if body.get("password") != "s3cret":
                    return 400, {"error": "authentication failed", "code": 3}
                self.tokens += 1
                return 200, {"token": f"token-{self.tokens}"}
            if self.auth and headers.get("Authorization") != f"token-{self.tokens}":
                return 401, {"error": "invalid auth token", "code": GRPC_UNAUTHENTICATED}
            if self.unavailable > 0:
                self.unavailable -= 1
                return 503, {"error": "etcdserver: unavailable", "code": GRPC_UNAVAILABLE}
            if self.bad_request:
                return 400, {"error": "etcdserver: bad request", "code": 3}
            return 200, {"header": {"revision": "7"}, "echo": body}


@pytest.fixture
def server() -> Iterator[tuple[Script, int]]:
    script = Script()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as etcd

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            status, answer = script.answer(self.path, self.headers, json.loads(raw or b"{}"))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield script, int(httpd.server_address[1])
    httpd.shutdown()
    httpd.server_close()


def test_retries_unavailable_then_answers(server: tuple[Script, int]) -> None:
    script, port = server
    script.unavailable = 3
    gateway = EtcdGateway([("127.0.0.1", port)], timeout=10)
    assert gateway.post("/v3/kv/range", {"key": "a2V5"})["echo"] == {"key": "a2V5"}
    assert script.requests.count("/v3/kv/range") == 4


def test_retry_loop_is_bounded_by_the_timeout(server: tuple[Script, int]) -> None:
    script, port = server
    script.unavailable = 10**9
    gateway = EtcdGateway([("127.0.0.1", port)], timeout=1)
    start = time.monotonic()
    with pytest.raises(KVConnectionError, match=rf"127\.0\.0\.1:{port} within 1 s.*unavailable"):
        gateway.post("/v3/kv/range", {})
    assert time.monotonic() - start < 5
    assert 1 < len(script.requests) < 1000  # retried, with a backoff


def test_a_refused_request_is_not_retried(server: tuple[Script, int]) -> None:
    script, port = server
    script.bad_request = True
    gateway = EtcdGateway([("127.0.0.1", port)], timeout=10)
    with pytest.raises(GatewayError, match="bad request") as info:
        gateway.post("/v3/kv/range", {})
    assert info.value.status == 400
    assert len(script.requests) == 1


def test_fails_over_to_the_endpoint_that_answers(server: tuple[Script, int]) -> None:
    script, port = server
    dead = free_port()
    gateway = EtcdGateway([("127.0.0.1", dead), ("127.0.0.1", port)], timeout=10)
    assert gateway.endpoint == f"http://127.0.0.1:{dead},http://127.0.0.1:{port}"
    gateway.post("/v3/kv/range", {})
    gateway.post("/v3/kv/range", {})  # straight to the live one now
    assert script.requests == ["/v3/kv/range", "/v3/kv/range"]


def test_unreachable_endpoints_name_themselves() -> None:
    ports = [free_port(), free_port()]
    gateway = EtcdGateway([("127.0.0.1", p) for p in ports], timeout=0.5)
    with pytest.raises(KVConnectionError) as info:
        gateway.post("/v3/kv/range", {})
    assert all(f"127.0.0.1:{p}" in str(info.value) for p in ports)


def test_stale_token_is_refreshed_once_for_many_threads(server: tuple[Script, int]) -> None:
    script, port = server
    script.auth = True
    gateway = EtcdGateway([("127.0.0.1", port)], username="root", password="s3cret", timeout=10)
    gateway.post("/v3/kv/range", {})
    assert gateway.authentications == 1
    with script.lock:
        script.tokens += 1  # the server forgets token-1 (expiry, restart): every thread's is stale
    barrier = threading.Barrier(8)

    def get(i: int) -> Any:
        barrier.wait(5)
        return gateway.post("/v3/kv/range", {"i": i})["echo"]["i"]

    with ThreadPoolExecutor(8) as pool:
        assert sorted(pool.map(get, range(8))) == list(range(8))
    assert gateway.authentications == 2  # one new token, shared by the eight threads
    assert script.requests.count("/v3/auth/authenticate") == 2


def test_wrong_password_names_the_user(server: tuple[Script, int]) -> None:
    script, port = server
    script.auth = True
    gateway = EtcdGateway([("127.0.0.1", port)], username="root", password="nope", timeout=10)
    with pytest.raises(KVConnectionError, match="rejected user 'root'"):
        gateway.post("/v3/kv/range", {})


class LostReads:
    """A fake gateway: every create fails (the key exists) but its read finds nothing
    ``lost`` times (the key deleted again in between), then the read sees ``stored``."""

    endpoint = "fake://etcd"

    def __init__(self, lost: int, stored: bytes = b"theirs") -> None:
        self.lost = lost
        self.stored = stored
        self.txns = 0

    def post(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any:
        import base64

        assert path == "/v3/kv/txn", path
        self.txns += 1
        if self.txns <= self.lost:
            return {"succeeded": False, "responses": [{"response_range": {"kvs": []}}]}
        value = base64.b64encode(self.stored).decode()
        return {"succeeded": False, "responses": [{"response_range": {"kvs": [{"value": value}]}}]}

    def watch_put(self, key: str, start_revision: int, timeout: float) -> bool:
        raise AssertionError("not used")


def _fake_kv(gateway: LostReads) -> EtcdKV:
    options = EtcdOptions(endpoints=[("fake", 1)], lease_ttl=0)
    return EtcdKV(options, gateway=gateway)


def test_set_if_absent_retries_a_create_that_raced_a_delete() -> None:
    gateway = LostReads(lost=2)
    assert _fake_kv(gateway).set_if_absent("k", b"mine") == b"theirs"
    assert gateway.txns == 3


def test_set_if_absent_gives_up_after_a_bounded_number_of_tries() -> None:
    gateway = LostReads(lost=10**9)
    message = rf"'k' at etcd fake://etcd.*{_SET_IF_ABSENT_TRIES} times"
    with pytest.raises(KVStateError, match=message):
        _fake_kv(gateway).set_if_absent("k", b"mine")
    assert gateway.txns == _SET_IF_ABSENT_TRIES  # a loop, not a recursion that runs away
