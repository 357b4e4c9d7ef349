"""Several "hosts" on one machine, for multi-node tests: Linux network namespaces.

:class:`Network` creates one namespace per host, bridged together, each with an address
in 198.18.0.0/15 (reserved for benchmarking, so it never collides with a real network), a
hostname and an ``/etc/hosts`` that resolves every host's name, so code that advertises
``socket.getfqdn()`` works across hosts as on real machines. Nothing is created in the
machine's own namespace, and cleanup is guaranteed (context manager, ``atexit``, and the
next :class:`Network` removes what a killed test process left). Needs root and iproute2:
:func:`netns_available` says whether this machine can, and why not. Errors:
:class:`NetnsError` (a ``RuntimeError``) when an ``ip`` command fails, with the command and
its stderr; ``ValueError`` for bad arguments.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from rallypoint._core.checks import check_int
from rallypoint._core.closing import Closing
from rallypoint._core.procs import pid_alive

__all__ = ["Host", "NetnsError", "Network", "netns_available", "remove_stale_namespaces"]

SUBNET = "198.18.0.0/24"
"""Where host addresses come from (``198.18.0.1`` is host 0); inside 198.18.0.0/15."""
MAX_HOSTS = 250
_NAME = re.compile(r"^rpn(?P<pid>\d+)-[0-9a-f]{4}-(?:h\d+|br)$")
_ETC_NETNS = "/etc/netns"
_NETNS_DIR = "/run/netns"  # where ``ip netns add`` mounts a namespace
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message has the command and its stderr."""


def _ip() -> str:
    path = shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.access(p, os.X_OK)), None
    )
    if path is None:
        raise NetnsError("iproute2's 'ip' command is not installed (apt-get install iproute2)")
    return path


