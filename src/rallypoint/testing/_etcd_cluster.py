"""A real multi-member etcd cluster for tests: find the leader, kill a member, cut its link.

:class:`EtcdCluster` starts ``size`` ``etcd`` processes that form one cluster, either all on
127.0.0.1 with their own free ports, or one per fake host of a
:class:`~rallypoint.testing.Network` (``hosts=``) on the standard ports. Elections are made
fast so that a test rides out a leader change quickly. Queries (status, health) go to each
member from where it can be reached: directly on loopback, or from a thread inside the
member's own namespace (``Host.call``), since the test process's namespace has no route
to the fake hosts.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

from rallypoint._core.checks import check_int
from rallypoint._core.closing import Closing
from rallypoint._core.net import free_ports
from rallypoint.testing._etcd import etcd_binary, member_args

if TYPE_CHECKING:
    from rallypoint.testing._netns import Host

__all__ = ["EtcdCluster", "EtcdMember"]


class EtcdMember:
    """One member of an :class:`EtcdCluster`: its name, address, ports and process."""

    def __init__(
        self, index: int, *, address: str, client_port: int, peer_port: int, data_dir: str
    ) -> None:
        self.index = index
        self.name = f"m{index}"
        self.address = address
        self.client_port = client_port
        self.peer_port = peer_port
        self.data_dir = data_dir
        self.host: Host | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.is_cut = False
        self.frozen = False
        self.log_path = os.path.join(data_dir, f"{self.name}.log")

    @property
    def endpoint(self) -> str:
        """``address:client_port``."""
        return f"{self.address}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.address}:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        state += ", cut" if self.is_cut else ""
        state += ", frozen" if self.frozen else ""
        return f"EtcdMember({self.name!r}, {self.endpoint!r}, {state})"

    def post(self, path: str, body: dict[str, Any], timeout: float = 1.0) -> dict[str, Any]:
        """POST to this member's gateway from where it is reachable (inside its host's
        namespace on fake hosts); ``{}`` if it does not answer."""

        def ask() -> dict[str, Any]:
            conn = http.client.HTTPConnection(self.address, self.client_port, timeout=timeout)
            try:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                answer: dict[str, Any] = json.loads(conn.getresponse().read() or b"{}")
                return answer
            except (OSError, http.client.HTTPException, ValueError):
                return {}
            finally:
                conn.close()

        return ask() if self.host is None else self.host.call(ask, timeout=timeout + 10)

    def log_tail(self, size: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-size:].decode(errors="replace")
        except OSError:
            return ""


class EtcdCluster(Closing):
    """``size`` etcd members forming one cluster; a context manager.

    ::

        with EtcdCluster(3) as cluster:             # on loopback
            use(cluster.endpoint)                    # "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
            old = cluster.kill_leader()              # SIGKILL; returns the member's index
            cluster.wait_ready()                     # the two others elected a new leader
            cluster.start_member(old)                # it comes back with its data dir
            cluster.freeze(cluster.leader())         # SIGSTOP: silent, connections held open
            cluster.move_leader(2)                   # leadership transfer to member 2

        with Network(3) as net, EtcdCluster(3, hosts=net.hosts) as cluster:
            cluster.cut(cluster.leader())            # its host's link goes down: no RST
            cluster.restore(...)

    Args:
        size: how many members (at least 1; 3 tolerates the loss of one).
        hosts: one fake host per member (members listen on the host's address); ``None``
            puts every member on 127.0.0.1 with free ports.
        election_timeout_ms, heartbeat_interval_ms: etcd's raft timings (etcd wants the
            election timeout at least 5 heartbeats).
        extra_args: more ``etcd`` flags for every member.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        hosts: Sequence[Host] | None = None,
        election_timeout_ms: int = 500,
        heartbeat_interval_ms: int = 50,
        extra_args: Sequence[str] = (),
    ) -> None:
        if check_int(size, "size") < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        if hosts is not None and len(hosts) < size:
            raise ValueError(f"{size} members need {size} hosts, got {len(hosts)}")
        if check_int(election_timeout_ms, "election_timeout_ms") < 5 * check_int(
            heartbeat_interval_ms, "heartbeat_interval_ms"
        ):
            raise ValueError(
                f"election_timeout_ms ({election_timeout_ms}) must be at least 5 times "
                f"heartbeat_interval_ms ({heartbeat_interval_ms})"
            )
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not on PATH (Debian: apt-get install etcd-server)")
        self._binary = binary
        self.data_dir = tempfile.mkdtemp(prefix="rallypoint-etcd-cluster-")
        self.members: list[EtcdMember] = []
        ports = free_ports(2 * size) if hosts is None else []
        for i in range(size):
            if hosts is None:
                member = EtcdMember(
                    i,
                    address="127.0.0.1",
                    client_port=ports[2 * i],
                    peer_port=ports[2 * i + 1],
                    data_dir=self.data_dir,
                )
            else:
                member = EtcdMember(
                    i, address=hosts[i].address, client_port=2379, peer_port=2380,
                    data_dir=self.data_dir,
                )  # fmt: skip
                member.host = hosts[i]
            self.members.append(member)
        self._extra = [
            "--election-timeout", str(election_timeout_ms),
            "--heartbeat-interval", str(heartbeat_interval_ms),
            *extra_args,
        ]  # fmt: skip
        self._initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        self._started = False
        atexit.register(self.close)  # members run in sessions of their own: never leak them

    # ------------------------------------------------------------------ addresses

    @property
    def endpoint(self) -> str:
        """Every member's ``address:port``, comma-separated (what ``--rdzv-endpoint`` takes)."""
        return ",".join(m.endpoint for m in self.members)

    def __repr__(self) -> str:
        return f"EtcdCluster({self.members!r})"

    # ------------------------------------------------------------------ processes

    def start(self, timeout: float = 30.0) -> None:
        """Start every member and wait until the cluster has a leader and all are healthy."""
        if self._started:
            raise RuntimeError("the cluster is already started")
        self._started = True
        for member in self.members:
            self._spawn(member, new=True)
        self.wait_ready(timeout=timeout, require_all=True)

    def _spawn(self, member: EtcdMember, *, new: bool) -> None:
        args = member_args(
            self._binary,
            name=member.name,
            data_dir=os.path.join(self.data_dir, member.name),
            client_url=f"http://{member.endpoint}",
            peer_url=member.peer_url,
            initial_cluster=self._initial,
            state="new" if new else "existing",
            extra=self._extra,
        )
        log = open(member.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            if member.host is None:
                member.proc = subprocess.Popen(
                    args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            else:
                member.proc = member.host.popen(
                    args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        finally:
            log.close()

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (a crash: no goodbye to its peers or clients)."""
        member = self.members[index]
        proc, member.proc = member.proc, None
        member.frozen = False
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def kill_leader(self, timeout: float = 10.0) -> int:
        """SIGKILL the current leader; return its index."""
        index = self.leader(timeout)
        self.kill(index)
        return index

    def start_member(self, index: int, timeout: float = 20.0) -> None:
        """Start a killed member again with its data dir; wait until it is healthy."""
        member = self.members[index]
        if member.running:
            raise RuntimeError(f"{member.name} is already running")
        self._spawn(member, new=False)
        self._wait_member(member, timeout)

    def freeze(self, index: int) -> None:
        """SIGSTOP member ``index``: it holds its connections and answers nothing (a hung
        process; on loopback the closest thing to a cut link)."""
        proc = self.members[index].proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self.members[index].name} is not running")
        os.killpg(proc.pid, signal.SIGSTOP)
        self.members[index].frozen = True

    def thaw(self, index: int) -> None:
        """SIGCONT member ``index`` after :meth:`freeze`."""
        proc = self.members[index].proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
        self.members[index].frozen = False

    def cut(self, index: int) -> None:
        """Drop member ``index``'s network link (its host's): peers and clients get silence."""
        member = self.members[index]
        if member.host is None:
            raise ValueError("cutting a member's link needs a cluster on fake hosts (hosts=)")
        member.host.cut()
        member.is_cut = True

    def restore(self, index: int) -> None:
        """Bring member ``index``'s link back after :meth:`cut`."""
        member = self.members[index]
        if member.host is None:
            raise ValueError("restoring a member's link needs a cluster on fake hosts (hosts=)")
        member.host.restore()
        member.is_cut = False

    # ------------------------------------------------------------------ state

    def status(self, index: int, timeout: float = 1.0) -> dict[str, Any]:
        """Member ``index``'s ``/v3/maintenance/status`` (``{}`` when it does not answer)."""
        return self.members[index].post("/v3/maintenance/status", {}, timeout)

    def _reachable(self) -> list[EtcdMember]:
        return [m for m in self.members if m.running and not m.is_cut and not m.frozen]

    def _leader_now(self) -> int | None:
        """The index of the leader that every reachable member agrees on, if any."""
        ids: dict[str, int] = {}
        leaders: set[str] = set()
        reachable = self._reachable()
        for member in reachable:
            status = self.status(member.index)
            member_id = status.get("header", {}).get("member_id")
            leader = status.get("leader")
            if member_id is None or leader in (None, "0"):
                return None
            ids[str(member_id)] = member.index
            leaders.add(str(leader))
        if len(leaders) != 1 or not reachable:
            return None
        return ids.get(leaders.pop())

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the current leader (waits until the reachable members agree)."""
        deadline = time.monotonic() + timeout
        while True:
            index = self._leader_now()
            if index is not None:
                return index
            if time.monotonic() > deadline:
                raise TimeoutError(f"no agreed etcd leader within {timeout} s: {self!r}")
            time.sleep(0.05)

    def move_leader(self, index: int, timeout: float = 10.0) -> None:
        """Make member ``index`` the leader (etcd's leadership transfer)."""
        deadline = time.monotonic() + timeout
        while (leader := self.leader(timeout)) != index:
            target = self.status(index).get("header", {}).get("member_id")
            if target is not None:
                self.members[leader].post(
                    "/v3/maintenance/transfer-leadership", {"targetID": str(target)}, timeout=5
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.members[index].name} did not become the leader")
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 20.0, *, require_all: bool = False) -> int:
        """Wait until the reachable members agree on a leader and answer a linearizable
        read; return the leader's index. ``require_all``: every member must be reachable."""
        deadline = time.monotonic() + timeout
        while True:
            for member in self.members:
                if member.proc is not None and member.proc.poll() is not None:
                    raise RuntimeError(
                        f"etcd {member.name} exited with {member.proc.returncode}: "
                        f"{member.log_tail()}"
                    )
            complete = not require_all or len(self._reachable()) == len(self.members)
            index = self._leader_now() if complete else None
            if index is not None and all(
                "header" in m.post("/v3/kv/range", {"key": "AA=="}) for m in self._reachable()
            ):
                return index
            if time.monotonic() > deadline:
                tails = "\n".join(f"{m.name}: {m.log_tail(500)}" for m in self.members)
                raise TimeoutError(f"etcd cluster not ready within {timeout} s:\n{tails}")
            time.sleep(0.05)

    def _wait_member(self, member: EtcdMember, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "header" not in member.post("/v3/kv/range", {"key": "AA=="}):
            if member.proc is not None and member.proc.poll() is not None:
                raise RuntimeError(f"etcd {member.name} exited: {member.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd {member.name} not healthy within {timeout} s")
            time.sleep(0.05)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Kill every member and remove the data dirs (idempotent)."""
        atexit.unregister(self.close)
        for member in self.members:
            self.kill(member.index)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:  # Ctrl-C too: started servers are stopped
            self.close()
            raise
        return self
