"""The rallypoint RPC agent: it owns one worker's parts and sends its calls.

:class:`RallypointAgent` composes parts that each have a small interface of their own:
the group (``_peers.PeerTable``, ``_membership.Group``), our pending calls
(``_calls.PendingCalls``), the RRefs (``_rref._table.RRefTable``), distributed autograd
(``dist_autograd._autograd.DistAutograd``), the codec (``_codec.Codec``), incoming frames
(``_dispatch.Dispatcher``) and the sockets (``_connections.Connections``). Threads per
worker: one accept thread, one reader per connection (requests run on it), and one
monitor that fires timeouts, detects stalled readers and sends batched RRef decrements.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rallypoint._core.checks import check_seconds
from rallypoint._core.envvars import RPC_ADDR
from rallypoint._core.torch_c import Future
from rallypoint.rpc._agent._calls import PendingCalls, fail
from rallypoint.rpc._agent._codec import Codec
from rallypoint.rpc._agent._connections import Connections
from rallypoint.rpc._agent._dispatch import Dispatcher
from rallypoint.rpc._agent._membership import CURRENT_GROUP, Group
from rallypoint.rpc._agent._peers import PeerTable
from rallypoint.rpc._backend import CURRENT_AGENT, Args, Func, Fut, Kwargs, RpcAgent
from rallypoint.rpc._builtins import resolve as builtin_overload
from rallypoint.rpc._device_maps import DeviceMap
from rallypoint.rpc._errors import NOT_INITIALIZED, RpcError, RpcShutdownError
from rallypoint.rpc._group import _groups
from rallypoint.rpc._group._groups import WorkerRecord
from rallypoint.rpc._group._store import hosts_store, store_host
from rallypoint.rpc._options import RallypointRpcBackendOptions
from rallypoint.rpc._rref._rref import RRef, remote_rref
from rallypoint.rpc._rref._table import CURRENT_TABLE, RRefTable
from rallypoint.rpc._torch_names import hold_pyrref, release_pyrref
from rallypoint.rpc._transport import _cuda, _wire
from rallypoint.rpc._transport._auth import resolve_secret
from rallypoint.rpc._transport._connection import Connection
from rallypoint.rpc._transport._cuda_routes import CudaInfo, CudaRouter
from rallypoint.rpc._transport._cuda_routes import Peer as CudaPeer
from rallypoint.rpc._transport._shm import SegmentPool
from rallypoint.rpc._transport._spin import WAITS
from rallypoint.rpc._worker_info import WorkerInfo
from rallypoint.rpc.constants import UNSET_RPC_TIMEOUT
from rallypoint.rpc.dist_autograd._autograd import CURRENT_AUTOGRAD, DistAutograd, current_context
from rallypoint.rpc.dist_autograd._context import AutogradContext
from rallypoint.rpc.dist_autograd._ddp_groups import GROUPS as DDP_GROUPS

if TYPE_CHECKING:
    from rallypoint._core.store import Store

logger = logging.getLogger("rallypoint.rpc")

_CFuture: Callable[[list[torch.device]], Fut] = Future  # type: ignore[assignment]  # the stubs call it Generic; it takes a device list
_TICK = 0.004
_RELEASE_EVERY = 0.05
"""Seconds between batches of RRef decrements/unpins and context releases: each batch is
a message that wakes a peer, so on a busy training loop they go out 20 times a second, not
every tick (what they free lives at most this much longer)."""
_CORK_AFTER = 4
_ALL_REPLIES = "rpc_all"  # the spin site of a caller reading the replies of rpc_all
_CALL = _wire.FrameKind.CALL
_ONEWAY = _wire.FrameKind.ONEWAY


def current_rallypoint_agent() -> RallypointAgent:
    """The running rallypoint agent of this process (``RpcError`` if there is none)."""
    agent = CURRENT_AGENT.get()
    if not isinstance(agent, RallypointAgent):
        raise RpcError(NOT_INITIALIZED)
    return agent


class RallypointAgent(RpcAgent):
    """One worker's RPC endpoint (created by ``init_rpc`` through the registry)."""

    def __init__(
        self,
        store: Store,
        name: str,
        rank: int,
        world_size: int | None,
        options: RallypointRpcBackendOptions,
        secret: bytes,
    ) -> None:
        self.info = WorkerInfo(name, rank)
        self.options = options
        WAITS.configure(options.busy_poll_us / 1e6)
        self._default_timeout = options.rpc_timeout
        self._closed = False
        self._ids = itertools.count(1)
        self.peers = PeerTable(self.info, dict(options.device_maps))  # type: ignore[arg-type]
        self.calls = PendingCalls(options.rpc_timeout)
        self.rrefs = RRefTable(self.info, caller=self)
        self.autograd = DistAutograd(
            self.info,
            caller=self,
            timeout=options.rpc_timeout,
            dead_workers=lambda: [n for n in self.peers.names() if self.peers.is_dead(n)],
            worker_id=self.peers.rank_of,
        )
        self._cuda = CudaInfo.of_this_process(options.cuda_ipc)
        me = CudaPeer(self.info.name, _groups.host_key(), self._cuda, _groups.device_count())
        router = CudaRouter(me, self._cuda_peer, ipc_threshold=options.cuda_ipc_threshold)
        self.codec = Codec(self.peers, self.rrefs, self.autograd, router)
        self.dispatcher = Dispatcher(self.info, self.calls, self.codec)
        self._pool = SegmentPool(options.shm_pool_bytes) if options.shared_memory else None
        host = (
            options.listen_addr
            or os.environ.get(RPC_ADDR)
            or _groups.local_address_towards(store_host(options.init_method))
        )
        self.connections = Connections(
            me=self.info,
            secret=secret,
            host=host,
            options=options,
            peers=self.peers,
            calls=self.calls,
            on_frame=self.dispatcher.handle_frame,
            pool=self._pool,
        )
        self.group = Group(
            store=store,
            me=self.info,
            world_size=world_size,
            hosts_store=hosts_store(options.init_method, rank),
            peers=self.peers,
            connections=self.connections,
            caller=self,
            rpc_timeout=options.rpc_timeout,
        )
        # held until close: the monitor's tick waits on it (a lock's timed acquire runs no
        # Python, where Event.wait runs a dozen calls of threading's, 250 times a second)
        self._running = threading.Lock()
        self._running.acquire()
        self._released_at = 0.0
        self._monitor = threading.Thread(target=self._monitor_loop, name="rpc-monitor", daemon=True)
        self._monitor.start()

    # ---- identity ------------------------------------------------------------------
    @property
    def rpc_timeout(self) -> float:
        return self._default_timeout

    @property
    def stats(self) -> dict[str, int]:
        """Tensor bytes sent inline, through shared memory, and handed back (not copied)."""
        return self.connections.stats

    def get_metrics(self) -> dict[str, str]:
        """torch's agent metrics. A request runs on a thread of its own (a connection's
        reader, or one it handed over to) while it runs, not while an ``@async_execution``
        call waits for its future: idle threads are ``num_worker_threads`` less those."""
        served, waiting = self.dispatcher.active()
        pool = self.options.num_worker_threads
        return {
            "agent.server_active_async_calls": str(waiting),
            "agent.client_active_calls": str(len(self.calls.owners)),
            "agent.server_active_calls": str(served),
            "agent.num_idle_threads": str(max(0, pool - (served - waiting))),
            "agent.thread_pool_size": str(pool),
        }

    def record(self) -> WorkerRecord:
        """What this worker publishes about itself in the store."""
        host, port = self.connections.address
        return WorkerRecord(
            name=self.info.name,
            rank=self.info.id,
            host=host,
            port=port,
            uds=self.connections.uds_name,
            host_key=self.connections.host_key,
            device_count=_groups.device_count(),
            device_maps=dict(self.options.device_maps),  # type: ignore[arg-type]
            devices=list(self.options.devices),  # type: ignore[arg-type]
            cuda=self._cuda,
        )

    def _cuda_peer(self, name: str) -> CudaPeer | None:
        """What the CUDA routes need of a peer's record (``None``: not in the group)."""
        if name not in self.peers:
            return None
        record = self.peers.record(name)
        return CudaPeer(record.name, record.host_key, record.cuda, record.device_count)

    def set_rpc_timeout(self, seconds: float) -> None:
        # calls already sent keep their deadlines; backward passes and the shutdown's
        # liveness probes started from now on use the new value, as in torch
        self._default_timeout = seconds
        self.calls.set_default(seconds)
        self.autograd.timeout = seconds
        self.group.rpc_timeout = seconds

    def get_worker_info(self, worker_name: str | int | None = None) -> WorkerInfo:
        return self.peers.info(worker_name)

    def get_worker_infos(self) -> list[WorkerInfo]:
        return self.peers.infos()

    def check_open(self) -> None:
        if self._closed:
            raise RpcError(NOT_INITIALIZED)

    # ---- calls ---------------------------------------------------------------------
    def _timeout(self, timeout: object) -> float:
        if timeout == UNSET_RPC_TIMEOUT or timeout is None:
            return self._default_timeout
        try:
            seconds = check_seconds(timeout, "timeout", allow_zero=True, numbers=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"timeout must be seconds >= 0 (0: no timeout), got {timeout!r}"
            ) from exc
        assert seconds is not None
        return seconds

    def rpc_async(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Fut:
        return self._call(to, func, args, kwargs, timeout, sync=False)

    def rpc_sync(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> Any:
        return self._call(to, func, args, kwargs, timeout, sync=True).wait()

    def rpc_all(self, calls: list[tuple[Any, Func, Args]], timeout: float) -> list[Fut]:
        """Send every call first, then read the replies on this thread, connection by
        connection: no reader thread wakes up only to hand a reply over to this one."""
        unread: list[tuple[Connection, Fut]] = []
        futures = [
            self._call(to, func, args, {}, timeout, sync=False, unread=unread)
            for to, func, args in calls
        ]
        last = {conn: i for i, (conn, _) in enumerate(unread)}
        for conn in last:  # encoded all first: the calls leave back to back
            conn.flush()
        for i, (conn, future) in enumerate(unread):
            # returns at once if a reader thread has the role
            conn.read_until(future, more=i != last[conn], site=_ALL_REPLIES)
        for future in futures:  # (contextlib.suppress would cost three calls of Python each)
            try:  # noqa: SIM105
                future.wait()
            except Exception:  # the caller reads each future's error
                pass
        return futures

    def _call(
        self,
        to: Any,
        func: Func,
        args: Args,
        kwargs: Kwargs,
        timeout: float,
        *,
        sync: bool,
        unread: list[tuple[Connection, Fut]] | None = None,
    ) -> Fut:
        if self._closed:
            raise RpcError(NOT_INITIALIZED)
        if not callable(func):
            raise TypeError("function should be callable.")
        seconds = self._default_timeout if timeout == UNSET_RPC_TIMEOUT else self._timeout(timeout)
        info = self.peers.resolve(to)
        payload = (builtin_overload(func, args, kwargs), args, kwargs)
        return self._send(
            info.name, payload, seconds, _CALL, current_context(), sync=sync, unread=unread
        )

    def remote(self, to: Any, func: Func, args: Args, kwargs: Kwargs, timeout: float) -> RRef[Any]:
        self.check_open()
        info = self.peers.resolve(to)
        payload = (builtin_overload(func, args, kwargs), args, kwargs)
        return remote_rref(self.rrefs, info, payload, timeout)

    def oneway(self, to: str, func: Func, *args: Any, device_map: DeviceMap | None = None) -> bool:
        try:
            self.check_open()
            dst = self.peers.resolve(to).name
            sent = self._send(dst, (func, args, {}), 0, _ONEWAY, device_map=device_map)
            sent.wait()  # a one-way call's future is complete once the frame is queued
        except RpcError:
            return False
        return True

    def _send(
        self,
        dst: str,
        payload: tuple[Func, Args, Kwargs],
        seconds: float,
        kind: _wire.FrameKind,
        ctx: AutogradContext | None = None,
        *,
        sync: bool = False,
        unread: list[tuple[Connection, Fut]] | None = None,
        device_map: DeviceMap | None = None,
    ) -> Fut:
        """Send a call; ``sync``: this thread waits for the reply next and reads it itself
        when nobody reads the connection (one thread wake-up per call instead of two);
        ``unread``: it will, after sending more calls (the call joins that list);
        ``device_map``: a gradient's map (see :meth:`Codec.call`)."""
        data, raws = self.codec.call(dst, payload, ctx, device_map)
        # torch's own rpc_async returns the C++ future type too: it costs no Python
        # __init__ and, unlike the Python subclass, is not tracked by the GC
        future = _CFuture([])
        try:
            conn = self.connections.get(dst)
        except RpcError as exc:
            fail(future, exc)
            return future
        if kind is _ONEWAY:
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
            flush = unread is None and (bool(raws) or len(conn.pending) <= _CORK_AFTER)
            conn.send_frame(kind, rid, data, raws, flush=flush)
        except RpcError as exc:
            if self.calls.pop(rid) is not None:
                fail(future, exc)
            return future
        if sync:
            conn.read_until(future, site=payload[0])
        elif unread is not None:
            unread.append((conn, future))  # unread for a whole tick: the monitor spawns a reader
        else:
            conn.expect_reply()
        return future

    # ---- monitor -------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while True:
            with WAITS.blocked(urgent=False):
                if self._running.acquire(timeout=_TICK):
                    self._running.release()  # closed: also for any later acquire
                    return
            try:
                self._tick()
            except Exception:  # pragma: no cover - keep the monitor alive
                logger.exception("rallypoint.rpc: monitor tick failed")

    def _tick(self) -> None:
        now = time.monotonic()
        self.connections.tick(now)
        self.calls.expire(now)
        if now - self._released_at < _RELEASE_EVERY:
            return
        self._released_at = now
        DDP_GROUPS.release_due()  # gone DDP modules' groups: freed here, without the GIL
        cuda = self.codec.cuda
        if cuda is not None and cuda.shared:
            cuda.shared = 0
            _cuda.collect()  # copies shared by CUDA IPC whose receivers let them go
        if self.rrefs.has_releases():
            self.rrefs.send_releases(self.peers.reachable)
        if self.autograd.has_releases():
            self.autograd.send_releases()

    # ---- lifecycle -----------------------------------------------------------------
    def start(self, timeout: float) -> None:
        """Become this process's agent, then join the group."""
        # peers may call us as soon as we are in the group, before init_rpc returns
        CURRENT_AGENT.set(self)
        CURRENT_TABLE.set(self.rrefs)
        CURRENT_GROUP.set(self.group)
        CURRENT_AUTOGRAD.set(self.autograd)
        hold_pyrref()  # isinstance(rref, torch's PyRRef) holds for ours (see _torch_names)
        try:
            self.group.join(self.record(), timeout)
        except BaseException:  # Ctrl-C too: the half-joined agent is closed
            self.close()
            raise

    def _wait_quiet(self, deadline: float) -> None:
        delay = 0.001
        while (self.calls or self.dispatcher.busy) and time.monotonic() < deadline:
            WAITS.sleep(delay)
            delay = min(delay * 1.5, 0.01)

    def shutdown(self, graceful: bool, timeout: float) -> None:
        # timeout 0 (the default): wait as long as the awaited workers are alive, as torch
        # does; a dead or unreachable one ends the wait (see _liveness)
        seconds = timeout if timeout > 0 else 0.0
        deadline = time.monotonic() + seconds if seconds else math.inf
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

    def _graceful(self, deadline: float, seconds: float) -> RpcShutdownError | None:
        """Wait for outstanding work, then leave (dynamic) or meet everyone (static)."""
        self._wait_quiet(deadline)
        self.rrefs.send_releases(self.peers.reachable)
        self.autograd.send_releases()
        return self.group.leave(deadline, seconds, self._wait_quiet)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(RuntimeError):  # closed before: released already
            self._running.release()  # the monitor stops
        if not self.connections.close():
            return
        self.calls.fail_all()
        if threading.current_thread() is not self._monitor:
            self._monitor.join(5)
        self.rrefs.close()
        if self._pool is not None:
            self._pool.close()
        CURRENT_AGENT.clear(self)
        CURRENT_TABLE.clear(self.rrefs)
        CURRENT_GROUP.clear(self.group)
        CURRENT_AUTOGRAD.clear(self.autograd)
        release_pyrref()
        self.autograd.close()
        self.group.close()
        DDP_GROUPS.release_all()


def start_agent(
    store: Store,
    name: str,
    rank: int,
    world_size: int | None,
    options: Any,
) -> RallypointAgent:
    """The RALLYPOINT backend's ``init_backend_handler``."""
    if not isinstance(options, RallypointRpcBackendOptions):
        raise TypeError(f"`rpc_backend_options` must be a `RallypointRpcBackendOptions`. {options}")
    secret = resolve_secret(options, store)
    agent = RallypointAgent(store, name, rank, world_size, options, secret)
    agent.start(options.rpc_timeout if options.rpc_timeout > 0 else 1800.0)
    return agent
