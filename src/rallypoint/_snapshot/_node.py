"""A worker's snapshots under ``rallypoint run``: kept by the node's snapshot server.

``save``: wait until the previous save is complete on every rank (normally long done: it
ran during the step), take a slot from the server (``begin``), copy the tensors and the
meta into it (the only work on the training thread), send ``commit`` and return. A
background thread then waits for the server's answer (sent once the replica on the next
node has the snapshot too) and counts the save as complete in the workers' store.

``restore``: every rank votes for the snapshots it could load (``_agree``); the newest one
every rank has wins. A rank maps it from its own node's server, or its server fetches it
from the server that holds it (the replica, after a node was lost) first. With no common
snapshot in memory, a complete ``--snapshot-dir`` checkpoint is loaded with DCP.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import queue
import threading
import time
from collections.abc import MutableMapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rallypoint._core import envvars
from rallypoint._core.net import local_address_towards
from rallypoint._snapshot._agree import Agreement, Choice, next_generation
from rallypoint._snapshot._client import MapError, NodeClient, ServerError, SlotBuffer
from rallypoint._snapshot._errors import SnapshotError
from rallypoint._snapshot._flatten import Flat, apply
from rallypoint._snapshot._layout import (
    Meta,
    encode_meta,
    exact_views,
    plan,
    read_meta,
    views,
    write_meta,
)
from rallypoint._snapshot._options import Options
from rallypoint._snapshot._persist import Persister, persister_for
from rallypoint._snapshot._records import Key
from rallypoint._snapshot._report import Reporter
from rallypoint._snapshot._snapshot_dir import Checkpoint

if TYPE_CHECKING:
    from rallypoint._core.torch_c import TCPStore

__all__ = ["NodeSession"]

_T = TypeVar("_T")

EXIT_WAIT = 10.0
"""Seconds a worker that ends without ``snapshot.wait()`` waits for its last save."""


class _Background:
    """One daemon thread that runs jobs in order (a process never waits for it at exit:
    a save whose peers died must not keep a finished worker alive)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Any, tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        threading.Thread(target=self._run, daemon=True, name="rallypoint-snapshot").start()

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((future, fn, args))
        return future

    def stop(self) -> None:
        """The thread ends after the job it runs (if any)."""
        self._jobs.put((Future(), None, ()))

    def _run(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if fn is None:
                return
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # SystemExit too: handed to the waiting thread
                future.set_exception(exc)


def _worker_store(timeout: float) -> TCPStore:
    from rallypoint._core.torch_c import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )


def _peer_host(world: int, local_world: int) -> str:
    """The address this node's server listens on for the others and publishes: loopback
    while the world is this node's alone (nobody else needs it), else the address the
    kernel routes towards ``MASTER_ADDR`` from (the one the other nodes reach)."""
    if world == local_world:
        return "127.0.0.1"
    return local_address_towards(os.environ["MASTER_ADDR"])


