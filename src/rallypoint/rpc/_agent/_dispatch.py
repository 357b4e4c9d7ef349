"""Frames in: run calls and send their replies or errors; complete the futures of ours.

A call's exception travels as an :class:`ErrorReply` with torch's text and its pickled
type, and is raised on the caller with that type (:mod:`rallypoint.rpc._remote_errors`).
A call runs once the owners of the RRefs in its arguments have confirmed them (torch's
order), and a call made in a distributed autograd context runs and replies in it. A
reply whose tensors landed on GPUs makes the waiting thread's streams wait for the
decoding thread's (:class:`~rallypoint.rpc._transport._cuda.StreamSync`). A one-way call
is decoded tolerantly, so a tensor it cannot place reaches the function as an
``Unreadable`` that a gradient propagation can report.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
import threading
from typing import Any

import torch

from rallypoint._core.torch_c import Future
from rallypoint.rpc._agent._calls import PendingCalls, fail
from rallypoint.rpc._agent._codec import Codec
from rallypoint.rpc._device_maps import Sent
from rallypoint.rpc._errors import RpcError
from rallypoint.rpc._remote_errors import ErrorReply, has_plain_errors
from rallypoint.rpc._rref._rref import collect_confirmations
from rallypoint.rpc._transport import _wire
from rallypoint.rpc._transport._connection import Connection
from rallypoint.rpc._transport._cuda import StreamSync
from rallypoint.rpc._transport._framing import Frame
from rallypoint.rpc._worker_info import WorkerInfo
from rallypoint.rpc.dist_autograd._autograd import run_in
from rallypoint.rpc.dist_autograd._context import AutogradContext
from rallypoint.rpc.functions import is_async_execution, no_future_error

logger = logging.getLogger("rallypoint.rpc")

_CALL = _wire.FrameKind.CALL
_REPLY = _wire.FrameKind.REPLY
_ERROR = _wire.FrameKind.ERROR
_ONEWAY = _wire.FrameKind.ONEWAY
_REPLIED = Sent.REPLY


class Dispatcher:
    """Handles every frame that arrives on this worker's connections."""

    def __init__(self, me: WorkerInfo, calls: PendingCalls, codec: Codec) -> None:
        self._me = me
        self._calls = calls
        self._codec = codec
        self._inflight = 0
        self._async = 0  # of those, @async_execution calls waiting for their future
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether a request is running (or waiting for its async result)."""
        return self._inflight > 0

    def active(self) -> tuple[int, int]:
        """Requests served now, and how many of them wait for an ``@async_execution``
        future (torch's ``server_active_calls`` and ``server_active_async_calls``)."""
        with self._lock:
            return self._inflight, self._async

    def handle_frame(self, conn: Connection, frame: Frame) -> None:
        """Replies complete futures; calls run here, on the connection's reader thread."""
        kind = frame.kind
        if kind is _REPLY or kind is _ERROR:
            self._complete(conn, frame)
        else:
            self._serve(conn, frame)

    def _complete(self, conn: Connection, frame: Frame) -> None:
        future = self._calls.pop(frame.request_id)
        if future is None:
            return
        try:
            if frame.kind is _ERROR:
                error: ErrorReply = pickle.loads(frame.data)
                fail(future, error.rebuild())
                return
            devices: set[torch.device] = set()
            value, _ = self._codec.decode(
                conn.peer_name, frame.data, frame.tensors, kind=_REPLIED, devices=devices
            )
            if devices:
                future._set_unwrap_func(StreamSync(devices).wait)
        except BaseException as exc:  # anything, SystemExit too, fails the caller's future
            fail(future, exc)
            return
        future.set_result(value)

    def _serve(self, conn: Connection, frame: Frame) -> None:
        with self._lock:
            self._inflight += 1
        finished = True
        ctx: AutogradContext | None = None
        try:
            forked: list[torch.futures.Future[Any]] = []
            saved = collect_confirmations(forked)
            try:
                (func, args, kwargs), ctx = self._codec.decode(
                    conn.peer_name, frame.data, frame.tensors, tolerant=frame.kind is _ONEWAY
                )
            except AttributeError as exc:
                # not the function's own error: a RuntimeError on the caller, as torch's
                raise RuntimeError(
                    f"AttributeError: {exc} Default RPC pickler does not serialize function "
                    "code. Ensure that UDFs are defined on both caller and callee modules."
                ) from exc
            finally:
                collect_confirmations(saved)
            conn.site = func  # the reader's next wait follows serving it
            for confirmed in forked:  # as torch: RRef arguments are confirmed by their owners
                confirmed.wait()
            result = func(*args, **kwargs) if ctx is None else run_in(ctx, func, args, kwargs)
            if frame.kind is _ONEWAY:
                return
            if is_async_execution(func):
                self._reply_later(conn, frame.request_id, func, result, ctx)
                finished = False
                return
            # more frames buffered: their replies go out together, after them
            self._reply(conn, frame.request_id, result, flush=not conn.frame_buffered(), ctx=ctx)
        # a remote SystemExit too: the caller gets it, the server lives
        except BaseException as exc:
            if frame.kind is _ONEWAY:
                logger.warning(
                    "rallypoint.rpc: one-way call from %s failed: %r", conn.peer_name, exc
                )
            else:
                self._reply_error(conn, frame.request_id, exc, flush=False)
        finally:
            if finished:
                self._done()

    def _done(self) -> None:
        with self._lock:
            self._inflight -= 1

    def _reply_later(
        self, conn: Connection, rid: int, func: Any, result: Any, ctx: AutogradContext | None
    ) -> None:
        """An ``@async_execution`` call: reply when the future it returned completes."""
        if not isinstance(result, Future):
            raise no_future_error(func, result)
        with self._lock:
            self._async += 1
        type_name = not has_plain_errors(func)
        result.add_done_callback(lambda fut: self._reply_future(conn, rid, fut, ctx, type_name))

    def _reply_future(
        self,
        conn: Connection,
        rid: int,
        fut: torch.futures.Future[Any],
        ctx: AutogradContext | None,
        type_name: bool,
    ) -> None:
        try:
            try:
                value = fut.wait()
            # a remote SystemExit too: the caller gets it, the server lives
            except BaseException as exc:
                self._reply_error(conn, rid, exc, flush=True, type_name=type_name)
                return
            self._reply(conn, rid, value, flush=True, ctx=ctx, type_name=type_name)
        finally:
            with self._lock:
                self._async -= 1
            self._done()

    def _reply(
        self,
        conn: Connection,
        rid: int,
        value: Any,
        *,
        flush: bool,
        ctx: AutogradContext | None = None,
        type_name: bool = True,
    ) -> None:
        try:
            data, raws = self._codec.reply(conn.peer_name, value, ctx)
        except BaseException as exc:  # anything, SystemExit too, is replied as an error
            self._reply_error(conn, rid, exc, flush=flush, type_name=type_name)
            return
        # not contextlib.suppress: it costs three calls of Python, for every reply
        try:  # noqa: SIM105
            conn.send_frame(_REPLY, rid, data, raws, flush=flush)
        except RpcError:
            pass

    def _reply_error(
        self, conn: Connection, rid: int, exc: BaseException, *, flush: bool, type_name: bool = True
    ) -> None:
        """Send the error; ``type_name``: the caller's future puts the type's name first."""
        reply = ErrorReply.of(self._me, exc, type_name)
        print(reply.text, file=sys.stderr)  # as torch's callee does: its log shows the error
        data = pickle.dumps(reply)
        with contextlib.suppress(RpcError):
            conn.send_frame(_ERROR, rid, data, [], flush=flush)
