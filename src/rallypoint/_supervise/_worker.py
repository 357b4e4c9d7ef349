"""The worker side: what a freshly forked (or spawned) worker does before and after user code.

A worker forked from the warm process must look like a fresh interpreter to user code: its
own session (so its whole tree can be signalled), default signal handlers, stdout/stderr on
pipes to the supervisor, its CPUs under ``numa_binding`` (``_numa``), the job's
environment, cwd, ``sys.argv`` and ``__main__``. The user's exception is caught here,
printed like Python would, written to ``TORCHELASTIC_ERROR_FILE`` in torch's JSON format
(so ``@record`` users keep working) and reported to the supervisor, without the user
decorating anything.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import json
import os
import pickle
import runpy
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from rallypoint._core import envvars
from rallypoint._core.procs import set_parent_death_signal
from rallypoint._supervise._errors import FatalError
from rallypoint._supervise._identity import show_identity
from rallypoint._supervise._main_module import load_main
from rallypoint._supervise._numa import bind_to_cpus
from rallypoint._worker_side._restartable import STOP_SEEN_WAIT, told_to_stop

__all__ = [
    "BAD_TARGET_EXIT",
    "FATAL_EXIT",
    "RESULT_FD",
    "Target",
    "WorkerSpec",
    "child_main",
    "execute",
]

RESULT_FD = 3
"""File descriptor on which a worker running a Python callable sends its result."""

BAD_TARGET_EXIT = 121
"""Exit status of a worker whose script/module/command could not be found (no restarts)."""
FATAL_EXIT = 122
"""Exit status of a worker that raised :class:`~rallypoint._supervise._errors.FatalError`."""

# callables registered by ``launch()`` before it forks its warm process: key -> fn, args
CALLABLES: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {}


@dataclass(frozen=True, slots=True)
class Target:
    """What a worker runs."""

    kind: Literal["script", "module", "exec", "callable", "payload"]
    name: str
    """Script path, module name, command, key in ``CALLABLES`` or pickled payload path."""
    args: tuple[str, ...] = ()


@dataclass(slots=True)
class WorkerSpec:
    """Everything the warm process needs to start one worker (sent over its socket)."""

    local_rank: int
    rank: int
    env: dict[str, str]
    cwd: str
    target: Target
    exec_argv: list[str] | None = None
    """Set for ``--no-python`` and ``spawn``: exec this instead of running in-process."""
    cpus: frozenset[int] | None = None
    """The CPUs this worker binds to first (``numa_binding``); ``None``: the launcher's."""
    extra: dict[str, Any] = field(default_factory=dict)


def _reset_signals() -> None:
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            signal.signal(sig, signal.SIG_DFL)
    # what a fresh CPython installs
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _shown(exc: BaseException, tb_text: str) -> str:
    """What a failed worker prints: its traceback; once the agent said the job stops (a
    Ctrl-C), nothing for the ``KeyboardInterrupt`` and one line for anything else (the
    launcher says "interrupted" once per node; the error file has the traceback)."""
    interrupted = isinstance(exc, KeyboardInterrupt)  # the signal comes after the message
    if not told_to_stop(wait=STOP_SEEN_WAIT if interrupted else 0.0):
        return tb_text
    if interrupted:
        return ""
    return f"stopped by the Ctrl-C with {type(exc).__name__}: {exc}\n"


