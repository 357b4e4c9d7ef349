"""Native (C/C++) stacks of hung processes, through gdb when the machine has it.

A worker blocked inside torch's C++ (a TCPStore connect waiting on a lock that a thread
of the process it was forked from held at the fork) shows in its Python stack only as
the Python line that called into C++. gdb's backtrace names the C++ function and the
lock it waits on. Test helpers use this once a worker timed out, to say where it hung;
nothing here is needed for a passing run, and without gdb (or without the right to
attach) it returns nothing.
"""

from __future__ import annotations

import re
import shutil
import subprocess

GDB_TIMEOUT = 5.0
"""Most seconds spent on the backtraces of all the processes asked for, together."""
_FRAMES = 9  # innermost native frames kept per thread in the short form
_THREADS = 4  # threads kept per process in the short form: those in c10d or a lock first
_FRAME = re.compile(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(?P<fn>[^\s(]+)")
_INTERESTING = ("c10d", "lock", "futex", "getaddrinfo", "cxa_guard", "call_once")


def native_stacks(pids: list[int]) -> dict[int, str]:
    """gdb's ``thread apply all bt`` of each process in ``pids`` (attached at once, in
    parallel); a process gdb could not read is left out."""
    gdb = shutil.which("gdb")
    if gdb is None or not pids:
        return {}
    # symbols of libc and libstdc++ only: they name the wait (a mutex, a once, a static's
    # guard); loading libtorch's too took 6 s per process, on top of 0.3 s
    command = [gdb, "-batch", "-nx", "-iex", "set auto-solib-add off"]
    command += ["-iex", "set auto-load python-scripts off"]
    command += ["-ex", "sharedlibrary libc\\.so", "-ex", "sharedlibrary libstdc"]
    command += ["-ex", "thread apply all bt 30", "-p"]
    running = {
        pid: subprocess.Popen(
            [*command, str(pid)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for pid in pids
    }
    stacks: dict[int, str] = {}
    for pid, gdb_run in running.items():
        try:
            out, _ = gdb_run.communicate(timeout=GDB_TIMEOUT / len(running))
        except subprocess.TimeoutExpired:
            gdb_run.kill()
            gdb_run.communicate()
            continue
        if gdb_run.returncode == 0 and "#0" in out:
            stacks[pid] = out
    return stacks


def short_native(backtrace: str) -> str:
    """gdb's backtrace in short: the threads in c10d or waiting on a lock first, each as
    its innermost function names (``a < b < c``; ``??@libtorch_cpu``: a function of a
    library whose symbols were not loaded)."""
    threads: list[list[str]] = []
    for line in backtrace.splitlines():
        if line.startswith("Thread "):
            threads.append([])
        elif threads and (frame := _FRAME.match(line)):
            name = frame["fn"]
            if name == "??" and " from " in line:  # no symbols loaded: name its library
                name = "??@" + line.rsplit("/", 1)[-1].split(".so")[0]
            threads[-1].append(name)
    if not threads:
        return ""

    def interesting(frames: list[str]) -> bool:
        return any(word in fn.lower() for fn in frames for word in _INTERESTING)

    ordered = sorted(threads, key=lambda frames: not interesting(frames))
    return " | ".join(" < ".join(frames[:_FRAMES]) for frames in ordered[:_THREADS] if frames)
