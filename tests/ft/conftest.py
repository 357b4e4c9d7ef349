"""Replica groups a failed test left running are stopped before the next test."""

from collections.abc import Iterator

import pytest
from _groups import stop_leftovers


@pytest.fixture(autouse=True)
def _no_leftover_groups() -> Iterator[None]:
    yield
    stop_leftovers()
