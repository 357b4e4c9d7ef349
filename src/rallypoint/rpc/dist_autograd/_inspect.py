"""A look into distributed autograd contexts: torch's private helpers, on rallypoint's.

``torch.distributed.autograd`` has underscore functions (``_current_context()``,
``_retrieve_context(id)``, ``_get_debug_info()``, ``_get_max_id()``) that its own tests
and debugging tools use; :mod:`rallypoint.rpc.dist_autograd` offers the same names, and
under ``BackendType.RALLYPOINT`` they read rallypoint's contexts through this module.
rallypoint records a send as the gradient edges of its tensors rather than a node, so
:meth:`DistAutogradContext._send_functions` shows each send as a :class:`SendRpcBackward`
whose ``next_functions`` are those edges, as torch's node's are.
"""

from __future__ import annotations

from typing import Any

from torch.autograd.graph import Node

from rallypoint.rpc.dist_autograd._autograd import DistAutograd
from rallypoint.rpc.dist_autograd._context import AutogradContext


class SendRpcBackward:
    """One send of a context, as torch's node shows it: where its gradient goes."""

    __slots__ = ("next_functions",)

    def __init__(self, edges: list[tuple[Node, int]]) -> None:
        self.next_functions: tuple[tuple[Node, int], ...] = tuple(edges)

    def name(self) -> str:
        return "torch::distributed::autograd::SendRpcBackward"

    def __repr__(self) -> str:
        return f"<SendRpcBackward: {len(self.next_functions)} tensor(s)>"


class DistAutogradContext:
    """One worker's part of a context (torch's ``DistAutogradContext``; a live view)."""

    __slots__ = ("_autograd", "_ctx")

    def __init__(self, autograd: DistAutograd, ctx: AutogradContext) -> None:
        self._autograd = autograd
        self._ctx = ctx

    def _context_id(self) -> int:
        return self._ctx.id

    def _send_functions(self) -> dict[int, SendRpcBackward]:
        """Message id -> the send of that message (tensors that require grad only)."""
        sends = list(self._ctx.sends.items())
        return {message_id: SendRpcBackward(send.edges) for message_id, send in sends}

    def _recv_functions(self) -> dict[int, Node]:
        """Message id -> the ``RecvRpcBackward`` node of that message's tensors."""
        recvs = list(self._ctx.recvs.items())
        return {record.message_id: node for node, record in sorted(recvs, key=_message_id)}

    def _known_worker_ids(self) -> set[int]:
        """The ranks of the workers this context sent messages to or got messages from."""
        return self._autograd.known_worker_ids(self._ctx)

    def __repr__(self) -> str:
        return f"DistAutogradContext(context_id={self._ctx.id})"


def _message_id(item: tuple[Node, Any]) -> int:
    message_id: int = item[1].message_id
    return message_id


def debug_info(autograd: DistAutograd) -> dict[str, Any]:
    """torch's ``_get_debug_info()``: contexts on this worker, backward passes running."""
    return {
        "num_autograd_contexts": len(autograd),
        "num_current_backward_passes": autograd.backward_passes(),
    }
