"""Both backends pass the same contract through rallypoint.rpc's one API."""

from __future__ import annotations

import pytest
import torch

from rallypoint.testing._rpc._contract import PATTERNS, run_rpc_contract, run_rpc_pattern
from rallypoint.testing._rpc._patterns import pipeline_reference
from rallypoint.testing._rpc._program_ddp import assert_same_training
from rallypoint.testing._workers import run_workers


@pytest.mark.timeout(100)
@pytest.mark.parametrize("backend", ["RALLYPOINT", "TENSORPIPE"])
def test_rpc_contract(backend: str) -> None:
    results = run_rpc_contract(backend)
    assert len(results[0]) == 42, results[0]
    assert results[1] == [] and results[2] == []


@pytest.mark.timeout(150)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_rpc_patterns_give_the_same_results_on_both_backends(pattern: str) -> None:
    ours = run_rpc_pattern("RALLYPOINT", pattern, timeout=70)
    theirs = run_rpc_pattern("TENSORPIPE", pattern, timeout=70)
    if pattern == "ddp_rpc":  # trainers' updates meet on the ps: equal up to float rounding
        assert [r is None for r in ours] == [r is None for r in theirs]
        assert_same_training(ours[2], theirs[2])
    else:
        assert ours == theirs
    if pattern == "observer_agent":
        assert len(ours[0]["rewards"]) == 6
    if pattern == "parameter_server":
        assert ours[0]["rounds_ok"] and len(ours[0]["losses"]) == 10
        assert ours[1:] == [{"called_in_shutdown": True}] * 2  # for longer than the timeout
    if pattern == "pipeline":  # and both train as one process would
        reference = run_workers(pipeline_reference, 1, timeout=60)[0]  # not in this process
        assert ours[1:] == [None, None] and len(ours[0]["losses"]) == 3
        for key in ("losses", "first_grads", "params"):
            for got, expected in zip(ours[0][key], reference[key], strict=True):
                torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), msg=key)
    if pattern == "process_group_and_rpc":
        assert ours == [{"got": r + 1, "total": 3.0, "bind_errors": []} for r in range(3)]


def test_unknown_pattern_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown RPC pattern 'nope'"):
        run_rpc_pattern("RALLYPOINT", "nope")
