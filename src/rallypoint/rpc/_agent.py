"""The rallypoint RPC agent: calls, replies, timeouts, membership and shutdown.

Threads per worker: one accept thread, one reader per connection (requests run on it;
see ``_transport`` for the hand-off when a request blocks), and one monitor that fires
timeouts, detects stalled readers and sends batched RRef decrements. Outstanding calls
are kept by ``_calls.PendingCalls``; incoming frames are handled by ``_dispatch``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rallypoint.rpc import _groups, _wire
from rallypoint.rpc._auth import client_handshake, resolve_secret, server_handshake
from rallypoint.rpc._backend import RpcAgent
from rallypoint.rpc._calls import PendingCalls, fail
from rallypoint.rpc._constants import ADDR_ENV, UNSET_RPC_TIMEOUT
from rallypoint.rpc._device_maps import (
    DeviceMap,
    create_device_list,
    create_reverse_mapping,
    device_maps_from_json,
    device_maps_to_json,
    validate_device_maps,
)
from rallypoint.rpc._dispatch import handle_frame
from rallypoint.rpc._errors import (
    NOT_INITIALIZED,
    RpcConnectionError,
    RpcError,
    RpcShutdownError,
)
from rallypoint.rpc._groups import WorkerInfo
from rallypoint.rpc._options import RallypointRpcBackendOptions
from rallypoint.rpc._rref import (
    OwnerTable,
    RRef,
    RRefId,
    _rref_create,
    _rref_decref_many,
    _rref_unpin,
    reduce_rref,
)
from rallypoint.rpc._shm import SegmentPool
from rallypoint.rpc._transport import Connection, Frame, Listener, connect

logger = logging.getLogger("rallypoint.rpc")

_CURRENT: RallypointAgent | None = None
_CFuture: Callable[[list[torch.device]], torch.futures.Future[Any]] = torch._C.Future  # type: ignore[assignment]  # the stubs call it Generic; it takes a device list
_HANDSHAKE_TIMEOUT = 10.0
_TICK = 0.004
_CORK_AFTER = 4


def current_rallypoint_agent() -> RallypointAgent:
    agent = _CURRENT
    if agent is None:
        raise RpcError(NOT_INITIALIZED)
    return agent


def _store_host(init_method: str) -> str:
    if init_method.startswith("env://"):
        return os.environ.get("MASTER_ADDR", "127.0.0.1")
    if init_method.startswith("tcp://"):
        return init_method[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return "127.0.0.1"


class RallypointAgent(RpcAgent):
    """One worker's RPC endpoint (created by ``init_rpc`` through the registry)."""

    def __init__(
        self,
        store: Any,
        name: str,
        rank: int,
        world_size: int | None,
        options: RallypointRpcBackendOptions,
        secret: bytes,
    ) -> None:
        self.info = WorkerInfo(name, rank)
        self.store = store
        self.world_size = world_size
        self.options = options
        self._secret = secret
        self._incarnation = secrets.randbits(31)
        self._rref_ids = itertools.count()
        self._ids = itertools.count(1)
        self._fork_ids = itertools.count(1)
        self._pins: dict[int, RRef[Any]] = {}
        self.rrefs = OwnerTable()
        self._records: dict[str, dict[str, Any]] = {}
        self._infos: dict[str, WorkerInfo] = {}
        self._by_id: dict[int, str] = {}
        self._device_maps: dict[str, DeviceMap] = dict(options.device_maps)  # type: ignore[arg-type]
        self._reverse_maps: dict[str, DeviceMap] = {}
        self.devices: list[torch.device] = []
        self._out: dict[str, Connection] = {}
        self._connect_locks: dict[str, threading.Lock] = {}
        self._inbound: set[Connection] = set()
        self._conns_lock = threading.Lock()
        self.calls = PendingCalls(options.rpc_timeout)
        self._dead: dict[str, str] = {}
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._deletes: queue.SimpleQueue[tuple[str, RRefId]] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._limiter = threading.Semaphore(options.num_worker_threads)
        self._stop = threading.Event()
        self._closed = False
        self.stats: dict[str, int] = {"inline_tensor_bytes": 0, "shm_tensor_bytes": 0}
        self._pool = SegmentPool(options.shm_pool_bytes) if options.shared_memory else None
        self._host_key = _groups.host_key()
        host = (
            options.listen_addr
            or os.environ.get(ADDR_ENV)
            or _groups.local_address_towards(_store_host(options.init_method))
        )
        self._listener = Listener(host, self._on_accept)
        self._address = (host, self._listener.port)
        self._monitor = threading.Thread(target=self._monitor_loop, name="rpc-monitor", daemon=True)
        self._monitor.start()

    # ---- identity ------------------------------------------------------------------
    @property
    def rpc_timeout(self) -> float:
        return self.options.rpc_timeout

    @property
    def is_static_group(self) -> bool:
        return self.world_size is not None

    def record(self) -> dict[str, Any]:
        return {
            "name": self.info.name,
            "rank": self.info.id,
            "host": self._address[0],
            "port": self._address[1],
            "uds": self._listener.uds_name,
            "host_key": self._host_key,
            "device_count": _groups.device_count(),
            "device_maps": device_maps_to_json(self._device_maps),
            "devices": [str(d) for d in self.options.devices],
        }

    def get_worker_info(self, worker_name: str | int | None = None) -> WorkerInfo:
        if worker_name is None:
            return self.info
        if isinstance(worker_name, int) and not isinstance(worker_name, bool):
            name = self._by_id.get(worker_name)
            if name is None:
                known = sorted(self._by_id)
                raise RpcError(
                    f"Unknown destination worker rank {worker_name}; known ranks: {known}"
                )
            worker_name = name
        if not isinstance(worker_name, str):
            raise ValueError(f"Cannot get WorkerInfo from name {worker_name}")
        record = self._records.get(worker_name)
        if record is None:
            raise self._unknown(worker_name)
        return WorkerInfo(worker_name, int(record["rank"]))

    def get_worker_infos(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(n, int(r["rank"]))
            for n, r in sorted(self._records.items(), key=lambda x: x[1]["rank"])
        ]

    def _unknown(self, name: str) -> RpcError:
        known = sorted(self._records)
        return RpcError(f"Unknown destination worker {name!r}; known workers: {known}")

    def _resolve(self, to: Any) -> WorkerInfo:
        if isinstance(to, WorkerInfo):
            if to.name not in self._records:
                raise self._unknown(to.name)
            return to
        if type(to) is str:
            info = self._infos.get(to)
            if info is not None:
                return info
        if isinstance(to, str | int) and not isinstance(to, bool):
            return self.get_worker_info(to)
        raise ValueError(f"Cannot get WorkerInfo from name {to}")

    def check_open(self) -> None:
        if self._closed:
            raise RpcError(NOT_INITIALIZED)

    # ---- membership ----------------------------------------------------------------
    def _set_records(self, records: list[dict[str, Any]], *, static: bool) -> None:
        names = [r["name"] for r in records]
        counts = {r["name"]: int(r["device_count"]) for r in records}
        maps = {r["name"]: device_maps_from_json(r["device_maps"]) for r in records}
        devices = {r["name"]: [torch.device(d) for d in r["devices"]] for r in records}
        validate_device_maps(names, counts, maps, devices, is_static_group=static)
        self._reverse_maps = create_reverse_mapping(self.info.name, names, maps)
        self.devices = create_device_list(
            devices.get(self.info.name, []), self._device_maps, self._reverse_maps
        )
        self._records = {r["name"]: r for r in records}
        self._infos = {r["name"]: WorkerInfo(r["name"], int(r["rank"])) for r in records}
        self._by_id = {int(r["rank"]): r["name"] for r in records}

    def join(self, timeout: float) -> None:
        from rallypoint.rpc._membership import join_group

        join_group(self, timeout)

    def member_joined(self, record: dict[str, Any]) -> None:
        records = [r for n, r in self._records.items() if n != record["name"]]
        self._set_records([*records, record], static=False)

    def member_left(self, name: str) -> None:
        records = [r for n, r in self._records.items() if n != name]
        self._set_records(records, static=False)
        with self._conns_lock:
            conn = self._out.pop(name, None)
        if conn is not None:
            conn.close()

    # ---- connections ---------------------------------------------------------------
    def _on_accept(self, sock: socket.socket, uds: bool, addr: Any) -> None:
        threading.Thread(
            target=self._serve_new, args=(sock, uds, addr), name="rpc-handshake", daemon=True
        ).start()

    def _serve_new(self, sock: socket.socket, uds: bool, addr: Any) -> None:
        try:
            hello = server_handshake(sock, self._secret, _HANDSHAKE_TIMEOUT)
            peer_name, peer_id = str(hello["name"]), int(hello["id"])
        except (OSError, RpcError, KeyError, TypeError, ValueError) as exc:
            where = "a local process" if uds else f"{addr[0]}:{addr[1]}"
            logger.warning(
                "rallypoint.rpc: %s rejected a connection from %s: %s", self.info.name, where, exc
            )
            sock.close()
            return
        conn = self._new_connection(sock, peer_name, peer_id, uds)
        conn.gate = self._ready
        with self._conns_lock:
            if self._closed:
                sock.close()
                return
            self._inbound.add(conn)
        conn.start()

    def _new_connection(
        self, sock: socket.socket, name: str, peer_id: int, uds: bool
    ) -> Connection:
        conn = Connection(
            sock,
            peer_name=name,
            peer_id=peer_id,
            uds=uds,
            handler=self,
            pool=self._pool,
            shm_threshold=self.options.shm_threshold,
            stats=self.stats,
        )
        conn.limiter = self._limiter
        return conn

    def _connection(self, name: str) -> Connection:
        conn = self._out.get(name)
        if conn is not None and not conn.closed:
            return conn
        with self._conns_lock:
            lock = self._connect_locks.setdefault(name, threading.Lock())
        with lock:
            conn = self._out.get(name)
            if conn is not None and not conn.closed:
                return conn
            if self._closed:
                raise RpcError(NOT_INITIALIZED)
            record = self._records[name]
            same_host = record["host_key"] == self._host_key and self.options.unix_socket
            address: tuple[str, int] | str = (
                record["uds"] if same_host else (record["host"], int(record["port"]))
            )
            try:
                sock, uds = connect(address, timeout=_HANDSHAKE_TIMEOUT)
                client_handshake(
                    sock,
                    self._secret,
                    {"name": self.info.name, "id": self.info.id},
                    _HANDSHAKE_TIMEOUT,
                )
            except (OSError, RpcError) as exc:
                reason = self._dead.get(name)
                detail = f" (it {reason})" if reason else ""
                raise RpcConnectionError(
                    f"cannot reach worker {name} (rank {record['rank']}){detail}: {exc}", peer=name
                ) from exc
            conn = self._new_connection(sock, name, int(record["rank"]), uds)
            conn.outbound = True
            with self._conns_lock:
                self._out[name] = conn
            conn.start()
            return conn

    def connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        with self._conns_lock:
            if self._out.get(conn.peer_name) is conn:
                del self._out[conn.peer_name]
            self._inbound.discard(conn)
            closing = self._closed
        outbound_eof = conn.outbound or isinstance(exc, EOFError | ConnectionError)
        if not closing and exc is not None and outbound_eof:
            self._dead.setdefault(conn.peer_name, f"closed its connection ({exc or 'EOF'})")
        pending = list(conn.pending)
        if not pending:
            return
        reason = "this agent is shutting down" if closing else f"the connection broke: {exc}"
        error = RpcConnectionError(
            f"RPC to worker {conn.peer_name} (rank {conn.peer_id}) failed: {reason}; "
            f"{len(pending)} call(s) were pending",
            peer=conn.peer_name,
        )
        self.calls.fail_connection(conn, error)

    # ---- calls ---------------------------------------------------------------------
    def _rref_hook(self, rref: RRef[Any]) -> _wire.ReduceValue:
        return reduce_rref(self, rref)

    def _encode(
        self, obj: Any, dst: str, device_map: DeviceMap | None
    ) -> tuple[bytes, list[torch.Tensor]]:
        return _wire.encode(
            obj,
            dst=dst,
            device_map=device_map,
            rref_type=RRef,
            rref_hook=self._rref_hook,
        )

    def _timeout(self, timeout: float) -> float:
        if timeout == UNSET_RPC_TIMEOUT or timeout is None:
            return self.options.rpc_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout < 0:
            raise ValueError(f"timeout must be seconds >= 0 (0: no timeout), got {timeout!r}")
        return float(timeout)

    def rpc_async(
        self,
        to: Any,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> torch.futures.Future[Any]:
        return self._call(to, func, args, kwargs, timeout, _wire.KIND_CALL)

    def _call(
        self,
        to: Any,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
        kind: int,
    ) -> torch.futures.Future[Any]:
        self.check_open()
        if not callable(func):
            raise TypeError("function should be callable.")
        seconds = (
            self.options.rpc_timeout if timeout == UNSET_RPC_TIMEOUT else self._timeout(timeout)
        )
        info = self._resolve(to)
        data, raws = _wire.encode(
            (func, args, kwargs),
            dst=info.name,
            device_map=self._device_maps.get(info.name),
            rref_type=RRef,
            rref_hook=self._rref_hook,
        )
        # torch's own rpc_async returns the C++ future type too: it costs no Python
        # __init__ and, unlike the Python subclass, is not tracked by the GC
        future: torch.futures.Future[Any] = _CFuture([])
        try:
            conn = self._connection(info.name)
        except RpcError as exc:
            fail(future, exc)
            return future
        if kind == _wire.KIND_ONEWAY:
            try:
                conn.send_frame(kind, 0, data, raws)
                future.set_result(None)
            except RpcError as exc:
                fail(future, exc)
            return future
        rid = next(self._ids)
        self.calls.add(rid, conn, future, seconds)
        # With many calls already in flight, leave the frame queued: the connection's reader
        # flushes the queue before it next blocks (a reply is coming), and the monitor
        # within one tick. Bursts of rpc_async then cost one sendmsg per batch.
        try:
            flush = bool(raws) or len(conn.pending) <= _CORK_AFTER
            conn.send_frame(kind, rid, data, raws, flush=flush)
        except RpcError as exc:
            if self.calls.pop(rid) is not None:
                fail(future, exc)
        return future

    def oneway(self, to: str, func: Callable[..., Any], *args: Any) -> None:
        with contextlib.suppress(RpcError):
            self._call(to, func, args, {}, 0, _wire.KIND_ONEWAY)

    def remote(
        self,
        to: Any,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> RRef[Any]:
        self.check_open()
        info = self._resolve(to)
        rref_id = self.new_rref_id()
        created = self.rpc_async(info, _rref_create, (rref_id, func, args, kwargs), {}, timeout)
        return RRef._make(self, info, rref_id, created)

    # ---- frames --------------------------------------------------------------------
    def handle_frame(self, conn: Connection, frame: Frame) -> None:
        handle_frame(self, conn, frame)

    # ---- rrefs ---------------------------------------------------------------------
    def new_rref_id(self) -> RRefId:
        return (self.info.name, self._incarnation, next(self._rref_ids))

    def release_rref(self, owner: str, rref_id: RRefId) -> None:
        if not self._closed:
            self._deletes.put((owner, rref_id))

    def pin(self, rref: RRef[Any]) -> int:
        fork_id = next(self._fork_ids)
        self._pins[fork_id] = rref
        return fork_id

    def unpin(self, fork_id: int) -> None:
        self._pins.pop(fork_id, None)

    def unpin_at(self, sender: str, fork_id: int) -> None:
        if sender == self.info.name:
            self.unpin(fork_id)
        else:
            self.oneway(sender, _rref_unpin, fork_id)

    def _drain_deletes(self) -> None:
        batches: dict[str, list[RRefId]] = {}
        while True:
            try:
                owner, rref_id = self._deletes.get_nowait()
            except queue.Empty:
                break
            batches.setdefault(owner, []).append(rref_id)
        for owner, ids in batches.items():
            if owner == self.info.name:
                for rref_id in ids:
                    self.rrefs.decref(rref_id)
            elif owner in self._records and owner not in self._dead:
                self.oneway(owner, _rref_decref_many, ids)

    # ---- monitor -------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while not self._stop.wait(_TICK):
            try:
                self._tick()
            except Exception:  # pragma: no cover - keep the monitor alive
                logger.exception("rallypoint.rpc: monitor tick failed")

    def _tick(self) -> None:
        now = time.monotonic()
        with self._conns_lock:
            conns = [*self._out.values(), *self._inbound]
        for conn in conns:
            conn.check_stall(now, self._limiter)
            conn.flush()
        self.calls.expire(now)
        if not self._deletes.empty():
            self._drain_deletes()

    # ---- shutdown ------------------------------------------------------------------
    def _wait_quiet(self, deadline: float) -> None:
        while (self.calls or self._inflight) and time.monotonic() < deadline:
            time.sleep(0.001)

    def _known_dead(self, keys: list[str]) -> bool:
        """Whether every worker still missing from a barrier is known to have died."""
        return all(k.rsplit("/", 1)[1] in self._dead for k in keys)

    def shutdown(self, graceful: bool, timeout: float) -> None:
        seconds = timeout if timeout > 0 else (self.options.rpc_timeout or 60.0)
        deadline = time.monotonic() + seconds
        error: BaseException | None = None
        try:
            if graceful:
                try:
                    error = self._graceful(deadline, seconds)
                except RpcError:
                    raise
                except RuntimeError as exc:  # the store failed (c10d raises DistError)
                    error = RpcShutdownError(
                        f"graceful shutdown of {self.info.name} lost the rendezvous store "
                        f"(rank 0 hosts it and may have exited already): {exc}"
                    )
        finally:
            self.close()
        if error is not None:
            raise error

    def _graceful(self, deadline: float, seconds: float) -> BaseException | None:
        from rallypoint.rpc._membership import graceful_shutdown

        return graceful_shutdown(self, deadline, seconds)

    def hosts_store(self) -> bool:
        return self.info.id == 0 and self.options.init_method.startswith(("env://", "tcp://"))

    def _linger_as_store_host(self, prefix: str, names: list[str], deadline: float) -> None:
        """Rank 0 hosts the TCPStore: keep it up until the live workers are done with it."""
        if self.hosts_store():
            alive = [f"{prefix}/{n}" for n in names if n not in self._dead]
            _groups.wait_for_keys(self.store, alive, deadline, dead=self._known_dead)

    def close(self) -> None:
        global _CURRENT
        with self._conns_lock:
            if self._closed:
                return
            self._closed = True
            conns = [*self._out.values(), *self._inbound]
            self._out.clear()
            self._inbound.clear()
        self._stop.set()
        self._ready.set()
        self._listener.close()
        for conn in conns:
            conn.flush()
            conn.close()
        self.calls.fail_all()
        if threading.current_thread() is not self._monitor:
            self._monitor.join(5)
        self._pins.clear()
        self.rrefs.clear()
        if self._pool is not None:
            self._pool.close()
        if _CURRENT is self:
            _CURRENT = None
        self.store = None


def start_agent(
    store: Any,
    name: str,
    rank: int,
    world_size: int | None,
    options: Any,
) -> RallypointAgent:
    """The RALLYPOINT backend's ``init_backend_handler``."""
    global _CURRENT
    if not isinstance(options, RallypointRpcBackendOptions):
        raise TypeError(f"`rpc_backend_options` must be a `RallypointRpcBackendOptions`. {options}")
    secret = resolve_secret(options, store)
    from rallypoint.rpc import _api

    agent = RallypointAgent(store, name, rank, world_size, options, secret)
    # peers may call us as soon as we are in the group, before init_rpc returns
    _CURRENT = agent
    _api.set_current(agent)
    try:
        agent.join(options.rpc_timeout if options.rpc_timeout > 0 else 1800.0)
    except BaseException:
        _api.set_current(None)
        agent.close()
        raise
    return agent
