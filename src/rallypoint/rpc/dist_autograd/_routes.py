"""Gradients that would only pass through a worker go straight on: one hop fewer.

A pipeline's driver ``A`` receives a stage's output from ``B`` and sends it, unchanged, to
``C``. In torch's FAST mode the gradient comes back from ``C`` to ``A``, whose pass only
hands it to ``B``: a whole hop on the critical path of every step. Here ``A`` offers a
route for such sends (:func:`offer`); a ``C`` that has not sent those gradients yet sends
them straight to ``B`` and gives ``A`` a notice so that ``A``'s round settles without
them, carried with the credit when ``A`` called ``backward``. Error texts still name
``A``. Routes are offered only for gradients no device map places, since a mapped
gradient lands where the maps of its own hops put it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from torch.autograd.graph import Node

from rallypoint.rpc._device_maps import DeviceMap

if TYPE_CHECKING:
    from rallypoint.rpc.dist_autograd._context import AutogradContext
    from rallypoint.rpc.dist_autograd._engine import Round

Offer: TypeAlias = "tuple[str, int, str, int, tuple[int, ...], int]"
"""A route for one send: the offering worker's name and rank, where its gradients go (the
worker, its message id), the input of that message's node for each tensor of the send,
and how many outputs that node has."""
Items: TypeAlias = "list[tuple[int, int, Any]]"
Notice: TypeAlias = "tuple[str, int]"
"""A send of ``worker`` (its message id) whose gradients went straight on."""


@dataclass(slots=True)
class Outgoing:
    """What one pass sends, per peer (and per device map, in the rare pass that sends a
    peer gradients of messages that came with different maps: see :meth:`add`)."""

    items: dict[str, Items] = field(default_factory=dict)  # gradients: message id, index, grad
    notices: dict[str, list[int]] = field(default_factory=dict)  # sends routed past the peer
    offers: list[tuple[int, Offer]] = field(default_factory=list)  # routes this pass knows
    via: dict[str, int] = field(default_factory=dict)  # a routed peer: the rank it skips
    maps: dict[str, DeviceMap] = field(default_factory=dict)  # a peer's items' map ({}: none)
    extra: list[tuple[str, DeviceMap, Items]] = field(default_factory=list)  # other maps

    def peers(self) -> list[str]:
        return list(dict.fromkeys([*self.items, *self.notices]))

    def add(self, peer: str, items: Items, device_map: DeviceMap | None) -> None:
        """Gradients for ``peer``, placed by ``device_map``; those of another map than the
        peer's first go in a propagation of their own."""
        device_map = device_map or {}
        known = self.maps.get(peer)
        if known is None or peer not in self.items:
            self.maps[peer] = device_map
            self.items.setdefault(peer, []).extend(items)
        elif known == device_map:
            self.items[peer].extend(items)
        else:
            for i, (other, other_map, other_items) in enumerate(self.extra):
                if other == peer and other_map == device_map:
                    self.extra[i] = (peer, device_map, [*other_items, *items])
                    return
            self.extra.append((peer, device_map, list(items)))


def offer(ctx: AutogradContext, rnd: Round, me: tuple[str, int], out: Outgoing) -> None:
    """The routes this pass offers: for this worker's sends whose gradients would only
    pass through it, and those offered to it in the round that are still open."""
    for message_id, send in dict(ctx.sends).items():  # callers record sends meanwhile
        if send.peer == me[0]:
            continue
        if send.device_map:  # a mapped gradient takes every hop (see above)
            continue
        through = rnd.pass_through(message_id, len(send.edges))
        if through is None:
            continue
        node, inputs = through
        record = ctx.recvs[node]
        if record.device_map:
            continue
        if record.peer != send.peer:  # else the gradients would go back where they are
            out.offers.append(
                (message_id, (*me, record.peer, record.message_id, tuple(inputs), record.outputs))
            )
    out.offers += [(message_id, route) for (_, message_id), route in rnd.routes.items()]


def learn(rnd: Round, offers: list[tuple[int, Offer]]) -> None:
    """Routes offered in a propagation that arrived (kept for the rest of the round)."""
    for message_id, route in offers:
        rnd.routes.setdefault((route[0], message_id), route)


def add(
    out: Outgoing, rnd: Round, me: str, peer: str, message_id: int, sent: dict[int, Any]
) -> bool:
    """Send a received message's gradients by the route offered for it, if any."""
    route = rnd.routes.get((peer, message_id))
    if route is None or route[2] == me:
        return False
    del rnd.routes[(peer, message_id)]
    _, via_rank, target, target_id, inputs, outputs = route
    by_input = {inputs[i]: grad for i, grad in sent.items()}
    out.add(target, [(target_id, i, by_input.get(i)) for i in range(outputs)], None)
    out.notices.setdefault(peer, []).append(message_id)
    out.via[target] = via_rank
    return True


def split(notices: list[Notice] | None, me: str) -> tuple[list[int], list[Notice]]:
    """Notices that arrived: the message ids of this worker's, and the others (for the
    worker that called ``backward``, carried on with the credit)."""
    if not notices:
        return [], []
    return [m for owner, m in notices if owner == me], [n for n in notices if n[0] != me]


def sort_notices(
    out: Outgoing, origin: str, carried: list[Notice] | None
) -> tuple[list[Notice], dict[str, list[Notice]]]:
    """A pass's notices: those carried with the credit (the origin's), and those sent to
    their owners, per owner."""
    carried = list(carried or ())
    direct: dict[str, list[Notice]] = {}
    for owner, message_ids in out.notices.items():
        notices = [(owner, m) for m in message_ids]
        if owner == origin:
            carried += notices
        else:
            direct[owner] = notices
    return carried, direct


def routed_nodes(ctx: AutogradContext, message_ids: list[int]) -> set[Node]:
    """The received messages' nodes whose gradients a notice says went straight on."""
    return {node for m in message_ids for node, _ in ctx.sends[m].edges}
