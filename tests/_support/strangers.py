"""Strangers that hold a server's connections open: idle, never answering, each one
reopened the moment the server drops it (enough of them fill a cap of pending handshakes)."""

from __future__ import annotations

import selectors
import socket
import threading
from types import TracebackType


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
