"""The agent's heartbeat default keeps node-loss detection within 15 s."""

from __future__ import annotations

from datetime import timedelta

import pytest

from rallypoint._elastic._rendezvous import AGENT_KEEP_ALIVE_INTERVAL, create_rendezvous


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("conf", "expected"), [({}, AGENT_KEEP_ALIVE_INTERVAL), ({"keep_alive_interval": "1.5"}, 1.5)]
)
def test_keep_alive_default_and_override(conf: dict[str, str], expected: float) -> None:
    handler = create_rendezvous("c10d", "127.0.0.1:0", "keepalive", 1, 1, conf)
    try:
        settings = handler.settings
        assert settings.keep_alive_interval == timedelta(seconds=expected)
        # a loss is noticed within interval x (missed beats + 1): the 15 s by default
        window = settings.keep_alive_interval * (settings.keep_alive_max_attempt + 1)
        if not conf:
            assert window <= timedelta(seconds=15)
    finally:
        handler.shutdown()
