"""torch's Join semantics, checked on real gloo ranks (ported from torch's test_join.py).

All scenarios of one world size run in one launch, one after the other on the same process
group, so the whole file costs two forks of warm workers.
"""

from __future__ import annotations

import datetime
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from rallypoint.join import (
    CollectiveJoinable,
    EarlyTerminationError,
    Join,
    Joinable,
    JoinHook,
    JoinOptions,
    JoinSummary,
    even_batches,
)
from rallypoint.observe import ProgressBoard
from rallypoint.testing import run_workers

W = 3
BEFORE_CONSTANT = 41
AFTER_CONSTANT = 42


class AllReducerJoinHook(JoinHook):
    """Shadows ``num_allreduces`` all-reduces per iteration; checks post-hook arguments."""

    def __init__(self, allreducer: AllReducer, num_allreduces: int) -> None:
        self.allreducer = allreducer
        self.num_allreduces = num_allreduces

    def main_hook(self) -> None:
        for _ in range(self.num_allreduces):
            t = torch.zeros(1)
            dist.all_reduce(t)
        self.allreducer.shadowed += 1

    def post_hook(self, is_last_joiner: bool) -> None:
        self.allreducer.post_hook_calls.append(is_last_joiner)
        t = torch.tensor([float(AFTER_CONSTANT if is_last_joiner else BEFORE_CONSTANT)])
        # the last joiner(s) broadcast: ranks agree on the largest last-joiner rank
        rank = torch.tensor([dist.get_rank() if is_last_joiner else -1])
        dist.all_reduce(rank, op=dist.ReduceOp.MAX)
        dist.broadcast(t, src=int(rank.item()))
        self.allreducer.post_hook_value = t.item()


class AllReducer(Joinable):
    def __init__(self) -> None:
        super().__init__()
        self.shadowed = 0
        self.post_hook_calls: list[bool] = []
        self.post_hook_value: float | None = None
        self.kwargs: dict[str, Any] = {}
        self.futures: list[Any] = []

    def __call__(self, num_allreduces: int = 1) -> float:
        future = Join.notify_join_context(self)
        self.futures.append(future)
        total = 0.0
        for _ in range(num_allreduces):
            t = torch.ones(1)
            dist.all_reduce(t)
            total += t.item()
        return total

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.kwargs = kwargs
        return AllReducerJoinHook(self, kwargs.get("num_allreduces", 1))

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


def expected_sum(rank: int, world: int) -> int:
    return 3 * world + sum(world - j for j in range(1, rank + 1))


def scenarios() -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    filters_before = list(warnings.filters)

    # 1. single joinable, uneven inputs: the formula, hooks, summary, future
    r = AllReducer()
    with Join([r], num_allreduces=1) as join:
        out["sum"] = sum(r() for _ in range(3 + rank))
    out["is_last_joiner"] = r.post_hook_calls
    out["post_value"] = r.post_hook_value
    out["shadowed"] = r.shadowed
    out["summary"] = join.summary
    first = r.futures[0]
    out["future"] = (type(first).__name__, first.done(), first.value()[0].item())
    out["config_after"] = tuple(r._join_config)

    # 2. multiple joinables and kwargs: two all-reduces per joinable per iteration
    a, b = AllReducer(), AllReducer()
    with Join([a, b], num_allreduces=2, extra="x"):
        out["multi_sum"] = sum(a(2) + b(2) for _ in range(3 + rank))
    out["kwargs"] = (a.kwargs, b.kwargs)
    out["multi_shadowed"] = (a.shadowed, b.shadowed)
    out["second_future_none"] = all(f is None for f in b.futures)

    # 3. enable=False with even inputs: nothing happens, no hook runs
    c = AllReducer()
    with Join([c], enable=False) as join_off:
        out["disabled_sum"] = sum(c() for _ in range(4))
    out["disabled"] = (c.post_hook_calls, join_off.summary, c.futures)

    # 4. throw mode: the rank that runs out and the others get torch's messages
    d = AllReducer()
    try:
        with Join([d], throw_on_early_termination=True):
            for _ in range(3 + rank):
                d()
        out["throw"] = None
    except EarlyTerminationError as exc:
        out["throw"] = (type(exc).__name__, isinstance(exc, RuntimeError), str(exc))

    # 5. the skew warning: once per Join, without touching the global filters
    e = AllReducer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Join([e], join_options=JoinOptions(warn_threshold=2)):
            for _ in range(1 if rank == 0 else 6):
                e()
    out["warnings"] = [str(w.message) for w in caught]
    out["filters_unchanged"] = warnings.filters == filters_before
    out["threads_left"] = [t.name for t in threading.enumerate() if "rallypoint" in t.name]

    # 6. CollectiveJoinable: several collectives per iteration, shadowed with neutral inputs
    sync = CollectiveJoinable()
    seen = []
    with Join([sync]):
        for step in range(3 + rank):
            with sync.iteration():
                active = sync.all_reduce(torch.ones(1)).item()
                top = sync.all_reduce(torch.tensor([rank]), op=dist.ReduceOp.MAX).item()
                low = sync.all_reduce(torch.tensor([float(rank)]), op=dist.ReduceOp.MIN).item()
                prod = sync.all_reduce(torch.tensor([2.0]), op=dist.ReduceOp.PRODUCT).item()
                sent = sync.broadcast(torch.tensor([float(step if rank == 2 else -1)]), src=2)
                mean = sync.average(torch.tensor([float(rank), 1.0]))
            seen.append((active, top, low, prod, sent.item(), mean.tolist()))
    out["collective"] = seen

    # 7. even_batches: pad and truncate agree on one count
    data = list(range(3 + rank))
    padded = even_batches(data)
    out["pad"] = (list(padded), len(padded), padded.padded)
    out["pad_epoch2"] = list(padded)  # a second epoch agrees again
    out["truncate"] = list(even_batches(data, mode="truncate"))
    loader = torch.utils.data.DataLoader(list(range(10 + 4 * rank)), batch_size=4)
    out["loader_batches"] = sum(1 for _ in even_batches(loader))
    sampler = torch.utils.data.DistributedSampler(list(range(10)), shuffle=True, seed=1)
    wrapped = even_batches(torch.utils.data.DataLoader(list(range(10)), 2, sampler=sampler))
    wrapped.set_epoch(3)
    out["sampler"] = (len(wrapped), sampler.epoch, sum(len(b) for b in wrapped))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def board() -> Iterator[ProgressBoard]:
    board = ProgressBoard(W)
    yield board
    board.close()


