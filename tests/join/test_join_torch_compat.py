"""torch's DistributedDataParallel and ZeroRedundancyOptimizer inside rallypoint's Join.

They implement torch's Joinable and call torch's static ``Join.notify_join_context``; the
results must equal a single-process reference and what torch's own Join gives.
"""

from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import Joinable as TorchJoinable
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from rallypoint.join import CollectiveJoinable, Join
from rallypoint.testing import run_workers

W = 2
LR = 0.1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def num_inputs(rank: int) -> int:
    return 4 + 3 * rank


def batch(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(3, 4, generator=gen)


def reference(divide_by_initial_world_size: bool) -> list[torch.Tensor]:
    """One process, one model: each step sums the losses of the ranks still working and
    divides by the initial world size or by the number of those ranks."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(max(num_inputs(r) for r in range(W))):
        active = [r for r in range(W) if step < num_inputs(r)]
        opt.zero_grad()
        loss = sum(model(batch(r, step)).sum() for r in active)
        divisor = W if divide_by_initial_world_size else len(active)
        (loss / divisor).backward()  # type: ignore[union-attr]
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_ddp(join_cls: Any, divide: bool, rank: int) -> list[torch.Tensor]:
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with join_cls([model], divide_by_initial_world_size=divide):
        for step in range(num_inputs(rank)):
            opt.zero_grad()
            model(batch(rank, step)).sum().backward()
            opt.step()
    # outside the context DDP must be back to normal: an even step works
    assert model._join_config.enable is (join_cls is TorchJoin)
    return [p.detach().clone() for p in model.parameters()]


def train_ddp_iterate(divide: bool, rank: int) -> tuple[list[torch.Tensor], list[bool]]:
    """rallypoint's Join.iterate: join mode only for the iterations that need it."""
    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    modes = []
    with Join([model], divide_by_initial_world_size=divide) as join:
        for step in join.iterate(range(num_inputs(rank))):
            modes.append(model._join_config.enable)
            opt.zero_grad()
            model(batch(rank, step)).sum().backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()], modes


def train_ddp_zero(join_cls: Any, rank: int) -> list[torch.Tensor]:
    model = DDP(make_model())
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=LR)
    sync = CollectiveJoinable()
    losses = []
    joinables = [model, opt] if join_cls is TorchJoin else [model, opt, sync]
    with join_cls(joinables):
        for step in range(num_inputs(rank)):
            opt.zero_grad()
            loss = model(batch(rank, step)).sum()
            loss.backward()
            opt.step()
            if join_cls is not TorchJoin:
                losses.append(sync.average(loss.detach()).item())
    return [p.detach().clone() for p in model.parameters()]


def throw_mode(rank: int) -> tuple[str, str] | None:
    """torch's notify inside DDP.forward raises on the working rank."""
    model = DDP(make_model())
    try:
        with Join([model], throw_on_early_termination=True):
            for step in range(num_inputs(rank)):
                model(batch(rank, step)).sum().backward()
    except RuntimeError as exc:
        return (type(exc).__name__, str(exc))
    return None


def max_diff(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(xs, ys, strict=True))


def scenarios() -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for divide in (True, False):
        ours = train_ddp(Join, divide, rank)
        theirs = train_ddp(TorchJoin, divide, rank)
        ref = reference(divide)
        out[f"ddp_{divide}_vs_ref"] = max_diff(ours, ref)
        out[f"ddp_{divide}_vs_torch"] = max_diff(ours, theirs)
        iterated, modes = train_ddp_iterate(divide, rank)
        out[f"iterate_{divide}_vs_torch"] = max_diff(iterated, theirs)
        out["iterate_modes"] = modes
    ours = train_ddp_zero(Join, rank)
    theirs = train_ddp_zero(TorchJoin, rank)
    out["zero_vs_torch"] = max_diff(ours, theirs)
    flat = torch.cat([p.reshape(-1) for p in ours])
    gathered = [torch.zeros_like(flat) for _ in range(W)]
    dist.all_gather(gathered, flat)
    out["zero_ranks_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    out["zero_moved"] = (
        (flat - torch.cat([p.reshape(-1) for p in make_model().parameters()])).abs().max().item()
    )
    out["throw"] = throw_mode(rank)
    # Every DDP model is gone by now (each lived in its own function): a DDP that outlives
    # destroy_process_group() holds the last reference to the group in its C++ Reducer, and
    # freeing it then destroys ProcessGroupGloo while holding the GIL; a gloo worker thread
    # still finishing a collective needs the GIL to free that collective's tensors, and the
    # two wait for each other forever (torch; see docs/join.md).
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(scenarios, W, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("divide", [True, False])
def test_ddp_uneven_inputs_match_single_process_reference(
    results: list[dict[str, Any]], divide: bool
) -> None:
    for res in results:
        assert res[f"ddp_{divide}_vs_ref"] < 1e-5
        assert res[f"ddp_{divide}_vs_torch"] == 0.0


@pytest.mark.parametrize("divide", [True, False])
def test_join_iterate_matches_torch_join_with_join_mode_only_at_the_end(
    results: list[dict[str, Any]], divide: bool
) -> None:
    for res in results:
        assert res[f"iterate_{divide}_vs_torch"] == 0.0
    assert results[0]["iterate_modes"] == [False] * num_inputs(0)
    assert results[1]["iterate_modes"] == [False] * num_inputs(0) + [True] * 3


def test_ddp_and_zero_match_torch_join(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["zero_vs_torch"] == 0.0
        assert res["zero_ranks_equal"]
        assert res["zero_moved"] > 1e-3


def test_ddp_throw_mode_raises_on_every_rank(results: list[dict[str, Any]]) -> None:
    assert results[0]["throw"] == ("EarlyTerminationError", "Rank 0 exhausted all inputs.")
    assert results[1]["throw"] == (
        "EarlyTerminationError",
        "Detected at least one rank that exhausted inputs. Throwing across all ranks.",
    )


def test_rallypoint_joinable_is_a_torch_joinable() -> None:
    assert issubclass(CollectiveJoinable, TorchJoinable)
    assert isinstance(copy.copy(CollectiveJoinable()), TorchJoinable)
