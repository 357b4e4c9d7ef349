"""Names of torch's C++ RPC module that programs look up when they run, made to answer for
rallypoint's agent too.

Only code that reads the attribute of ``torch._C._distributed_rpc`` at call time sees
rallypoint's answers; torch's own modules bound these names at import and keep torch's.
``_is_current_rpc_agent_set()`` is true while either agent runs (PyG asks it).
``PyRRef`` is, while rallypoint's agent runs, a stand-in class for which ``isinstance``
holds for rallypoint's RRefs too (torchrl checks it); anything else goes to torch's class,
which is put back when the agent closes.
"""

from __future__ import annotations

from typing import Any

from rallypoint._core.forking import fork_safe_lock
from rallypoint._core.torch_c import distributed_rpc
from rallypoint.rpc._backend import CURRENT_AGENT
from rallypoint.rpc._rref._rref import RRef

_MODULE: Any = distributed_rpc
_TORCH_PYRREF: Any = getattr(_MODULE, "PyRRef", None)
_lock = fork_safe_lock()
_holders = 0  # rallypoint agents running now (one per process, but starts and closes race)


def answer_agent_check_too() -> None:
    """Wrap torch's ``_is_current_rpc_agent_set``: true while either agent runs."""
    original = getattr(_MODULE, "_is_current_rpc_agent_set", None)
    if original is None or getattr(original, "rallypoint", False):
        return

    def is_set() -> bool:
        return CURRENT_AGENT.peek() is not None or bool(original())

    is_set.rallypoint = True  # type: ignore[attr-defined]
    _MODULE._is_current_rpc_agent_set = is_set


class _StandInType(type):
    """The stand-in's type: checks accept both RRef classes; the rest is torch's class."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (_TORCH_PYRREF, RRef))

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, (_TORCH_PYRREF, RRef))

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _TORCH_PYRREF(*args, **kwargs)

    def __getattr__(cls, name: str) -> Any:
        return getattr(_TORCH_PYRREF, name)


class PyRRef(metaclass=_StandInType):
    """Stands for ``torch._C._distributed_rpc.PyRRef`` while rallypoint's agent runs."""


def hold_pyrref() -> None:
    """rallypoint's agent starts: ``torch._C._distributed_rpc.PyRRef`` is the stand-in."""
    global _holders
    if _TORCH_PYRREF is None:
        return
    with _lock:
        _holders += 1
        _MODULE.PyRRef = PyRRef


def release_pyrref() -> None:
    """rallypoint's agent closed: torch's class is back once no agent holds the stand-in."""
    global _holders
    if _TORCH_PYRREF is None:
        return
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            _MODULE.PyRRef = _TORCH_PYRREF
