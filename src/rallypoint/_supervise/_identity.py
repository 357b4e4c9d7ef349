"""What tools see of a worker: its command line (``ps``) and environment (``/proc/PID/environ``).

A worker forked from the warm process keeps the launcher's command line and environment
block, so ``ps``, ``py-spy``, ``top`` and cluster tooling cannot tell the ranks apart.
:func:`show_identity` writes ``rallypoint worker rank R (local L) <target>`` and the
worker's environment into a private mapping and points ``/proc/PID/cmdline`` and
``/proc/PID/environ`` there (``prctl(PR_SET_MM, PR_SET_MM_MAP)``, no privilege needed).
Best effort: anything unexpected leaves the process as it was and returns ``False``.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from collections.abc import Mapping, Sequence

__all__ = ["show_identity"]

_PR_SET_MM = 35
_PR_SET_MM_MAP = 14
_KEEP_EXE = 0xFFFFFFFF  # exe_fd -1: the executable stays, so no privilege is needed
_KEEP: list[mmap.mmap] = []  # the mappings /proc reads from; never unmapped


class _MmMap(ctypes.Structure):
    """``struct prctl_mm_map`` (linux/prctl.h)."""

    _fields_ = [
        *(
            (name, ctypes.c_uint64)
            for name in (
                "start_code",
                "end_code",
                "start_data",
                "end_data",
                "start_brk",
                "brk",
                "start_stack",
                "arg_start",
                "arg_end",
                "env_start",
                "env_end",
                "auxv",
            )
        ),
        ("auxv_size", ctypes.c_uint32),
        ("exe_fd", ctypes.c_uint32),
    ]


def show_identity(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Make ``/proc/self/cmdline`` read ``argv`` and ``/proc/self/environ`` read ``env``.

    Call it while the process has one thread (right after the fork). Returns whether the
    kernel took it.
    """
    with contextlib.suppress(Exception):
        return _show(argv, env)
    return False


def _show(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    args = b"".join(a.encode(errors="surrogateescape") + b"\0" for a in argv)
    envs = b"".join(f"{k}={v}".encode(errors="surrogateescape") + b"\0" for k, v in env.items())
    # private: /proc cannot read a shared anonymous mapping of another process
    buf = mmap.mmap(-1, len(args) + len(envs), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(args + envs)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    with open("/proc/self/stat", "rb") as fp:
        stat = fp.read()
    # the fields after "(comm) ": field 3 (state) is index 0
    fields = [
        int(v) if v.lstrip(b"-").isdigit() else 0 for v in stat[stat.rindex(b")") + 2 :].split()
    ]

    def field(n: int) -> int:  # numbered as in proc(5)
        return fields[n - 3]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_long]
    libc.prctl.argtypes = [ctypes.c_int, *[ctypes.c_ulong] * 4]
    m = _MmMap()
    m.start_code, m.end_code, m.start_stack = field(26), field(27), field(28)
    m.start_data, m.end_data, m.start_brk = field(45), field(46), field(47)
    m.arg_start, m.arg_end = base, base + len(args)
    m.env_start, m.env_end = base + len(args), base + len(args) + len(envs)
    m.exe_fd = _KEEP_EXE
    brk = libc.sbrk(0)  # the kernel takes brk from the map too: it must be the current one
    if not brk or brk < m.start_brk or not m.start_code:
        return False
    m.brk = brk
    if libc.prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.addressof(m), ctypes.sizeof(m), 0) != 0:
        return False
    _KEEP.append(buf)
    return True
