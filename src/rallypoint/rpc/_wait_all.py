"""``torch.futures.wait_all`` returns at the first failed call, for rallypoint's calls too.

torch's ``wait_all`` returns early when a C++ future fails, but Python cannot mark a C++
future failed, so a failed rallypoint call is completed as ``Future.set_exception`` does
(the exception is the value, an unwrap function raises it) and ``wait_all`` would wait
for every other call first. So :func:`._calls.fail` records the future here, and
``torch.futures.wait_all`` is wrapped at import: it also raises the first recorded failure
as soon as it happens. Nothing changes for other futures. Only code that looks
``wait_all`` up when it runs sees the wrapper; ``collect_all`` is unchanged.
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
