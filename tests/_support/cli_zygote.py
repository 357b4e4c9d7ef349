"""``python -m rallypoint ...`` without a new interpreter: :func:`Popen` and :func:`run`
stand in for ``subprocess``'s and run the command's own ``main`` in a process forked from
a warm interpreter.

A new interpreter for each command imports torch: the warm process of every
``rallypoint run`` does, and so does the agent of a multi-node job (its store client), some
1.2 s of CPU each, or 2.5 s per node, on a 2-core machine with several nodes per test. The
*command zygote* is one interpreter, started at the first command of the session with
the session's environment, that has imported torch and rallypoint's command line and then
does nothing but fork (the worker zygote's loop, :mod:`rallypoint.testing._zygote`). Each
command is one of its children running ``rallypoint.__main__.main(argv)``: the command
line, the agent, its warm process and its workers are the code and the processes of
``python -m rallypoint``. By default that zygote has also imported what a first training
step imports (``later``, below); with ``later=False``, a command that preloads one of
:data:`_WARM_IMPORTS` (``--preload torch._dynamo``) is forked from a zygote of its own that
has imported it too, as the command's warm process would before its first worker. What a
new interpreter would set up by itself is set up as it would have been:

- the environment (``env=``, else this process's at the call), the working directory, a
  new session (``start_new_session=``), ``sys.argv`` and ``sys.path[0]`` of ``-m``;
- stdout buffered and stderr line-buffered (as on pipes), SIGINT raising
  ``KeyboardInterrupt``; warnings and logging as a new interpreter has them (the zygote
  is one: pytest's capture never touched it);
- c10's C++ log level as ``import torch`` reads it from ``TORCH_CPP_LOG_LEVEL``, and the
  level the agent of a multi-node job gives its own torch (``FATAL``, or
  ``RALLYPOINT_AGENT_CPP_LOG_LEVEL``) after its warm process was forked, as
  ``rallypoint._cli._run`` does when it imports torch itself.

A command that needs what cannot be set up so (another Python, an interpreter option, a
variable read when an interpreter starts or torch is imported (``PYTHON*``, ``LD_*``,
thread-pool and other ``TORCH_*`` variables) with a value other than the zygote's, a
level c10 cannot parse) runs as a real subprocess. Tests about the command line itself
(its start-up, signals before it handles them, what reaches a terminal) use
``subprocess`` directly.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["Popen", "run"]

_TESTS = str(Path(__file__).resolve().parents[1])
_PREFIX = [sys.executable, "-m", "rallypoint"]
_SENSITIVE = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "MALLOC")
_RUNTIME = {"TORCH_CPP_LOG_LEVEL", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"}
"""Read after start-up (or set up here), so they may differ from the zygote's."""
_LEVELS = {"INFO": 0, "WARNING": 1, "ERROR": 2, "FATAL": 3, "0": 0, "1": 1, "2": 2, "3": 3}
_DEFAULT_LEVEL = 1  # c10's without TORCH_CPP_LOG_LEVEL
_POLL = 0.02

_SERVER = f"""
import socket, sys
sys.path.insert(0, {_TESTS!r})
import torch, torch.distributed, torch.nn.parallel
import rallypoint.__main__, rallypoint._cli, rallypoint._cli._args, rallypoint._cli._run
import rallypoint.launcher, rallypoint._supervise._warm._server
import _support.cli_zygote
import importlib
for name in sys.argv[2:]:
    importlib.import_module(name)
from rallypoint.testing._zygote import _serve
_serve(socket.socket(fileno=int(sys.argv[1])))
"""
_WARM_IMPORTS = ("torch._dynamo",)
"""``--preload`` modules that the zygote of a command preloading them has imported: the
command's warm process imports them before its first worker (``torch._dynamo``: some 2 s
of CPU each time) and, forked from that zygote, finds them imported. A command that does
not preload them is forked from a zygote without them: its workers import them where
they would.

Unless the caller passes ``later=False``, the zygote has also imported what a first step
imports (``LATER_MODULES``, ``torch._dynamo`` among them), so the command's warm process
and its first workers find them imported: some 1.6 s of CPU less for each of them (most
commands of the suite train a few steps with a torch optimizer; a test of 4 replica groups
paid some 12 s of its 2 cores' CPU in those imports). A test about those imports (a wait
for them, a fault while a worker imports them) passes ``later=False``: its commands' warm
processes and workers import them where a user's would."""


