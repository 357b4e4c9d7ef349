"""``rallypoint.rpc.dist_autograd``: ``torch.distributed.autograd``'s API on either backend.

Change ``import torch.distributed.autograd as dist_autograd`` to
``import rallypoint.rpc.dist_autograd as dist_autograd``::

    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", model_stage, args=(x,)).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # {tensor: gradient}

Under ``BackendType.RALLYPOINT`` it is rallypoint's implementation (torch's FAST mode on
rallypoint's transport, see :mod:`rallypoint.rpc.dist_autograd._autograd`); under
``BackendType.TENSORPIPE`` every call goes to ``torch.distributed.autograd``, so one
program runs on both. Errors are torch's (types and messages), except that before
``init_rpc`` the message names ``rallypoint.rpc.init_rpc`` instead of torch's internal
initializer.
"""

from __future__ import annotations

import importlib
from types import TracebackType
from typing import Any

import torch

from rallypoint.rpc._backend import CURRENT_AGENT
from rallypoint.rpc.dist_autograd._autograd import CURRENT_AUTOGRAD, DistAutograd, current_context
from rallypoint.rpc.dist_autograd._checks import check_context_id, root_list
from rallypoint.rpc.dist_autograd._inspect import DistAutogradContext, debug_info

__all__ = ["backward", "context", "get_gradients", "is_available"]

_NOT_INITIALIZED = (
    "Need to initialize distributed autograd using rallypoint.rpc.init_rpc() "
    "(it starts distributed autograd, as torch's init_rpc does)"
)
_NO_CONTEXT = (  # torch's text
    "Current thread doesn't have a valid autograd context. Please wrap your code using: "
    "`with torch.distributed.autograd.context() as context_id` to generate a valid context"
)


def _torch() -> Any:
    return importlib.import_module("torch.distributed.autograd")


def _ours() -> DistAutograd | None:
    """Our implementation if the running agent is rallypoint's; ``None``: torch's."""
    autograd = CURRENT_AUTOGRAD.peek()
    if autograd is not None:
        return autograd
    if CURRENT_AGENT.peek() is None:
        raise RuntimeError(_NOT_INITIALIZED)
    return None


def _bad_arguments(function: str, exc: TypeError) -> TypeError:
    # torch's binding says "incompatible function arguments" (programs and torch's own
    # tests match that); ours also says which argument is wrong
    return TypeError(f"{function}(): incompatible function arguments: {exc}")


def is_available() -> bool:
    """Always true: the rallypoint backend's distributed autograd needs only torch."""
    return True


class context:
    """A distributed autograd context; ``with context() as context_id:`` (torch's API).

    The forward and the backward pass of one iteration run inside it; every worker they
    touch keeps that iteration's gradients under ``context_id`` until the block ends.
    """

    def __init__(self) -> None:
        self._id: int | None = None
        self._torch: Any = None

    def __enter__(self) -> int:
        ours = _ours()
        if ours is None:
            self._torch = _torch()._new_context()
            self._id = int(self._torch._context_id())
        else:
            self._id = ours.new_context().id
        return self._id

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._id is not None
        if self._torch is not None:
            _torch()._release_context(self._id)
            return
        autograd = CURRENT_AUTOGRAD.peek()
        if autograd is not None:  # else RPC was shut down inside the block: nothing to release
            autograd.exit_context(self._id)


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars) in context ``context_id``.

    Gradients flow back across every ``rpc_sync``/``rpc_async``/``remote``/``to_here``
    made in the context, on every worker; leaf gradients accumulate in the context (see
    :func:`get_gradients`), not in ``.grad``. Returns when the whole pass is done.
    ``retain_graph=False`` frees the graph, as torch's ``backward`` does.
    """
    try:
        context_id = check_context_id(context_id)
        roots = root_list(roots)
        if not isinstance(retain_graph, bool):
            raise TypeError(f"retain_graph must be a bool, got {type(retain_graph).__name__}")
    except TypeError as exc:
        raise _bad_arguments("backward", exc) from None
    ours = _ours()
    if ours is None:
        _torch().backward(context_id, roots, retain_graph)
        return
    ours.backward(context_id, roots, retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients accumulated in context ``context_id`` on this worker: tensor -> grad."""
    try:
        context_id = check_context_id(context_id)
    except TypeError as exc:
        raise _bad_arguments("get_gradients", exc) from None
    ours = _ours()
    if ours is None:
        grads: dict[torch.Tensor, torch.Tensor] = _torch().get_gradients(context_id)
        return grads
    return dict(ours.retrieve(context_id).grads)


def _context_id_argument(function: str, context_id: object) -> int:
    try:
        return check_context_id(context_id)
    except TypeError as exc:
        raise _bad_arguments(function, exc) from None


# ---- torch's private helpers (torch's own tests and debugging tools use them) -------------
# Under BackendType.TENSORPIPE each is torch's; see rallypoint.rpc.dist_autograd._inspect.


def _is_valid_context(context_id: int) -> None:
    """Raise torch's error if this worker has no context ``context_id``."""
    context_id = _context_id_argument("_is_valid_context", context_id)
    ours = _ours()
    if ours is None:
        _torch()._is_valid_context(context_id)
    else:
        ours.retrieve(context_id)


def _current_context() -> Any:
    """The calling thread's context (``RuntimeError`` if it has none)."""
    ours = _ours()
    if ours is None:
        return _torch()._current_context()
    ctx = current_context()
    if ctx is None:
        raise RuntimeError(_NO_CONTEXT)
    return DistAutogradContext(ours, ours.retrieve(ctx.id))


def _retrieve_context(context_id: int) -> Any:
    """This worker's context ``context_id`` (``RuntimeError`` if it has none)."""
    context_id = _context_id_argument("_retrieve_context", context_id)
    ours = _ours()
    if ours is None:
        return _torch()._retrieve_context(context_id)
    return DistAutogradContext(ours, ours.retrieve(context_id))


def _new_context() -> Any:
    """A new context, now the calling thread's (what ``context().__enter__`` does)."""
    ours = _ours()
    if ours is None:
        return _torch()._new_context()
    return DistAutogradContext(ours, ours.new_context())


def _release_context(context_id: int) -> None:
    """Release context ``context_id`` here and on the workers it talked to (what
    ``context().__exit__`` does); the calling thread forgets it if it was its context."""
    context_id = _context_id_argument("_release_context", context_id)
    ours = _ours()
    if ours is None:
        _torch()._release_context(context_id)
    else:
        ours.exit_context(context_id)


def _get_max_id() -> int:
    """The largest context id this worker can make (its rank is in the high 16 bits)."""
    ours = _ours()
    if ours is None:
        return int(_torch()._get_max_id())
    return ours.max_context_id()


def _get_debug_info() -> dict[str, Any]:
    """``num_autograd_contexts`` and ``num_current_backward_passes`` on this worker."""
    ours = _ours()
    if ours is None:
        info: dict[str, Any] = _torch()._get_debug_info()
        return info
    return debug_info(ours)
