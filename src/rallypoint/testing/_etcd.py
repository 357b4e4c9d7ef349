"""A real etcd server for tests: free loopback ports, a temporary data dir, stop on exit.

``EtcdServer`` starts ``etcd`` (Debian's ``etcd-server`` package) as a single-member
cluster on 127.0.0.1, waits until ``/health`` answers, and can be stopped and started
again on the same ports and data dir (to test a restart mid-rendezvous).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from types import TracebackType

from rallypoint._net import free_port


def etcd_binary() -> str | None:
    """Path of the ``etcd`` binary, or ``None`` when it is not installed."""
    return shutil.which("etcd")


class EtcdServer:
    """One etcd member on 127.0.0.1 with its own data dir; a context manager."""

    def __init__(self, *, data_dir: str | None = None, extra_args: list[str] | None = None) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not on PATH (Debian: apt-get install etcd-server)")
        self._binary = binary
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="rallypoint-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self._extra = list(extra_args or [])
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = os.path.join(self.data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<client port>``."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def start(self, timeout: float = 20.0) -> None:
        """Start etcd and wait until it is healthy."""
        if self._proc is not None:
            raise RuntimeError("etcd is already running")
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self._binary,
            "--name", "rallypoint-test",
            "--data-dir", os.path.join(self.data_dir, "data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"rallypoint-test={peer}",
            "--initial-cluster-state", "new",
            "--log-level", "error",
            *self._extra,
        ]  # fmt: skip
        log = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if json.loads(resp.read()).get("health") in ("true", True):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd did not become healthy within {timeout} s: {self.log_tail()}")

    def stop(self) -> None:
        """Stop etcd (SIGTERM, then SIGKILL); the data dir stays for a restart."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def close(self) -> None:
        """Stop etcd and remove the data dir if this object created it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, size: int = 2000) -> str:
        try:
            with open(self._log_path, "rb") as f:
                return f.read()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> EtcdServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