def child_main(spec: WorkerSpec, fds: list[int], close: list[int]) -> NoReturn:
    """Run in a child just forked from the warm process; never returns."""
    try:
        os.setsid()
        _reset_signals()
        set_parent_death_signal(signal.SIGKILL)
        out_fd, err_fd, result_fd, control_fd = fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        if spec.cpus:  # before the user's code or an exec: every thread to come inherits it
            bind_to_cpus(spec.cpus)
        for fd in close:
            if fd > 2 and fd not in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if control_fd == RESULT_FD:  # keep it from being overwritten by the result pipe
            control_fd = os.dup(control_fd)
        if result_fd >= 0 and result_fd != RESULT_FD:
            os.dup2(result_fd, RESULT_FD, inheritable=False)
            os.close(result_fd)
            result_fd = RESULT_FD
        for fd in {devnull, out_fd, err_fd}:
            if fd > 2 and fd not in (result_fd, control_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
        os.environ.clear()
        os.environ.update(spec.env)
        os.chdir(spec.cwd)
        if spec.exec_argv is None:  # @rallypoint.restartable finds the agent there
            os.environ[envvars.CONTROL_FD] = str(control_fd)
        else:
            os.close(control_fd)
        if spec.exec_argv is not None:
            if result_fd >= 0 and spec.target.kind == "payload":
                os.set_inheritable(result_fd, True)
            try:
                os.execvpe(spec.exec_argv[0], spec.exec_argv, spec.env)
            except OSError as exc:
                os.write(2, f"rallypoint: cannot execute {spec.exec_argv[0]!r}: {exc}\n".encode())
                _write_bad_target(f"cannot execute {spec.exec_argv[0]!r}: {exc.strerror}")
                os._exit(BAD_TARGET_EXIT)
        execute(spec.target, result_fd)
    except BaseException:  # a forked child reaches os._exit whatever it caught
        with contextlib.suppress(BaseException):
            os.write(2, ("rallypoint: worker setup failed:\n" + traceback.format_exc()).encode())
        os._exit(70)


def _fresh_stdio() -> None:
    enc = "utf-8"
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding=enc, line_buffering=True, write_through=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        encoding=enc,
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=enc)
    # the "original" streams too (faulthandler and some libraries write there)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin  # type: ignore[misc]


def _write_bad_target(message: str) -> None:
    path = os.environ.get(envvars.ERROR_FILE)
    if path:
        with contextlib.suppress(OSError), open(path, "w") as fp:
            json.dump({"rallypoint": {"bad_target": message}}, fp)


def _mark_fatal(message: str) -> None:
    """Add ``{"rallypoint": {"fatal": message}}`` to the error file (ours or ``@record``'s)."""
    path = os.environ.get(envvars.ERROR_FILE)
    if not path:
        return
    with contextlib.suppress(OSError, ValueError):
        with open(path) as fp:
            data = json.load(fp)
        if isinstance(data, dict):
            data["rallypoint"] = {"fatal": message}
            with open(path, "w") as fp:
                json.dump(data, fp)


def _record(exc: BaseException, tb_text: str) -> None:
    """Write the exception to TORCHELASTIC_ERROR_FILE as torch's ``@record`` would."""
    path = os.environ.get(envvars.ERROR_FILE)
    if not path or os.path.exists(path):  # ``@record`` already wrote it
        return
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": tb_text, "timestamp": str(int(time.time()))},
        }
    }
    with contextlib.suppress(OSError), open(path, "w") as fp:
        json.dump(data, fp)


def _send_result(result_fd: int, message: tuple[Any, ...]) -> None:
    if result_fd < 0:
        return
    _write_all(result_fd, pickle.dumps(message))


def _write_all(result_fd: int, data: bytes) -> None:
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(result_fd, view) :]
    os.close(result_fd)


def _find_module(name: str) -> str | None:
    import importlib.util

    try:
        if importlib.util.find_spec(name) is None:
            return f"No module named {name!r}"
    except (ImportError, ValueError) as exc:
        return f"cannot import module {name!r}: {exc}"
    return None


