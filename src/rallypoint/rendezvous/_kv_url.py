"""A :class:`KeyValueStore` named by one address, for parts that share a store by URL.

- ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` (``etcds://`` for TLS): an etcd v3 cluster;
  no process of ours holds the data, so none can be lost;
- ``HOST:PORT``, ``tcp://HOST:PORT`` or ``http://HOST:PORT`` (torchft's lighthouse form):
  a c10d TCPStore, hosted there (``host=True`` makes this process its server).

Errors: ``ValueError`` for an address that names neither, :class:`KVConnectionError`
naming the address when the store cannot be reached.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from rallypoint.rendezvous._endpoint import parse_rendezvous_endpoint
from rallypoint.rendezvous._kv_c10d import tcp_kv

if TYPE_CHECKING:
    from rallypoint._core.torch_c import TCPStore
    from rallypoint.rendezvous._kv import KeyValueStore

__all__ = ["connect_kv", "is_etcd_address"]

_ETCD = ("etcd://", "etcds://")


def is_etcd_address(address: str) -> bool:
    return address.strip().lower().startswith(_ETCD)


def connect_kv(
    address: str, *, timeout: timedelta, host: bool = False
) -> tuple[KeyValueStore, TCPStore | None]:
    """The store at ``address`` and, when ``host`` (TCPStore only), the server this process
    now runs (keep it referenced: the store lives as long as it)."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"a store address is HOST:PORT or etcd://HOST:PORT, got {address!r}")
    text = address.strip()
    if is_etcd_address(text):
        if host:
            raise ValueError(f"{address}: an etcd cluster is not hosted by rallypoint")
        return _etcd(text, timeout), None
    for scheme in ("tcp://", "http://", "https://"):
        if text.lower().startswith(scheme):
            text = text[len(scheme) :]
    text = text.rstrip("/")
    if "/" in text:
        raise ValueError(f"{address}: a TCPStore address is HOST:PORT, without a path")
    hostname, port = parse_rendezvous_endpoint(text, default_port=-1)
    if port < 0:
        raise ValueError(f"{address}: the address needs a port (HOST:PORT)")
    return tcp_kv(hostname, port, is_server=host, timeout=timeout)


def _etcd(text: str, timeout: timedelta) -> KeyValueStore:
    from rallypoint.rendezvous._etcd.kv import DEFAULT_PORT, EtcdKV, EtcdOptions

    tls = text.lower().startswith("etcds://")
    rest = text.split("://", 1)[1]
    hosts_part, _, prefix = rest.partition("/")
    endpoints = [
        parse_rendezvous_endpoint(item.strip(), default_port=DEFAULT_PORT)
        for item in hosts_part.split(",")
        if item.strip()
    ]
    if not endpoints:
        raise ValueError(f"{text}: name at least one etcd member (etcd://HOST:PORT)")
    prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/rallypoint/"
    # no lease: what a member writes (a round's quorum) outlives it
    options = EtcdOptions(endpoints=endpoints, prefix=prefix, tls=tls, timeout=timeout, lease_ttl=0)
    return EtcdKV(options)
