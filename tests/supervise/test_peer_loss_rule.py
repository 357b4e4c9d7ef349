"""The peer-loss rule (``_supervise._peer_loss``): which errors say a peer vanished, and
the one clock on which every wait for such a failure's cause runs."""

from __future__ import annotations

import pytest

from rallypoint._supervise._peer_loss import (
    LOCAL_CAUSE_WAIT,
    CauseWait,
    PeerLoss,
    peer_vanished,
)

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


@pytest.mark.timeout(10)
def test_the_clock_starts_at_the_first_peer_loss_and_runs_one_window() -> None:
    causes = CauseWait(5.0)
    assert causes.since is None
    assert causes.seen(100.0) == 105.0
    assert causes.seen(103.0) == 105.0  # a later one waits on the same clock
    assert causes.since == 100.0


@pytest.mark.timeout(10)
def test_an_exit_waits_for_a_cause_on_its_node_only_and_never_past_the_window() -> None:
    causes = CauseWait(5.0)
    assert causes.exit_until(100.0) == 100.0 + LOCAL_CAUSE_WAIT  # the rest: the coordinator's
    assert causes.exit_until(104.8) == 105.0  # the window started with the first
    raised = CauseWait(5.0)
    raised.seen(100.0)  # a function raised one first
    assert raised.exit_until(100.2) == 100.2 + LOCAL_CAUSE_WAIT


@pytest.mark.timeout(10)
def test_the_failure_carries_the_clock_so_its_next_wait_is_only_the_rest() -> None:
    causes = CauseWait(5.0)
    causes.seen(100.0)
    loss = causes.failure(GLOO, 105.0)  # raised at 100, held the whole window in its attempt
    assert loss == PeerLoss(since=100.0, until=105.0)
    assert loss.left(105.0) == 0.0 and loss.left(106.0) == 0.0
    assert causes.failure("ValueError: boom", 105.0) is None  # its own: nothing to wait for
    fresh = CauseWait(5.0).failure(GLOO, 200.0)  # first seen as the root's exit
    assert fresh == PeerLoss(since=200.0, until=205.0) and fresh.left(201.5) == 3.5
