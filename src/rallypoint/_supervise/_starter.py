"""Starting one attempt's workers: their specs, their pipes, and where their output goes."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from rallypoint._core.envvars import ERROR_FILE, FT_NOTICE
from rallypoint._supervise._env import spare_env, standby_env, worker_env
from rallypoint._supervise._main_module import describe_main
from rallypoint._supervise._options import OutputOptions, WorkerOptions
from rallypoint._supervise._output import LOG_TROUBLE, Duplicate, OutputRouter
from rallypoint._supervise._state import GroupInfo, Worker
from rallypoint._supervise._warm._process import WarmProcess
from rallypoint._supervise._worker import CALLABLES, Target, WorkerSpec
from rallypoint._watch._observer import Observer
from rallypoint._worker_side._control import Assign, encode
from rallypoint._worker_side._control import pair as control_pair

__all__ = ["WorkerStarter"]

_SPAWNED = [sys.executable, "-u", "-m", "rallypoint._supervise._spawn_entry"]


@dataclass(slots=True)
class _Pipes:
    """The supervisor's read ends of one worker's stdout, stderr and result pipes, and its
    end of the worker's control channel."""

    out: int
    err: int
    res: int
    control: socket.socket

    def close(self) -> None:
        for fd in (self.out, self.err, self.res):
            os.close(fd)
        self.control.close()


