"""``torch.futures.wait_all`` returns at the first failed call, for rallypoint's calls too.

torch's ``wait_all`` waits on ``torch._C._collect_all``, whose future fails as soon as
one of the futures fails *in C++* (``setError``): a call on torch's agent that raised on
the callee or timed out. Its docstring says so: "If any of the futures encounters an
error, the method will exit early". Python cannot mark a C++ future failed (a failing
``then`` callback wraps the error in a ``RuntimeError`` of its own), so a failed
rallypoint call is completed as ``torch.futures.Future.set_exception`` does it: the
exception is the value and an unwrap function raises it (:func:`._calls.fail`).
``_collect_all`` then sees a value, and ``wait_all`` would wait for every other call
first: a program that waits for a slow call and a failed one learned of the failure only
when the slow one ended (or timed out, 60 s later by default).

So ``fail`` records the future here, and ``torch.futures.wait_all`` is wrapped (at
import, as :mod:`._torch_names` does for its names): it returns as torch's does, and also
raises the error of the first recorded failure as soon as it happens. For every other
future nothing changes: a Python ``Future`` completed with ``set_exception`` by the
program still makes ``wait_all`` wait for the rest, as in torch. Only code that looks
``wait_all`` up when it runs sees the wrapper (``torch.futures.wait_all(...)``, the
usual spelling); a name bound before ``rallypoint.rpc`` was imported keeps torch's.
``torch.futures.collect_all`` is unchanged: its future completes when all calls have.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from rallypoint._core.forking import fork_safe_lock
from rallypoint._core.torch_c import collect_all

_failed: weakref.WeakSet[Any] = weakref.WeakSet()
_failed_lock = fork_safe_lock()


def record_failure(future: Any) -> None:
    """``future`` is about to complete with an error (before its ``set_result``)."""
    with _failed_lock:
        _failed.add(future)


def _has_failed(future: Any) -> bool:
    with _failed_lock:
        return future in _failed


def wait_all(futures: list[Any]) -> list[Any]:
    """torch's ``wait_all``; a rallypoint call that fails ends the wait at once."""
    combined = collect_all(futures)  # torch's own checks and early exit
    if not combined.done():
        ended = threading.Event()
        first: list[Any] = []

        def on_failure(fut: Any) -> None:
            if _has_failed(fut):
                first.append(fut)
                ended.set()

        combined.add_done_callback(lambda _: ended.set())
        for future in futures:
            future.add_done_callback(on_failure)
        ended.wait()
        if first:
            first[0].wait()  # raises the call's error
    values: list[Any] = combined.wait()
    return [future.wait() for future in values]


TORCH_WAIT_ALL = torch.futures.wait_all
"""torch's own function (what ``torch.futures.wait_all`` was before :func:`wrap_torch_wait_all`)."""


def wrap_torch_wait_all() -> None:
    """Make ``torch.futures.wait_all`` :func:`wait_all` (idempotent)."""
    torch.futures.wait_all = wait_all
