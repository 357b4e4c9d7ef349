"""A rank that raises inside a Join context makes the other ranks raise, not hang.

Rank 1 raises while its process stays alive (it goes on to the next scenario); rank 0 must
raise RankFailedError naming rank 1 within 10 s. Each scenario runs on its own gloo group,
because a failure leaves collectives pending on the survivor's group for good.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rallypoint.join import CollectiveJoinable, Join, JoinOptions, RankFailedError
from rallypoint.testing import run_workers

FAILING = 1


class Boom(ValueError):
    pass


class Flaky(torch.nn.Module):
    """A model whose forward raises on demand (after DDP's pre-forward collectives)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise Boom("bad batch in forward")
        return self.lin(x)  # type: ignore[no-any-return]


def fail_now(step: int) -> None:
    raise Boom(f"bad batch {step}")


def survivor_in_join_loop(group: dist.ProcessGroup, rank: int) -> None:
    """Rank 0 runs out first and waits in the join loop; rank 1 fails at step 3."""
    sync = CollectiveJoinable(process_group=group)
    with Join([sync]):
        for step in range(2 if rank == 0 else 6):
            if rank == FAILING and step == 3:
                fail_now(step)
            sync.all_reduce(torch.ones(2))


def survivor_in_ddp_main_hook(group: dist.ProcessGroup, rank: int) -> None:
    """Rank 1 fails inside forward, after DDP notified: rank 0 is inside DDP's main hook."""
    module = Flaky()
    model = DDP(module, process_group=group)
    with Join([model]):
        for step in range(2 if rank == 0 else 6):
            module.fail = rank == FAILING and step == 3
            model(torch.ones(2, 4)).sum().backward()


def survivor_in_collective(group: dist.ProcessGroup, rank: int) -> None:
    """Both ranks still working: rank 0 waits in CollectiveJoinable.average."""
    sync = CollectiveJoinable(process_group=group)
    with Join([sync]):
        for step in range(5):
            if rank == FAILING and step == 2:
                fail_now(step)
            sync.average(torch.ones(3))


def survivor_in_throw_check(group: dist.ProcessGroup, rank: int) -> None:
    """throw_on_early_termination: rank 0 waits in notify_join_context's check."""
    sync = CollectiveJoinable(process_group=group)
    with Join([sync], throw_on_early_termination=True):
        for step in range(5):
            if rank == FAILING and step == 2:
                fail_now(step)
            sync.all_reduce(torch.ones(1))


def survivor_waiting_for_the_switch(group: dist.ProcessGroup, rank: int) -> None:
    """Deferred join mode: rank 0 runs out and waits in the store for the others' records
    (or, if rank 1's watcher was quicker, in the join loop); rank 1 fails instead of
    running its next forward."""
    model = DDP(Flaky(), process_group=group)
    with Join([model]):
        for step in range(2 if rank == 0 else 6):
            if rank == FAILING and step == 2:
                fail_now(step)
            model(torch.ones(2, 4)).sum().backward()


def survivor_in_ddp_backward(group: dist.ProcessGroup, rank: int) -> None:
    """gloo cannot abort DDP's backward all-reduce, so the failed rank completes it (with
    zero gradients) once the survivor's watcher has seen the failure; the survivor raises
    before its next forward, long before the group's 60 s timeout."""
    model = DDP(Flaky(), process_group=group)
    with Join([model]):
        for step in range(5):
            if rank == FAILING and step == 2:
                fail_now(step)
            model(torch.ones(2, 4)).sum().backward()


def survivor_in_ddp_backward_join_mode(group: dist.ProcessGroup, rank: int) -> None:
    """The same in join mode from step 1: the failed rank shadows the survivor's iteration
    with DDP's join hook, and the survivor raises at its next forward."""
    model = DDP(Flaky(), process_group=group)
    with Join([model], join_options=JoinOptions(defer_join_mode=False)):
        for step in range(5):
            if rank == FAILING and step == 2:
                fail_now(step)
            model(torch.ones(2, 4)).sum().backward()


def survivor_in_plain_collective(group: dist.ProcessGroup, rank: int) -> None:
    """A plain dist.all_reduce in the body, which no join hook shadows: not interruptible,
    so the group's short timeout fires, and Join still names the failed rank."""
    sync = CollectiveJoinable(process_group=group)
    with Join([sync]):
        for step in range(5):
            if rank == FAILING and step == 2:
                fail_now(step)
            dist.all_reduce(torch.ones(1), group=group)


SCENARIOS: list[tuple[str, Callable[[dist.ProcessGroup, int], None], float]] = [
    ("plain_collective", survivor_in_plain_collective, 3),
    ("ddp_backward_join_mode", survivor_in_ddp_backward_join_mode, 60),
    ("ddp_backward", survivor_in_ddp_backward, 60),
    ("join_loop", survivor_in_join_loop, 60),
    ("ddp_main_hook", survivor_in_ddp_main_hook, 60),
    ("deferred_switch", survivor_waiting_for_the_switch, 60),
    ("collective", survivor_in_collective, 60),
    ("throw_check", survivor_in_throw_check, 60),
]


def run_scenarios() -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    groups = [
        dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        for _, _, timeout in SCENARIOS
    ]
    out: dict[str, Any] = {"started": {}}
    logged: list[tuple[float, str]] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: logged.append((record.created, record.getMessage()))  # type: ignore[method-assign]
    logging.getLogger("rallypoint.join").addHandler(handler)
    for (name, scenario, _), group in zip(SCENARIOS, groups, strict=True):
        dist.barrier()  # both ranks start each scenario together
        out["started"][name] = time.time()
        try:
            scenario(group, rank)
            out[name] = ("returned", "", None, time.time())
        except Exception as exc:
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
            out[name] = (type(exc).__name__, str(exc), getattr(exc, "rank", cause), time.time())
    out["logged"] = logged
    dist.barrier()  # the failing rank stays alive until the survivor has seen every failure
    # no destroy_process_group: the survivor's scenario groups have collectives pending
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_workers(run_scenarios, 2, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS])
def test_failing_rank_propagates_its_own_exception(
    results: list[dict[str, Any]], name: str
) -> None:
    kind, message, _, _ = results[FAILING][name]
    assert kind == "Boom"
    assert "bad batch" in message


