"""One worker's part of a distributed autograd context: what it sent and received.

A message that carries tensors that require grad is recorded at both ends (torch's FAST
mode): the sender keeps the tensors' gradient edges (:class:`SendRecord`, by message id);
the receiver wraps the tensors in one ``RecvRpcBackward`` node (:func:`receive_message`)
and keeps it (:class:`RecvRecord`), with the device map its gradients go back with (the
inverse of the one the message came with, as torch's ``RecvRpcBackward``). Leaf gradients
of the context's backward passes accumulate here (:meth:`AutogradContext.accumulate`),
never in ``.grad``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch.autograd.graph import Node, get_gradient_edge

from rallypoint.rpc._device_maps import DeviceMap

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rallypoint.rpc.dist_autograd._engine import Round, SourceKey


class _RecvRpc(torch.autograd.Function):
    """Wraps the tensors of one received message that require grad; their node (one per
    message, named as torch's: ``torch::distributed::autograd::RecvRpcBackward``) marks
    where their gradients leave this worker."""

    @staticmethod
    def forward(ctx: Any, *raws: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(raw.detach() for raw in raws)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return grads


# torch's node name: a Function's node is named after its class, plus "Backward"
RecvRpc: type[_RecvRpc] = type(
    "torch::distributed::autograd::RecvRpc", (_RecvRpc,), {"__module__": __name__}
)
_RECV_NAME = "torch::distributed::autograd::RecvRpcBackward"


def _recv_name(node: Any) -> str:
    return _RECV_NAME


# torch's node is a C++ one: Python sees its type as ``CppFunction`` and its name() as
# above, so a received tensor prints ``grad_fn=<RecvRpcBackward>`` (torch's repr shortens
# the names of CppFunction nodes only)
_backward_cls: Any = RecvRpc._backward_cls
_backward_cls.__name__ = _backward_cls.__qualname__ = "CppFunction"
_backward_cls.name = _recv_name


class RecvRecord(NamedTuple):
    peer: str
    message_id: int
    outputs: int  # the message's tensors that require grad: the node's outputs
    device_map: DeviceMap | None = None  # where their gradients go on the peer (None: CPU)


def receive_message(
    recvs: dict[Node, RecvRecord],
    src: str,
    message_id: int,
    raws: list[torch.Tensor],
    device_map: DeviceMap | None = None,
) -> list[torch.Tensor]:
    """Wrap a message's tensors that require grad in one ``RecvRpcBackward`` node; their
    gradients will go back to ``src`` with ``device_map``."""
    outs = recv_wrap(raws)
    record = RecvRecord(src, message_id, len(outs), device_map)
    recvs[outs[0].grad_fn] = record  # type: ignore[index]
    return outs


def recv_wrap(raws: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors ``raws`` (which require grad), as outputs of one new ``RecvRpc`` node (its
    next edges lead to the raws' ``AccumulateGrad`` nodes, which no pass reaches)."""
    if torch.is_grad_enabled():  # it is on the reader threads that decode
        outs: tuple[torch.Tensor, ...] = RecvRpc.apply(*raws)  # type: ignore[no-untyped-call]
    else:
        with torch.enable_grad():
            outs = RecvRpc.apply(*raws)  # type: ignore[no-untyped-call]
    return list(outs)


@dataclass(slots=True)
class SendRecord:
    peer: str
    edges: list[tuple[Node, int]]
    device_map: DeviceMap | None = None  # the map the message went with (None: none)


class AutogradContext:
    """One worker's part of a distributed autograd context."""

    __slots__ = ("grads", "id", "known", "lock", "recvs", "round", "sends")

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self.lock = threading.Lock()
        self.sends: dict[int, SendRecord] = {}
        self.recvs: dict[Node, RecvRecord] = {}
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.known: set[str] = set()
        self.round: Round | None = None

    def accumulate(self, leaves: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add a pass's leaf gradients, as torch's context does (``AccumulateGrad``).

        The first gradient of a leaf is kept as it is if nothing else can see it (else a
        copy: also when the pass gives one gradient to several leaves, every one of them
        gets a copy, as torch's engine holds them all until it is done); later ones are
        added to it in place, so a dict from ``get_gradients`` sees later passes, as
        torch's does.
        """
        grads = self.grads
        # one lookup per leaf (a Parameter's hash is a Python call), unless a leaf comes
        # twice: then each lookup sees what the ones before it added
        olds: list[torch.Tensor | None] | None = None
        if len({id(tensor) for tensor, _ in leaves}) == len(leaves):
            olds = [grads.get(tensor) for tensor, _ in leaves]
        shared: dict[int, int] = {}
        for index, (tensor, grad) in enumerate(leaves):
            if (grads.get(tensor) if olds is None else olds[index]) is None:
                key = _storage(grad)[0]
                shared[key] = shared.get(key, 0) + 1
        for index, (tensor, grad) in enumerate(leaves):
            old = grads.get(tensor) if olds is None else olds[index]
            if old is not None:
                if old.is_sparse and not grad.is_sparse:  # in place is impossible (torch too)
                    grads[tensor] = grad + old
                else:
                    old.add_(grad)
                continue
            storage, keep = _storage(grad)
            if keep and shared[storage] == 1:
                grads[tensor] = grad.detach()
            elif grad.is_sparse:
                grads[tensor] = grad.detach().clone()
            else:  # an expanded view, or the same gradient given to two leaves
                grads[tensor] = grad.clone(memory_format=torch.contiguous_format)

    def sources(self, roots: Sequence[torch.Tensor]) -> list[tuple[SourceKey, Node, int]]:
        """Where a round's gradients enter: the roots, and every tensor sent in the context."""
        found: list[tuple[SourceKey, Node, int]] = [
            ((-1, i), root.grad_fn, root.output_nr)  # type: ignore[misc]
            for i, root in enumerate(roots)
        ]
        # copied as a dict: callers record sends meanwhile, and copying items would
        # allocate a tuple per item (a GC pass there may switch threads)
        for message_id, send in dict(self.sends).items():
            found.extend(((message_id, i), node, nr) for i, (node, nr) in enumerate(send.edges))
        return found


def _storage(grad: torch.Tensor) -> tuple[int, bool]:
    """Where a gradient's data lives, and whether it can be kept as it is (torch's rule:
    a sparse gradient's indices and values must be contiguous, a dense one itself)."""
    if grad.is_sparse:
        values = grad._values()
        keep = grad._indices().is_contiguous() and values.is_contiguous()
        return values.untyped_storage().data_ptr(), keep
    return grad.untyped_storage().data_ptr(), grad.is_contiguous()


def edge_of(tensor: torch.Tensor) -> tuple[Node, int]:
    """Where ``tensor``'s gradient goes: its node and input, as ``get_gradient_edge``."""
    grad_fn = tensor.grad_fn
    if grad_fn is not None:
        return grad_fn, tensor.output_nr
    if tensor.layout != torch.strided:
        # a sparse leaf: torch finds a leaf's AccumulateGrad node through a view, which
        # sparse tensors have none of; a clone's node leads to it as well
        with torch.enable_grad():
            clone_node: Node = tensor.clone().grad_fn  # type: ignore[assignment]
        leaf_node: Node = clone_node.next_functions[0][0]  # type: ignore[assignment]
        return leaf_node, 0
    edge = get_gradient_edge(tensor)
    return edge.node, edge.output_nr
