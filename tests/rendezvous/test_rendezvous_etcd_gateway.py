"""The etcd gateway client and EtcdKV without etcd: a scripted HTTP server and a fake gateway.

The real-etcd behaviour (TLS, auth, leases, restarts) is in ``test_rendezvous_etcd.py``;
here each failure the client must handle is produced on purpose: an endpoint that is down,
one that answers "unavailable" (as a plain reply or inside a streamed one), one that
accepts connections and never answers, a token the server stops accepting, a create whose
read finds nothing, a transaction applied twice because its first answer was lost.
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rallypoint._core.net import free_ports
from rallypoint.rendezvous import KVConnectionError, KVStateError
from rallypoint.rendezvous._etcd.gateway import (
    GRPC_NOT_FOUND,
    GRPC_UNAUTHENTICATED,
    GRPC_UNAVAILABLE,
    GRPC_UNKNOWN,
    EtcdGateway,
    GatewayError,
)
from rallypoint.rendezvous._etcd.kv import _SET_IF_ABSENT_TRIES, EtcdKV, EtcdOptions

pytestmark = pytest.mark.timeout(60)


class Script:
    """What the fake etcd answers; shared by the server's handler threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unavailable = 0  # answer this many requests with 503 / UNAVAILABLE first
        self.streamed: list[dict[str, Any]] = []  # then these errors, streamed (200)
        self.deadline = 0  # then this many with 500 / UNKNOWN "context deadline exceeded"
        self.bad_request = False
        self.auth = False  # require the newest token
        self.tokens = 0  # tokens handed out
        self.requests: list[str] = []
        self.hasleader: list[str | None] = []

    def answer(self, path: str, headers: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.requests.append(path)
            self.hasleader.append(headers.get("Grpc-Metadata-Hasleader"))
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
            if self.streamed:
                return 200, {"error": self.streamed.pop(0)}
            if self.deadline > 0:
                self.deadline -= 1
                return 500, {"error": "context deadline exceeded", "code": GRPC_UNKNOWN}
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


def test_every_request_asks_for_a_member_with_a_leader(server: tuple[Script, int]) -> None:
    script, port = server
    gateway = EtcdGateway([("127.0.0.1", port)], timeout=10)
    gateway.post("/v3/kv/range", {})
    gateway.post("/v3/kv/put", {})
    assert script.hasleader == ["true", "true"]


def test_election_errors_are_retried(server: tuple[Script, int]) -> None:
    """What etcd answers during an election: "no leader" inside a streamed answer (lease
    keep-alive), "context deadline exceeded" (a write to a leaderless member)."""
    script, port = server
    no_leader = {"grpc_code": GRPC_UNAVAILABLE, "http_code": 503, "message": "no leader"}
    script.streamed = [no_leader, no_leader]
    script.deadline = 2
    gateway = EtcdGateway([("127.0.0.1", port)], timeout=10)
    assert gateway.post("/v3/lease/keepalive", {"ID": "1"})["echo"] == {"ID": "1"}
    assert len(script.requests) == 5


def test_a_streamed_error_that_retrying_cannot_cure_names_its_code(
    server: tuple[Script, int],
) -> None:
    script, port = server
    script.streamed = [
        {"grpc_code": GRPC_NOT_FOUND, "http_code": 404, "message": "requested lease not found"}
    ]
    gateway = EtcdGateway([("127.0.0.1", port)], timeout=10)
    with pytest.raises(GatewayError, match="404: requested lease not found") as info:
        gateway.post("/v3/lease/keepalive", {"ID": "1"})
    assert info.value.code == GRPC_NOT_FOUND
    assert len(script.requests) == 1


@pytest.fixture
def silent() -> Iterator[int]:
    """A port that accepts connections and never answers (a hung member)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield int(sock.getsockname()[1])
    sock.close()


def test_a_silent_member_costs_one_bounded_try(server: tuple[Script, int], silent: int) -> None:
    script, port = server
    # bounds far from what each check tells apart, for a loaded machine
    gateway = EtcdGateway(
        [("127.0.0.1", silent), ("127.0.0.1", port)], timeout=100, attempt_timeout=8
    )
    start = time.monotonic()
    gateway.post("/v3/kv/range", {})
    assert time.monotonic() - start < 50  # one try (8 s), not the request's 100 s
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:  # every thread now starts at the live member
        list(pool.map(lambda _: gateway.post("/v3/kv/range", {}), range(4)))
    assert time.monotonic() - start < 8  # none of them tried the silent one (8 s)
    assert script.requests == ["/v3/kv/range"] * 5


def test_a_slow_cluster_gets_longer_tries(silent: int) -> None:
    """When every member runs out of time, the next sweep waits longer (a slow etcd still
    answers), and the whole request stays within its timeout."""
    gateway = EtcdGateway([("127.0.0.1", silent)], timeout=5, attempt_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(KVConnectionError, match="within 5 s"):
        gateway.post("/v3/kv/range", {})
    assert 4.9 < time.monotonic() - start < 10  # its timeout (a loaded machine), not twice


def test_watch_on_a_silent_member_ends_with_its_slice(silent: int) -> None:
    gateway = EtcdGateway([("127.0.0.1", silent)], timeout=100, attempt_timeout=40)
    start = time.monotonic()
    assert gateway.watch_put("a2V5", timeout=0.5) is False
    assert time.monotonic() - start < 20  # its 0.5 s slice, not the 40 s try


def test_bad_attempt_timeout_is_rejected() -> None:
    with pytest.raises(ValueError, match="attempt_timeout"):
        EtcdGateway([("127.0.0.1", 1)], attempt_timeout=0)
    with pytest.raises(ValueError, match="request_timeout"):
        from datetime import timedelta

        EtcdOptions(endpoints=[("h", 1)], request_timeout=timedelta(0))


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
    """The first endpoint takes connections and hangs up on each, so its tries can be
    counted: the second request goes straight to the live one. (The live one's count is
    not the check: it is the same either way, and a try that runs out of its time on a
    loaded machine is sent again.)"""
    script, port = server
    hangs_up = socket.create_server(("127.0.0.1", 0))
    dead = hangs_up.getsockname()[1]
    tries: list[int] = []

    def hang_up() -> None:
        while True:
            try:
                conn, _ = hangs_up.accept()
            except OSError:
                return
            tries.append(1)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        gateway = EtcdGateway([("127.0.0.1", dead), ("127.0.0.1", port)], timeout=10)
        assert gateway.endpoint == f"http://127.0.0.1:{dead},http://127.0.0.1:{port}"
        gateway.post("/v3/kv/range", {})
        gateway.post("/v3/kv/range", {})  # straight to the live one now
    finally:
        hangs_up.close()
    assert len(tries) == 1
    assert len(script.requests) >= 2 and set(script.requests) == {"/v3/kv/range"}


def test_unreachable_endpoints_name_themselves() -> None:
    ports = free_ports(2)
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

    def watch_put(self, key: str, timeout: float, *, present: object = None) -> bool:
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


class Replaying:
    """A fake gateway over a dict that applies every transaction twice and answers the
    second time: what the real gateway does when a transaction's first answer is lost (a
    member killed mid-request, a try that ran out of time) and it sends it again."""

    endpoint = "fake://etcd"

    def __init__(self) -> None:
        self.data: dict[str, str] = {}  # base64 key -> base64 value

    def _range(self, key: str) -> dict[str, Any]:
        value = self.data.get(key)
        return {"kvs": [] if value is None else [{"key": key, "value": value}]}

    def _apply(self, body: dict[str, Any]) -> dict[str, Any]:
        holds = True
        for cmp in body.get("compare", []):
            value = self.data.get(cmp["key"])
            if cmp["target"] == "CREATE":
                holds = holds and value is None
            else:
                holds = holds and value == cmp["value"]
        ops = body["success"] if holds else body.get("failure", [])
        responses: list[dict[str, Any]] = []
        for op in ops:
            if "request_put" in op:
                self.data[op["request_put"]["key"]] = op["request_put"]["value"]
                responses.append({"response_put": {}})
            else:
                responses.append({"response_range": self._range(op["request_range"]["key"])})
        return {"succeeded": holds, "responses": responses}

    def post(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any:
        if path == "/v3/kv/range":
            return {"header": {"revision": "1"}, **self._range(body["key"])}
        assert path == "/v3/kv/txn", path
        self._apply(body)  # its answer is lost
        return self._apply(body)

    def watch_put(self, key: str, timeout: float, *, present: object = None) -> bool:
        raise AssertionError("not used")


def test_add_counts_once_when_its_transaction_is_applied_twice() -> None:
    gateway = Replaying()
    kv = EtcdKV(EtcdOptions(endpoints=[("fake", 1)], lease_ttl=0), gateway=gateway)
    assert kv.add("claim", 1) == 1  # the first to claim must learn that it was first
    assert kv.add("claim", 1) == 2
    assert kv.add("claim", 5) == 7
    assert kv.get("claim") == b"7"
    other = EtcdKV(EtcdOptions(endpoints=[("fake", 1)], lease_ttl=0), gateway=gateway)
    assert other.add("claim", 1) == 8  # another client's add is not mistaken for ours
    stored = {base64.b64decode(k) for k in gateway.data}
    assert sum(1 for k in stored if b".adds/" in k) == 2  # one marker per client and thread
