"""Fixtures shared by the multi-node agent tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def endpoint() -> Iterator[str]:
    """``HOST:PORT`` of a c10d rendezvous store hosted by the test (so it outlives the
    agents); the agents get ``--rdzv-conf is_host=false``."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield f"127.0.0.1:{store.port}"
    del store
