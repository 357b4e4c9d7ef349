"""Both backends pass the same contract through rallypoint.rpc's one API."""

from __future__ import annotations

import pytest

from rallypoint.testing._rpc_contract import run_rpc_contract


@pytest.mark.timeout(100)
@pytest.mark.parametrize("backend", ["RALLYPOINT", "TENSORPIPE"])
def test_rpc_contract(backend: str) -> None:
    results = run_rpc_contract(backend)
    assert len(results[0]) == 28, results[0]
    assert results[1] == [] and results[2] == []
