"""One step's commit, across the replica groups of its quorum: all of them or none.

torchft decides a commit inside each group, so one group can step while another does not.
Here the members of a quorum vote through the lighthouse's store, under the round that
made the quorum: ``vote/<round>/<member>`` is ``commit`` or ``abort`` (a participant that
failed: nobody may step). Only participants vote: a group that heals this step (it sent
zeros) commits with the others if its heal worked, or sits the step out (``sit``) and
heals again; nobody waits for it. The first member to see the outcome writes it once
(``outcome/<round>``, set if absent) and everyone reads that: a participant that died
before its vote (told by its agent, or its heartbeat stopped) is an abort.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rallypoint.ft._quorum import Liveness
from rallypoint.rendezvous import KeyValueStore

__all__ = ["ABORT", "COMMIT", "SIT", "agree"]

COMMIT, ABORT, SIT = "commit", "abort", "sit"


def agree(
    kv: KeyValueStore,
    round_: int,
    member: str,
    vote: str,
    participants: Sequence[str],
    live: Liveness,
    timeout: float,
) -> bool:
    """Vote (a participant), then wait for the round's outcome: whether this member commits
    (``participants`` must all vote ``commit``; a healing member votes ``sit`` or
    ``commit`` for itself alone)."""
    if member in participants:
        kv.set(f"vote/{round_}/{member}", vote.encode())
    key = f"outcome/{round_}"
    deadline = time.monotonic() + timeout
    while True:
        raw = kv.get(key)
        if raw is not None:
            return raw == COMMIT.encode() and vote != SIT
        outcome = _outcome(kv, round_, participants, live)
        if outcome is None and time.monotonic() >= deadline:
            outcome = ABORT
        if outcome is not None:
            kv.set_if_absent(key, outcome.encode())
            continue
        time.sleep(0.005)  # (a store wait this short logs a C++ warning each time)


def _outcome(
    kv: KeyValueStore, round_: int, participants: Sequence[str], live: Liveness
) -> str | None:
    raws = kv.multi_get([f"vote/{round_}/{m}" for m in participants])
    votes = dict(zip(participants, raws, strict=True))
    if any(v == ABORT.encode() for v in votes.values()):
        return ABORT
    missing = [m for m in participants if votes[m] is None]
    if not missing:
        return COMMIT
    live.refresh(kv, missing)
    if any(not live.alive(m) for m in missing):
        return ABORT  # a participant died before it voted
    return None
