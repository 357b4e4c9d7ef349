"""``rallypoint.ft.ProcessGroupGloo``'s abort: it cuts its own communicator and no other.

Several managers can live in one process (torchft's own tests run every replica group as
threads of one process), and a program can make its own gloo groups while a manager makes
one: aborting one communicator must leave the others working, and free at once a rank
blocked in a collective that a peer never joins.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch

from rallypoint._core.torch_c import HashStore
from rallypoint.ft import ProcessGroupGloo


def _made_together(n_groups: int, monkeypatch: pytest.MonkeyPatch) -> list[ProcessGroupGloo]:
    """``n_groups`` communicators of two ranks each, all made at the same time (rank ``i``'s
    address names its group's store)."""
    stores = [HashStore() for _ in range(n_groups)]
    pgs = [ProcessGroupGloo(timeout=timedelta(seconds=20)) for _ in range(2 * n_groups)]
    monkeypatch.setattr(
        "rallypoint.ft.process_group.store_from_address",
        lambda addr, timeout: stores[int(addr.split("#")[1]) // 2],
    )
    threads = [
        threading.Thread(target=pgs[i].configure, args=(f"unused#{i}", str(i), i % 2, 2))
        for i in range(len(pgs))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return pgs


def _allreduce(pgs: list[ProcessGroupGloo], ranks: list[int]) -> list[object]:
    out: list[object] = [None] * len(pgs)

    def run(i: int) -> None:
        t = torch.ones(4) * (i + 1)
        try:
            pgs[i].allreduce([t], torch.distributed.ReduceOp.SUM).wait()
            out[i] = t.tolist()
        except Exception as exc:  # the test reports what happened
            out[i] = type(exc).__name__

    threads = [threading.Thread(target=run, args=(i,)) for i in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [out[i] for i in ranks]


@pytest.mark.timeout(60)
def test_communicators_made_at_once_in_one_process_are_aborted_one_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pgs = _made_together(3, monkeypatch)
    pgs[0].abort()  # group A's rank 0, then its rank 1
    pgs[1].abort()
    assert _allreduce(pgs, [2, 3]) == [[7.0] * 4, [7.0] * 4]  # group B still works
    assert _allreduce(pgs, [4, 5]) == [[11.0] * 4, [11.0] * 4]  # and group C
    for pg in pgs[2:]:
        pg.abort()


@pytest.mark.timeout(60)
def test_an_abort_frees_a_rank_blocked_on_a_peer_that_never_joins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pgs = _made_together(2, monkeypatch)
    result: list[object] = []
    blocked = threading.Thread(target=lambda: result.extend(_allreduce(pgs, [0])))
    blocked.start()
    time.sleep(0.5)  # rank 0 waits in the allreduce; rank 1 never joins it
    assert blocked.is_alive()
    began = time.monotonic()
    pgs[1].abort()  # rank 1's own connections are cut: rank 0 fails at once
    blocked.join(10)
    assert not blocked.is_alive() and time.monotonic() - began < 5
    assert isinstance(result[0], str), result  # an error, not a sum
    assert _allreduce(pgs, [2, 3]) == [[7.0] * 4, [7.0] * 4]  # the other group is untouched
    for pg in pgs:
        pg.abort()


@pytest.mark.timeout(60)
def test_set_timeout_bounds_the_next_collective_as_torchs_own_gloo_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchft's tests shorten a live group's timeout before a collective a crashed peer
    never joins, and wait for the error; a timeout kept for the next communicator only
    made each such wait the first timeout (30 s there). torch's gloo backend, given the
    same call, is the control."""
    import torch.distributed as dist

    def failed_within(allreduce: Callable[[], object]) -> float:
        began = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out"):
            allreduce()
        return time.monotonic() - began

    store = HashStore()
    control: dict[int, object] = {}

    def make(rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._timeout = timedelta(seconds=20)
        control[rank] = dist.ProcessGroupGloo(store, rank, 2, options)

    threads = [threading.Thread(target=make, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    torch_gloo = control[0]
    torch_gloo.set_timeout(timedelta(seconds=1))  # type: ignore[attr-defined]
    torch_took = failed_within(lambda: torch_gloo.allreduce([torch.ones(1)]).wait())  # type: ignore[attr-defined]

    pgs = _made_together(1, monkeypatch)
    pgs[0].set_timeout(timedelta(seconds=1))
    ours_took = failed_within(lambda: pgs[0].allreduce([torch.ones(1)]).wait())
    assert torch_took < 5 and ours_took < 5, (torch_took, ours_took)
    for pg in pgs:
        pg.abort()


@pytest.mark.timeout(60)
def test_an_injected_failure_is_swallowed_recorded_and_the_next_allreduces_skipped() -> None:
    """``FakeProcessGroupWrapper`` fails the next allreduce's work on request; an
    ``ErrorSwallowingProcessGroupWrapper`` above it records the error instead of raising
    and skips every allreduce after it until ``configure``."""
    from rallypoint.ft.process_group import (
        ErrorSwallowingProcessGroupWrapper,
        FakeProcessGroupWrapper,
        ProcessGroupDummy,
    )

    dummy = ProcessGroupDummy(0, 1)
    fake = FakeProcessGroupWrapper(dummy)
    pg = ErrorSwallowingProcessGroupWrapper(fake)
    assert isinstance(pg, torch.distributed.ProcessGroup) and pg.parent is fake
    t = torch.ones(2)
    assert pg.allreduce([t], torch.distributed.ReduceOp.SUM).wait() and pg.error() is None
    boom = RuntimeError("injected")
    fake.report_future_error(boom)
    work = pg.allreduce([t], torch.distributed.AllreduceOptions())
    assert work.wait() and pg.error() is boom  # swallowed, recorded
    skipped = len(dummy._work)
    assert pg.allreduce([t], torch.distributed.ReduceOp.SUM).get_future().wait() == [t]
    assert len(dummy._work) == skipped  # never reached the group under it
    pg.configure("unused", "0", 0, 1)
    assert pg.error() is None and dummy.configure_count == 1
    with pytest.raises(RuntimeError, match="injected"):  # the fake alone raises it
        fake.report_future_error(boom)
        fake.allreduce([t], torch.distributed.ReduceOp.SUM).wait()
