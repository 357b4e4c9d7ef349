"""A real etcd server for tests: free loopback ports, a temporary data dir, stop on exit.

``EtcdServer`` starts ``etcd`` (Debian's ``etcd-server`` package) as a single-member
cluster on 127.0.0.1, waits until ``/health`` answers, and can be stopped and started
again on the same ports and data dir (to test a restart mid-rendezvous). Several members
forming one cluster (leader kills, cut links): ``_etcd_cluster.EtcdCluster``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Self

from rallypoint._core.closing import Closing
from rallypoint._core.net import free_ports


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files of a throwaway CA, a server cert for 127.0.0.1 and a client cert."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def make_tls_files(directory: str) -> TLSFiles:
    """Create a CA and certs with ``openssl`` (``FileNotFoundError`` if it is missing)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("openssl is not on PATH")

    def path(name: str) -> str:
        return os.path.join(directory, name)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
        "-keyout", path("ca.key"), "-out", path("ca.pem"))  # fmt: skip
    ext = path("san.cnf")
    with open(ext, "w") as f:
        f.write(
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
        )
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}",
            "-keyout", path(f"{who}.key"), "-out", path(f"{who}.csr"))  # fmt: skip
        run("x509", "-req", "-in", path(f"{who}.csr"), "-CA", path("ca.pem"),
            "-CAkey", path("ca.key"), "-CAcreateserial", "-days", "2",
            "-extfile", ext, "-out", path(f"{who}.pem"))  # fmt: skip
    return TLSFiles(
        ca=path("ca.pem"),
        server_cert=path("server.pem"),
        server_key=path("server.key"),
        client_cert=path("client.pem"),
        client_key=path("client.key"),
    )


def member_args(
    binary: str,
    *,
    name: str,
    data_dir: str,
    client_url: str,
    peer_url: str,
    initial_cluster: str,
    state: str,
    extra: list[str],
) -> list[str]:
    """The command line of one etcd member (``state``: ``new`` or ``existing``)."""
    return [
        binary,
        "--name", name,
        "--data-dir", data_dir,
        "--listen-client-urls", client_url,
        "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url,
        "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", initial_cluster,
        "--initial-cluster-state", state,
        "--log-level", "error",
        *extra,
    ]  # fmt: skip


def etcd_binary() -> str | None:
    """Path of the ``etcd`` binary, or ``None`` when it is not installed."""
    return shutil.which("etcd")


class EtcdServer(Closing):
    """One etcd member on 127.0.0.1 with its own data dir; a context manager."""

    def __init__(
        self,
        *,
        data_dir: str | None = None,
        extra_args: list[str] | None = None,
        tls: TLSFiles | None = None,
    ) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not on PATH (Debian: apt-get install etcd-server)")
        self._binary = binary
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="rallypoint-etcd-")
        self.client_port, self.peer_port = free_ports(2)
        self._extra = list(extra_args or [])
        self.tls = tls
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = os.path.join(self.data_dir, "etcd.log")

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:<client port>``."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint}"

    def start(self, timeout: float = 20.0) -> None:
        """Start etcd and wait until it is healthy."""
        if self._proc is not None:
            raise RuntimeError("etcd is already running")
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = member_args(
            self._binary,
            name="rallypoint-test",
            data_dir=os.path.join(self.data_dir, "data"),
            client_url=self.url,
            peer_url=peer,
            initial_cluster=f"rallypoint-test={peer}",
            state="new",
            extra=self._extra,
        )
        context: ssl.SSLContext | None = None
        if self.tls is not None:
            args += [
                "--cert-file", self.tls.server_cert,
                "--key-file", self.tls.server_key,
                "--trusted-ca-file", self.tls.ca,
                "--client-cert-auth",
            ]  # fmt: skip
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
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
                with urllib.request.urlopen(
                    self.url + "/health", timeout=1, context=context
                ) as resp:
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

    def __enter__(self) -> Self:
        self.start()
        return self
