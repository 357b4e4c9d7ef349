"""The Flight Recorder of each worker: on by default, and dumped on the agent's request.

torch records every collective of every process group in its Flight Recorder (gloo and
NCCL alike). :func:`flight_recorder_env` gives the workers rallypoint's default buffer
(or none with ``--flight-recorder off``) unless the user set torch's own variables.
Worker side: :func:`install_flight_dumper` starts a daemon thread that reads requests from
a FIFO and writes torch's trace, with the group memberships, to a file. A thread, not a
signal handler: a Python handler never runs while the main thread is blocked in a
collective, but that call releases the GIL, so the thread runs. Agent side:
:class:`FlightRequest` writes the requests and collects the answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from rallypoint._core import envvars
from rallypoint._core.procs import pid_running
from rallypoint._watch._fifo import STACKS_REQUEST, ask, fifo_path
from rallypoint._watch._flight._records import FlightEntry, GroupTrace, RankTrace

__all__ = [
    "BUFFER_ENV",
    "DEFAULT_BUFFER",
    "NCCL_DUMP_PREFIX",
    "FlightRequest",
    "answers",
    "flight_recorder_env",
    "install_flight_dumper",
    "merged_dumps",
    "parse_buffer",
    "recording",
    "remove_flight_files",
    "trace_from_dump",
    "write_answer",
]

DEFAULT_BUFFER = 2000
"""Entries kept per worker (torch's own default; the benchmark measures its cost)."""
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
_USER_BUFFER_ENVS = (BUFFER_ENV, "TORCH_NCCL_TRACE_BUFFER_SIZE")
KEEP_COMPLETED = 4
"""Completed collectives per group sent with a dump, besides the pending ones."""


def parse_buffer(value: int | str | None, name: str = "flight_recorder") -> int | None:
    """``--flight-recorder``: a number of entries >= 1, or ``off``/``None``/``0`` (no recording)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number of entries or 'off', got {value!r}")
    text = str(value).strip().lower()
    if text in ("off", "0"):
        return None
    if not text.isdigit():
        raise ValueError(f"{name} must be a number of entries (e.g. 2000) or off, got {value!r}")
    return int(text)


NCCL_DUMP_PREFIX = "nccl_trace_rank_"
"""Where NCCL's watchdog writes a worker's Flight Recorder when a collective times out:
``<stacks dir>/nccl_trace_rank_<rank>`` (``TORCH_FR_DUMP_TEMP_FILE``)."""


def flight_recorder_env(
    env: Mapping[str, str],
    buffer: int | None,
    directory: str | None = None,
    *,
    timing: bool = False,
) -> dict[str, str]:
    """The variables to add to a worker's ``env``; a variable the user set is never touched.

    ``TORCH_FR_BUFFER_SIZE`` (unless ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set), and with
    recording on, for NCCL: ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` and ``TORCH_FR_DUMP_TEMP_FILE``
    in ``directory``, so that a worker that NCCL's watchdog ends on a collective timeout
    leaves its trace on the agent's disk (the watchdog aborts the process after the
    timeout, whatever ``--hang-timeout`` says: see docs/diagnosis.md); with ``timing``
    (straggler detection on), ``TORCH_NCCL_ENABLE_TIMING=1``: each collective's time on
    the GPU, where a rank whose GPU is slow shows (about 3.5 us per collective on an H200).
    """
    out: dict[str, str] = {}
    if not any(k in env for k in _USER_BUFFER_ENVS):
        out[BUFFER_ENV] = str(buffer or 0)
    if not recording({**env, **out}):
        return out
    out.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    if timing:
        out["TORCH_NCCL_ENABLE_TIMING"] = "1"
    if directory is not None:
        out["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(directory, NCCL_DUMP_PREFIX)
    return {k: v for k, v in out.items() if k not in env}


def recording(env: Mapping[str, str]) -> bool:
    for key in _USER_BUFFER_ENVS:
        if key in env:
            return env[key].strip().isdigit() and int(env[key]) > 0
    return True  # torch's default records


# ---------------------------------------------------------------------------- worker side


def _op_name(profiling_name: str) -> str:
    return profiling_name.split(":", 1)[-1]


def _groups_of_this_worker() -> dict[str, tuple[tuple[int, ...], bool]]:
    """``{group name: (global ranks, is the default group)}`` from ``torch.distributed``."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        return {}
    world = c10d._world
    default = world.default_pg
    return {
        name: (tuple(sorted(world.pg_group_ranks.get(pg, {}))), pg is default)
        for pg, name in world.pg_names.items()
    }


def trace_from_dump(
    rank: int,
    dump: Mapping[str, Any],
    groups: Mapping[str, tuple[tuple[int, ...], bool]],
    keep: int = KEEP_COMPLETED,
    window_ns: int | None = None,
) -> RankTrace:
    """A :class:`RankTrace` from torch's unpickled dump and this worker's groups;
    ``window_ns``: only the entries created that long before the newest one, or later."""
    status = dump.get("pg_status", {})
    by_group: dict[str, list[FlightEntry]] = {}
    issued: dict[str, int] = {}
    completed: dict[str, int] = {}
    entries = dump.get("entries", [])
    oldest = None
    if window_ns is not None and entries:
        oldest = max(int(e["time_created_ns"]) for e in entries) - window_ns
    for e in entries:
        if e.get("is_p2p"):
            continue
        name = str(e["process_group"][0])
        st = status.get(str(e["pg_id"]), {})
        issued[name] = max(0, int(st.get("last_enqueued_collective", 0)))  # -1: none
        completed[name] = max(0, int(st.get("last_completed_collective", 0)))
        if oldest is not None and int(e["time_created_ns"]) < oldest:
            continue
        by_group.setdefault(name, []).append(
            FlightEntry(
                seq=int(e["collective_seq_id"]),
                op=_op_name(str(e["profiling_name"])),
                sizes=tuple(tuple(int(n) for n in s) for s in e.get("input_sizes", [])),
                dtypes=tuple(str(d) for d in e.get("input_dtypes", [])),
                created_ns=int(e["time_created_ns"]),
                completed=bool(e.get("retired")) or e.get("state") == "completed",
                frames=tuple(
                    (str(f["filename"]), int(f["line"]), str(f["name"]))
                    for f in e.get("frames", [])
                ),
                duration_ns=_duration_ns(e.get("duration_ms")),
            )
        )
    traces = []
    for name in sorted(set(groups) | set(by_group), key=lambda n: (len(n), n)):
        entries = by_group.get(name, [])
        # NCCL's status lags: its watchdog marks entries completed before it counts them
        done = max(completed.get(name, 0), max((e.seq for e in entries if e.completed), default=0))
        last = issued.get(name, max((e.seq for e in entries), default=0))
        recent = tuple(e for e in entries if e.seq > done - keep)
        ranks, world = groups.get(name, ((), False))
        traces.append(GroupTrace(name, ranks, last, done, recent, world))
    return RankTrace(rank=rank, groups=tuple(traces))


def _duration_ns(ms: Any) -> int | None:
    """NCCL's ``duration_ms`` (with ``TORCH_NCCL_ENABLE_TIMING``, once done) in ns."""
    return None if ms is None else round(float(ms) * 1e6)


def _dump_this_worker(
    rank: int, frames: bool, keep: int = KEEP_COMPLETED, window_ns: int | None = None
) -> RankTrace:
    if "torch.distributed" not in sys.modules:
        return RankTrace(rank=rank, error="torch.distributed is not in use")
    from rallypoint._core.torch_c import dump_flight_recorder

    try:
        dump = merged_dumps(pickle.loads(raw) for raw in dump_flight_recorder(frames))
    except Exception as exc:
        return RankTrace(rank=rank, error=f"torch's Flight Recorder dump failed: {exc}")
    return trace_from_dump(rank, dump, _groups_of_this_worker(), keep, window_ns)


def merged_dumps(dumps: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One dump of several recorders' dumps: their entries, and each group's status from
    the recorder that saw more of it."""
    entries: list[Any] = []
    status: dict[str, Any] = {}
    for dump in dumps:
        entries.extend(dump.get("entries", []))
        for pg_id, st in dump.get("pg_status", {}).items():
            seen = status.get(pg_id, {}).get("last_enqueued_collective", -1)
            if int(st.get("last_enqueued_collective", -1)) >= int(seen):
                status[pg_id] = st
    return {"entries": entries, "pg_status": status}


def answers(request: str, rank: int) -> Iterator[tuple[bool, RankTrace]]:
    """What a request gets: ``(final, trace)`` pairs, each yielded as soon as it is made, so
    that the frameless answer is written before torch's first symbolisation (which imports
    some 800 modules: seconds on a busy machine) starts."""
    token, _, window = request.partition(" arrivals")
    if token != request:  # straggler sampling: the entries of the window, never frames
        window_s = float(window) if window.strip() else None
        window_ns = None if window_s is None else int(window_s * 1e9)
        yield True, _dump_this_worker(rank, False, keep=1 << 30, window_ns=window_ns)
        return
    yield False, _dump_this_worker(rank, False)
    yield True, _dump_this_worker(rank, True)


def _serve(fd: int, directory: str, rank: int, on_stacks: Callable[[], None] | None) -> None:
    pid = os.getpid()
    pending = b""
    while True:
        try:
            data = os.read(fd, 256)
        except OSError:
            return
        pending += data
        if b"\n" not in pending:
            continue
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = line.decode(errors="replace").strip()
            if request == STACKS_REQUEST:
                if on_stacks is not None:
                    with contextlib.suppress(Exception):
                        on_stacks()
                continue
            try:
                for final, trace in answers(request, rank):
                    _answer(directory, pid, request, final, trace)
            except Exception as exc:  # never let the thread die: the next request gets one
                trace = RankTrace(rank=rank, error=f"dump failed: {exc!r}")
                _answer(directory, pid, request, True, trace)


def _answer(directory: str, pid: int, request: str, final: bool, trace: RankTrace) -> None:
    with contextlib.suppress(OSError):
        write_answer(_answer_path(directory, pid, request), request, final, trace)


def _answer_path(directory: str, pid: int, request: str) -> str:
    kind = "arrivals" if " arrivals" in request else "dump"  # one never hides the other
    return os.path.join(directory, f"{pid}.fr.{kind}.json")


def write_answer(path: str, request: str, final: bool, trace: RankTrace) -> None:
    """Write one answer to ``request`` at ``path``: whole, renamed into place."""
    text = json.dumps({"request": request, "final": final, "trace": trace.to_json()})
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def install_flight_dumper(
    env: Mapping[str, str] | None = None, on_stacks: Callable[[], None] | None = None
) -> str | None:
    """Start this worker's Flight Recorder dumper thread; return its FIFO's path.

    The FIFO is ``$RALLYPOINT_STACKS_DIR/<pid>.fr``. A request is one line (a token;
    ``... arrivals [SECONDS]`` for straggler sampling: the entries of the last SECONDS, no
    frames; ``stacks`` for a stack dump); the thread calls torch's ``_dump_fr_trace()``,
    adds the group memberships and writes ``<pid>.fr.dump.json`` (or
    ``<pid>.fr.arrivals.json``), renamed into place.

    ``on_stacks`` answers a stack request (``_stacks.dump_stacks_now``): from this thread,
    with the GIL held, so no other thread's frames change while they are read.
    Does nothing (``None``) without ``RALLYPOINT_STACKS_DIR`` or with recording off.
    """
    env = os.environ if env is None else env
    directory = env.get(envvars.STACKS_DIR)
    if not directory or not recording(env):
        return None
    rank = int(env.get("RANK", "0") or 0)
    path = fifo_path(directory, os.getpid())
    for stale in (path, os.path.join(directory, f"{os.getpid()}.fr.final.json")):  # reused pid
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # never EOF: this process holds a writer too
    thread = threading.Thread(
        target=_serve,
        args=(fd, directory, rank, on_stacks),
        name="rallypoint-flight-recorder",
        daemon=True,
    )
    thread.start()
    return path


# ---------------------------------------------------------------------------- agent side


class FlightRequest:
    """Ask the local workers for their Flight Recorder (the requests:
    :func:`install_flight_dumper`)."""

    def __init__(
        self,
        pids_by_rank: Mapping[int, int],
        directory: str | os.PathLike[str],
        *,
        arrivals: bool = False,
        window_s: float | None = None,
    ) -> None:
        """``arrivals``: the recorded entries, without frames (straggler sampling): those
        created in the ``window_s`` seconds up to each worker's newest, or all."""
        self.directory = os.fspath(directory)
        self.started = time.monotonic()
        self.token = f"{os.getpid()}-{time.monotonic_ns()}"
        if arrivals:
            self.token += " arrivals" + ("" if window_s is None else f" {window_s:g}")
        self.errors: dict[int, str] = {}
        self.waiting: dict[int, int] = {}  # rank -> pid
        for rank, pid in sorted(pids_by_rank.items()):
            why = ask(self.directory, pid, self.token)
            if why is None:
                self.waiting[rank] = pid
            else:
                self.errors[rank] = why

    def _read(self, rank: int, pid: int) -> tuple[RankTrace, bool] | None:
        """The worker's answer to this request, and whether it has the frames."""
        try:
            with open(_answer_path(self.directory, pid, self.token), encoding="utf-8") as fh:
                answer = json.load(fh)
        except (OSError, ValueError):
            return None
        if not isinstance(answer, dict) or answer.get("request") != self.token:
            return None
        try:
            return RankTrace.from_json(answer["trace"]), bool(answer["final"])
        except (KeyError, ValueError) as exc:
            return RankTrace(rank=rank, error=str(exc)), True

    def ready(self) -> bool:
        """Whether every worker asked wrote its final answer or exited (never waits)."""
        head = json.dumps({"request": self.token, "final": True})[:-1].encode()
        for pid in self.waiting.values():
            try:
                with open(_answer_path(self.directory, pid, self.token), "rb") as fh:
                    if fh.read(len(head)) == head:
                        continue
            except OSError:
                pass
            if pid_running(pid):
                return False
        return True

    def results(self, timeout: float) -> dict[int, RankTrace]:
        """Every worker's trace, or one with ``error`` set, ``timeout`` seconds after the
        request at most. A worker answers twice: at once without the issuing frames, then
        with them (torch's first symbolisation imports a lot: seconds on a busy machine);
        at the deadline, the first answer serves."""
        out = {rank: RankTrace(rank=rank, error=why) for rank, why in self.errors.items()}
        deadline = self.started + timeout
        waiting = dict(self.waiting)
        while waiting:
            for rank, pid in list(waiting.items()):
                answer = self._read(rank, pid)
                if answer is not None:
                    out[rank] = answer[0]
                    if answer[1]:
                        del waiting[rank]
                elif not pid_running(pid) and self._read(rank, pid) is None:
                    out[rank] = RankTrace(rank=rank, error="it exited before answering")
                    del waiting[rank]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        for rank in waiting:
            if rank not in out:
                why = f"no Flight Recorder dump within {timeout:g} s"
                out[rank] = RankTrace(rank=rank, error=why)
        return dict(sorted(out.items()))


def remove_flight_files(directory: str | os.PathLike[str], pid: int) -> None:
    """Delete an exited worker's FIFO and last dump."""
    written = (".fr.dump.json", ".fr.arrivals.json")  # and their write_answer() .tmp
    for suffix in (".fr", *written, *(f"{w}.tmp" for w in written)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(os.fspath(directory), f"{pid}{suffix}"))
