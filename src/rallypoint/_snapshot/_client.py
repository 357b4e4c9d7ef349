"""A worker's connection to its node's snapshot server (``_server``), one request at a time.

The server answers ``begin``, ``open`` and ``fetch`` with a slot's memfd; the worker maps
it (a slot it already maps is recognised by its ``fid`` and not mapped again) and reads or
writes the snapshot's bytes directly in the server's memory.
"""

from __future__ import annotations

import errno
import mmap
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from rallypoint._snapshot._records import Key
from rallypoint._snapshot._wire import recv_local, send_local

__all__ = ["MapError", "NodeClient", "ServerError", "SlotBuffer"]


class ServerError(RuntimeError):
    """The node's snapshot server refused a request or went away."""


class MapError(ServerError):
    """This worker cannot map a slot the server gave it (out of memory, address space)."""


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE: the pages are mapped now, in one go, not faulted one by one
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    try:
        return mmap.mmap(fd, size, flags=flags)
    except OSError as exc:
        what = "out of memory" if exc.errno == errno.ENOMEM else exc.strerror or str(exc)
        raise MapError(
            f"cannot map a snapshot slot of {size / 2**20:.1f} MiB in this worker ({what}, "
            f"{errno.errorcode.get(exc.errno or 0, exc.errno)}): leave the node more memory "
            "(or address space: ulimit -v) for a copy of the state"
        ) from exc


@dataclass(slots=True)
class SlotBuffer:
    """A mapped slot: ``base`` is a flat ``uint8`` tensor over its bytes."""

    index: int
    fid: int
    nbytes: int
    mm: mmap.mmap
    base: torch.Tensor

    @property
    def view(self) -> memoryview:
        return memoryview(self.mm)


class NodeClient:
    def __init__(
        self, path: str, secret: bytes, timeout: float, *, host: str = "127.0.0.1"
    ) -> None:
        """``host``: the address the server listens on for other nodes (``port``)."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
            reply, _ = self._call({"op": "hello", "secret": secret.hex(), "host": host})
        except BaseException:  # Ctrl-C too: the socket is closed
            self.sock.close()
            raise
        self.port = int(reply["port"])
        self.server_pid = int(reply["pid"])
        self._maps: dict[int, SlotBuffer] = {}

    def close(self) -> None:
        self._maps.clear()
        self.sock.close()

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            send_local(self.sock, msg)
        except OSError as exc:
            raise ServerError(f"lost the node's snapshot server: {exc}") from exc

    def _recv(self) -> tuple[dict[str, Any], int]:
        try:
            reply, fds = recv_local(self.sock)
        except OSError as exc:
            raise ServerError(f"lost the node's snapshot server: {exc}") from exc
        if reply is None:
            raise ServerError("the node's snapshot server closed the connection")
        fd = fds[0] if fds else -1
        for extra in fds[1:]:
            os.close(extra)
        if reply.get("ok") is not True:
            if fd >= 0:
                os.close(fd)
            raise ServerError(str(reply.get("error", "refused")))
        return reply, fd

    def _call(self, msg: dict[str, Any]) -> tuple[dict[str, Any], int]:
        self._send(msg)
        return self._recv()

    def _mapped(self, reply: dict[str, Any], fd: int) -> SlotBuffer:
        try:
            index, fid = int(reply["slot"]), int(reply["fid"])
            cached = self._maps.get(index)
            if cached is None or cached.fid != fid:
                mm = _map(fd, int(reply["size"]))
                base = torch.frombuffer(mm, dtype=torch.uint8)
                cached = self._maps[index] = SlotBuffer(index, fid, 0, mm, base)
            cached.nbytes = int(reply["nbytes"])
            return cached
        finally:
            os.close(fd)

    @staticmethod
    def _where(rank: int, world: int, key: Key) -> dict[str, Any]:
        return {"rank": rank, "world": world, "gen": key[0], "step": key[1]}

    # ------------------------------------------------------------------ saving
    def begin(self, rank: int, world: int, key: Key, nbytes: int, keep: Key | None) -> SlotBuffer:
        msg = {"op": "begin", **self._where(rank, world, key), "nbytes": nbytes}
        msg["keep"] = list(keep) if keep else None
        return self._mapped(*self._call(msg))

    def commit(
        self, rank: int, world: int, key: Key, index: int, keep: Key | None, replica: str | None
    ) -> None:
        """Send the commit; the answer (after replication) is :meth:`commit_reply`'s."""
        msg = {"op": "commit", **self._where(rank, world, key), "slot": index}
        msg.update(keep=list(keep) if keep else None, replica=replica)
        self._send(msg)

    def commit_reply(self) -> dict[str, Any]:
        return self._recv()[0]

    # ------------------------------------------------------------------ restoring
    def inventory(self) -> dict[str, Any]:
        return self._call({"op": "inventory"})[0]

    def open(self, rank: int, world: int, key: Key) -> SlotBuffer:
        return self._mapped(*self._call({"op": "open", **self._where(rank, world, key)}))

    def fetch(self, rank: int, world: int, key: Key, source: str) -> SlotBuffer:
        msg = {"op": "fetch", **self._where(rank, world, key), "source": source}
        return self._mapped(*self._call(msg))

    def prune(self, world: int, ranks: list[int]) -> None:
        self._call({"op": "prune", "world": world, "ranks": ranks})

    def restored(self, rank: int, world: int, key: Key) -> None:
        self._call({"op": "restored", **self._where(rank, world, key)})