def _run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [_ip(), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def _enter_netns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _list_namespaces() -> list[str]:
    out = _run_ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces left by :class:`Network` in processes that no longer exist."""
    removed = []
    for name in _list_namespaces():
        m = _NAME.match(name)
        if m is None or pid_alive(int(m.group("pid"))):
            continue
        if _run_ip("netns", "delete", name, check=False).returncode == 0:
            removed.append(name)
    with contextlib.suppress(OSError):
        for name in os.listdir(_ETC_NETNS):
            m = _NAME.match(name)
            if m is not None and not pid_alive(int(m.group("pid"))):
                shutil.rmtree(os.path.join(_ETC_NETNS, name), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(_ETC_NETNS)  # only if empty: it may hold other tools' files
    return removed


@functools.cache
def netns_available() -> tuple[bool, str]:
    """``(True, "")`` if namespaces, veth pairs and bridges can be made here, else
    ``(False, reason)``. Tries it once per process."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root (CAP_SYS_ADMIN); run the tests as root"
    try:
        _ip()
    except NetnsError as exc:
        return False, str(exc)
    try:
        with Network(1):
            pass
    except (NetnsError, OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot create network namespaces here: {exc}"
    return True, ""


class Host:
    """One namespace of a :class:`Network`: ``name``, ``address`` and ``eth0``."""

    def __init__(self, network: Network, index: int) -> None:
        self.network = network
        self.index = index
        self.name = f"{network.prefix}-h{index}"
        self.address = f"198.18.0.{index + 1}"
        self.port_name = f"v{index}"  # the bridge's end of this host's link
        self.hostname = f"h{index}"
        self._cut = False

    def __repr__(self) -> str:
        return f"Host({self.name!r}, {self.address!r}{', cut' if self._cut else ''})"

    @property
    def is_cut(self) -> bool:
        return self._cut

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed to run inside this host (``ip netns exec NAME ...``)."""
        if isinstance(cmd, str) or not cmd:
            raise ValueError("cmd must be a non-empty list of arguments, not a string")
        prefix = [_ip(), "netns", "exec", self.name]
        unshare, hostname, sh = (shutil.which(p) for p in ("unshare", "hostname", "sh"))
        if unshare and hostname and sh:  # own hostname; sh and hostname exec, pid unchanged
            prefix += [unshare, "--uts", "--", sh, "-c", f'{hostname} "$0" && exec "$@"']
            prefix.append(self.hostname)
        return [*prefix, *cmd]

    def popen(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``cmd`` inside this host (same pid: ``ip netns exec`` execs it).

        ``env`` replaces the environment as in :class:`subprocess.Popen`. The process is
        killed when the network closes, if it still runs.
        """
        self.network._require_open()
        proc = subprocess.Popen(
            self.command(cmd), env=dict(env) if env is not None else None, **kwargs
        )
        self.network._track(proc)
        return proc

    def run(
        self, cmd: Sequence[str], *, timeout: float = 30.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``cmd`` inside this host to completion (``subprocess.run`` arguments)."""
        self.network._require_open()
        return subprocess.run(self.command(cmd), timeout=timeout, check=False, **kwargs)

    def call(self, fn: Callable[[], T], *, timeout: float = 30.0) -> T:
        """Run ``fn()`` in a new thread of this process that has entered this host's
        network namespace (``setns``: the namespace is per thread), and return its result:
        a socket call into a fake host without starting a process. Name lookups still see
        the machine's ``/etc/hosts``: use addresses."""
        self.network._require_open()
        result: list[T] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                _enter_netns(f"{_NETNS_DIR}/{self.name}")
                result.append(fn())
            except BaseException as exc:  # SystemExit too: handed to the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=run, name=f"netns-{self.hostname}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{fn!r} did not return within {timeout} s inside {self.name}")
        if failure:
            raise failure[0]
        return result[0]

    def cut(self) -> None:
        """Drop this host's link: its packets are lost, connections time out (no reset)."""
        self.network._require_open()
        _run_ip("-n", self.network.bridge_ns, "link", "set", self.port_name, "down")
        self._cut = True

    def throttle(self, rate: str) -> None:
        """Slow this host's link both ways to ``rate`` (``"40mbit"``) with a token bucket
        (``tc qdisc ... tbf``) on each end: a bad cable or a flapping NIC."""
        self.network._require_open()
        tbf = ["root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"]
        tc = shutil.which("tc") or "tc"
        for ns, dev in ((self.network.bridge_ns, self.port_name), (self.name, "eth0")):
            proc = subprocess.run(
                [_ip(), "netns", "exec", ns, tc, "qdisc", "replace", "dev", dev, *tbf],
                capture_output=True,
                text=True,
                timeout=10,
            )
            if proc.returncode != 0:
                raise NetnsError(f"tc tbf on {ns}/{dev}: {proc.stderr.strip()}")

    def restore(self) -> None:
        """Bring the link back after :meth:`cut`."""
        self.network._require_open()
        _run_ip("-n", self.network.bridge_ns, "link", "set", self.port_name, "up")
        self._cut = False


class Network(Closing):
    """``nhosts`` namespaces on one bridge. Use as a context manager, or call :meth:`close`.

    Host ``i`` is named ``h<i>``, has a veth pair ``eth0`` to the bridge and the address
    ``198.18.0.<i+1>/24``; its ``/etc/hosts`` is ``/etc/netns/<ns>/hosts``, which ``ip netns
    exec`` mounts over ``/etc/hosts``. Processes started with :meth:`Host.popen` are killed
    on close. ::

        with Network(3) as net:
            server = net.hosts[0].popen([sys.executable, "server.py"])
            net.hosts[2].cut()       # host 2 loses its link (packets dropped, no RST)
            net.hosts[2].restore()
            net.hosts[1].call(lambda: socket.create_connection(("198.18.0.1", 80)).close())

    In a test module, skip where namespaces cannot be made::

        ok, why = netns_available()
        pytestmark = pytest.mark.skipif(not ok, reason=why)
    """

    def __init__(self, nhosts: int, *, prefix: str | None = None) -> None:
        if not 1 <= check_int(nhosts, "nhosts") <= MAX_HOSTS:
            raise ValueError(f"nhosts must be between 1 and {MAX_HOSTS}, got {nhosts}")
        if prefix is None:
            prefix = f"rpn{os.getpid()}-{secrets.token_hex(2)}"
        elif not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}", prefix):
            raise ValueError(
                f"prefix {prefix!r} must be 1-40 letters, digits, '_', '.' or '-' "
                "and start with a letter or digit"
            )
        self.prefix = prefix
        self.bridge_ns = f"{prefix}-br"
        self.hosts = [Host(self, i) for i in range(nhosts)]
        self._created: list[str] = []
        self._etc_dirs: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        with contextlib.suppress(NetnsError, OSError, subprocess.SubprocessError):
            remove_stale_namespaces()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:  # Ctrl-C too: half-built namespaces are removed
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        _run_ip("netns", "add", name)
        self._created.append(name)
        _run_ip("-n", name, "link", "set", "lo", "up")

    def _write_hosts_files(self) -> None:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.address}\t{h.hostname}" for h in self.hosts]
        text = "\n".join(lines) + "\n"
        for host in self.hosts:
            directory = os.path.join(_ETC_NETNS, host.name)
            os.makedirs(directory, exist_ok=True)
            self._etc_dirs.append(directory)
            with open(os.path.join(directory, "hosts"), "w", encoding="utf-8") as fh:
                fh.write(text)

    def _build(self) -> None:
        br = self.bridge_ns
        self._add_namespace(br)
        _run_ip("-n", br, "link", "add", "br0", "type", "bridge")
        _run_ip("-n", br, "link", "set", "br0", "up")
        for host in self.hosts:
            self._add_namespace(host.name)
            _run_ip(
                "link", "add", "eth0", "netns", host.name, "type", "veth",
                "peer", "name", host.port_name, "netns", br,
            )  # fmt: skip
            _run_ip("-n", br, "link", "set", host.port_name, "master", "br0")
            _run_ip("-n", br, "link", "set", host.port_name, "up")
            _run_ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run_ip("-n", host.name, "link", "set", "eth0", "up")
        self._write_hosts_files()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.hosts)} hosts"
        return f"Network({self.prefix!r}, {state})"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace this network created (hosts and the bridge)."""
        return list(self._created)

    def _track(self, proc: subprocess.Popen[Any]) -> None:
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None]
            self._procs.append(proc)

    def _require_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed")

    def close(self) -> None:
        """Kill processes started in the hosts and delete every namespace (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs, self._procs = self._procs, []
        atexit.unregister(self.close)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        errors = []
        for name in reversed(self._created):
            done = _run_ip("netns", "delete", name, check=False)
            if done.returncode != 0 and "No such file" not in done.stderr:
                errors.append(f"{name}: {done.stderr.strip()}")
        self._created.clear()
        for directory in self._etc_dirs:
            shutil.rmtree(directory, ignore_errors=True)
        self._etc_dirs.clear()
        with contextlib.suppress(OSError):
            os.rmdir(_ETC_NETNS)  # only if empty
        if errors:
            raise NetnsError("could not delete namespaces: " + "; ".join(errors))