@pytest.fixture(scope="module")
def results(board: ProgressBoard) -> list[dict[str, Any]]:
    # each worker points rallypoint.progress() at its slot, as the launcher does
    out = run_workers(scenarios, W, timeout=90, env=board.env)
    return out


def test_shadowing_ranks_report_progress_to_the_launcher(
    results: list[dict[str, Any]], board: ProgressBoard
) -> None:
    # ranks that ran out of inputs keep reporting progress while they shadow the others,
    # so --hang-timeout does not mistake a long skew for a hang
    shadowing = [rank for rank, res in enumerate(results) if res["shadowed"] > 0]
    assert shadowing, "the scenario must make some rank shadow"
    assert set(shadowing) <= set(board.reported())


@pytest.mark.timeout(120)
def test_uneven_inputs_sum_matches_formula(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert res["sum"] == expected_sum(rank, W), rank
        assert res["shadowed"] == (W - 1 - rank)


def test_post_hook_is_last_joiner_only_on_last_rank(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert res["is_last_joiner"] == [rank == W - 1]
        assert res["post_value"] == AFTER_CONSTANT


def test_summary_reports_shadowed_iterations(results: list[dict[str, Any]]) -> None:
    for res in results:
        summary = res["summary"]
        assert isinstance(summary, JoinSummary)
        assert summary.shadowed == (2, 1, 0)
        assert summary.max_skew == 2
        assert summary.last_joiners == (2,)


def test_notify_returns_future_with_number_of_active_ranks(
    results: list[dict[str, Any]],
) -> None:
    for res in results:
        assert res["future"] == ("Future", True, float(W))


def test_join_config_restored_after_context(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["config_after"] == (False, False, False)


def test_multiple_joinables_and_kwargs(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert res["multi_sum"] == 4 * expected_sum(rank, W)
        assert res["kwargs"] == ({"num_allreduces": 2, "extra": "x"},) * 2
        assert res["multi_shadowed"] == (W - 1 - rank,) * 2
        assert res["second_future_none"]


def test_enable_false_with_even_inputs(results: list[dict[str, Any]]) -> None:
    for res in results:
        assert res["disabled_sum"] == 4 * W
        assert res["disabled"] == ([], None, [None] * 4)


def test_throw_mode_messages(results: list[dict[str, Any]]) -> None:
    assert results[0]["throw"] == ("EarlyTerminationError", True, "Rank 0 exhausted all inputs.")
    for res in results[1:]:
        assert res["throw"] == (
            "EarlyTerminationError",
            True,
            "Detected at least one rank that exhausted inputs. Throwing across all ranks.",
        )


def test_skew_warning_once_without_global_filter(results: list[dict[str, Any]]) -> None:
    assert len(results[0]["warnings"]) == 1
    assert "Detected uneven input skew of greater than 2" in results[0]["warnings"][0]
    assert "rank 0 has at least 2 fewer inputs" in results[0]["warnings"][0]
    assert results[1]["warnings"] == results[2]["warnings"] == []
    assert all(res["filters_unchanged"] for res in results)


def test_no_helper_threads_left_behind(results: list[dict[str, Any]]) -> None:
    assert all(res["threads_left"] == [] for res in results)


def test_collective_joinable_results_over_working_ranks(
    results: list[dict[str, Any]],
) -> None:
    # steps 0-2: ranks 0, 1, 2 work; step 3: ranks 1, 2; step 4: rank 2 alone
    active_ranks = [[0, 1, 2]] * 3 + [[1, 2], [2]]
    for rank, res in enumerate(results):
        expected = [
            (
                float(len(ranks)),
                2,
                float(min(ranks)),
                2.0 ** len(ranks),
                float(step),
                [sum(ranks) / len(ranks), 1.0],
            )
            for step, ranks in enumerate(active_ranks[: 3 + rank])
        ]
        assert res["collective"] == expected, rank


def test_even_batches(results: list[dict[str, Any]]) -> None:
    assert results[0]["pad"] == ([0, 1, 2, 0, 1], 5, 2)
    assert results[1]["pad"] == ([0, 1, 2, 3, 0], 5, 1)
    assert results[2]["pad"] == ([0, 1, 2, 3, 4], 5, 0)
    assert [res["pad_epoch2"] for res in results] == [res["pad"][0] for res in results]
    for res in results:
        assert res["truncate"] == [0, 1, 2]
        assert res["loader_batches"] == 5  # ceil(18 / 4) on the longest rank
        # DistributedSampler pads 10 samples to 12, 4 per rank: 2 batches; epoch forwarded
        assert res["sampler"] == (2, 3, 4)
