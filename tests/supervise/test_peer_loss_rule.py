"""The peer-loss rule (``_supervise._peer_loss``): which errors say a peer vanished."""

from __future__ import annotations

import pytest

from rallypoint._supervise._peer_loss import peer_vanished

GLOO = (
    "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5527"
)
TIMED_OUT = (
    "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms "
    "for recv operation to complete"
)


@pytest.mark.timeout(10)
def test_peer_loss_errors_are_recognised() -> None:
    assert peer_vanished(GLOO)
    assert peer_vanished("torch.distributed.DistNetworkError: Connection reset by peer")
    assert not peer_vanished("ValueError: boom") and not peer_vanished("")
    # a collective that timed out names gloo's transport too, but no peer vanished: it is a
    # failure of its own (a multi-node job then does not wait the liveness window for one)
    assert not peer_vanished(TIMED_OUT)
