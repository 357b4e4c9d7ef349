"""torch's builtin operators as call targets, matched to an overload as torch's RPC does.

When the function of a call is one of torch's builtin operators (``torch.add``,
``math.sqrt``...: the functions TorchScript knows by a qualified name), torch's RPC never
calls the Python function: the caller matches the arguments against the operator's
TorchScript schemas (raising at the call when none matches) and the callee runs the
matched overload. So ``rpc_sync(to, torch.add, args=(1, 2))`` returns the int ``3``
where a local ``torch.add(1, 2)`` gives ``tensor(3)``. This module does the same with
torch's own per-schema matcher and runs the overload through ``torch.ops``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.jit._builtins import _find_builtin as _untyped_find_builtin

from rallypoint._core.torch_c import check_schema, find_dispatcher_schema, get_schema, jit_operation

_find_builtin: Callable[[Any], str | None] = _untyped_find_builtin
_check_schema: Any = check_schema

NO_MATCH = "Overloaded torch operator invoked from Python failed to match any schema:\n"


class BuiltinOp:
    """One overload of a builtin operator, sent in place of the Python function."""

    __slots__ = ("overload", "qualname")

    def __init__(self, qualname: str, overload: str) -> None:
        self.qualname = qualname
        self.overload = overload

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return BuiltinOp, (self.qualname, self.overload)

    @property
    def __name__(self) -> str:
        return self.qualname if not self.overload else f"{self.qualname}.{self.overload}"

    def __repr__(self) -> str:
        return f"BuiltinOp({self.__name__})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _operator(self.qualname, self.overload)(*args, **kwargs)


@functools.cache
def _operator(qualname: str, overload: str) -> Callable[..., Any]:
    namespace, name = qualname.split("::", 1)
    packet = getattr(getattr(torch.ops, namespace), name)
    op: Callable[..., Any] = getattr(packet, overload or "default")
    return op


def _is_dispatcher_op(qualname: str, overload: str) -> bool:
    try:
        find_dispatcher_schema(qualname, overload)
    except RuntimeError:
        return False
    return True


@functools.cache
def _overloads(qualname: str) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """The operator's overloads with their schemas: the dispatcher's, TorchScript's."""
    _, names = jit_operation(qualname)
    dispatcher: list[tuple[str, Any]] = []
    script: list[tuple[str, Any]] = []
    for overload in names or ():
        group = dispatcher if _is_dispatcher_op(qualname, overload) else script
        group.append((overload, get_schema(qualname, overload)))
    return dispatcher, script


def _first_match(
    overloads: list[tuple[str, Any]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str | None, list[RuntimeError]]:
    errors: list[RuntimeError] = []
    for overload, schema in overloads:
        try:
            _check_schema(schema, *args, **kwargs)
        except RuntimeError as exc:
            errors.append(exc)
            continue
        return overload, errors
    return None, errors


def resolve(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func`` itself, or the overload of a builtin operator to run instead (raises
    torch's ``RuntimeError`` when the arguments match none)."""
    qualname = _find_builtin(func)
    if qualname is None:
        return func
    dispatcher, script = _overloads(qualname)
    overload, _ = _first_match(dispatcher, args, kwargs)
    if overload is None:
        overload, errors = _first_match(script, args, kwargs)
        if overload is None:
            if len(script) == 1:  # torch raises the one schema's error as it is
                raise errors[0]
            raise RuntimeError(NO_MATCH + "".join(f"{error}\n\n" for error in errors))
    return BuiltinOp(qualname, overload)
