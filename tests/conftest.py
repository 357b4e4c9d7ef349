"""Session-wide set-up of rallypoint's own suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rallypoint.testing import worker_zygote
from rallypoint.testing._zygote import Zygote


@pytest.fixture(scope="session", autouse=True)
def zygote() -> Iterator[Zygote]:
    """Every ``run_workers`` worker of the session is forked from one single-threaded copy
    of this process, made before the first test starts a thread (see
    ``rallypoint.testing._zygote``: a worker forked from this process while one of its
    threads looked a name up blocked for good in its own store connect)."""
    with worker_zygote() as made:
        yield made