def execute(target: Target, result_fd: int) -> NoReturn:
    """Run the user's target in this process with fresh interpreter state, then exit."""
    _fresh_stdio()
    atexit._clear()
    _show_rank(target)
    _install_stack_dumper()
    if target.kind in ("script", "module") and result_fd >= 0:
        with contextlib.suppress(OSError):
            os.close(result_fd)
        result_fd = -1
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch_mod = sys.modules.get("torch")
    if threads.isdigit() and int(threads) > 0 and torch_mod is not None:
        torch_mod.set_num_threads(int(threads))
    error_file = os.environ.get(envvars.ERROR_FILE)
    fault_file = None
    if error_file:
        with contextlib.suppress(OSError):
            fault_file = open(error_file + ".fault", "w")  # noqa: SIM115 - kept open until exit
            faulthandler.disable()  # inherited "enabled" state, but our signal reset removed it
            faulthandler.enable(file=fault_file, all_threads=True)
    code = 0
    try:
        if target.kind == "script":
            sys.argv = [target.name, *target.args]
            sys.path[0] = os.path.dirname(os.path.abspath(target.name))
            runpy.run_path(target.name, run_name="__main__")
        elif target.kind == "module":
            sys.argv = [target.name, *target.args]
            sys.path[0] = os.getcwd()
            problem = _find_module(target.name)
            if problem is not None:
                sys.stderr.write(f"{sys.executable}: {problem}\n")
                _write_bad_target(problem)
                _exit(BAD_TARGET_EXIT, fault_file)
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        else:
            fn, args = _load_callable(target)
            value = fn(*args)
            try:
                data = pickle.dumps(("ok", value))
            except Exception as exc:
                raise TypeError(
                    f"the return value of rank {os.environ.get('RANK')} cannot be pickled "
                    f"and sent back: {exc}"
                ) from exc
            if result_fd >= 0:
                _write_all(result_fd, data)
            result_fd = -1
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException as exc:  # the user's KeyboardInterrupt too is the worker's failure
        tb_text = _user_traceback(exc)
        with contextlib.suppress(BaseException):
            sys.stderr.write(_shown(exc, tb_text))
        _record(exc, tb_text)
        try:
            pickled: bytes | None = pickle.dumps(exc)
        except Exception:
            pickled = None
        with contextlib.suppress(BaseException):
            _send_result(result_fd, ("err", pickled, tb_text, f"{type(exc).__name__}: {exc}"))
        _leave_final_trace(exc)
        if isinstance(exc, KeyboardInterrupt):
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        code = 1
        if isinstance(exc, FatalError):
            _mark_fatal(str(exc))
            code = FATAL_EXIT
    _finish()
    _exit(code, fault_file)


def _show_rank(target: Target) -> None:
    """Let ``ps`` and ``/proc/PID/environ`` show this worker's rank (``_identity``)."""
    if target.kind == "module":
        argv = ["-m", target.name, *target.args]
    elif target.kind == "callable":
        fn = CALLABLES[target.name][0]
        argv = [f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)!s}"]
    else:
        argv = [target.name, *target.args]
    env = os.environ
    rank = env.get("RANK", "?")
    local_rank = env.get(envvars.LOCAL_RANK) or env.get("LOCAL_RANK", "?")
    show_identity([f"rallypoint worker rank {rank} (local {local_rank})", *argv], dict(os.environ))


def _install_stack_dumper() -> None:
    """Answer the agent's stack requests (``rallypoint stacks``, hang reports)."""
    from rallypoint._watch._flight._recorder import install_flight_dumper
    from rallypoint._watch._stacks import dump_stacks_now, install_stack_dumper

    try:
        install_stack_dumper()
        install_flight_dumper(on_stacks=dump_stacks_now)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(BaseException):
            sys.stderr.write(f"rallypoint: stack dumps unavailable in this worker: {exc}\n")


def _leave_final_trace(exc: BaseException) -> None:
    """A collective timed out: leave this worker's Flight Recorder for the agent's report."""
    from rallypoint._watch._flight._final import leave_final_trace

    with contextlib.suppress(Exception):
        leave_final_trace(f"{exc}")


def _user_traceback(exc: BaseException) -> str:
    """Format ``exc`` like Python would, without the launcher's and runpy's own frames."""
    tb = exc.__traceback__
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and _abspath(tb.tb_frame.f_code.co_filename) in ours:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _abspath(name: str) -> str:
    return name if name.startswith("<") else os.path.abspath(name)


def _load_callable(target: Target) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    if target.kind == "callable":
        return CALLABLES[target.name]
    with open(target.name, "rb") as fp:
        main = pickle.load(fp)
        if main is not None:
            load_main(main)
        fn, args = pickle.load(fp)
    return fn, tuple(args)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(BaseException):
        sys.stderr.write(f"{exc.code}\n")
    return 1


def _finish() -> None:
    """What interpreter shutdown would do: join threads, run atexit, flush."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()


def _exit(code: int, fault_file: io.TextIOWrapper | None) -> NoReturn:
    if fault_file is not None:
        with contextlib.suppress(BaseException):
            faulthandler.disable()
            fault_file.close()
            os.unlink(fault_file.name)
    os._exit(code)
