"""A rank that raises inside Join and stays alive does not block the others.

Three ranks; rank 1 raises between two iterations and then waits in a barrier of the
default group until the others are out (its process, and its process group, stay alive:
an idle peer, not a dead one, is what the others must get away from). The other ranks are
blocked in a collective that a joinable issued in the loop body (a plain custom joinable's
own all-reduce, DDP's backward) or are shadowing in the join loop. Each must raise
RankFailedError naming rank 1, released by the failure protocol: no collective error behind
its exception (a survivor released by the group's timeout raises with gloo's "Timed out"
behind it), and before the group's timeout could have fired. Rank 1's own exception must
come out of its Join. What is checked is how a rank was released, never how fast: the
machine may be loaded (how fast: benchmarks/). Each scenario has its own gloo group with a
20 s timeout, so a survivor released only by the group's timeout fails the test instead of
hanging it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.distributed.algorithms.join import Joinable as TorchJoinable
from torch.distributed.algorithms.join import JoinHook as TorchJoinHook
from torch.nn.parallel import DistributedDataParallel as DDP

from rallypoint.join import CollectiveJoinable, Join, JoinOptions
from rallypoint.testing import run_workers

W = 3
FAILING = 1
FAIL_STEP = 3
GROUP_TIMEOUT = 20
MID_ITERATION_TIMEOUT = 3


Scenario = Callable[[dist.ProcessGroup, int, dict[str, float]], None]


class Boom(ValueError):
    pass


class AllReduceJoinable(TorchJoinable):
    """A plain joinable on torch's interface: each step notifies the Join, then issues its
    own blocking all-reduce of ``shape``; its hook shadows that all-reduce with zeros."""

    def __init__(
        self, group: dist.ProcessGroup, shape: tuple[int, ...], notify: Callable[[Any], Any]
    ) -> None:
        super().__init__()
        self.group = group
        self.shape = shape
        self.notify = notify
        self.fail_after_notify: Callable[[], None] = lambda: None

    def step(self) -> torch.Tensor:
        self.notify(self)
        self.fail_after_notify()
        total = torch.ones(self.shape)
        dist.all_reduce(total, group=self.group)
        return total

    def join_hook(self, **kwargs: Any) -> TorchJoinHook:
        owner = self

        class Hook(TorchJoinHook):
            def main_hook(self) -> None:
                dist.all_reduce(torch.zeros(owner.shape), group=owner.group)

        return Hook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.group


def fail_if_due(rank: int, step: int, out: dict[str, float]) -> None:
    if rank == FAILING and step == FAIL_STEP:
        out["failed_at"] = time.time()
        raise Boom(f"bad batch {step}")


def one_joinable(notify: Callable[[Any], Any]) -> Scenario:
    """Every rank working: the others wait in the joinable's own all-reduce. ``notify`` is
    rallypoint's ``Join.notify_join_context`` or torch's (a joinable written for torch)."""

    def scenario(group: dist.ProcessGroup, rank: int, out: dict[str, float]) -> None:
        joinable = AllReduceJoinable(group, (4,), notify)
        with Join([joinable]):
            for step in range(10):
                fail_if_due(rank, step, out)
                joinable.step()

    return scenario


def several_joinables(group: dist.ProcessGroup, rank: int, out: dict[str, float]) -> None:
    """Two custom joinables and a CollectiveJoinable; rank 0 has run out and shadows in the
    join loop while rank 2 still works."""
    first = AllReduceJoinable(group, (2,), Join.notify_join_context)
    second = AllReduceJoinable(group, (3, 5), TorchJoin.notify_join_context)
    sync = CollectiveJoinable(process_group=group)
    with Join([first, second, sync]):
        for step in range(2 if rank == 0 else 10):
            fail_if_due(rank, step, out)
            first.step()
            second.step()
            sync.average(torch.full((3,), float(step)))


def ddp_model(group: dist.ProcessGroup) -> DDP:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return DDP(model, process_group=group)


def ddp_join_mode(group: dist.ProcessGroup, rank: int, out: dict[str, float]) -> None:
    """DDP in join mode from the first step plus a custom joinable: the others wait in
    DDP's backward all-reduce or in the joinable's all-reduce."""
    model = ddp_model(group)
    extra = AllReduceJoinable(group, (2,), Join.notify_join_context)
    with Join([model, extra], join_options=JoinOptions(defer_join_mode=False)):
        for step in range(10):
            fail_if_due(rank, step, out)
            model(torch.ones(3, 4)).sum().backward()
            extra.step()


def ddp_deferred_after_switch(group: dist.ProcessGroup, rank: int, out: dict[str, float]) -> None:
    """Deferred join mode, after rank 0 ran out and every rank switched to join mode."""
    model = ddp_model(group)
    with Join([model]):
        for step in range(2 if rank == 0 else 10):
            fail_if_due(rank, step, out)
            model(torch.ones(3, 4)).sum().backward()


def mid_iteration(group: dist.ProcessGroup, rank: int, out: dict[str, float]) -> None:
    """Rank 1 raises inside an iteration, after its notify and before its all-reduce. No
    rank is past that iteration, so there is nothing to shadow (a shadow would start with
    the notify all-reduce against the others' pending all-reduce of another size, which
    gloo answers with an abort): the others wait for the group's (short) timeout and still
    name the failed rank."""
    joinable = AllReduceJoinable(group, (4,), Join.notify_join_context)
    with Join([joinable]):
        for step in range(10):
            if step == FAIL_STEP:
                joinable.fail_after_notify = lambda: fail_if_due(rank, FAIL_STEP, out)
            joinable.step()


SCENARIOS: dict[str, Scenario] = {
    "one_joinable": one_joinable(Join.notify_join_context),
    "torch_style_joinable": one_joinable(TorchJoin.notify_join_context),
    "several_joinables": several_joinables,
    "ddp_join_mode": ddp_join_mode,
    "ddp_deferred_after_switch": ddp_deferred_after_switch,
    "mid_iteration": mid_iteration,
}
RELEASED_BY_TIMEOUT = {"mid_iteration"}


def run_scenarios() -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    groups = {
        name: dist.new_group(
            backend="gloo",
            timeout=datetime.timedelta(
                seconds=MID_ITERATION_TIMEOUT if name in RELEASED_BY_TIMEOUT else GROUP_TIMEOUT
            ),
        )
        for name in SCENARIOS
    }
    results: dict[str, Any] = {}
    for name, scenario in SCENARIOS.items():
        dist.barrier()  # every rank starts each scenario together
        out: dict[str, float] = {}
        try:
            scenario(groups[name], rank, out)
            results[name] = ("returned", "", None, time.time(), out, "")
        except Exception as exc:
            rank_named = getattr(exc, "rank", None)
            # what released it: a collective's error (a timeout), or nothing (the protocol)
            cause = exc.__cause__ or exc.__context__
            behind = "" if cause is None else f"{type(cause).__name__}: {cause}"
            results[name] = (type(exc).__name__, str(exc), rank_named, time.time(), out, behind)
        # rank 1 waits here, alive and idle, until the others are out; they pass it only
        # after their own scenario ended (in the test's bound, or the group's timeout)
        dist.barrier()
    return results  # no destroy_process_group: the scenario groups are unusable now


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(run_scenarios, W, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_failing_rank_gets_its_own_exception_promptly(
    results: list[dict[str, Any]], name: str
) -> None:
    kind, message, _, raised_at, out, _ = results[FAILING][name]
    assert (kind, message) == ("Boom", f"bad batch {FAIL_STEP}")
    # it shadows for the others, then leaves: not after a group's timeout (nor a hang)
    assert raised_at - out["failed_at"] < GROUP_TIMEOUT


@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - RELEASED_BY_TIMEOUT))
@pytest.mark.parametrize("survivor", [r for r in range(W) if r != FAILING])
def test_every_survivor_is_released_by_the_protocol_while_the_failed_rank_lives(
    results: list[dict[str, Any]], name: str, survivor: int
) -> None:
    failed_at = results[FAILING][name][4]["failed_at"]
    kind, message, failed_rank, raised_at, _, behind = results[survivor][name]
    assert kind == "RankFailedError", message
    assert failed_rank == FAILING
    assert message.startswith(f"rank 1 failed inside the Join context: Boom: bad batch {FAIL_STEP}")
    assert behind == "", f"released by a collective's error, not the protocol: {behind}"
    assert raised_at - failed_at < GROUP_TIMEOUT  # before the group's timeout could fire


@pytest.mark.parametrize("survivor", [r for r in range(W) if r != FAILING])
def test_a_failure_inside_an_iteration_is_not_shadowed_and_still_named(
    results: list[dict[str, Any]], survivor: int
) -> None:
    failed_at = results[FAILING]["mid_iteration"][4]["failed_at"]
    kind, message, failed_rank, raised_at, _, behind = results[survivor]["mid_iteration"]
    assert kind == "RankFailedError", message
    assert failed_rank == FAILING
    assert "Timed out" in behind, behind  # released by the group's (short) timeout
    assert raised_at - failed_at < GROUP_TIMEOUT  # and no hang