@pytest.mark.parametrize("name", [s[0] for s in SCENARIOS if s[0] != "plain_collective"])
def test_survivor_raises_naming_the_failed_rank_within_seconds(
    results: list[dict[str, Any]], name: str
) -> None:
    kind, message, failed_rank, when = results[0][name]
    assert kind == "RankFailedError", message
    assert failed_rank == FAILING
    assert message.startswith("rank 1 failed inside the Join context: Boom: bad batch")
    assert "detected on rank 0" in message
    assert when - results[FAILING][name][3] < 10


def test_survivor_blocked_in_a_plain_collective_names_the_rank_after_group_timeout(
    results: list[dict[str, Any]],
) -> None:
    kind, message, _, raised_at = results[0]["plain_collective"]
    assert kind == "RankFailedError", message
    assert message.startswith("rank 1 failed inside the Join context: Boom: bad batch 2")
    # while blocked, the body watcher logged the failure before the timeout fired
    started = results[0]["started"]["plain_collective"]
    logs = [(t, m) for t, m in results[0]["logged"] if started <= t <= raised_at]
    assert logs, results[0]["logged"]
    assert logs[0][1].startswith("rank 1 failed inside the Join context: Boom: bad batch 2")
    assert logs[0][0] < raised_at


def test_rank_failed_error_pickles() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(RankFailedError(3, "ValueError: x", 0)))
    assert (err.rank, err.reason, err.observer) == (3, "ValueError: x", 0)
    assert str(err).startswith("rank 3 failed inside the Join context: ValueError: x")


def failing_rank_exits() -> tuple[str, str, Any]:
    """Rank 1 fails and its process exits at once: rank 0, blocked in a plain all-reduce
    of its own in the body, gets a gloo connection error, which Join turns into
    RankFailedError naming rank 1."""
    import os

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    sync = CollectiveJoinable()
    try:
        with Join([sync]):
            for step in range(4):
                if rank == FAILING and step == 2:
                    fail_now(step)
                Join.notify_join_context(sync)
                dist.all_reduce(torch.ones(1))  # not interruptible
    except Exception as exc:
        if rank == FAILING:
            os._exit(17)
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return (type(exc).__name__, str(exc), cause)
    return ("returned", "", None)


@pytest.mark.timeout(60)
def test_failing_rank_that_exits_is_named_by_the_survivor() -> None:
    survivor, failed = run_workers(failing_rank_exits, 2, timeout=45, return_exceptions=True)
    assert "exited with code 17" in str(failed)
    kind, message, cause = survivor
    assert kind == "RankFailedError", message
    assert message.startswith("rank 1 failed inside the Join context: Boom: bad batch 2")
    assert cause is not None and cause != "RankFailedError"


class LateWork:
    """A collective whose time-sliced wait runs out ("Operation timed out!", gloo's text)
    just before it completes: what a loaded machine does now and then."""

    def __init__(self) -> None:
        self.completed = False

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if timeout is not None and not self.completed:
            self.completed = True
            raise RuntimeError("Operation timed out!")
        return True


def test_a_collective_completing_just_after_a_time_slice_is_not_an_error() -> None:
    from torch.distributed import HashStore

    from rallypoint.join._failure import FailureChannel, wait_work

    channel = FailureChannel(HashStore(), "p", 0, datetime.timedelta(milliseconds=50))
    wait_work(LateWork(), channel)  # type: ignore[arg-type]  # returns, does not raise
