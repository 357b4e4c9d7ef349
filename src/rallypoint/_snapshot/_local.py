"""Snapshots outside ``rallypoint run`` (plain python, torchrun, a notebook): this process only.

The last two snapshots are copies in this process's memory, so ``restore`` in the same
process (a notebook cell run again after an exception) gets the newest back; a new process
gets nothing from memory. ``--snapshot-dir``/``configure(dir=...)`` persists and restores
with DCP as under ``rallypoint run``, without an agreement between ranks: every rank loads
the newest complete checkpoint it sees (a shared directory shows every rank the same).
Nothing here raises for the environment: it says so once and goes on.
"""

from __future__ import annotations

import os
import secrets
from collections import deque
from collections.abc import MutableMapping
from typing import Any

import torch

from rallypoint._core import envvars
from rallypoint._snapshot._flatten import Flat, apply
from rallypoint._snapshot._layout import Meta, plan
from rallypoint._snapshot._options import Options
from rallypoint._snapshot._persist import Persister, persister_for
from rallypoint._snapshot._report import Reporter

__all__ = ["LocalSession"]

OUTSIDE = (
    "not running under `rallypoint run`: snapshots are kept in this process's memory only "
    "(restore() in a new process finds none unless --snapshot-dir/configure(dir=...) is set); "
    "run the script with `rallypoint run` to keep them on the node and its peer"
)


class LocalSession:
    def __init__(self, options: Options, report: Reporter, why: str = OUTSIDE) -> None:
        self.options = options
        self.report = report
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        self.snapshots: deque[tuple[Meta, list[torch.Tensor]]] = deque(maxlen=2)
        self.persister: Persister | None = None
        self.why = why
        # torchrun gives every rank of a job the same run id (and store); plain python: none
        run_id = os.environ.get(envvars.RUN_ID) or f"local-{secrets.token_hex(6)}"
        store = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
        self.run_id, self.token = run_id, f"{run_id}@{store}"

    def close(self) -> None:
        if self.persister is not None:
            self.persister.abandon()

    def configure(self, options: Options) -> None:
        self.options = options
        self.persister = persister_for(
            options, self.persister, rank=self.rank, world=self.world, run_id=self.run_id,
            token=self.token, report=self.report,
        )  # fmt: skip

    def save(self, flat: Flat, step: int) -> None:
        self.report.once("outside", self.why)
        try:
            with torch.no_grad():
                copies = [t.to("cpu", copy=True) for t in flat.tensors]
            entries, _ = plan(flat.tensors, flat.paths)
            meta = Meta(self.rank, self.world, "local", step, flat.skeleton, entries)
            self.snapshots.append((meta, copies))
            persister = self.persister
            if (
                persister is not None
                and persister.due(step)
                and not persister.start(step, copies, meta)
            ):
                self.report.once(
                    "no-pg",
                    "--snapshot-dir needs torch.distributed initialised in a job "
                    "of several ranks (DCP writes collectively); not persisting",
                )
        except Exception as exc:
            self.report.once("local-save", f"a snapshot failed and was skipped: {exc}")

    def restore(self, state: MutableMapping[str, Any]) -> int | None:
        self.report.once("outside", self.why)
        if self.snapshots:
            meta, tensors = self.snapshots[-1]
            notes = apply(state, meta.skeleton, tensors, [e.device for e in meta.entries])
            for note in notes:
                self.report.once(note, note)
            return meta.step
        if self.persister is None:
            return None
        failures = []
        for checkpoint in self.persister.complete():  # newest first
            loaded = self.persister.try_load(checkpoint)
            if not isinstance(loaded, str):
                self.persister.resumed(checkpoint)
                return self._apply_disk(state, *loaded, self.persister.origin(checkpoint))
            where = self.persister.directory / checkpoint.name
            failures.append(f"{where} ({loaded})")
            self.report.always(f"cannot load the checkpoint {where} ({loaded}); trying the next")
        if self.persister.explicit:  # a choice that does not load is an error
            raise self.persister.nothing_loaded(failures)
        return None

    def _apply_disk(
        self, state: MutableMapping[str, Any], meta: Meta, tensors: list[torch.Tensor], where: str
    ) -> int:
        notes = apply(state, meta.skeleton, tensors, [e.device for e in meta.entries], owned=True)
        for note in notes:
            self.report.once(note, note)
        self.report.always(f"rank {self.rank}: restored step {meta.step} from {where}")
        return meta.step

    def wait(self) -> None:
        if self.persister is not None:
            self.persister.join()
