"""Encoding calls and replies for one peer: its device map, and RRefs forked on the way.

A call to ``dst`` moves tensors with this worker's device map for ``dst``; a reply to
``dst`` with the inverse of ``dst``'s map onto this worker (torch's rule). Every RRef in
the message is forked through the worker's RRef table.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rallypoint.rpc import _wire
from rallypoint.rpc._peers import PeerTable
from rallypoint.rpc._rref import RRef, reduce_rref
from rallypoint.rpc._rref_table import RRefTable


class Codec:
    """Pickles messages for a peer (tensors out of band, see :mod:`rallypoint.rpc._wire`)."""

    def __init__(self, peers: PeerTable, rrefs: RRefTable) -> None:
        self._peers = peers
        self._fork = functools.partial(reduce_rref, rrefs)

    def call(self, dst: str, payload: Any) -> tuple[bytes, list[torch.Tensor]]:
        """A call's ``(func, args, kwargs)`` for ``dst``: this worker's map for ``dst``."""
        device_map = self._peers.device_maps.get(dst)
        return _wire.encode(
            payload, dst=dst, device_map=device_map, rref_type=RRef, rref_hook=self._fork
        )

    def reply(self, dst: str, value: Any) -> tuple[bytes, list[torch.Tensor]]:
        """A call's return value for the caller ``dst``: the inverse of ``dst``'s map."""
        device_map = self._peers.reverse_maps.get(dst)
        return _wire.encode(
            value, dst=dst, device_map=device_map, rref_type=RRef, rref_hook=self._fork
        )