class _Zygote:
    """A command zygote: started at the first command it forks, ended when this process
    ends. One for each set of imports: the :data:`_WARM_IMPORTS` a command preloads, and
    ``later``'s."""

    _lock = threading.Lock()
    _started: dict[tuple[str, ...], _Zygote] = {}

    def __init__(self, imports: tuple[str, ...]) -> None:
        self.imports = imports
        self.made: Any = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}

    @classmethod
    def of(cls, imports: tuple[str, ...]) -> _Zygote:
        with cls._lock:
            return cls._started.setdefault(imports, cls(imports))

    def get(self) -> Any:
        from rallypoint.testing._zygote import Zygote

        with self._lock:
            if self.made is not None and self.made.pid and self.made._sock is not None:
                return self.made
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
            proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, str(theirs.fileno()), *self.imports],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
            )
            theirs.close()
            zygote = Zygote.__new__(Zygote)
            zygote.threads_at_start = 1
            zygote._lock = threading.Lock()
            zygote.pid = proc.pid
            zygote._sock = ours
            zygote._owner = os.getpid()
            zygote._asked = 0
            self.made, self.env, self.proc = zygote, env, proc
            atexit.register(self.close)
            return zygote

    def close(self) -> None:
        with self._lock:
            made, self.made = self.made, None
        if made is not None and os.getpid() == made._owner:
            sock, made._sock = made._sock, None
            if sock is not None:
                sock.close()  # the zygote kills the commands it still has, and exits
            if self.proc is not None:
                with contextlib.suppress(Exception):
                    self.proc.wait(30)


def _warm_imports(argv: Sequence[str], later: bool = False) -> tuple[str, ...]:
    """The :data:`_WARM_IMPORTS` that ``--preload`` names in a command's ``argv``; with
    ``later``, ``LATER_MODULES`` (which hold them)."""
    if later:
        from rallypoint._supervise._warm._server import LATER_MODULES

        assert set(_WARM_IMPORTS) <= set(LATER_MODULES)  # one zygote for any --preload
        return tuple(LATER_MODULES)
    named: set[str] = set()
    for flag, value in itertools.pairwise(argv):
        if flag == "--preload":
            named.update(value.split(","))
    named.update(a.split("=", 1)[1] for a in argv if a.startswith("--preload="))
    return tuple(name for name in _WARM_IMPORTS if name in named)


def _level(value: str | None) -> int | None:
    """c10's level for a ``TORCH_CPP_LOG_LEVEL`` value (``None``: c10 cannot parse it)."""
    if not value:
        return _DEFAULT_LEVEL
    return _LEVELS.get(value.upper())


def _levels(env: Mapping[str, str]) -> tuple[int | None, int | None]:
    """c10's level in the workers and the warm process (what ``import torch`` reads from
    the environment) and in the agent of a multi-node job (``rallypoint._cli._run`` has its
    torch read ``RALLYPOINT_AGENT_CPP_LOG_LEVEL``, ``FATAL`` by default)."""
    return _level(env.get("TORCH_CPP_LOG_LEVEL")), _level(
        env.get("RALLYPOINT_AGENT_CPP_LOG_LEVEL", "FATAL")
    )


def _set_cpp_level(level: int) -> None:
    import ctypes

    lib = ctypes.CDLL("libc10.so", mode=getattr(os, "RTLD_NOLOAD", 0))
    ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level").value = level


def _reseed() -> None:
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _command(
    fds: list[int],
    argv: list[str],
    env: dict[str, str],
    cwd: str | None,
    new_session: bool,
    levels: tuple[int | None, int | None],
) -> None:
    """In a child of the command zygote: become ``python -m rallypoint ARGV``."""
    if new_session:
        os.setsid()
    os.environ.clear()
    os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    with contextlib.suppress(ValueError):
        sys.path.remove(_TESTS)
    sys.path[0] = os.getcwd()  # what -m puts first
    signal.signal(signal.SIGINT, signal.default_int_handler)
    encoding = sys.stdout.encoding
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
        encoding=encoding,
        line_buffering=os.isatty(1),
    )
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding=encoding,
        errors="backslashreplace",
        line_buffering=True,
    )
    user_level, agent_level = levels
    assert user_level is not None and agent_level is not None
    _set_cpp_level(user_level)  # what this process's `import torch` would have read
    _reseed()  # a new interpreter's random states are its own, not its siblings'
    tempfile.tempdir = None  # found again from this environment's TMPDIR when needed

    import rallypoint.__main__ as entry
    from rallypoint._cli import _run

    def quiet_agent_torch() -> None:  # the warm process is forked: it keeps user_level
        _set_cpp_level(agent_level)

    _run._quiet_agent_torch = quiet_agent_torch
    sys.argv = [str(entry.__file__), *argv]
    sys.exit(entry.main(argv))


# Its frames lie under every stack the command's workers have (they are forked from
# within it): named like runpy's (``<frozen runpy>``), they count as the launcher's, not the
# user's, where rallypoint trims stacks to start at the user's code, as it does for
# ``python -m rallypoint``.
_command.__code__ = _command.__code__.replace(co_filename="<cli_zygote>")


def _forkable(
    args: Sequence[str], env: Mapping[str, str], kwargs: dict[str, Any], zygote: _Zygote
) -> bool:
    if list(args[:3]) != _PREFIX or kwargs:
        return False
    if None in _levels(env):
        return False
    base = zygote.env if zygote.made is not None else os.environ
    names = {*env, *base}
    return not any(
        name.startswith(_SENSITIVE) and name not in _RUNTIME and env.get(name) != base.get(name)
        for name in names
    )


