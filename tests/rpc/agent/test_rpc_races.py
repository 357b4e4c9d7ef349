"""Containers that one thread iterates while another changes them.

The interpreter may switch threads between any two instructions, and a garbage
collection (which runs Python code: finalizers, GC callbacks) may start at any allocation,
even amid a C-level copy that allocates per item. A loop over a dict that another thread
changes then raises ``dictionary changed size during iteration``. Each test here makes
the switch happen at the worst point, deterministically: a trace function stops the
iterating thread mid-loop and lets another thread run there, or acts for it.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import pytest
import torch

from rallypoint.rpc._transport._shm import RemoteSegments, SegmentPool
from rallypoint.rpc.dist_autograd._context import AutogradContext, receive_message
from rallypoint.rpc.dist_autograd._engine import Round


@contextmanager
def _between_instructions(code: Any, act: Callable[[FrameType], None]) -> Iterator[None]:
    """Run ``act(frame)`` before each instruction of ``code`` (and of the comprehensions
    it runs) on this thread, as if another thread ran there."""

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            act(frame)
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        inside = frame.f_code is code or (frame.f_back is not None and frame.f_back.f_code is code)
        if not inside:
            return None
        frame.f_trace_opcodes = True
        return local

    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(None)


@pytest.mark.timeout(30)
def test_a_new_segment_arriving_while_a_sender_looks_for_a_handed_back_one() -> None:
    """A thread sending a large tensor looks through the peer's segments (``hand_back``)
    while the connection's reader maps a new one that just arrived (``add``). The sender
    raised ``RuntimeError`` (its call failed; an ``@async_execution`` reply was never
    sent). Now the reader waits for the sender's lock."""
    pool = SegmentPool(1 << 26)
    segments = [pool.put(torch.zeros(1 << 16, dtype=torch.uint8)) for _ in range(3)]
    extra = pool.put(torch.zeros(1 << 17, dtype=torch.uint8))
    assert all(segments) and extra is not None
    remote = RemoteSegments()
    for segment in segments:
        assert segment is not None
        remote.add(segment.id, os.dup(segment.fd))
    last = segments[-1]
    assert last is not None
    view = remote.tensor(last.id, 1 << 16)  # received: a view of the last segment mapped
    readers: list[threading.Thread] = []

    def reader_maps_a_new_segment(frame: FrameType) -> None:
        if readers or "seg_id" not in frame.f_locals:
            return  # once, inside the loop
        reader = threading.Thread(target=remote.add, args=(extra.id, os.dup(extra.fd)))
        readers.append(reader)
        reader.start()
        reader.join(0.3)  # it runs now, unless it must wait for the sender

    try:
        with _between_instructions(RemoteSegments.hand_back.__code__, reader_maps_a_new_segment):
            handed = remote.hand_back(view)
        assert handed == last.id
        assert readers, "the loop never ran"
        readers[0].join(10)
        assert not readers[0].is_alive()
        assert remote.tensor(extra.id, 1 << 17).numel() == 1 << 17  # it was mapped after all
    finally:
        del view
        remote.close()
        pool.close()


@pytest.mark.timeout(30)
def test_a_message_received_while_a_round_of_backward_starts() -> None:
    """A round of ``dist_autograd.backward`` starts (under the context's lock) while a
    reader thread decodes another message of the same context, which records a receive
    without that lock (a driver's next micro-batch). Building the round raised
    ``RuntimeError`` and the backward failed."""
    ctx = AutogradContext(1)
    outs: list[torch.Tensor] = []
    for message_id in range(1, 5):
        outs += receive_message(ctx.recvs, "peer", message_id, [torch.ones(3, requires_grad=True)])
    loss = torch.stack([out.sum() for out in outs]).sum()
    more = iter(range(100, 100_000))

    def reader_decodes_a_message(frame: FrameType) -> None:
        receive_message(ctx.recvs, "peer", next(more), [torch.ones(3, requires_grad=True)])

    with ctx.lock, _between_instructions(Round.__init__.__code__, reader_decodes_a_message):
        rnd = Round(7, False, ctx.sources([loss]), ctx.recvs)
    assert next(more) > 101  # messages arrived amid the construction
    assert all(rnd.reaches(node) for node in [out.grad_fn for out in outs])
