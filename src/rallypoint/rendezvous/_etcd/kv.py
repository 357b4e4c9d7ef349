"""The key-value interface over etcd v3 (the HTTP side is ``gateway``).

The same code talks to etcd 3.4 through 3.6 (torch's etcd backends use the v2 API, which
3.6 removed). Atomic operations are transactions comparing the key's revision or value;
``wait`` watches from the next revision (a server push, no polling). Every key carries the
job's lease, kept alive by every live node, so a job's keys expire once all its nodes are
gone. Requests are retried across the endpoints until ``timeout``. A retried request may
have been applied already: every operation is idempotent but ``add``, whose transaction
also writes a nonce under this client's marker key so that a retry finds it and does not
add twice. TLS and user/password auth are supported.
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

from rallypoint.rendezvous._config import seconds_option
from rallypoint.rendezvous._endpoint import parse_rendezvous_endpoint
from rallypoint.rendezvous._etcd.gateway import (
    ATTEMPT_TIMEOUT,
    GRPC_NOT_FOUND,
    WATCH_SLICE,
    EtcdGateway,
    GatewayError,
    WatchBroken,
)
from rallypoint.rendezvous._kv import KeyValueStore, KVConnectionError, KVError, KVStateError

if TYPE_CHECKING:
    from rallypoint._core.torch_c import TorchStore
    from rallypoint.rendezvous._api import RendezvousParameters

DEFAULT_PORT = 2379
_MAX_TXN_OPS = 100  # etcd's default --max-txn-ops is 128
_SET_IF_ABSENT_TRIES = 8


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def _range_value(txn: dict[str, Any], index: int) -> bytes | None:
    """The value read by the ``index``-th ``request_range`` of a transaction's answer."""
    responses = txn.get("responses") or []
    if index >= len(responses):
        return None
    kvs = responses[index].get("response_range", {}).get("kvs") or []
    return _unb64(kvs[0].get("value", "")) if kvs else None


def _prefix_end(prefix: bytes) -> bytes:
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\x00"
    end[-1] += 1
    return bytes(end)


@dataclass(kw_only=True, slots=True)
class EtcdOptions:
    """How to reach etcd."""

    endpoints: list[tuple[str, int]]
    prefix: str = "/rallypoint/"
    tls: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    username: str | None = None
    password: str | None = None
    lease_ttl: int = 60
    timeout: timedelta = timedelta(seconds=60)
    request_timeout: timedelta = timedelta(seconds=ATTEMPT_TIMEOUT)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("etcd needs at least one endpoint (host:port).")
        if (self.username is None) != (self.password is None):
            raise ValueError("etcd auth needs both 'username' and 'password'.")
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd client TLS needs both 'cert' and 'key'.")
        if self.lease_ttl < 0:
            raise ValueError(f"lease_ttl ({self.lease_ttl}) must be >= 0 (0 disables leases).")
        if self.request_timeout <= timedelta(0):
            raise ValueError(f"request_timeout ({self.request_timeout}) must be positive.")


