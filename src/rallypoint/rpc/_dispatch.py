"""Frames in, frames out: run calls, send replies and errors, complete futures.

A call's exception travels as torch's text (``On WorkerInfo(...):``, its repr and the
remote traceback) plus its pickled type, and is raised on the caller with that type;
if the type cannot be rebuilt there, a ``RuntimeError`` carries the same text.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from typing import TYPE_CHECKING, Any

import torch

from rallypoint.rpc import _wire
from rallypoint.rpc._calls import fail
from rallypoint.rpc._errors import RpcError
from rallypoint.rpc._rref import remote_error_text
from rallypoint.rpc._transport import Connection, Frame
from rallypoint.rpc.functions import is_async_execution

if TYPE_CHECKING:
    from rallypoint.rpc._agent import RallypointAgent

logger = logging.getLogger("rallypoint.rpc")


def handle_frame(agent: RallypointAgent, conn: Connection, frame: Frame) -> None:
    """Replies complete futures; calls run here, on the connection's reader thread."""
    kind = frame.kind
    if kind == _wire.KIND_REPLY or kind == _wire.KIND_ERROR:
        future = agent.calls.pop(frame.request_id)
        if future is None:
            return
        try:
            if kind == _wire.KIND_REPLY:
                value = _wire.decode(frame.data, frame.tensors, conn.peer_name)
            else:
                value = rebuild_error(frame.data)
                fail(future, value)
                return
        except BaseException as exc:
            fail(future, exc)
            return
        future.set_result(value)
        return
    with agent._inflight_lock:
        agent._inflight += 1
    finished = True
    try:
        try:
            func, args, kwargs = _wire.decode(frame.data, frame.tensors, conn.peer_name)
        except AttributeError as exc:
            raise AttributeError(
                f"{exc} Default RPC pickler does not serialize function code. Ensure that "
                "UDFs are defined on both caller and callee modules."
            ) from exc
        result = func(*args, **kwargs)
        if kind == _wire.KIND_ONEWAY:
            return
        if is_async_execution(func):
            if not isinstance(result, torch._C.Future):
                raise TypeError(
                    f"{getattr(func, '__qualname__', func)} is decorated with "
                    f"@async_execution but returned {type(result).__name__}; it must "
                    "return a torch.futures.Future"
                )
            finished = False
            rid = frame.request_id
            result.add_done_callback(lambda fut: _reply_future(agent, conn, rid, fut))
            return
        _reply(agent, conn, frame.request_id, result, flush=False)
    except BaseException as exc:
        if kind == _wire.KIND_ONEWAY:
            logger.warning("rallypoint.rpc: one-way call from %s failed: %r", conn.peer_name, exc)
        else:
            _reply_error(agent, conn, frame.request_id, exc, flush=False)
    finally:
        if finished:
            with agent._inflight_lock:
                agent._inflight -= 1


def _reply_future(
    agent: RallypointAgent, conn: Connection, rid: int, fut: torch.futures.Future[Any]
) -> None:
    try:
        try:
            value = fut.wait()
        except BaseException as exc:
            _reply_error(agent, conn, rid, exc, flush=True)
            return
        _reply(agent, conn, rid, value, flush=True)
    finally:
        with agent._inflight_lock:
            agent._inflight -= 1


def _reply(agent: RallypointAgent, conn: Connection, rid: int, value: Any, *, flush: bool) -> None:
    try:
        data, raws = agent._encode(value, conn.peer_name, agent._reverse_maps.get(conn.peer_name))
    except BaseException as exc:
        _reply_error(agent, conn, rid, exc, flush=flush)
        return
    with contextlib.suppress(RpcError):
        conn.send_frame(_wire.KIND_REPLY, rid, data, raws, flush=flush)


def _reply_error(
    agent: RallypointAgent, conn: Connection, rid: int, exc: BaseException, *, flush: bool
) -> None:
    text = remote_error_text(repr(agent.info), exc)
    try:
        kind_bytes = pickle.dumps(type(exc))
    except Exception:
        kind_bytes = b""
        text = f"{type(exc).__qualname__}: {text}"
    data = pickle.dumps((text, kind_bytes))
    with contextlib.suppress(RpcError):
        conn.send_frame(_wire.KIND_ERROR, rid, data, [], flush=flush)


def rebuild_error(data: bytes) -> BaseException:
    text, kind_bytes = pickle.loads(data)
    kind: Any = None
    if kind_bytes:
        try:
            kind = pickle.loads(kind_bytes)
        except Exception:
            kind = None
    if not (isinstance(kind, type) and issubclass(kind, BaseException)):
        return RuntimeError(text)
    try:
        return kind(text)
    except BaseException as exc:
        return RuntimeError(
            f"Failed to create original exception type. Error msg was {exc}"
            f" Original exception on remote side was {text}"
        )
