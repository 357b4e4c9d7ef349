"""The RPC part's compiled fast path: building it, finding it, loading it.

``_native.cpp`` (next to this file) holds C++ twins of three hot pieces of every message:
the ``RecvRpcBackward`` node of received tensors (:mod:`._autograd_context`) and the
per-tensor part of the lean wire form (:mod:`._lean`). They make the distributed-autograd
training step of ``benchmarks/rpc_step.py`` ~10% faster: the Python versions cost 3-4x
their hot-loop time in processes whose caches went cold while others ran.

Nothing needs it: each piece has a pure-Python version, used when the module is not built
(no compiler on the machine, or nobody ran the build). ``rallypoint build-native`` (run by
``./dev setup``) compiles it with the C++ compiler (``$CXX``, else ``c++``) against the
installed torch's headers, into a cache directory (:data:`~rallypoint._core.envvars.
NATIVE_DIR`) under a name that hashes the source, torch's version and Python's ABI, so a
stale build is never loaded. Importing ``rallypoint.rpc`` loads it when it is there
(``RALLYPOINT_NATIVE=0`` turns it off); it never compiles.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from rallypoint._core.envvars import NATIVE, NATIVE_DIR

SOURCE = Path(__file__).with_name("_native.cpp")
_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
_MODES = ("", "0", "1")


class NativeBuildError(RuntimeError):
    """The fast path could not be compiled (no compiler, or it failed)."""


def _abi() -> int:
    return int(torch._C._GLIBCXX_USE_CXX11_ABI)


def module_name() -> str:
    """The module's name: its source, torch's version and ABI, and Python's ABI, hashed."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(f"{torch.__version__}|{_abi()}|{_SUFFIX}".encode())
    return f"rallypoint_native_{digest.hexdigest()[:16]}"


def native_dir() -> Path:
    """Where the compiled module is kept (see :data:`NATIVE_DIR`)."""
    chosen = os.environ.get(NATIVE_DIR)
    if chosen:
        return Path(chosen)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "rallypoint" / "native"


def module_path() -> Path:
    return native_dir() / (module_name() + _SUFFIX)


def compile_command(output: Path, name: str) -> list[str]:
    """The compiler's command line: torch's extension flags, as ``torch.utils.cpp_extension``
    uses them for a CPU extension."""
    from torch.utils.cpp_extension import include_paths, library_paths

    python_include = sysconfig.get_path("include", scheme="posix_prefix")
    libraries = library_paths()
    return [
        os.environ.get("CXX") or "c++",
        "-O2",
        "-shared",
        "-fPIC",
        "-std=c++20",
        "-w",  # torch's headers warn a lot; the source is checked by its tests
        f"-DTORCH_EXTENSION_NAME={name}",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        f"-D_GLIBCXX_USE_CXX11_ABI={_abi()}",
        *(f"-isystem{path}" for path in [*include_paths(), python_include]),
        str(SOURCE),
        "-o",
        str(output),
        *(f"-L{path}" for path in libraries),
        *(f"-Wl,-rpath,{path}" for path in libraries),
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
    ]


def build(*, force: bool = False) -> Path:
    """Compile the module unless a build of this source for this torch is there (~25 s).

    Written under a temporary name and renamed: processes that load it meanwhile see the
    whole file or none, and two builds at once both succeed."""
    target = module_path()
    if target.exists() and not force:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".build-", suffix=_SUFFIX, dir=target.parent)
    except OSError as exc:
        raise NativeBuildError(
            f"cannot write the compiled module into {target.parent} ({exc.strerror or exc}); "
            f"set {NATIVE_DIR} to a writable directory"
        ) from None
    os.close(fd)
    command = compile_command(Path(temporary), module_name())
    try:
        try:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            raise NativeBuildError(
                f"no C++ compiler: {command[0]!r} was not found (install g++, or set CXX); "
                "rallypoint.rpc works without the fast path"
            ) from None
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-20:])
            raise NativeBuildError(
                f"compiling {SOURCE.name} failed (exit {done.returncode}):\n{tail}"
            )
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def check_loadable(path: Path) -> None:
    """Load a built module in a fresh process (this one may hold an older build): raise
    :class:`NativeBuildError` with the reason if it does not load."""
    code = "import sys, pathlib, rallypoint.rpc._native as n; n._import(pathlib.Path(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise NativeBuildError(f"{path} was built but does not load:\n{tail}")


def _import(path: Path) -> Any:
    name = path.name[: -len(_SUFFIX)]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def enabled() -> bool:
    """``RALLYPOINT_NATIVE``: unset or ``1``, use the module when it is built; ``0``, never."""
    value = os.environ.get(NATIVE, "").strip()
    if value not in _MODES:
        raise ValueError(
            f"{NATIVE}={value!r}: use 0 (never use the compiled fast path), or 1 or nothing "
            "(use it when built: `rallypoint build-native`)"
        )
    return value != "0"


def load() -> Any | None:
    """The compiled module, or ``None`` (the Python versions are used): not built, turned
    off (:func:`enabled`), or built but not loadable (a warning says so)."""
    if not enabled():
        return None
    path = module_path()
    if not path.exists():
        return None
    try:
        return _import(path)
    except ImportError as exc:
        warnings.warn(
            f"rallypoint: not using the compiled fast path {path} ({exc}); "
            "run `rallypoint build-native --force` to rebuild it",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


NATIVE_MODULE: Any | None = load()
"""The compiled module this process uses, or ``None``."""
