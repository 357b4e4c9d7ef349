"""The agent loop: who this node is in the job, then start, watch and restart local workers.

Two steps, kept apart so that a rendezvous can replace the first one (multi-node):

1. :func:`resolve_group` answers "who am I in the job" (group rank, world size, master
   address and port). On one node that is static.
2. :class:`Agent` starts the local workers from the warm process, watches them (exits are
   reported the moment they happen, output pipes, signals, deadlines), stops every
   worker's whole process tree on the first failure, and restarts the group with a fresh
   store when restarts remain.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from rallypoint._core.net import port_is_free
from rallypoint.launcher._config import LaunchConfig
from rallypoint.launcher._errors import (
    BadTargetError,
    HangError,
    LaunchInterruptedError,
    LaunchTimeoutError,
    PortInUseError,
    WarmProcessError,
    WorkerFailedError,
)
from rallypoint.launcher._observe import Observer
from rallypoint.launcher._output import OutputRouter, write_console
from rallypoint.launcher._signals import install_signal_handlers, restore_signal_handlers
from rallypoint.launcher._state import GroupInfo, resolve_group
from rallypoint.launcher._state import Outcome as _Outcome
from rallypoint.launcher._state import Worker as _Worker
from rallypoint.launcher._summary import (
    bad_target_message,
    error_info,
    format_summary,
    peer_loss,
)
from rallypoint.launcher._warm import WarmProcess
from rallypoint.launcher._worker import BAD_TARGET_EXIT, Target, WorkerSpec

__all__ = ["Agent", "GroupInfo", "resolve_group"]

_OMP_WARNING = (
    "\n*****************************************\n"
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
    "to avoid your system being overloaded, please further tune the variable for optimal "
    "performance in your application as needed. \n"
    "*****************************************\n"
)


class Agent:
    """Runs one job on this node: attempts, monitoring, restarts, results."""

    def __init__(
        self,
        config: LaunchConfig,
        target: Target,
        warm: WarmProcess,
        *,
        title: str,
        collect_results: bool = False,
        warn_omp: bool = False,
    ) -> None:
        self.config = config
        self.target = target
        self.warm = warm
        self.title = title
        self.collect_results = collect_results
        self.warn_omp = warn_omp
        self.group = resolve_group(config)
        self.host = socket.gethostname()
        self.started = time.monotonic()
        self.deadline = (
            None if config.timeout is None else self.started + config.timeout.total_seconds()
        )
        self.port = self.group.master_port
        self.store_pid = 0
        self.signals: list[int] = []
        self._tmp = Path(tempfile.mkdtemp(prefix="rallypoint_"))
        self.obs = Observer(
            nproc=config.nproc,
            hang_timeout=config.hang_timeout,
            events=None if config.events is None else os.fspath(config.events),
            node=self.host,
        )
        self.round = 0
        self._log_root = self._log_dir()
        self._base_env = self._make_base_env()

    # ------------------------------------------------------------------ set-up
    def _log_dir(self) -> Path | None:
        cfg = self.config
        wants_files = any(
            cfg.std_mask(which, lr) for which in ("redirects", "tee") for lr in range(cfg.nproc)
        )
        if cfg.log_dir is not None:
            return Path(cfg.log_dir) / self.group.run_id
        if wants_files:
            root = Path(tempfile.mkdtemp(prefix="torchelastic_")) / self.group.run_id
            write_console(2, f"rallypoint: log directory is {root}\n".encode())
            return root
        return None

    def _make_base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.config.env)
        if "OMP_NUM_THREADS" not in env and self.config.nproc > 1:
            if self.warn_omp:
                write_console(2, _OMP_WARNING.encode())
            env["OMP_NUM_THREADS"] = "1"
        env.setdefault("RALLYPOINT_RPC_SECRET", secrets.token_hex(32))
        if self.config.start_method == "spawn":
            paths = [p for p in sys.path if p]
            env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    def _worker_env(self, local_rank: int, attempt: int, error_file: Path) -> dict[str, str]:
        g, cfg = self.group, self.config
        env = dict(self._base_env)
        rank = g.rank_offset + local_rank
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(local_rank),
            GROUP_RANK=str(g.group_rank),
            ROLE_RANK=str(rank),
            ROLE_NAME=cfg.role,
            LOCAL_WORLD_SIZE=str(cfg.nproc),
            WORLD_SIZE=str(g.world_size),
            GROUP_WORLD_SIZE=str(g.group_world_size),
            ROLE_WORLD_SIZE=str(g.world_size),
            MASTER_ADDR=g.master_addr,
            MASTER_PORT=str(self.port),
            TORCHELASTIC_RESTART_COUNT=str(attempt),
            TORCHELASTIC_MAX_RESTARTS=str(cfg.max_restarts),
            TORCHELASTIC_RUN_ID=g.run_id,
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_ERROR_FILE=str(error_file),
            TORCH_NCCL_ASYNC_ERROR_HANDLING=self._base_env.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
            ),
        )
        env.update(self.obs.worker_env(local_rank))
        return env

    def _exec_argv(self) -> list[str] | None:
        t = self.target
        if t.kind == "exec":
            return [t.name, *t.args]
        if self.config.start_method == "spawn" and t.kind != "callable":
            entry = [sys.executable, "-u", "-m", "rallypoint.launcher._spawned"]
            return [*entry, t.kind, t.name, *t.args]
        return None

    # ------------------------------------------------------------------ main loop
    def run(self) -> list[Any]:
        """Run the job to the end; returns per-rank results (``None`` for scripts)."""
        status, code = "failed", 1
        try:
            self._start_store()
            old = self._install_signal_handlers()
            try:
                results = self._run_attempts()
                status, code = "succeeded", 0
                return results
            finally:
                self._restore_signal_handlers(old)
        except LaunchInterruptedError as exc:
            status, code = "interrupted", 128 + exc.signum
            raise
        finally:
            with contextlib.suppress(Exception):
                self.obs.emit("job_end", status=status, exitcode=code)
            self.obs.close()
            shutil.rmtree(self._tmp, ignore_errors=True)

    def _init_warm(self) -> None:
        try:
            self.warm.init(self.config.preload)
        except WarmProcessError as exc:
            if str(exc).startswith("--preload"):
                raise BadTargetError(str(exc)) from None
            raise

    def _start_store(self) -> None:
        g = self.group
        if not g.hosts_store:
            return
        if g.master_port and not port_is_free(g.master_port):
            raise PortInUseError(g.master_port)
        self._init_warm()
        try:
            self.port, self.store_pid = self.warm.start_store(g.master_addr, g.master_port)
        except WarmProcessError as exc:
            if g.master_port and "in use" in str(exc).lower():
                raise PortInUseError(g.master_port) from None
            raise

    def _run_attempts(self) -> list[Any]:
        if not self.group.hosts_store:
            self._init_warm()
        cfg = self.config
        for attempt in range(cfg.max_restarts + 1):
            if attempt and self.group.hosts_store:
                self.warm.reset_store()
            self.round = attempt
            g = self.group
            self.obs.emit(
                "round", round=attempt, world_size=g.world_size, nnodes=1, run_id=g.run_id
            )
            self.obs.emit("members", round=attempt, members=[self.host])
            outcome = self._attempt(attempt)
            if outcome.kind == "ok":
                return [self._result(w) for w in outcome.workers]
            if outcome.kind == "bad_target":
                assert outcome.root is not None
                raise BadTargetError(self._bad_target_message(outcome.root))
            if outcome.kind == "signal":
                name = signal.Signals(outcome.signum).name
                states = "; ".join(f"rank {w.rank}: {w.state().detail}" for w in outcome.workers)
                raise LaunchInterruptedError(
                    f"received {name}: forwarded it to the workers and stopped ({states})",
                    signum=outcome.signum,
                )
            if outcome.kind == "timeout":
                raise LaunchTimeoutError(
                    f"the job did not finish within {cfg.timeout}; its workers were killed"
                )
            if outcome.kind == "hang":
                if cfg.on_hang == "restart" and attempt < cfg.max_restarts:
                    self._announce_restart(attempt, outcome.reason)
                    continue
                self.obs.emit("failure", round=attempt, message=outcome.reason)
                raise HangError(
                    f"{outcome.reason}; stopped the workers "
                    f"({'--on-hang fail' if cfg.on_hang == 'fail' else 'no restarts left'})"
                )
            assert outcome.root is not None
            if attempt < cfg.max_restarts:
                root = outcome.root.state()
                self._announce_restart(attempt, f"rank {root.rank} {root.detail}")
                continue
            err = self._failure(outcome, attempt)
            self.obs.emit(
                "failure",
                round=attempt,
                rank=err.rank,
                exitcode=err.exitcode,
                message=str(err),
            )
            raise err
        raise AssertionError("unreachable")

    def _announce_restart(self, attempt: int, reason: str) -> None:
        restarts = self.config.max_restarts
        write_console(
            2,
            f"rallypoint: {reason}; restarting the worker group "
            f"(restart {attempt + 1} of {restarts})\n".encode(),
        )
        self.obs.emit("restart", round=attempt + 1, restart_count=attempt + 1, reason=reason)

    def _on_hang(self, workers: list[_Worker]) -> str:
        """Print the workers' stacks grouped by identical stacks; returns the reason."""
        idle = self.obs.idle_seconds()
        reason = f"no worker reported progress for {idle:.1f} s (--hang-timeout)"
        self.obs.emit("hang", round=self.round, idle_s=round(idle, 3), action=self.config.on_hang)
        pids = {w.rank: w.pid for w in workers if w.status is None}
        text = self.obs.local_stacks_text(pids)
        write_console(2, f"rallypoint: {reason}; stacks:\n{text}\n".encode())
        return reason

    def _poll(self, workers: list[_Worker]) -> _Outcome | None:
        """Called each monitor tick while the workers run: another reason to stop them."""
        if self.obs.hung():
            return _Outcome("hang", workers, reason=self._on_hang(workers))
        return None

    def _spawn_all(self, attempt: int, router: OutputRouter) -> list[_Worker]:
        cfg = self.config
        exec_argv = self._exec_argv()
        target = self.target
        if cfg.start_method == "spawn" and target.kind == "callable":
            from rallypoint.launcher._worker import CALLABLES

            payload = self._tmp / "payload.pkl"
            fn, args = CALLABLES[target.name]
            payload.write_bytes(pickle.dumps((fn, args)))
            target = Target("payload", str(payload))
            exec_argv = [sys.executable, "-u", "-m", "rallypoint.launcher._spawned"]
            exec_argv += ["payload", str(payload)]
        attempt_dir = (self._log_root or self._tmp) / f"attempt_{attempt}"
        requests: list[tuple[WorkerSpec, list[int]]] = []
        readers: list[tuple[int, int, int]] = []
        try:
            for local_rank in range(cfg.nproc):
                rank_dir = attempt_dir / str(local_rank)
                rank_dir.mkdir(parents=True, exist_ok=True)
                error_file = rank_dir / "error.json"
                for stale in (error_file, Path(f"{error_file}.fault")):
                    with contextlib.suppress(FileNotFoundError):
                        stale.unlink()
                spec = WorkerSpec(
                    local_rank=local_rank,
                    rank=self.group.rank_offset + local_rank,
                    env=self._worker_env(local_rank, attempt, error_file),
                    cwd=os.fspath(cfg.cwd) if cfg.cwd is not None else os.getcwd(),
                    target=target,
                    exec_argv=exec_argv,
                )
                pipes = [os.pipe() for _ in range(3)]
                requests.append((spec, [w for _, w in pipes]))
                readers.append((pipes[0][0], pipes[1][0], pipes[2][0]))
            pids = self.warm.spawn_many(requests)
        except BaseException:
            for fds in readers:
                for fd in fds:
                    os.close(fd)
            raise
        finally:
            for _, write_ends in requests:
                for fd in write_ends:
                    os.close(fd)
        workers: list[_Worker] = []
        for (spec, _), pid, (out_r, err_r, res_r) in zip(requests, pids, readers, strict=True):
            local_rank = spec.local_rank
            rank_dir = attempt_dir / str(local_rank)
            redirect = cfg.std_mask("redirects", local_rank)
            mask = redirect | cfg.std_mask("tee", local_rank)
            for fd, stream, name in ((out_r, 1, "stdout"), (err_r, 2, "stderr")):
                shown = not (redirect & stream)
                if cfg.local_ranks_filter is not None:
                    shown = shown and local_rank in cfg.local_ranks_filter
                to_file = self._log_root is not None and (
                    cfg.log_dir is not None or bool(mask & stream)
                )
                router.add(
                    fd,
                    stream=stream,
                    prefix_template=cfg.prefix,
                    rank=spec.rank,
                    local_rank=local_rank,
                    role=cfg.role,
                    console=shown,
                    file=rank_dir / f"{name}.log" if to_file else None,
                )
            os.set_blocking(res_r, False)
            workers.append(_Worker(local_rank, spec.rank, pid, rank_dir / "error.json", res_r))
        return workers

    def _attempt(self, attempt: int) -> _Outcome:
        router = OutputRouter()
        sel = selectors.DefaultSelector()
        sel.register(self.warm.fileno(), selectors.EVENT_READ, "warm")
        wake_r = self._wake_r
        if wake_r is not None:
            sel.register(wake_r, selectors.EVENT_READ, "signal")
        workers: list[_Worker] = []
        outcome: _Outcome | None = None
        try:
            workers = self._spawn_all(attempt, router)
        except BaseException:
            self._kill_trees(workers, signal.SIGKILL)
            self._wait_all(workers, 5.0)
            router.close()
            sel.close()
            raise
        self.obs.reset()
        for started in workers:
            self.obs.emit(
                "worker_start",
                round=self.round,
                rank=started.rank,
                local_rank=started.local_rank,
                pid=started.pid,
            )
        by_pid = {w.pid: w for w in workers}
        by_res = {w.res_fd: w for w in workers}
        for fd in router.fds():
            sel.register(fd, selectors.EVENT_READ, "out")
        for fd in by_res:
            sel.register(fd, selectors.EVENT_READ, "res")
        kill_at: float | None = None
        drain_until: float | None = None
        interval = self.config.monitor_interval.total_seconds()
        next_poll = time.monotonic() + interval
        pending = self.warm.read_events() if self.warm.events else []
        try:
            while True:
                now = time.monotonic()
                batch = []
                for pid, status in pending:
                    w = by_pid.get(pid)
                    if w is None or w.status is not None:
                        continue
                    w.status, w.exited_at = status, now
                    self._on_exit(w)
                    batch.append(w)
                # exits reaped together have no order: a rank that failed because its peer
                # vanished ("Connection closed by peer") is a consequence, not the cause
                batch.sort(key=lambda w: peer_loss(w.error_file))
                for w in batch:
                    if w.returncode != 0 and outcome is None:
                        kind = "failed"
                        if w.returncode == BAD_TARGET_EXIT and self._bad_target_message(w):
                            kind = "bad_target"
                        outcome = _Outcome(kind, workers, root=w)
                        kill_at = self._stop(workers, signal.SIGTERM)
                pending = []
                while self.signals:
                    signum = self.signals.pop(0)
                    if outcome is None or outcome.kind != "signal":
                        outcome = _Outcome("signal", workers, signum=signum)
                        kill_at = self._stop(workers, signum)
                if outcome is None and self.deadline is not None and now >= self.deadline:
                    outcome = _Outcome("timeout", workers)
                    kill_at = self._stop(workers, signal.SIGKILL)
                if outcome is None and now >= next_poll:
                    next_poll = now + interval
                    outcome = self._poll(workers)
                    if outcome is not None:
                        kill_at = self._stop(workers, signal.SIGTERM, outcome.kind)
                if kill_at is not None and now >= kill_at:
                    self._kill_trees(workers, signal.SIGKILL)
                    kill_at = now + 1.0
                alive = [w for w in workers if w.status is None]
                if not alive and drain_until is None:
                    self._kill_trees(workers, signal.SIGKILL)  # no orphans, even on success
                    drain_until = now + 0.5
                if not alive and ((not router.fds() and not by_res) or now >= (drain_until or 0)):
                    break
                timeout = interval
                for t in (kill_at, self.deadline if outcome is None else None, drain_until):
                    if t is not None:
                        timeout = min(timeout, max(0.0, t - now))
                for key, _ in sel.select(timeout):
                    tag = key.data
                    fd = key.fd
                    if tag == "warm":
                        pending.extend(self.warm.read_events())
                    elif tag == "out":
                        if not router.on_readable(fd):
                            sel.unregister(fd)
                    elif tag == "res":
                        if not self._read_result(by_res[fd]):
                            sel.unregister(fd)
                            del by_res[fd]
                    elif tag == "signal":
                        with contextlib.suppress(BlockingIOError):
                            os.read(fd, 512)
        finally:
            router.close()
            for fd in by_res:
                with contextlib.suppress(OSError):
                    os.close(fd)
            sel.close()
        return outcome if outcome is not None else _Outcome("ok", workers)

    def _on_exit(self, w: _Worker) -> None:
        self.obs.forget(w.pid)
        state = w.state()
        fields: dict[str, Any] = {}
        if state.exitcode is not None and state.exitcode < 0:
            with contextlib.suppress(ValueError):
                fields["signal"] = signal.Signals(-state.exitcode).name
        self.obs.emit(
            "worker_exit",
            round=self.round,
            rank=w.rank,
            local_rank=w.local_rank,
            pid=w.pid,
            state=state.state,
            exitcode=state.exitcode,
            **fields,
        )

    def _read_result(self, w: _Worker) -> bool:
        try:
            data = os.read(w.res_fd, 1 << 20)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if data:
            w.result += data
            return True
        os.close(w.res_fd)
        return False

    # ------------------------------------------------------------------ stopping
    def _descendants(self) -> list[psutil.Process]:
        try:
            procs = psutil.Process(self.warm.pid).children(recursive=True)
        except psutil.Error:
            return []
        skip = {self.store_pid}
        out = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                if p.pid in skip or p.ppid() in skip:
                    continue
                out.append(p)
        return out

    def _kill_trees(self, workers: list[_Worker], signum: int) -> None:
        for w in workers:
            with contextlib.suppress(OSError):
                os.killpg(w.pid, signum)
        for p in self._descendants():
            with contextlib.suppress(psutil.Error):
                p.send_signal(signum)

    def _stop(self, workers: list[_Worker], signum: int, why: str = "") -> float:
        for w in workers:
            if w.status is None and w.signalled is None:
                w.signalled = signum
        self._kill_trees(workers, signum)
        grace = self.config.shutdown_timeout.total_seconds()
        if why in ("hang", "restart"):
            grace = min(grace, 3.0)  # blocked in a collective: do not wait long for them
        return time.monotonic() + grace

    def _wait_all(self, workers: list[_Worker], timeout: float) -> None:
        end = time.monotonic() + timeout
        while any(w.status is None for w in workers) and time.monotonic() < end:
            sel = selectors.DefaultSelector()
            sel.register(self.warm.fileno(), selectors.EVENT_READ)
            sel.select(0.05)
            sel.close()
            for pid, status in self.warm.read_events():
                for w in workers:
                    if w.pid == pid:
                        w.status = status

    # ------------------------------------------------------------------ signals
    _wake_r: int | None = None

    def _install_signal_handlers(self) -> dict[int, Any] | None:
        self._wake_r, old = install_signal_handlers(self.config.signals_to_handle, self.signals)
        return old

    def _restore_signal_handlers(self, old: dict[int, Any] | None) -> None:
        restore_signal_handlers(old)
        self._wake_r = None

    # ------------------------------------------------------------------ reporting
    def _error_info(self, w: _Worker) -> tuple[str, BaseException | None]:
        return error_info(bytes(w.result), w.error_file)

    def _bad_target_message(self, w: _Worker) -> str:
        return bad_target_message(w.error_file)

    def _failure(self, outcome: _Outcome, attempt: int) -> WorkerFailedError:
        root = outcome.root
        assert root is not None
        tb, exc = self._error_info(root)
        state = root.state()
        others = [w.state() for w in outcome.workers if w is not root]
        restarts = self.config.max_restarts
        attempts = f"attempt {attempt + 1} of {restarts + 1}" if restarts else "no restarts"
        summary = format_summary(
            title=self.title,
            root=state,
            host=self.host,
            when=time.time() - (time.monotonic() - root.exited_at),
            elapsed=root.exited_at - self.started,
            traceback_text=tb,
            others=others,
            attempts=attempts,
        )
        err = WorkerFailedError(
            f"rank {root.rank} (local_rank {root.local_rank}, pid {root.pid}) {state.detail}",
            rank=root.rank,
            local_rank=root.local_rank,
            pid=root.pid,
            host=self.host,
            exitcode=state.exitcode,
            remote_traceback=tb,
            summary=summary,
            others=tuple(others),
            exception=exc,
        )
        if exc is not None:
            err.__cause__ = exc
        return err

    def _result(self, w: _Worker) -> Any:
        if not self.collect_results:
            return None
        if len(w.result) < 8:
            raise WorkerFailedError(
                f"rank {w.rank} exited with 0 without sending a result",
                rank=w.rank,
                local_rank=w.local_rank,
                pid=w.pid,
                host=self.host,
                exitcode=0,
                remote_traceback="",
                summary="",
            )
        msg = pickle.loads(bytes(w.result[8:]))
        return msg[1]
