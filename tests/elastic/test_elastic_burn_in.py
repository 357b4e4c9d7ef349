"""The burn-in's verdict (``elastic._burn_in.slow_node``) on made-up link times; the real
measurement runs in ``tests/agent/test_agent_burn_in.py``."""

from __future__ import annotations

from rallypoint.elastic._burn_in import LinkTimes, slow_node

FAST = 0.01


def _times(n: int, slow_out: int | None = None, slow_in: int | None = None) -> LinkTimes:
    """Receive times when node ``slow_out`` sends slowly / ``slow_in`` receives slowly."""
    forward, backward = [], []
    for g in range(n):
        fwd_from, bwd_from = (g - 1) % n, (g + 1) % n
        forward.append(1.5 if slow_in == g or slow_out == fwd_from else FAST)
        backward.append(1.5 if slow_in == g or slow_out == bwd_from else FAST)
    return LinkTimes(forward=forward, backward=backward)


def test_a_slow_sender_or_receiver_is_named_not_its_neighbours() -> None:
    for n in (3, 4, 8):
        for g in range(n):
            assert slow_node(_times(n, slow_out=g))[:2] == (g, 1.5)  # type: ignore[index]
            assert slow_node(_times(n, slow_in=g))[:2] == (g, 1.5)  # type: ignore[index]


def test_nobody_is_named_without_a_slow_link() -> None:
    assert slow_node(_times(5)) is None
    jitter = LinkTimes(forward=[0.01, 0.05, 0.012, 0.011], backward=[0.01, 0.011, 0.06, 0.01])
    assert slow_node(jitter) is None, "tiny times vary by large factors: under SLOW_SECONDS"


def test_two_nodes_cannot_tell_which_side_is_slow() -> None:
    assert slow_node(_times(2, slow_out=1)) is None
