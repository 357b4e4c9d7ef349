"""Errors raised by ``rallypoint.rpc``.

Every error is a :class:`RuntimeError`, as in ``torch.distributed.rpc``, so code that
catches torch's errors keeps working::

    RpcError (RuntimeError)
    ├── RpcTimeoutError          a call ran past its timeout
    ├── RpcConnectionError       a peer is unknown, unreachable, died or closed mid-call
    ├── RpcAuthenticationError   a peer failed the HMAC challenge (or we did)
    ├── RpcProtocolError         malformed bytes on a connection (it is dropped)
    └── RpcShutdownError         graceful shutdown gave up; ``missing`` names the workers
"""

from __future__ import annotations

from collections.abc import Sequence


class RpcError(RuntimeError):
    """Root of every error raised by the RPC part."""


class RpcTimeoutError(RpcError):
    """An RPC did not complete within its timeout."""


class RpcConnectionError(RpcError):
    """A peer could not be reached, or its connection broke while calls were pending."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class RpcAuthenticationError(RpcError):
    """A connection did not prove knowledge of the job's RPC secret."""


class RpcProtocolError(RpcError):
    """A connection sent bytes that are not a valid rallypoint RPC frame."""


class RpcShutdownError(RpcError):
    """Graceful shutdown could not wait for every worker; ``missing`` names them."""

    def __init__(self, message: str, *, missing: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.missing = list(missing)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_shutdown_error, (str(self), self.missing))


def _rebuild_shutdown_error(message: str, missing: list[str]) -> RpcShutdownError:
    return RpcShutdownError(message, missing=missing)


NOT_INITIALIZED = "RPC has not been initialized. Call rallypoint.rpc.init_rpc first."
