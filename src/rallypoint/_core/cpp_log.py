"""torch's C++ warnings off while rallypoint waits on a store failure it expects.

c10d logs a failed TCPStore call at ``WARNING`` before it raises the error in Python: a
lost server as the C++ exception with its whole backtrace (some 20 lines of
``frame #N: ...``), a timeout as two lines. Where rallypoint handles that error itself (a
background thread blocked in the store, which ends when the store goes away), the lines
tell nobody anything. c10 reads its level (``FLAGS_caffe2_log_level``, set from
``TORCH_CPP_LOG_LEVEL`` when torch is imported) at every message, so
:func:`cpp_warnings_off` raises it to ``ERROR`` while one of its holders runs and puts
the old value back when the last one leaves. The level is the process's: C++ warnings of
other threads are off meanwhile too (errors still show). Nothing happens where torch's
C++ library is not loaded (nothing here loads it) or has no such variable.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
from collections.abc import Iterator

from rallypoint._core.forking import fork_safe_lock

__all__ = ["cpp_warnings_off"]

_ERROR = 2  # c10's GLOG_ERROR
_lock = fork_safe_lock()
_holders = 0
_saved = 0


@functools.cache
def _loaded_level() -> ctypes.c_int | None:
    name = "libc10.dylib" if sys.platform == "darwin" else "libc10.so"
    try:
        lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0))  # only if loaded already
        return ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):
        return None


def _level() -> ctypes.c_int | None:
    level = _loaded_level()
    if level is None:
        _loaded_level.cache_clear()  # torch may be imported later
    return level


@contextlib.contextmanager
def cpp_warnings_off() -> Iterator[None]:
    """While inside, torch's C++ code logs errors only (see the module docstring)."""
    global _holders, _saved
    level = _level()
    if level is None:
        yield
        return
    with _lock:
        if _holders == 0:
            _saved = level.value
            level.value = max(_saved, _ERROR)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and level.value == max(_saved, _ERROR):  # nobody changed it since
                level.value = _saved
