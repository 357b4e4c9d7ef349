"""Typed access to the two stores the agents of a job share.

The round store (``rallypoint/round<k>/`` in the round's store) holds what one round
decides: its nodes, the workers' master, failures, the claim and the decision. The run
store (``rallypoint/<run_id>/job/`` on the rendezvous backend, from
``handler.open_run_store()``) outlives rounds: the restart budget counter (so every node
and worker sees the same ``TORCHELASTIC_RESTART_COUNT``), the job's status, hang and
straggler exchanges, the stacks exchange, the job's RPC secret, the failure runs that
lead to exclusion and the exclusion list. Each key is a method of the classes below.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from rallypoint._core.memory_store import MemoryStore
from rallypoint._core.status import JobStatus
from rallypoint._elastic._records import (
    Decision,
    ExclusionRecord,
    FailureRecord,
    NodeRecord,
    RootRecord,
)

if TYPE_CHECKING:
    from rallypoint._core.store import Store

__all__ = ["RoundStore", "RunStore", "prefixed"]


def _warn(line: str) -> None:
    from rallypoint._supervise._output import write_console

    write_console(2, line.encode())


def prefixed(prefix: str, store: Store) -> Store:
    """``store`` with every key under ``prefix/`` (torch's ``PrefixStore``; a one-node
    job's store in memory makes its own view, without torch)."""
    if isinstance(store, MemoryStore):
        return store.under(prefix)
    from rallypoint._core.torch_c import PrefixStore, as_torch_store

    return PrefixStore(prefix, as_torch_store(store))


class RoundStore:
    """The keys of one round, under ``rallypoint/round<k>/`` in the round's store:
    ``node/<g>``, ``master``, ``failure/<g>``, ``claim``, ``restart`` (the decision), ``root``
    and ``done``."""

    def __init__(self, store: Store) -> None:
        self.store: Store = store

    def publish_node(self, group_rank: int, node: NodeRecord) -> None:
        self.store.set(f"node/{group_rank}", node.to_json())

    def nodes(self, nnodes: int) -> list[NodeRecord]:
        """Every node's record, by group rank (waits until all are there)."""
        keys = [f"node/{g}" for g in range(nnodes)]
        self.store.wait(keys)  # one blocking round trip, then one read of every entry
        return [NodeRecord.from_json(bytes(v)) for v in self.store.multi_get(keys)]

    def publish_master(self, addr: str, port: int) -> None:
        self.store.set("master", f"{addr}:{port}")

    def master(self) -> tuple[str, int]:
        addr, _, port = bytes(self.store.get("master")).decode().rpartition(":")
        return addr, int(port)

    def publish_failure(self, record: FailureRecord) -> None:
        self.store.set(f"failure/{record.group_rank}", record.to_json())

    def earliest_failure(self, nnodes: int) -> FailureRecord | None:
        records = [
            FailureRecord.from_json(bytes(self.store.get(key)))
            for key in (f"failure/{g}" for g in range(nnodes))
            if self.store.check([key])
        ]
        return min(records, key=lambda r: r.time) if records else None

    def claim(self) -> bool:
        """Whether this node is the first to claim the round's decision."""
        return int(self.store.add("claim", 1)) == 1

    def decide(self, decision: Decision) -> Decision:
        """Write ``decision`` unless the round has one already; returns the round's."""
        raw = self.store.compare_set("restart", "", decision.to_json())
        return Decision.from_json(bytes(raw))

    def decided(self) -> bool:
        return bool(self.store.check(["restart"]))

    def decision(self) -> Decision:
        return Decision.from_json(bytes(self.store.get("restart")))

    def publish_root(self, root: RootRecord) -> None:
        self.store.set("root", root.to_json())

    def root(self, timeout: timedelta) -> RootRecord:
        self.store.wait(["root"], timeout)
        return RootRecord.from_json(bytes(self.store.get("root")))

    def node_done(self) -> int:
        """Count this node as finished; returns how many are."""
        return int(self.store.add("done", 1))

    def done(self) -> int:
        return int(self.store.add("done", 0))


class RunStore:
    """The keys of the whole run (every round); ``where`` names them in errors.

    Under ``rallypoint/<run_id>/job/``: ``restarts``, ``status``, ``end`` (the last round and
    its node count, written just before ``status``), ``left/<k>``, ``hang/<k>``,
    ``pace/<k>/<g>``, the ``stacks/*`` exchange, ``rpc_secret`` (set once by the first
    agent), ``same_failure`` and ``node_failures`` (the runs of identical root causes and of
    failures rooted on one node) and ``excluded`` (a JSON list of ``ExclusionRecord``s, edited
    by compare-and-set so that two exclusions at once both stay; a malformed record in it is
    ignored, said once through ``say``)."""

    def __init__(
        self, store: Store, where: str = "the run store", say: Callable[[str], None] = _warn
    ) -> None:
        self.store: Store = store
        self.where = where
        self._say = say
        self._said: set[str] = set()

    def restarts(self, spend: int = 0) -> int:
        """The job's restart counter after adding ``spend``."""
        return int(self.store.add("restarts", spend))

    def same_failure(self, signature: str) -> int:
        """Count a round that failed with ``signature`` (``""``: one that ended otherwise,
        which breaks the run); returns how many rounds in a row failed with it."""
        return self._streak("same_failure", signature)

    def node_failed(self, node: str) -> int:
        """Count a round whose root cause was on ``node`` (``""``: a round that failed
        otherwise, which breaks every node's run); returns how many rounds in a row it was
        that node."""
        return self._streak("node_failures", node)

    def _streak(self, key: str, value: str) -> int:
        """The run of rounds in a row that ended with ``value`` under ``key``, this one
        counted (0 for ``""``). Only the node that decides a round calls it, so rounds
        never race."""
        count = 0
        if value:
            if self.store.check([key]):
                last, _, n = bytes(self.store.get(key)).decode().rpartition("\n")
                count = int(n) if last == value and n.isdigit() else 0
            count += 1
        self.store.set(key, f"{value}\n{count}")
        return count

    def exclusions(self) -> list[ExclusionRecord]:
        """The agents kept out of the job, oldest first."""
        return self._exclusions(self._excluded_raw())

    def _excluded_raw(self) -> bytes:
        return bytes(self.store.get("excluded")) if self.store.check(["excluded"]) else b""

    def _exclusions(self, raw: bytes) -> list[ExclusionRecord]:
        if not raw:
            return []
        records, bad = ExclusionRecord.list_from_json(raw, self._excluded_key)
        for line in bad:
            if line not in self._said:
                self._said.add(line)
                self._say(f"rallypoint: warning: {line}; it is ignored\n")
        return records

    @property
    def _excluded_key(self) -> str:
        return f"{self.where}/excluded"

    def exclude(self, record: ExclusionRecord) -> None:
        """Add ``record`` to the exclusion list: compare-and-set, again while another
        exclusion got in between (nodes decide different rounds' exclusions at once).
        The items already there stay as they are."""
        raw = self._excluded_raw()
        while True:
            new = ExclusionRecord.list_plus(raw, self._excluded_key, record)
            now = bytes(self.store.compare_set("excluded", raw.decode(), new))
            if now == new.encode():
                return
            raw = self._excluded_raw()

    def set_end(self, round_number: int, nnodes: int) -> None:
        """The round the job ended in and its node count (before :meth:`set_status`)."""
        self.store.set("end", f"{round_number} {nnodes}")

    def end(self) -> tuple[int, int] | None:
        """What :meth:`set_end` wrote, or ``None``."""
        if not self.store.check(["end"]):
            return None
        k, _, n = bytes(self.store.get("end")).decode().partition(" ")
        return int(k), int(n)

    def rpc_secret(self, candidate: str) -> str:
        """The job's RPC secret: ``candidate`` if this node is the first to set it (an
        atomic set-if-absent), else the one the first node set."""
        return bytes(self.store.compare_set("rpc_secret", "", candidate)).decode()

    def status(self) -> str:
        if self.store.check(["status"]):
            return bytes(self.store.get("status")).decode()
        return ""

    def set_status(self, status: JobStatus) -> None:
        self.store.set("status", status)

    def leave(self, round_number: int, count: int = 1) -> int:
        """Count this node as leaving after ``round_number``; returns how many left."""
        return int(self.store.add(f"left/{round_number}", count))

    def first_to_see_hang(self, round_number: int) -> bool:
        return int(self.store.add(f"hang/{round_number}", 1)) == 1

    def hang_reported(self, round_number: int) -> None:
        self.store.set(f"hang/{round_number}/done", "1")

    def hang_is_reported(self, round_number: int) -> bool:
        return bool(self.store.check([f"hang/{round_number}/done"]))

    def publish_culprit(self, round_number: int, line: str, rank: int | None = None) -> None:
        """The Flight Recorder's culprit of a round's hang or collective timeout (its line
        for the summaries; its rank, for the node that runs it to replace it)."""
        if rank is not None:
            self.store.set(f"hang/{round_number}/culprit_rank", str(rank))
        self.store.set(f"hang/{round_number}/culprit", line)

    def culprit_rank(self, round_number: int) -> int | None:
        """The rank :meth:`publish_culprit` named for the round, if any."""
        key = f"hang/{round_number}/culprit_rank"
        if not self.store.check([key]):
            return None
        raw = bytes(self.store.get(key)).decode(errors="replace")
        return int(raw) if raw.isdigit() else None

    def culprit(self, round_number: int) -> str:
        """What :meth:`publish_culprit` wrote for the round (``""``: nothing, yet)."""
        key = f"hang/{round_number}/culprit"
        if not self.store.check([key]):
            return ""
        return bytes(self.store.get(key)).decode(errors="replace")
