"""The peer port of a running node's snapshot server, and a stranger that holds it open."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from types import TracebackType

import psutil


def snapshot_listeners(agent_pid: int, timeout: float = 30) -> list[tuple[str, int]]:
    """``(ip, port)`` of every TCP listener of the snapshot server under ``agent_pid`` (the
    process among its descendants that listens on ``rallypoint-snapshots-*/server.sock``)."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in psutil.Process(agent_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                unix = proc.net_connections(kind="unix")
                if any("rallypoint-snapshots-" in str(c.laddr) for c in unix):
                    tcp = proc.net_connections(kind="tcp")
                    found = [c.laddr for c in tcp if c.status == psutil.CONN_LISTEN]
                    if found:
                        return [(str(a.ip), int(a.port)) for a in found]
        assert time.monotonic() < deadline, "no snapshot server listens on TCP"
        time.sleep(0.1)


class Holder:
    """``count`` idle connections to each address, each one reopened as soon as the
    server drops it (enough of them can fill the server's handshake slots, and a
    replacement node's restore must still succeed)."""

    def __init__(self, addresses: list[tuple[str, int]], count: int = 64) -> None:
        self.addresses = [("127.0.0.1" if ip == "0.0.0.0" else ip, port) for ip, port in addresses]
        self.count = count
        self.opened = 0
        self.reopened = 0
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Holder:
        for address in self.addresses:
            for _ in range(self.count):
                self._open(address)
        self._thread.start()
        return self

    def _open(self, address: tuple[str, int]) -> None:
        try:
            sock = socket.create_connection(address, timeout=5)
        except OSError:
            return
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, address)
        self.opened += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    if sock.recv(4096):
                        continue  # the challenge: never answered
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._sel.unregister(sock)
                sock.close()
                self.reopened += 1
                self._open(key.data)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(10)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
