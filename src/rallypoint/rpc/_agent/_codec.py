"""Encoding calls and replies for one peer: its device map, RRefs, and autograd tags.

A call moves tensors with this worker's device map for the callee, a reply with the
inverse of the caller's map, a gradient with the map its caller names (torch's rules,
:mod:`rallypoint.rpc._device_maps`); CUDA tensors go by the routes of
:class:`~rallypoint.rpc._transport._cuda_routes.CudaRouter`, and every RRef in the
message is forked through the worker's RRef table. Inside a distributed autograd context
a message starts with a tag (``b"AG"``, the context id and a message id) before the
pickle, so the callee runs the call in the context and records the sends and receives.
Outside a context nothing changes.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import torch

from rallypoint.rpc._agent._peers import PeerTable
from rallypoint.rpc._device_maps import DeviceMap, Sent, gradient_map
from rallypoint.rpc._rref._rref import RRef, reduce_rref
from rallypoint.rpc._rref._table import RRefTable
from rallypoint.rpc._transport import _wire
from rallypoint.rpc._transport._cuda_routes import CudaRouter
from rallypoint.rpc.dist_autograd._autograd import DistAutograd
from rallypoint.rpc.dist_autograd._context import AutogradContext

TAG = struct.Struct("<2sqq")
TAG_MAGIC = b"AG"
_TAG_FIRST = TAG_MAGIC[0]


class Codec:
    """Pickles messages for a peer (tensors out of band, see
    :mod:`rallypoint.rpc._transport._wire`)."""

    def __init__(
        self,
        peers: PeerTable,
        rrefs: RRefTable,
        autograd: DistAutograd,
        cuda: CudaRouter | None = None,
    ) -> None:
        self._peers = peers
        self._fork = functools.partial(reduce_rref, rrefs)
        self._autograd = autograd
        self.cuda = cuda

    def call(
        self,
        dst: str,
        payload: Any,
        ctx: AutogradContext | None = None,
        device_map: DeviceMap | None = None,
    ) -> tuple[bytes, list[torch.Tensor]]:
        """A call's ``(func, args, kwargs)`` for ``dst``: this worker's map for ``dst``, or
        ``device_map`` when given (a gradient's, ``{}`` for none)."""
        if device_map is None:
            device_map = self._peers.device_maps.get(dst)
        return self._encode(dst, payload, device_map, ctx, always=True, response=False)

    def reply(
        self, dst: str, value: Any, ctx: AutogradContext | None = None
    ) -> tuple[bytes, list[torch.Tensor]]:
        """A call's return value for the caller ``dst``: the inverse of ``dst``'s map."""
        device_map = self._peers.reverse_maps.get(dst)
        return self._encode(dst, value, device_map, ctx, always=False, response=True)

    def _encode(
        self,
        dst: str,
        obj: Any,
        device_map: DeviceMap | None,
        ctx: AutogradContext | None,
        *,
        always: bool,
        response: bool,
    ) -> tuple[bytes, list[torch.Tensor]]:
        """``obj`` for ``dst``; within an autograd context, tagged with it (``always``: even
        when no tensor needs a gradient)."""
        if ctx is None:
            return _wire.encode(
                obj,
                dst=dst,
                device_map=device_map,
                rref_type=RRef,
                rref_hook=self._fork,
                response=response,
                cuda=self.cuda,
            )
        # as in torch, tensors sent with grad mode off are not recorded
        needs_grad: list[torch.Tensor] | None = [] if torch.is_grad_enabled() else None
        data, raws = _wire.encode(
            obj,
            dst=dst,
            device_map=device_map,
            rref_type=RRef,
            rref_hook=self._fork,
            grad_sink=needs_grad,
            response=response,
            cuda=self.cuda,
        )
        message_id = 0
        if needs_grad:
            message_id = self._autograd.record_send(ctx, dst, needs_grad, device_map or None)
        elif not always:
            return data, raws
        ctx.known.add(dst)
        return TAG.pack(TAG_MAGIC, ctx.id, message_id) + data, raws

    def decode(
        self,
        src: str,
        data: bytes,
        tensors: list[torch.Tensor],
        *,
        kind: Sent = Sent.CALL,
        devices: set[torch.device] | None = None,
        tolerant: bool = False,
    ) -> tuple[Any, AutogradContext | None]:
        """A message of ``kind`` from ``src``, and the autograd context it arrived in (if
        tagged). ``devices`` gets the GPUs its tensors landed on; ``tolerant``: see
        :func:`~rallypoint.rpc._transport._wire.decode`."""
        if not data or data[0] != _TAG_FIRST:
            return _wire.decode(data, tensors, devices=devices, tolerant=tolerant), None
        magic, context_id, message_id = TAG.unpack_from(data)
        if magic != TAG_MAGIC:
            raise ValueError(f"bad message tag {magic!r}")
        ctx = self._autograd.get_or_create(context_id)
        ctx.known.add(src)
        body = memoryview(data)[TAG.size :]
        if not message_id:
            return _wire.decode(body, tensors, devices=devices, tolerant=tolerant), ctx
        peers = self._peers
        back = gradient_map(kind, src, peers.device_maps, peers.reverse_maps)
        hook = self._autograd.receiver(ctx, src, message_id, back or None)
        value = _wire.decode(body, tensors, recv_hook=hook, devices=devices, tolerant=tolerant)
        return value, ctx