class Gateway(Protocol):
    """What :class:`EtcdKV` needs from its transport (:class:`EtcdGateway`, or a fake)."""

    endpoint: str

    def post(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any: ...

    def watch_put(
        self, key: str, timeout: float, *, present: Callable[[], bool] | None = None
    ) -> bool: ...


def gateway_for(options: EtcdOptions) -> EtcdGateway:
    """The gateway client that ``options`` describe."""
    context: ssl.SSLContext | None = None
    if options.tls:
        context = ssl.create_default_context(cafile=options.cacert)
        if options.cert and options.key:
            context.load_cert_chain(options.cert, options.key)
    return EtcdGateway(
        options.endpoints,
        ssl_context=context,
        username=options.username,
        password=options.password,
        timeout=options.timeout.total_seconds(),
        attempt_timeout=options.request_timeout.total_seconds(),
    )


class EtcdKV(KeyValueStore):
    """:class:`KeyValueStore` over etcd v3 (thread-safe: the gateway keeps one HTTP
    connection per thread). ``gateway`` replaces the HTTP client (tests pass a fake)."""

    def __init__(self, options: EtcdOptions, *, gateway: Gateway | None = None) -> None:
        self._opts = options
        self._prefix = options.prefix.encode()
        self._gateway = gateway_for(options) if gateway is None else gateway
        self.endpoint = self._gateway.endpoint
        self._lock = threading.Lock()
        self._lease: int | None = None
        self._keepalive: threading.Thread | None = None
        self._closed = threading.Event()
        self._client = os.urandom(6).hex()  # names this client's add markers

    def _post(self, path: str, body: dict[str, Any], *, timeout: float | None = None) -> Any:
        return self._gateway.post(path, body, timeout=timeout)

    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    # ------------------------------------------------------------------ lease

    def _lease_id(self) -> int | None:
        if self._opts.lease_ttl == 0:
            return None
        with self._lock:
            if self._lease is None:
                self._lease = self._acquire_lease()
                if self._keepalive is None:
                    self._keepalive = threading.Thread(
                        target=_keep_alive,
                        args=(weakref.ref(self), self._closed, max(0.5, self._opts.lease_ttl / 3)),
                        name="rallypoint-etcd-lease",
                        daemon=True,
                    )
                    self._keepalive.start()
            return self._lease

    def _acquire_lease(self) -> int:
        """The run's shared lease: reuse the one under ``<prefix>lease`` if it is alive."""
        lease_key = _b64(self._prefix + b"lease")
        for _ in range(5):
            data = self._post("/v3/kv/range", {"key": lease_key})
            kvs = data.get("kvs") or []
            if kvs:
                lease = int(_unb64(kvs[0]["value"]))
                ttl = self._post("/v3/lease/timetolive", {"ID": str(lease)})
                if int(ttl.get("TTL", -1)) > 0:
                    return lease
                self._post("/v3/kv/deleterange", {"key": lease_key})
            granted = int(self._post("/v3/lease/grant", {"TTL": self._opts.lease_ttl})["ID"])
            txn = self._post(
                "/v3/kv/txn",
                {
                    "compare": [{"key": lease_key, "target": "CREATE", "create_revision": "0"}],
                    "success": [
                        {
                            "request_put": {
                                "key": lease_key,
                                "value": _b64(str(granted)),
                                "lease": str(granted),
                            }
                        }
                    ],
                    "failure": [{"request_range": {"key": lease_key}}],
                },
            )
            if txn.get("succeeded") or _range_value(txn, 0) == str(granted).encode():
                return granted  # (the second: an earlier try of this txn went through)
            self._post("/v3/lease/revoke", {"ID": str(granted)})
        raise KVConnectionError(f"Cannot agree on a lease for {self._opts.prefix!r} at etcd")

    def _renew(self, interval: float) -> None:
        """Renew the lease once (through whichever member answers: a member loss or an
        election costs a retried keep-alive, well within the TTL); a lease that expired
        anyway (etcd away for longer than the TTL) is replaced."""
        lease = self._lease
        if lease is None:
            return
        try:
            try:
                data = self._post("/v3/lease/keepalive", {"ID": str(lease)}, timeout=interval)
                expired = int(data.get("result", data).get("TTL", 0)) <= 0
            except GatewayError as exc:
                if exc.code != GRPC_NOT_FOUND:
                    raise
                expired = True  # "requested lease not found"
            if expired:
                with self._lock:
                    self._lease = self._acquire_lease()
        except KVError:
            pass  # etcd unreachable for now; the next interval retries

    def _put(self, key: bytes, value: bytes) -> dict[str, Any]:
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        lease = self._lease_id()
        if lease is not None:
            put["lease"] = str(lease)
        return put

    # ------------------------------------------------------------------ KV API

    def set(self, key: str, value: bytes) -> None:
        self._post("/v3/kv/put", self._put(self._key(key), value))

    def _range(self, key: bytes) -> tuple[bytes | None, int]:
        data = self._post("/v3/kv/range", {"key": _b64(key)})
        kvs = data.get("kvs") or []
        revision = int(data.get("header", {}).get("revision", 0))
        if not kvs:
            return None, revision
        return _unb64(kvs[0].get("value", "")), revision

    def get(self, key: str) -> bytes | None:
        return self._range(self._key(key))[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for start in range(0, len(keys), _MAX_TXN_OPS):
            chunk = keys[start : start + _MAX_TXN_OPS]
            ops = [{"request_range": {"key": _b64(self._key(k))}} for k in chunk]
            data = self._post("/v3/kv/txn", {"success": ops})
            for resp in data.get("responses", []):
                kvs = resp.get("response_range", {}).get("kvs") or []
                out.append(_unb64(kvs[0].get("value", "")) if kvs else None)
        return out

    def multi_set(self, items: Sequence[tuple[str, bytes]]) -> None:
        for start in range(0, len(items), _MAX_TXN_OPS):
            chunk = items[start : start + _MAX_TXN_OPS]
            ops = [{"request_put": self._put(self._key(k), v)} for k, v in chunk]
            self._post("/v3/kv/txn", {"success": ops})

    def _cas(
        self,
        key: bytes,
        compare: dict[str, Any],
        value: bytes,
        marker: tuple[bytes, bytes] | None = None,
    ) -> tuple[bool, bytes | None]:
        """Put ``value`` if ``compare`` holds; return (succeeded, value now stored).

        ``marker`` (key, nonce): also put the nonce there on success, and on failure count
        it as a success if the marker already holds the nonce (a retried try whose first
        send went through)."""
        success = [{"request_put": self._put(key, value)}]
        failure = [{"request_range": {"key": _b64(key)}}]
        if marker is not None:
            success.append({"request_put": self._put(*marker)})
            failure.append({"request_range": {"key": _b64(marker[0])}})
        data = self._post(
            "/v3/kv/txn",
            {"compare": [{"key": _b64(key), **compare}], "success": success, "failure": failure},
        )
        if data.get("succeeded"):
            return True, value
        if marker is not None and _range_value(data, 1) == marker[1]:
            return True, value
        return False, _range_value(data, 0)

    def _marker(self) -> bytes:
        """This client's (and thread's) add marker key."""
        return self._prefix + f".adds/{self._client}-{threading.get_ident()}".encode()

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        marker = self._marker()
        current, _ = self._range(full)
        for attempt in range(10_000):
            nonce = os.urandom(8).hex().encode()
            if current is None:
                new = amount
                compare: dict[str, Any] = {"target": "CREATE", "create_revision": "0"}
            else:
                try:
                    new = int(current) + amount
                except ValueError:
                    raise KVStateError(
                        f"The key {key!r} in etcd at {self.endpoint} holds {current[:40]!r}, "
                        "not an integer counter."
                    ) from None
                compare = {"target": "VALUE", "value": _b64(current)}
            ok, current = self._cas(full, compare, b"%d" % new, (marker, nonce))
            if ok:
                return new
            if attempt > 2:
                time.sleep(random.uniform(0, min(0.05, 0.001 * attempt)))
        raise KVConnectionError(f"add on {key!r} kept losing races at etcd {self.endpoint}")

    def enroll(self, counter: str, member: str) -> int:
        """Contention-free arrival number: put ``<counter>/<member>-<nonce>`` and count the
        keys under ``<counter>/`` as of that put's revision (etcd revisions are totally
        ordered, so the numbers are unique and dense). A range's ``count`` ignores
        ``max_create_revision``, hence the read at a past revision."""
        full = self._key(f"{counter}/{member}-{os.urandom(4).hex()}")
        answer = self._post("/v3/kv/put", {**self._put(full, b"1"), "prev_kv": True})
        previous = answer.get("prev_kv")
        if previous:  # our first put landed but its answer was lost: keep its revision
            revision = int(previous["create_revision"])
        else:
            revision = int(answer["header"]["revision"])
        start = self._key(counter + "/")
        span = {"key": _b64(start), "range_end": _b64(_prefix_end(start))}
        try:  # the count as of our revision: one small answer
            data = self._post("/v3/kv/range", {**span, "count_only": True, "revision": revision})
            return int(data.get("count", 0))
        except GatewayError:  # that revision was compacted: filter the keys instead
            data = self._post(
                "/v3/kv/range",
                {**span, "keys_only": True, "max_create_revision": str(revision)},
            )
            return len(data.get("kvs") or [])

    def enrolled(self, counter: str) -> int:
        return self.count_prefix(counter + "/")

    def set_if_absent(self, key: str, value: bytes) -> bytes:
        if not value:
            raise ValueError("set_if_absent needs a non-empty value")
        full = self._key(key)
        for _ in range(_SET_IF_ABSENT_TRIES):
            _, stored = self._cas(full, {"target": "CREATE", "create_revision": "0"}, value)
            if stored is not None:
                return stored
            # the create failed, so the key existed, yet the read found none: it is gone
            # again (deleted, or its lease expired); try to create it once more
        raise KVStateError(
            f"set_if_absent on {key!r} at etcd {self.endpoint}: the key existed but could "
            f"not be read, {_SET_IF_ABSENT_TRIES} times in a row"
        )

    def compare_and_swap(self, key: str, expected: bytes, desired: bytes) -> bytes:
        full = self._key(key)
        if not expected:
            _, stored = self._cas(full, {"target": "CREATE", "create_revision": "0"}, desired)
            return desired if stored is None else stored
        _, stored = self._cas(full, {"target": "VALUE", "value": _b64(expected)}, desired)
        return expected if stored is None else stored

    def wait(self, keys: Sequence[str], timeout: timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        present = self.multi_get(keys) if len(keys) > 1 else [self.get(k) for k in keys]
        missing = [k for k, v in zip(keys, present, strict=True) if v is None]
        return all(self._wait_one(self._key(key), deadline) for key in missing)

    def _wait_one(self, key: bytes, deadline: float) -> bool:
        """Until ``key``, found missing, is written: watch it from now for at most a slice
        (a silent member holds a watch without a word) and read it once the watch is made.
        No put is missed, and none waits for etcd's catch-up of watches that start in the
        past (:meth:`EtcdGateway.watch_put`)."""
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                if self._gateway.watch_put(
                    _b64(key),
                    min(remaining, WATCH_SLICE),
                    present=lambda: self._range(key)[0] is not None,
                ):
                    return True
            except WatchBroken:
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return self._range(key)[0] is not None

    def delete(self, key: str) -> bool:
        data = self._post("/v3/kv/deleterange", {"key": _b64(self._key(key))})
        return int(data.get("deleted", 0)) > 0

    def delete_many(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), _MAX_TXN_OPS):
            chunk = keys[start : start + _MAX_TXN_OPS]
            ops = [{"request_delete_range": {"key": _b64(self._key(k))}} for k in chunk]
            self._post("/v3/kv/txn", {"success": ops})

    def count_prefix(self, prefix: str) -> int:
        start = self._key(prefix)
        data = self._post(
            "/v3/kv/range",
            {"key": _b64(start), "range_end": _b64(_prefix_end(start)), "count_only": True},
        )
        return int(data.get("count", 0))

    def compact(self, keep: int = 10_000) -> None:
        revision = self._range(self._key("compact"))[1] - keep
        if revision > 1:  # best effort (another caller may have compacted past it)
            with contextlib.suppress(GatewayError):
                self._post("/v3/kv/compaction", {"revision": str(revision)})

    def clone(self) -> EtcdKV:
        return self  # connections are per thread already

    def torch_store(self, prefix: str) -> TorchStore:
        from rallypoint.rendezvous._kv_store import KVTorchStore

        return KVTorchStore(self, prefix)

    def close(self) -> None:
        self._closed.set()


def _keep_alive(kv_ref: weakref.ref[EtcdKV], closed: threading.Event, interval: float) -> None:
    """Renew a KV's lease every ``interval`` (``lease_ttl / 3``) s until it is closed or
    dropped: the thread holds the KV only while renewing, so a KV nobody holds any more
    (a handler dropped without ``shutdown()``) stops renewing, and its lease expires as a
    dead node's would, instead of a thread keeping it alive for the life of the process."""
    while not closed.wait(interval):
        kv = kv_ref()
        if kv is None:
            return
        kv._renew(interval)
        del kv


def _split_endpoints(endpoint: str) -> tuple[list[tuple[str, int]], bool | None]:
    hosts: list[tuple[str, int]] = []
    tls: bool | None = None
    for item in endpoint.split(","):
        item = item.strip()
        if not item:
            continue
        for scheme, is_tls in (("https://", True), ("http://", False)):
            if item.startswith(scheme):
                item, tls = item[len(scheme) :], is_tls
        hosts.append(parse_rendezvous_endpoint(item.rstrip("/"), default_port=DEFAULT_PORT))
    return hosts, tls


def etcd_kv_from_params(params: RendezvousParameters) -> EtcdKV:
    """Build an :class:`EtcdKV` from rendezvous parameters.

    ``endpoint``: ``host[:port]`` or a comma-separated list (``http://``/``https://``
    allowed). Options: ``protocol`` (``http``/``https``), ``cacert``, ``cert``, ``key``,
    ``username``, ``password``, ``key_prefix`` (``/rallypoint/``), ``lease_ttl`` (60 s, 0
    disables), ``read_timeout`` (60 s: how long a request retries an unreachable etcd),
    ``request_timeout`` (2 s: how long one try at one member may take before the next).
    """
    if not params.endpoint or not params.endpoint.strip():
        raise ValueError("The etcd rendezvous backend needs an endpoint: host[:port][,...].")
    hosts, tls = _split_endpoints(params.endpoint)
    protocol = str(params.get("protocol", "https" if tls else "http")).strip().lower()
    if protocol not in ("http", "https"):
        raise ValueError(
            f"The rendezvous configuration option 'protocol' must be 'http' or 'https', "
            f"got {protocol!r}."
        )
    ttl = params.get_as_int("lease_ttl", 60)
    timeout = seconds_option(params, "read_timeout", 60.0)
    attempt = seconds_option(params, "request_timeout", ATTEMPT_TIMEOUT)
    assert ttl is not None and timeout is not None and attempt is not None
    prefix = str(params.get("key_prefix", "/rallypoint/"))
    if not prefix.endswith("/"):
        prefix += "/"
    return EtcdKV(
        EtcdOptions(
            endpoints=hosts,
            prefix=prefix,
            tls=protocol == "https",
            cacert=params.get("cacert"),
            cert=params.get("cert"),
            key=params.get("key"),
            username=params.get("username", params.get("user")),
            password=params.get("password"),
            lease_ttl=ttl,
            timeout=timeout,
            request_timeout=attempt,
        )
    )
