"""One step's commit, across the replica groups of its quorum: all of them or none.

torchft decides a commit inside each group, so one group can step while another does not.
Here the participants of a round count their ``commit`` votes on one counter
(``c/<round>``); the one whose vote makes the count whole writes the outcome
(``o/<round>`` = ``commit``, set if absent). A participant that cannot step writes
``abort`` there at once and tells the lighthouse, which tells every watcher, so nobody
waits in a collective for it. A participant that dies before its vote is aborted for by
the lighthouse. Everyone waits on ``o/<round>`` with the store's own wait: a commit costs
each group three store round trips (add, wait, read) and no polling. A healing group
that sits the step out does not vote; it reads the outcome to know the step.
"""

from __future__ import annotations

import time
from datetime import timedelta

from rallypoint.ft._quorum.client import post
from rallypoint.ft._quorum.records import Ask
from rallypoint.rendezvous import KeyValueStore, KVStateError

__all__ = ["ABORT", "COMMIT", "SIT", "agree"]

COMMIT, ABORT, SIT = "commit", "abort", "sit"


def agree(
    kv: KeyValueStore,
    round_: int,
    member: str,
    vote: str,
    participants: int,
    participating: bool,
    timeout: float,
) -> bool:
    """Vote (a participant), then wait for the round's outcome: whether this member steps."""
    key = f"o/{round_}"
    if participating:
        if vote == COMMIT:
            try:
                counted = kv.add(f"c/{round_}", 1)
            except KVStateError:  # a forged counter: this round cannot be counted
                counted, vote = -1, ABORT
            if counted >= participants:  # the last vote: the outcome is known here
                return kv.set_if_absent(key, COMMIT.encode()) == COMMIT.encode()
        if vote == ABORT and kv.set_if_absent(key, ABORT.encode()) == ABORT.encode():
            post(kv, Ask("abort", member, round=round_))
    return _outcome(kv, key, timeout) == COMMIT.encode() and vote != SIT


def _outcome(kv: KeyValueStore, key: str, timeout: float) -> bytes:
    """The outcome at ``key`` once written: a wait and one read (a wake-up that finds no
    key waits again), or ``abort``, written by whoever finds it undecided in time."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not kv.wait_woken([key], timedelta(seconds=left)):
            return kv.set_if_absent(key, ABORT.encode())  # undecided in time: nobody steps
        outcome = kv.get_woken(key)
        if outcome is not None:
            return outcome