class _LineReader(io.TextIOBase):
    """A text stream of a pipe that reads no byte past the line it returns."""

    def __init__(self, fd: int) -> None:
        self._raw = io.FileIO(fd, "r")

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def readline(self, size: int | None = -1) -> str:
        return _text(self._raw.readline(-1 if size is None else size))  # byte by byte

    def read(self, size: int | None = -1) -> str:
        return _text(
            self._raw.readall() if size is None or size < 0 else self._raw.read(size) or b""
        )

    def close(self) -> None:
        self._raw.close()
        super().close()


def _text(data: bytes) -> str:
    """As Popen decodes: universal newlines."""
    return data.decode().replace("\r\n", "\n").replace("\r", "\n")


class _Forked:
    """What ``subprocess.Popen`` offers, for a command forked by the command zygote."""

    def __init__(
        self,
        args: Sequence[str],
        env: Mapping[str, str],
        stdout: Any,
        stderr: Any,
        text: bool,
        cwd: str | None,
        start_new_session: bool,
        zygote: _Zygote,
    ) -> None:
        self.args = list(args)
        self.returncode: int | None = None
        self.stdout: IO[Any] | None = None
        self.stderr: IO[Any] | None = None
        self._text = text
        self._chunks: dict[int, list[bytes]] = {}
        self._reading: dict[int, IO[Any]] = {}
        self._result: tuple[Any, Any] | None = None
        close: list[int] = []
        try:
            out_fd = self._target(stdout, 1, close, "stdout")
            if stderr == subprocess.STDOUT:
                err_fd = out_fd
            else:
                err_fd = self._target(stderr, 2, close, "stderr")
            levels = _levels(env)
            self._child = zygote.get().fork(
                _command,
                (self.args[3:], dict(env), cwd, start_new_session, levels),
                [out_fd, err_fd],
            )
        finally:
            for fd in close:
                os.close(fd)
        self.pid = self._child.pid

    def _target(self, spec: Any, default: int, close: list[int], name: str) -> int:
        if spec is None:
            return default
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY)
            close.append(fd)
            return fd
        if spec == subprocess.PIPE:
            read, write = os.pipe()
            close.append(write)
            # read ahead of nothing: ``communicate()`` reads the pipe itself, so a byte a
            # buffered stream had taken for ``readline()`` would be lost (Popen loses it)
            stream: IO[Any] = _LineReader(read) if self._text else io.FileIO(read, "r")
            setattr(self, name, stream)
            self._chunks[read] = []
            self._reading[read] = stream
            return write
        if isinstance(spec, int):
            return spec
        return int(spec.fileno())

    # ---------------------------------------------------------------- Popen's interface
    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._child.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(_POLL)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        assert input is None, "no input for a forked command"
        if self._result is not None:  # as Popen's: the same output again
            return self._result
        deadline = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in self._reading:
                sel.register(fd, selectors.EVENT_READ)
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                for key, _ in sel.select(left):
                    fd = int(key.fd)
                    data = os.read(fd, 1 << 16)
                    if data:
                        self._chunks[fd].append(data)
                    else:
                        sel.unregister(fd)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            self.wait(left)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
        got: list[Any] = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                got.append(None)
                continue
            data = b"".join(self._chunks.pop(stream.fileno(), []))
            self._reading.pop(stream.fileno(), None)
            stream.close()
            if self._text:
                got.append(_text(data))
            else:
                got.append(data)
        self._result = (got[0], got[1])
        return self._result

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # not reaped yet: the pid is still the command's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> _Forked:
        return self

    def __exit__(self, *exc: object) -> None:
        for stream in (self.stdout, self.stderr):
            if stream is not None:
                stream.close()
        self.wait()


def Popen(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    text: bool = False,
    cwd: str | os.PathLike[str] | None = None,
    start_new_session: bool = False,
    later: bool = True,
    **kwargs: Any,
) -> Any:
    """``subprocess.Popen(args, ...)``; a ``python -m rallypoint`` command is forked by the
    command zygote (see the module's doc; ``later``: one that has imported what a first
    step imports, else what a command imports before its first worker), anything else is a
    real subprocess."""
    environ = dict(os.environ if env is None else env)
    zygote = _Zygote.of(_warm_imports(args[3:], later))
    if not _forkable(args, environ, kwargs, zygote):
        return subprocess.Popen(
            args,
            env=env,
            stdout=stdout,
            stderr=stderr,
            text=text,
            cwd=cwd,
            start_new_session=start_new_session,
            **kwargs,
        )
    where = None if cwd is None else os.fspath(cwd)
    return _Forked(args, environ, stdout, stderr, text, where, start_new_session, zygote)


def run(
    args: Sequence[str],
    *,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    stdout: Any = None,
    stderr: Any = None,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(args, ...)`` through :func:`Popen`."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    with contextlib.ExitStack() as stack:
        proc = Popen(args, stdout=stdout, stderr=stderr, **kwargs)
        if isinstance(proc, subprocess.Popen):
            stack.enter_context(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        code = proc.wait()
    if check and code:
        raise subprocess.CalledProcessError(code, args, out, err)
    return subprocess.CompletedProcess(args, code, out, err)