class NodeSession:
    """This worker's snapshots on its node's server (see the module docstring)."""

    def __init__(self, path: str, options: Options, report: Reporter) -> None:
        env = os.environ
        self.options = options
        self.report = report
        self.rank, self.world = int(env["RANK"]), int(env["WORLD_SIZE"])
        # LOCAL_RANK is 0 for every worker under --virtual-local-rank
        self.local_rank = int(env.get(envvars.LOCAL_RANK) or env.get("LOCAL_RANK", "0"))
        secret = env.get(envvars.RPC_SECRET, "")
        if not secret:
            raise SnapshotError(f"{envvars.RPC_SECRET} is not set")
        self.first_rank = self.rank - self.local_rank
        self.local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
        host = _peer_host(self.world, self.local_world)
        self.client = NodeClient(path, secret.encode(), options.timeout, host=host)
        self.server = f"{host}:{self.client.port}"
        self.agree = self._agreement()
        self.agree.publish_server(self.server, self.first_rank, self.local_world)
        self._bg = _Background()
        self._bg_agree: Agreement | None = None
        self.pending: Future[Any] | None = None
        self.gen: str | None = None
        self.keep: Key | None = None
        self.restores = 0
        self._replica: str | None = ""
        self.persister: Persister | None = None
        self.disabled = ""
        run_id = env.get(envvars.RUN_ID) or "none"
        self.run_id = run_id
        self.token = hashlib.sha256(f"{run_id}\0{secret}".encode()).hexdigest()[:16]
        self.pid = os.getpid()
        atexit.register(self._at_exit)

    def _agreement(self) -> Agreement:
        env = os.environ
        return Agreement(
            _worker_store(self.options.timeout),
            rank=self.rank,
            world=self.world,
            group_rank=int(env.get("GROUP_RANK", "0")),
            group_world=int(env.get("GROUP_WORLD_SIZE", "1")),
            timeout=timedelta(seconds=self.options.timeout),
        )

    def configure(self, options: Options) -> None:
        self.options = options
        self.persister = persister_for(
            options, self.persister, rank=self.rank, world=self.world, run_id=self.run_id,
            token=self.token, report=self.report,
        )  # fmt: skip

    # ------------------------------------------------------------------ saving
    def save(self, flat: Flat, step: int) -> None:
        if self.disabled:
            return
        try:
            self._save(flat, step)
        except MapError as exc:
            self._disable(str(exc))
        except (ServerError, OSError) as exc:
            self._disable(f"lost the node's snapshot server ({exc})")

    def _save(self, flat: Flat, step: int) -> None:
        self.settle()
        if self.disabled:
            return
        key = (self._generation(), step)
        entries, data_end = plan(flat.tensors, flat.paths)
        meta = Meta(self.rank, self.world, key[0], step, flat.skeleton, entries)
        blob = encode_meta(meta)
        slot = self.client.begin(self.rank, self.world, key, data_end + len(blob), self.keep)
        persister = self.persister
        if persister is not None and persister.busy_with(slot.fid):
            persister.join()  # DCP still reads this slot's previous snapshot
        _copy(flat.tensors, views(slot.base, entries))
        write_meta(slot.view, data_end, blob)
        replica = self._replica_server()
        self.client.commit(self.rank, self.world, key, slot.index, self.keep, replica)
        self.keep = key
        self.pending = self._bg.submit(self._complete, key)
        if persister is not None and persister.due(step):
            self._persist(persister, step, slot, meta)

    def _persist(self, persister: Persister, step: int, slot: SlotBuffer, meta: Meta) -> None:
        if not persister.start(step, exact_views(slot.mm, meta.entries), meta, slot.fid):
            self.report.once(
                "no-pg",
                "--snapshot-dir needs torch.distributed initialised in a job of "
                "several ranks (DCP writes collectively); not persisting",
            )

    def _generation(self) -> str:
        if self.gen is None:
            self.gen = self.agree.generation(self.restores, next_generation(None))
        return self.gen

    def _replica_server(self) -> str | None:
        if self._replica == "":
            self._replica = self.agree.replica_server()
        return self._replica

    def _complete(self, key: Key) -> None:
        """Background: the server's answer to ``commit``, then every rank's completion."""
        reply = self.client.commit_reply()
        if reply.get("replica") == "failed":
            self.report.once(
                "replica",
                f"rank {self.rank}: snapshots are not replicated to the next node "
                f"({reply.get('error')}); a node loss would lose them",
            )
        if self._bg_agree is None:
            self._bg_agree = self._agreement()
        self._bg_agree.save_done(key)

    def settle(self) -> None:
        """Wait for the previous save's completion on every rank (bounded by the timeout)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result(timeout=self.options.timeout)
        except FutureTimeout:
            self._disable(f"a save did not complete within {self.options.timeout:.0f} s")
        except (ServerError, OSError) as exc:
            self._disable(f"lost the node's snapshot server ({exc})")
        except Exception as exc:  # the workers' store: a rank is gone, the job restarts
            self.report.once("store", f"a save was not confirmed by every rank ({exc})")

    def wait(self) -> None:
        self.settle()
        if self.persister is not None:
            self.persister.join()

    def _at_exit(self) -> None:
        """A script that never called ``wait()``: read the last save's answer (for at most
        :data:`EXIT_WAIT` s) before closing, so the server sees a clean end."""
        if os.getpid() != self.pid:
            return
        pending, self.pending = self.pending, None
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.result(timeout=EXIT_WAIT)
        if self.persister is not None:
            self.persister.join(EXIT_WAIT)
        self.client.close()

    def close(self) -> None:
        """This attempt is over and the process stays (an in-process restart): drop the
        session without waiting for saves whose peers may be gone."""
        atexit.unregister(self._at_exit)
        self._bg.stop()
        self.pending = None
        if self.persister is not None:
            self.persister.abandon()
        self.client.close()

    def _disable(self, why: str) -> None:
        self.disabled = why
        self.report.once("disabled", f"rank {self.rank}: snapshots are off for this worker: {why}")

    # ------------------------------------------------------------------ restoring
    def restore(self, state: MutableMapping[str, Any]) -> int | None:
        self.settle()
        n, self.restores = self.restores, self.restores + 1
        start = time.perf_counter()
        disk = self.persister.complete() if self.persister is not None else []
        try:
            choice = self._choose(n, disk)
        except (ServerError, OSError, RuntimeError) as exc:  # before any rank decided
            self.report.always(f"rank {self.rank}: cannot agree on a snapshot ({exc}); None")
            return None
        step, source, origin, memory = self._load(state, choice, n)
        self.keep = memory
        self.gen = self.agree.generation(n + 1, next_generation(memory[0] if memory else None))
        self._prune(n)
        if step is not None and self.rank == 0:
            took = time.perf_counter() - start
            self.report.always(
                f"restored step {step} from {source} on every rank ({self.world} ranks; "
                f"rank 0 took {took:.3f} s){': ' + origin if origin else ''}"
            )
        return step

    def _load(
        self, state: MutableMapping[str, Any], choice: Choice, n: int
    ) -> tuple[int | None, str, str, Key | None]:
        """Load what the ranks agreed on: ``(step, "memory"/"disk"/"", the checkpoint's
        origin, the key in memory)``."""
        memory, disk = choice.memory, choice.disk
        if memory is not None and (not disk or memory[1] >= disk[0].step):
            return self._from_memory(state, memory, choice.holders), "memory", "", memory
        failures: list[str] = []
        if disk:
            checkpoint, failures = self._from_disk(state, disk, n)
            if checkpoint is not None:
                assert self.persister is not None
                self.persister.resumed(checkpoint)
                return checkpoint.step, "disk", self.persister.origin(checkpoint), None
        if self.persister is not None and self.persister.explicit:
            raise self.persister.nothing_loaded(failures)  # every rank: the same votes
        self._explain(choice)
        return None, "", "", None

    def _prune(self, n: int) -> None:
        """Once every rank loaded its part, the node's server drops what it no longer needs
        (other worlds' snapshots, ranks that are neither its workers' nor its upstream's)."""
        try:
            self.agree.loaded(n)
            if self.local_rank == 0:
                mine = range(self.first_rank, self.first_rank + self.local_world)
                self.client.prune(self.world, sorted({*mine, *self.agree.upstream_ranks()}))
        except (ServerError, OSError, RuntimeError) as exc:
            self.report.once("prune", f"rank {self.rank}: could not prune old snapshots ({exc})")

    def _choose(self, n: int, disk: list[Checkpoint]) -> Choice:
        def inventory() -> list[tuple[int, int, Key]]:
            records = self.client.inventory()["records"]
            return [(r["rank"], r["world"], (r["gen"], r["step"])) for r in records]

        return self.agree.choose(
            n,
            inventory=inventory if self.local_rank == 0 else None,
            server=self.server,
            disk=disk,
        )

    def _from_memory(self, state: MutableMapping[str, Any], key: Key, holders: list[str]) -> int:
        errors = []
        slot: SlotBuffer | None = None
        for addr in holders:
            try:
                if addr == self.server:
                    slot = self.client.open(self.rank, self.world, key)
                else:
                    slot = self.client.fetch(self.rank, self.world, key, addr)
                break
            except ServerError as exc:
                errors.append(f"{addr}: {exc}")
        if slot is None:
            raise SnapshotError(
                f"rank {self.rank}: every rank has a snapshot of step {key[1]} in memory, but "
                f"this rank could not load its own: {'; '.join(errors)}"
            )
        meta = read_meta(slot.view[: slot.nbytes])
        if (meta.rank, meta.world, meta.gen, meta.step) != (self.rank, self.world, *key):
            raise SnapshotError(f"rank {self.rank}: the server returned another snapshot")
        self._apply(state, meta, views(slot.base, meta.entries), False)
        self.client.restored(self.rank, self.world, key)
        return key[1]

    def _from_disk(
        self, state: MutableMapping[str, Any], checkpoints: list[Checkpoint], n: int
    ) -> tuple[Checkpoint | None, list[str]]:
        """The newest of ``checkpoints`` that every rank loads (one that vanished or is
        damaged on some rank: every rank goes on to the next), ``None`` if none; and
        ``PATH (why)`` of each one that failed."""
        persister = self.persister
        assert persister is not None
        failures: list[str] = []
        for attempt, checkpoint in enumerate(checkpoints):
            loaded = persister.try_load(checkpoint)
            if self.agree.all_loaded(n, attempt, not isinstance(loaded, str)):
                assert not isinstance(loaded, str)
                self._apply(state, *loaded, owned=True)
                return checkpoint, failures
            where = persister.directory / checkpoint.name
            why = loaded if isinstance(loaded, str) else "another rank cannot load it"
            failures.append(f"{where} ({why})")
            if not isinstance(loaded, str):
                continue
            if attempt + 1 < len(checkpoints):
                then = "every rank tries the next complete one"
            elif persister.explicit:
                continue  # the restore's error says it
            else:
                then = "no other complete checkpoint: restore() returns None (a fresh start)"
            self.report.always(
                f"rank {self.rank}: cannot load the checkpoint {where} ({loaded}); {then}"
            )
        return None, failures

    def _apply(
        self,
        state: MutableMapping[str, Any],
        meta: Meta,
        tensors: list[torch.Tensor],
        owned: bool,
    ) -> None:
        notes = apply(state, meta.skeleton, tensors, [e.device for e in meta.entries], owned=owned)
        for note in notes:
            self.report.once(note, f"rank {self.rank}: {note}")

    def _explain(self, choice: Choice) -> None:
        if self.rank != 0:
            return
        if choice.other_worlds:
            worlds = ", ".join(str(w) for w in sorted(choice.other_worlds))
            self.report.always(
                f"the snapshots in memory were saved by a world of {worlds} ranks and this "
                f"world has {self.world}: they cannot be mapped onto the new ranks, and no "
                "--snapshot-dir checkpoint is complete for every rank to reshard from; "
                "restore() returns None (start from scratch, or set --snapshot-dir)"
            )


def _copy(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Stage: copy every tensor into the slot (from any device)."""
    with torch.no_grad():
        for src, dst in zip(sources, targets, strict=True):
            dst.copy_(src)
