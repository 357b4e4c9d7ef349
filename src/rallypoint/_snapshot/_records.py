"""What a node's snapshot server holds: per rank, two slots of shared memory.

Each rank this node has a copy of (its own workers' ranks, and those it is the replica
of) has one :class:`Record` with two :class:`Slot` s: the newest complete snapshot and the
one being written, so a rank never costs more than twice its state per copy. A slot is an
anonymous ``memfd`` (no name in any file system; the workers get its descriptor over the
node's Unix socket). A write marks its slot ``WRITING`` first, so a crash in the middle
leaves it unfinished, and only ``COMPLETE`` slots are listed or served.
"""

from __future__ import annotations

import contextlib
import enum
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Key", "Record", "Records", "Slot", "SlotState"]

Key = tuple[str, int]
"""``(generation, step)``: a snapshot's identity within the job."""
_PAGE = mmap.PAGESIZE


class SlotState(enum.Enum):
    EMPTY = "empty"
    WRITING = "writing"
    COMPLETE = "complete"


@dataclass(slots=True)
class Slot:
    index: int
    fd: int = -1
    fid: int = 0
    """Unique per memfd, so a worker knows whether its mapping is still the right one."""
    size: int = 0
    state: SlotState = SlotState.EMPTY
    key: Key = ("", -1)
    nbytes: int = 0
    pins: int = 0
    _map: mmap.mmap | None = None

    def mapping(self) -> memoryview:
        """The server's own read-write mapping of this slot (made on first use)."""
        if self._map is None:
            self._map = mmap.mmap(self.fd, self.size)
        return memoryview(self._map)

    def release(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a receive still holds a view
                self._map.close()
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.size, self.state, self.key, self.nbytes = -1, 0, SlotState.EMPTY, ("", -1), 0


@dataclass(slots=True)
class Record:
    rank: int
    world: int
    slots: tuple[Slot, Slot] = field(default_factory=lambda: (Slot(0), Slot(1)))
    keep: Key | None = None

    def complete(self) -> list[Slot]:
        return [s for s in self.slots if s.state is SlotState.COMPLETE]


class Records:
    """Every record of this node, guarded by one condition variable."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._by_rank: dict[int, Record] = {}
        self._fids = 0

    # ------------------------------------------------------------------ writing
    def begin(self, rank: int, world: int, key: Key, nbytes: int, keep: Key | None) -> Slot:
        """Choose and size the slot for a write of ``key``, marked ``WRITING``.

        The slot that already holds ``key``; otherwise never the slot holding the writer's
        ``keep`` (the newest snapshot it knows is complete everywhere it matters); otherwise
        an empty or unfinished slot, else the one with the older step. A slot being sent to
        a peer is pinned, and a write that needs it waits until the send ends.
        """
        with self.cond:
            record = self._record(rank, world)
            while True:
                slot = self._choose(record, key, keep)
                if slot.pins == 0:
                    break
                self.cond.wait()
            self._size(slot, nbytes)
            slot.state, slot.key, slot.nbytes = SlotState.WRITING, key, nbytes
            return slot

    def commit(self, rank: int, key: Key, index: int) -> bool:
        """The write of ``key`` into slot ``index`` is complete; False if it is not there."""
        with self.cond:
            record = self._by_rank.get(rank)
            if record is None or not 0 <= index < 2:
                return False
            slot = record.slots[index]
            if slot.state is not SlotState.WRITING or slot.key != key:
                return False
            slot.state = SlotState.COMPLETE
            record.keep = key
            self.cond.notify_all()
            return True

    def abort(self, slot: Slot) -> None:
        with self.cond:
            if slot.state is SlotState.WRITING:
                slot.state, slot.key = SlotState.EMPTY, ("", -1)

    def _record(self, rank: int, world: int) -> Record:
        record = self._by_rank.get(rank)
        if record is not None and record.world != world:
            for slot in record.slots:  # another world's snapshot of this rank: useless
                if slot.pins == 0:
                    slot.state, slot.key = SlotState.EMPTY, ("", -1)
            record.world, record.keep = world, None
        if record is None:
            record = self._by_rank[rank] = Record(rank, world)
        return record

    @staticmethod
    def _choose(record: Record, key: Key, keep: Key | None) -> Slot:
        a, b = record.slots
        for slot in (a, b):
            if slot.key == key and slot.state is not SlotState.EMPTY:
                return slot
        for slot, other in ((a, b), (b, a)):
            if keep is not None and other.key == keep and other.state is SlotState.COMPLETE:
                return slot
        for slot in (a, b):
            if slot.state is not SlotState.COMPLETE:
                return slot
        return a if a.key[1] <= b.key[1] else b

    def _size(self, slot: Slot, nbytes: int) -> None:
        size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
        if slot.size == size and slot.fd >= 0:
            return
        slot.release()
        fd = os.memfd_create(f"rallypoint-snapshot-{os.getpid()}", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)  # reachable only through a descriptor anyway
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            raise
        self._fids += 1
        slot.fd, slot.size, slot.fid = fd, size, self._fids

    # ------------------------------------------------------------------ reading
    def find(self, rank: int, world: int, key: Key) -> Slot | None:
        with self.cond:
            record = self._by_rank.get(rank)
            if record is None or record.world != world:
                return None
            for slot in record.complete():
                if slot.key == key:
                    return slot
            return None

    def pin(self, rank: int, world: int, key: Key) -> Slot | None:
        """The complete slot of ``key``, pinned (not rewritten) until :meth:`unpin`."""
        with self.cond:
            slot = self.find(rank, world, key)
            if slot is not None:
                slot.pins += 1
            return slot

    def unpin(self, slot: Slot) -> None:
        with self.cond:
            slot.pins -= 1
            self.cond.notify_all()

    def restored(self, rank: int, world: int, key: Key) -> None:
        """Rank ``rank`` of world ``world`` went on from ``key``: keep it; drop the other
        worlds' records (they can no longer be restored)."""
        with self.cond:
            for other in [r for r in self._by_rank.values() if r.world != world]:
                if not any(s.pins for s in other.slots):
                    for slot in other.slots:
                        slot.release()
                    del self._by_rank[other.rank]
            record = self._by_rank.get(rank)
            if record is not None:
                record.keep = key

    def prune(self, world: int, ranks: set[int]) -> None:
        """Drop every record this node no longer needs: another world's, or a rank that is
        neither one of its workers' nor one it is the replica of."""
        with self.cond:
            for record in list(self._by_rank.values()):
                stale = record.world != world or record.rank not in ranks
                if stale and not any(s.pins for s in record.slots):
                    for slot in record.slots:
                        slot.release()
                    del self._by_rank[record.rank]

    def inventory(self) -> list[dict[str, Any]]:
        """Every complete snapshot here: ``{"rank", "world", "gen", "step"}``."""
        with self.cond:
            return [
                {"rank": r.rank, "world": r.world, "gen": s.key[0], "step": s.key[1]}
                for r in self._by_rank.values()
                for s in r.complete()
            ]

    def held_bytes(self) -> int:
        """Shared memory this server holds (every slot's size)."""
        with self.cond:
            return sum(s.size for r in self._by_rank.values() for s in r.slots)
