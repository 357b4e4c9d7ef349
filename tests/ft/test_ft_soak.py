"""A long run stays the same size: hundreds of steps through the whole manager path (the
quorum, the commit's votes, the groups' own stores, the heartbeats, the news) leave the
lighthouse's store with as many keys as after the first hundred, and every process of the
job with as many threads and file descriptors and about the same memory. The coordination
client's path alone is counted in test_ft_protocol.py; this is what a user's job does."""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from _groups import (
    finish,
    lighthouse,
    never_back,
    same_parameters,
    start_group,
    steps,
    wait_for_step,
)

from rallypoint.rendezvous import connect_kv

STEPS = 600
FIRST, LAST = 100, 500
"""The steps at which the job is measured (no sleep between steps)."""


def _start(out: Path, group: int, address: str) -> subprocess.Popen[str]:
    """A replica group of two ranks (so its own store carries votes and quorums too)."""
    return start_group(out, group, address, STEPS, nproc=2, restarts=0, FT_STEP_SLEEP="0",
                       FT_TOGETHER="2")  # fmt: skip


def _sizes(roots: dict[int, str]) -> dict[int, tuple[str, int, int, float]]:
    """Each process under ``roots`` (pid: what it is; they included): what it is, its
    threads, open file descriptors and resident MiB. Threads and descriptors are the fewest
    of a few looks 50 ms apart: an agent opens files for a moment (its workers'
    ``/proc/<pid>/stat``, their Flight Recorders' pipes), which one look may catch (a
    loaded suite run: 15 then 16), while a leak holds what it took."""
    found: dict[int, tuple[str, int, int, float]] = {}
    for look in range(SAMPLES):
        if look:
            time.sleep(0.05)
        for pid, what in roots.items():
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                try:
                    with proc.oneshot():
                        threads, fds = proc.num_threads(), proc.num_fds()
                        rss = proc.memory_info().rss / 2**20
                except psutil.NoSuchProcess:  # gone between two looks: the check says so
                    continue
                name = what if proc is root else f"a process under {what}"
                if proc.pid in found:
                    _, fewest_threads, fewest_fds, _ = found[proc.pid]
                    threads, fds = min(threads, fewest_threads), min(fds, fewest_fds)
                found[proc.pid] = (name, threads, fds, rss)
    return found


SAMPLES = 5


@pytest.mark.timeout(300)
def test_six_hundred_steps_of_two_groups_leave_the_store_and_every_process_the_same_size(
    tmp_path: Path,
) -> None:
    house = lighthouse("--min_replicas", "2", "--join_timeout_ms", "60000")
    kv, _ = connect_kv(house.address, timeout=timedelta(seconds=30))
    store = kv.store  # type: ignore[attr-defined]
    try:
        groups = [_start(tmp_path, g, house.address) for g in range(2)]
        assert house.proc is not None
        roots = {house.proc.pid: "the lighthouse"}
        roots.update({p.pid: f"group {g}'s launcher" for g, p in enumerate(groups)})

        def measure(step: int) -> tuple[int, dict[int, tuple[str, int, int, float]]]:
            wait_for_step(tmp_path, (0, 1), step, timeout=150)
            return store.num_keys(), _sizes(roots)

        keys_first, first = measure(FIRST)
        keys_last, last = measure(LAST)
        texts = finish(groups, timeout=150)
    finally:
        screen = house.stop()
    context = screen + "\n".join(t[-2000:] for t in texts)
    assert all(p.returncode == 0 for p in groups), context
    # the keys a round leaves are deleted RETAIN rounds later; at most NEWS_KEPT news are
    # kept (one every 5 s of quiet, which a loaded machine's slower run may not have had
    # by step 100) and a tick's message or two
    assert keys_last <= keys_first + 12, (keys_first, keys_last)
    kept = sorted(set(first) & set(last))
    assert len(kept) == len(first) >= 2 + 2 * 3, (first, last)  # launchers, warm, ranks
    for pid in kept:
        name, threads, fds, rss = first[pid]
        _, threads_after, fds_after, rss_after = last[pid]
        what = f"{name} ({pid}), step {FIRST} then {LAST}"
        assert threads_after == threads, f"{what}: {threads} then {threads_after} threads"
        assert fds_after == fds, f"{what}: {fds} then {fds_after} file descriptors"
        assert rss_after - rss < 16, f"{what}: {rss:.1f} then {rss_after:.1f} MiB resident"
    for g in range(2):
        rows = steps(tmp_path, g)
        never_back(rows)
        assert rows[-1][1] == STEPS, (g, rows[-3:])
    same_parameters(tmp_path, [0, 1], ranks=2)  # rank by rank
