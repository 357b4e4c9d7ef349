"""``HTTPTransport``'s steps: a receiver that asks for a step before its source offers it
waits for it (torchft's multi-rank test asks as soon as a barrier lets it, which on a loaded
machine can be before the source's ``send_checkpoint``); an earlier step is refused."""

from __future__ import annotations

import threading
import urllib.error
from datetime import timedelta
from typing import Any

import pytest
import torch

from rallypoint.ft.checkpointing import HTTPTransport

WAIT = timedelta(seconds=10)


@pytest.mark.timeout(30)
def test_a_later_step_waits_until_offered_and_an_earlier_one_is_refused() -> None:
    source: HTTPTransport[dict[str, Any]] = HTTPTransport(WAIT, num_chunks=0)
    receiver: HTTPTransport[dict[str, Any]] = HTTPTransport(WAIT, num_chunks=0)
    try:
        source.send_checkpoint([1], 1, {"w": torch.ones(2)}, WAIT)  # serving step 1
        got: list[Any] = []
        early = threading.Thread(
            target=lambda: got.append(receiver.recv_checkpoint(0, source.metadata(), 2, WAIT))
        )
        early.start()
        early.join(0.5)  # asked for step 2 while step 1 is served: it waits, no 400
        assert early.is_alive() and not got
        source.disallow_checkpoint()
        source.send_checkpoint([1], 2, {"w": torch.full((2,), 2.0)}, WAIT)
        early.join(20)
        assert not early.is_alive() and torch.equal(got[0]["w"], torch.full((2,), 2.0))
        with pytest.raises(urllib.error.HTTPError, match="serving 2 but got step=1"):
            receiver.recv_checkpoint(0, source.metadata(), 1, WAIT)
        with pytest.raises(Exception, match="timed out"):  # step 3 is never offered
            receiver.recv_checkpoint(0, source.metadata(), 3, timedelta(milliseconds=300))
    finally:
        source.shutdown()
        receiver.shutdown()
