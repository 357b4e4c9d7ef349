"""Fixtures shared by the multi-node agent tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rallypoint.testing._store_host import store_host


@pytest.fixture
def endpoint() -> Iterator[str]:
    """``HOST:PORT`` of a c10d rendezvous store hosted for the test (so it outlives the
    agents) in a process of its own; the agents get ``--rdzv-conf is_host=false``."""
    with store_host() as port:
        yield f"127.0.0.1:{port}"
