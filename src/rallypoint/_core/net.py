"""Ports: a free one now, and whether an explicit one is free."""

from __future__ import annotations

import socket

__all__ = ["free_port", "port_is_free"]


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now.

    The port is only reserved until this function returns; callers that can bind port 0
    themselves (TCPStore can) should do that instead.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "0.0.0.0") -> bool:
    """Whether ``port`` can be bound on ``host`` (used to reject a busy explicit port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True