class WorkerStarter:
    """Forks the workers of one attempt from the warm process and routes their output."""

    def __init__(
        self,
        warm: WarmProcess,
        target: Target,
        *,
        workers: WorkerOptions,
        output: OutputOptions,
        observer: Observer,
        base_env: dict[str, str],
        log_root: Path | None,
        scratch: Path,
    ) -> None:
        self.warm = warm
        self.workers = workers
        self.output = output
        self.observer = observer
        self.base_env = base_env
        self.log_root = log_root
        self.scratch = scratch
        self.target, self.exec_argv = self._prepare(target, scratch)
        self.cpus: tuple[frozenset[int], ...] = ()
        """Each local rank's CPUs under ``numa_binding`` (set once by the supervisor)."""

    def _prepare(self, target: Target, scratch: Path) -> tuple[Target, list[str] | None]:
        """What each worker runs in its process, or execs instead (``--no-python``, spawn)."""
        if target.kind == "exec":
            return target, [target.name, *target.args]
        if self.workers.start_method != "spawn":
            return target, None
        if target.kind == "callable":  # a fresh interpreter gets fn and args pickled
            payload = scratch / "payload.pkl"
            with payload.open("wb") as fp:  # the caller's __main__ first: fn may live there
                pickle.dump(describe_main(), fp)
                pickle.dump(CALLABLES[target.name], fp)
            target = Target("payload", str(payload))
        return target, [*_SPAWNED, target.kind, target.name, *target.args]

    def start(
        self,
        group: GroupInfo,
        attempt: int,
        router: OutputRouter,
        kept: Mapping[int, Worker] | None = None,
    ) -> list[Worker]:
        """Fork the local workers of ``group`` for ``attempt`` (their output goes to
        ``router``); the ``kept`` ones (by local rank, parked after an in-process restart)
        get the attempt's environment instead and go on in their processes."""
        kept = kept or {}
        attempt_dir = (self.log_root or self.scratch) / f"attempt_{attempt}"
        specs = [self._spec(group, local_rank, attempt_dir) for local_rank in range(self.nproc)]
        fresh = [spec for spec in specs if spec.local_rank not in kept]
        pids, pipes = self._fork(fresh)
        out = self.output
        duplicates = {  # torchrun opens these files only when it has filters
            stream: router.duplicate(attempt_dir / f"filtered_{name}.log", filters)
            for stream, name, filters in (
                (1, "stdout", out.duplicate_stdout_filters),
                (2, "stderr", out.duplicate_stderr_filters),
            )
            if filters and self.log_root is not None
        }
        started = {}
        for spec, pid, p in zip(fresh, pids, pipes, strict=True):
            os.set_blocking(p.res, False)
            error_file = attempt_dir / str(spec.local_rank) / "error.json"
            started[spec.local_rank] = Worker(
                spec.local_rank, spec.rank, pid, error_file, p.res, pipes=(p.out, p.err),
                control=p.control,
            )  # fmt: skip
        for spec in specs:
            if spec.local_rank in kept:
                started[spec.local_rank] = _resume(kept[spec.local_rank], spec, attempt)
            w = started[spec.local_rank]
            self._route(router, spec, w.pipes, attempt_dir / str(spec.local_rank), duplicates)
        return [started[spec.local_rank] for spec in specs]

    def start_standby(self, group: GroupInfo) -> list[Worker]:
        """Fork this node's workers as a hot spare's: they run the script's set-up and wait
        in their restartable function for the ranks of the round that admits them
        (``group`` only fills what does not depend on it)."""
        standby_dir = (self.log_root or self.scratch) / "standby"
        specs = []
        for local_rank in range(self.nproc):
            spec = self._spec(group, local_rank, standby_dir)
            spec.env = standby_env(spec.env)
            specs.append(spec)
        pids, pipes = self._fork(specs)
        workers = []
        for spec, pid, p in zip(specs, pids, pipes, strict=True):
            os.set_blocking(p.res, False)
            error_file = standby_dir / str(spec.local_rank) / "error.json"
            workers.append(
                Worker(spec.local_rank, -1, pid, error_file, p.res, pipes=(p.out, p.err),
                       control=p.control, parked=True)
            )  # fmt: skip
        return workers

    def start_spares(self, group: GroupInfo, first: int, count: int) -> list[Worker]:
        """Fork ``count`` spare workers (``--spare-workers``), numbered from ``first``: they
        run the script's set-up and wait in their restartable function until one is given
        a replaced rank's place (:meth:`start` with it among ``kept``)."""
        spares_dir = (self.log_root or self.scratch) / "spares"
        specs = []
        for number in range(first, first + count):
            # local rank 0's, less what is its own; its files in a directory of its own
            spec = self._spec(group, 0, spares_dir, rank_dir=spares_dir / str(number))
            spec.env = spare_env(spec.env)
            # numbered past the local ranks: the warm process tells its children apart by it
            spec.local_rank, spec.rank, spec.cpus = self.nproc + number, -1, None
            specs.append(spec)
        pids, pipes = self._fork(specs)
        workers = []
        for spec, pid, p in zip(specs, pids, pipes, strict=True):
            os.set_blocking(p.res, False)
            workers.append(
                Worker(spec.local_rank, -1, pid, Path(spec.env[ERROR_FILE]), p.res,
                       pipes=(p.out, p.err), control=p.control, parked=True)
            )  # fmt: skip
        return workers

    @property
    def nproc(self) -> int:
        return self.workers.nproc

    def _spec(
        self, group: GroupInfo, local_rank: int, attempt_dir: Path, rank_dir: Path | None = None
    ) -> WorkerSpec:
        """``local_rank``'s spec; its files go to ``rank_dir`` (default ``attempt_dir/N``)."""
        rank_dir = rank_dir or attempt_dir / str(local_rank)
        error_file = rank_dir / "error.json"
        notice = rank_dir / "ft-member.json"  # rallypoint.ft: who tells its peers it died
        try:
            rank_dir.mkdir(parents=True, exist_ok=True)
            for stale in (error_file, Path(f"{error_file}.fault"), notice):
                with contextlib.suppress(FileNotFoundError):
                    stale.unlink()
        except OSError as exc:  # a disk that failed mid-run: the job goes on without files
            LOG_TROUBLE.report(rank_dir, "preparing the rank's directory", exc)
        env = worker_env(
            self.base_env, group, local_rank=local_rank, workers=self.workers, error_file=error_file
        )
        env.update(self.observer.worker_env(local_rank, env))
        env[FT_NOTICE] = str(notice)
        return WorkerSpec(
            local_rank=local_rank,
            rank=group.rank_offset + local_rank,
            env=env,
            cwd=self.workers.cwd if self.workers.cwd is not None else os.getcwd(),
            target=self.target,
            exec_argv=self.exec_argv,
            cpus=self.cpus[local_rank] if self.cpus else None,
        )

    def _fork(self, specs: list[WorkerSpec]) -> tuple[list[int], list[_Pipes]]:
        requests: list[tuple[WorkerSpec, list[int]]] = []
        readers: list[_Pipes] = []
        workers_ends: list[socket.socket] = []
        try:
            for spec in specs:
                (out_r, out_w), (err_r, err_w), (res_r, res_w) = (os.pipe() for _ in range(3))
                agent_end, worker_end = control_pair()
                workers_ends.append(worker_end)
                readers.append(_Pipes(out_r, err_r, res_r, agent_end))
                requests.append((spec, [out_w, err_w, res_w, worker_end.fileno()]))
            return self.warm.spawn_many(requests), readers
        except BaseException:  # Ctrl-C too: the pipes are closed
            for p in readers:
                p.close()
            raise
        finally:
            for _, write_ends in requests:
                for fd in write_ends[:3]:
                    os.close(fd)
            for sock in workers_ends:
                sock.close()

    def _route(
        self,
        router: OutputRouter,
        spec: WorkerSpec,
        pipes: tuple[int, int],
        rank_dir: Path,
        duplicates: dict[int, Duplicate],
    ) -> None:
        out = self.output
        local_rank = spec.local_rank
        redirect = out.std_mask("redirects", local_rank)
        tee = out.std_mask("tee", local_rank)
        mask = redirect | tee
        for fd, stream, name in ((pipes[0], 1, "stdout"), (pipes[1], 2, "stderr")):
            if fd < 0:  # a kept worker that closed it
                continue
            shown = not (redirect & stream)
            if out.local_ranks_filter is not None:
                shown = shown and local_rank in out.local_ranks_filter
            to_file = self.log_root is not None and (out.log_dir is not None or bool(mask & stream))
            router.add(
                fd,
                stream=stream,
                prefix_template=out.prefix,
                rank=spec.rank,
                local_rank=local_rank,
                role=self.workers.role,
                console=shown,
                file=rank_dir / f"{name}.log" if to_file else None,
                # as torchrun: only a tee'd stream's lines are duplicated
                duplicate=duplicates.get(stream) if tee & stream and to_file else None,
            )


def _resume(worker: Worker, spec: WorkerSpec, attempt: int) -> Worker:
    """``worker``, kept from an earlier attempt, in ``attempt``: told its environment."""
    assert worker.control is not None
    try:
        worker.control.setblocking(True)
        worker.control.send(encode(Assign(spec.env)))
    except OSError:
        pass  # it died meanwhile: its exit is reported as any worker's
    finally:
        worker.control.setblocking(False)
    return replace(
        worker,
        rank=spec.rank,
        error_file=Path(spec.env[ERROR_FILE]) if ERROR_FILE in spec.env else worker.error_file,
        parked=False,
        interrupted_at=None,
        raised="",
        signalled=None,
        kept_since=worker.kept_since if worker.kept_since is not None else attempt - 1,
    )
