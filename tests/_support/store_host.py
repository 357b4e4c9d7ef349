"""A TCPStore server in a process of its own, for tests that need one to outlive agents.

A store server hosted by the test process itself runs a libuv thread that looks every
connecting client's address up (c10d formats peers with ``getnameinfo``), and a name
lookup holds glibc's resolver lock for a moment: a process the test forks meanwhile
(``rallypoint.launch``'s warm process, say) inherits that lock held and blocks in its first
lookup. Hosted here, the server's thread lives in another process. The process is forked
by the worker zygote when one is active (torch is imported there already), else it is a
new interpreter.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["store_host"]

_START_TIMEOUT = 60.0
_HOST_SCRIPT = (
    "import sys, torch.distributed as d; "
    "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
    "print(s.port, flush=True); sys.stdin.read()"
)


def _host(fds: list[int]) -> None:
    """In a process forked by the zygote: host the server, say its port, wait to be killed."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # re-exported at runtime

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.write(fds[0], f"{store.port}\n".encode())
    os.close(fds[0])
    while True:
        time.sleep(3600)


def _read_port(fd: int, what: str) -> int:
    ready, _, _ = select.select([fd], [], [], _START_TIMEOUT)
    line = os.read(fd, 64).decode().strip() if ready else ""
    if not line.isdigit():
        raise RuntimeError(f"{what} did not report its store's port within {_START_TIMEOUT:g} s")
    return int(line)


@contextlib.contextmanager
def store_host() -> Iterator[int]:
    """A ``TCPStore`` server on 127.0.0.1 in another process; yields its port, and ends
    the process (and so the server) when the block ends."""
    from rallypoint.testing import _workers

    zygote = _workers._ZYGOTE
    if zygote is None:
        with subprocess.Popen(
            [sys.executable, "-c", _HOST_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        ) as proc:
            try:
                assert proc.stdout is not None
                yield _read_port(proc.stdout.fileno(), "the store process")
            finally:
                proc.kill()
        return
    read, write = os.pipe()
    host: Any = None
    try:
        host = zygote.fork(_host, (), [1, 2, write])
        os.close(write)
        write = -1
        yield _read_port(read, "the store process")
    finally:
        if write >= 0:
            os.close(write)
        os.close(read)
        if host is not None:
            host.kill()
            host.join(10)
