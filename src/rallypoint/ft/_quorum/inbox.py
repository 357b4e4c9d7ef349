"""The lighthouse's inbox: how a message reaches the lighthouse's loop, in one of two layouts.

``box``, where the store appends natively (the TCPStore a lighthouse hosts): a member
appends its message to ``in/box``, then a byte to ``in/bell``, two sends that wait for no
answer. The loop waits on the bell, deletes it, and takes the whole box at once with a
compare-and-swap to empty: four round trips a wake however many messages it brings, and
two keys however long the job runs. ``slots``, on any store (etcd): a member takes a slot
with ``add`` on ``in/n`` and writes ``in/<i>``; the loop waits on its next slot, reads
every written slot in one read, and its janitor deletes them. Each frame or slot is
parsed as input (records.py); a bad one is named by its key.
"""

from __future__ import annotations

from datetime import timedelta

from rallypoint.ft._quorum.records import Ask, parse_counter
from rallypoint.rendezvous import KeyValueStore

__all__ = ["BOX", "Inbox", "post"]

BOX, BELL = "in/box", "in/bell"


def post(kv: KeyValueStore, msg: Ask) -> None:
    """Put ``msg`` in the lighthouse's inbox (a slot that the lighthouse filled as a hole
    meanwhile, its writer being too slow, is given up for the next)."""
    raw = msg.to_bytes()
    if kv.native_append:  # each frame starts a line: bytes forged before it stay apart
        kv.append(BOX, b"\n" + raw + b"\n")
        kv.append(BELL, b".")
        return
    while True:
        index = kv.add("in/n", 1)
        if kv.set_if_absent(f"in/{index}", raw) == raw:
            return


class Inbox:
    """The loop's side: :meth:`wait` for mail, :meth:`take` it (``(key, raw)`` each), then
    :meth:`consumed` names the keys its janitor deletes."""

    def __init__(self, kv: KeyValueStore) -> None:
        self.kv = kv
        self.boxed = kv.native_append
        self.next = 0 if self.boxed else parse_counter(kv.get("in/done"), "in/done") + 1
        """The next slot to read (``slots``)."""

    def wait(self, timeout: timedelta) -> None:
        self.kv.wait_woken([BELL if self.boxed else f"in/{self.next}"], timeout)

    def take(self) -> list[tuple[str, bytes]]:
        """The messages that arrived (a slot not written yet ends the run: its writer is
        between its ``add`` and its write)."""
        if not self.boxed:
            count = parse_counter(self.kv.get("in/n"), "in/n")
            keys = self._written([f"in/{i}" for i in range(self.next, max(count, self.next) + 1)])
            found = []
            for key, raw in zip(keys, self.kv.multi_get(keys), strict=True):
                if raw is None:
                    break
                found.append((key, raw))
            self.next += len(found)
            return found
        self.kv.delete(BELL)  # before the box is read: a bell rung after it stays rung
        seen = self.kv.compare_and_swap(BOX, b"", b"")  # (never blocks, even on no key)
        while seen and (now := self.kv.compare_and_swap(BOX, seen, b"")):
            seen = now  # more arrived since it was read: take that
        return [(BOX, frame) for frame in seen.split(b"\n") if frame]

    def consumed(self, taken: list[tuple[str, bytes]]) -> list[str]:
        """The keys to delete once ``taken`` is handled (none from a box)."""
        if self.boxed or not taken:
            return []
        self.kv.set("in/done", str(self.next - 1).encode())
        return [key for key, _ in taken]

    def _written(self, keys: list[str]) -> list[str]:
        """The longest run of ``keys`` from the first that is written: one check when all
        are there, a binary search otherwise (a read of a missing key is a round trip)."""
        if len(keys) <= 1 or self.kv.wait_woken(keys, timedelta(0)):
            return keys
        there, missing = 1, len(keys)  # the first was waited on; the whole run was not there
        while missing - there > 1:
            mid = (there + missing) // 2
            if self.kv.wait_woken(keys[:mid], timedelta(0)):
                there = mid
            else:
                missing = mid
        return keys[:there]

    def stuck(self) -> int | None:
        """The slot the loop waits on (``None`` in a box, where no writer leaves a hole)."""
        return None if self.boxed else self.next

    @staticmethod
    def fill(kv: KeyValueStore, slot: int) -> None:
        """Fill ``slot`` as a hole (its writer died between its ``add`` and its write) on
        ``kv``, the caller's own connection: the loop then reads past it."""
        kv.set_if_absent(f"in/{slot}", Ask("hole").to_bytes())
