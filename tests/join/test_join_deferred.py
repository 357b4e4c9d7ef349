"""Deferred join mode: DDP stays out of join mode until a rank runs out, then every rank
switches at one agreed forward; the trained parameters must equal torch's Join exactly.

One launch of three gloo ranks with uneven inputs runs every scenario: plain training,
gradient accumulation with ``no_sync``, ``find_unused_parameters``, a switch exactly at the
shortest rank's length, and the cases where join mode cannot be deferred.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.nn.parallel import DistributedDataParallel as DDP

from rallypoint.join import CollectiveJoinable, Join, JoinOptions
from rallypoint.testing import run_workers

W = 3
LR = 0.1
FAST = JoinOptions(poll_interval=datetime.timedelta(milliseconds=20))
EAGER = JoinOptions(defer_join_mode=False)


def num_inputs(rank: int) -> int:
    return (4, 6, 9)[rank]


class Branchy(torch.nn.Module):
    """A model whose second head is used only on even steps (find_unused_parameters)."""

    def __init__(self, with_extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)
        self.extra = torch.nn.Linear(8, 1) if with_extra else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h)
        return out + self.extra(h) if self.extra is not None and use_extra else out


def batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(3, 4, generator=gen)


def train(
    make_join: Callable[[DDP], Any],
    rank: int,
    *,
    accumulate: int = 1,
    find_unused: bool = False,
    pause_at: int | None = None,
) -> dict[str, Any]:
    model = DDP(Branchy(with_extra=find_unused), find_unused_parameters=find_unused)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    modes: list[bool] = []
    model.register_forward_hook(lambda m, a, o: modes.append(m._join_config.enable))
    with make_join(model) as join:
        for step in range(num_inputs(rank)):
            if step == pause_at and rank != 0:
                time.sleep(0.5)  # the others record before their next forward
            last = (step + 1) % accumulate == 0
            ctx = model.no_sync() if not last else contextlib.nullcontext()
            with ctx:
                model(batch(rank, step), use_extra=find_unused and step % 2 == 0).sum().backward()
            if last:
                opt.step()
                opt.zero_grad()
    summary = getattr(join, "summary", None)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "modes": modes,
        "shadowed": summary.shadowed if summary is not None else None,
        "config_after": model._join_config.enable,
    }


def max_diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(xs, ys, strict=True))


def blockers(rank: int) -> dict[str, str]:
    def blocker(joinables: list[Any], **kwargs: Any) -> str:
        return str(Join(joinables, **kwargs)._deferred_blocker)

    class OnMeta(DDP):  # stands in for a DDP on a GPU (none in CI)
        @property
        def join_device(self) -> torch.device:
            return torch.device("meta")

    plain = DDP(Branchy())
    with_bn = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    sync = CollectiveJoinable()
    return {
        "plain": blocker([plain]),
        "with_collective": blocker([plain, sync]),
        "divide": blocker([plain], divide_by_initial_world_size=False),
        "buffers": blocker([with_bn]),
        "throw": blocker([plain], throw_on_early_termination=True),
        "disabled": blocker([plain], enable=False),
        "no_failure_detection": blocker([plain], join_options=JoinOptions(detect_failures=False)),
        "option_off": blocker([plain], join_options=EAGER),
        "not_first": blocker([sync, plain]),
        "not_cpu": blocker([OnMeta(Branchy())]),
    }


def scenarios() -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    cases: dict[str, dict[str, Any]] = {
        "plain": {},
        "accumulate": {"accumulate": 2},
        "unused": {"find_unused": True},
        "switch_at_join": {"pause_at": num_inputs(0)},
    }
    for name, kwargs in cases.items():
        deferred = train(lambda m: Join([m], join_options=FAST), rank, **kwargs)
        eager = train(lambda m: Join([m], join_options=EAGER), rank, **kwargs)
        theirs = train(lambda m: TorchJoin([m]), rank, **kwargs)
        out[name] = {
            "vs_torch": max_diff(deferred["params"], theirs["params"]),
            "eager_vs_torch": max_diff(eager["params"], theirs["params"]),
            "modes": deferred["modes"],
            "eager_modes": eager["modes"],
            "shadowed": deferred["shadowed"],
            "eager_shadowed": eager["shadowed"],
            "config_after": deferred["config_after"],
        }
    out["blockers"] = blockers(rank)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(scenarios, W, timeout=150)


CASES = ["plain", "accumulate", "unused", "switch_at_join"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_deferred_join_mode_trains_exactly_like_torch_join(
    results: list[dict[str, Any]], case: str
) -> None:
    for res in results:
        assert res[case]["vs_torch"] == 0.0
        assert res[case]["eager_vs_torch"] == 0.0
        assert res[case]["config_after"] is False  # restored after the context


@pytest.mark.parametrize("case", CASES)
def test_join_mode_starts_where_the_shortest_rank_ran_out(
    results: list[dict[str, Any]], case: str
) -> None:
    shortest = num_inputs(0)
    for rank, res in enumerate(results):
        modes = res[case]["modes"]
        assert res[case]["eager_modes"] == [True] * num_inputs(rank)
        # out of join mode up to the switch, which is the shortest rank's length or the
        # forward that was running when the watcher noticed: at most one later, or up to
        # the next synchronizing forward with no_sync accumulation
        switch = modes.index(True) if True in modes else len(modes)
        assert modes == [False] * switch + [True] * (len(modes) - switch)
        slack = 2 if case == "accumulate" else 1
        if rank > 0:
            assert shortest <= switch <= shortest + slack, modes
        if case == "switch_at_join" and rank > 0:
            assert switch == shortest, modes


@pytest.mark.parametrize("case", CASES)
def test_summary_counts_the_same_shadowed_iterations(
    results: list[dict[str, Any]], case: str
) -> None:
    longest = max(num_inputs(r) for r in range(W))
    for rank, res in enumerate(results):
        assert res[case]["shadowed"] == res[case]["eager_shadowed"]
        assert res[case]["shadowed"][rank] == longest - num_inputs(rank)


def test_join_mode_is_deferred_only_where_it_is_safe(results: list[dict[str, Any]]) -> None:
    reasons = results[0]["blockers"]
    assert reasons["plain"] == ""
    assert reasons["with_collective"] == ""
    assert "divide_by_initial_world_size=False" in reasons["divide"]
    assert "buffers" in reasons["buffers"]
    assert "throw_on_early_termination" in reasons["throw"]
    assert "enable=False" in reasons["disabled"]
    assert "detect_failures=False" in reasons["no_failure_detection"]
    assert "defer_join_mode=False" in reasons["option_off"]
    assert "not a DistributedDataParallel" in reasons["not_first"]
    assert "join device meta" in reasons["not_cpu"]


def test_defer_join_mode_option_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="defer_join_mode must be a bool"):
        JoinOptions(defer_join_mode="yes")  # type: ignore[arg-type]
