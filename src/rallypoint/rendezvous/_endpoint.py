"""Parsing of rendezvous endpoints and option strings (torch's rules and messages)."""

from __future__ import annotations

import functools
import ipaddress
import re
import socket


def parse_rendezvous_endpoint(endpoint: str | None, default_port: int) -> tuple[str, int]:
    """Split ``<host>[:<port>]`` (IPv6 in brackets) into host and port.

    Raises ``ValueError`` naming the endpoint when the port is not a number in
    [0, 65536) or the host is not a hostname/IPv4/IPv6 address.
    """
    if endpoint is not None:
        endpoint = endpoint.strip()
    if not endpoint:
        return ("localhost", default_port)
    rest: list[str]
    if endpoint[0] == "[" and endpoint[-1] == "]":
        host, rest = endpoint, []
    else:
        host, *rest = endpoint.rsplit(":", 1)
    if len(host) > 1 and host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
    if len(rest) == 1:
        port_str = rest[0]
        port = int(port_str) if re.match(r"^[0-9]{1,5}$", port_str) else None
        if port is None or port >= 2**16:
            raise ValueError(
                f"The port number of the rendezvous endpoint '{endpoint}' must be an integer "
                "between 0 and 65536."
            )
    else:
        port = default_port
    if not re.match(r"^[\w\.:-]+$", host):
        raise ValueError(
            f"The hostname of the rendezvous endpoint '{endpoint}' must be a dot-separated list of "
            "labels, an IPv4 address, or an IPv6 address."
        )
    return host, port


def parse_rendezvous_config(config_str: str) -> dict[str, str]:
    """Parse ``<key1>=<value1>,...,<keyN>=<valueN>`` (torchrun's ``--rdzv-conf``)."""
    config: dict[str, str] = {}
    config_str = config_str.strip()
    if not config_str:
        return config
    for item in config_str.split(","):
        key, *values = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ValueError(
                "The rendezvous configuration string must be in format "
                "<key1>=<value1>,...,<keyN>=<valueN>."
            )
        value = values[0].strip() if values else None
        if not value:
            raise ValueError(
                f"The rendezvous configuration option '{key}' must have a value specified."
            )
        config[key] = value
    return config


@functools.cache
def local_fqdn() -> str:
    """This machine's FQDN (cached: a slow resolver must not cost once per node)."""
    return socket.getfqdn()


def matches_machine_hostname(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, hostname, or one of its addresses)."""
    if host == "localhost":
        return True
    try:
        addr: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        addr = None
    if addr is not None and addr.is_loopback:
        return True
    this_host = socket.gethostname()
    if host == this_host:
        return True
    try:
        host_ips = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
        mine = socket.getaddrinfo(
            this_host, None, proto=socket.IPPROTO_TCP, flags=socket.AI_CANONNAME
        )
    except (OSError, UnicodeError):
        return False
    for info in mine:
        if info[3] and info[3] == host:
            return True
        if addr is not None and info[4][0] == str(addr):
            return True
        if info[4][0] in host_ips:
            return True
    return False
