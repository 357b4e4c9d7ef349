"""The running instance of a per-process service: the agent, its RRef table, its group.

Functions that run on behalf of a remote worker (an RRef fetch, a membership notice) find
this process's service through its slot; the agent fills the slots when it starts and
empties them when it closes. One slot per service type, owned by that service's module.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from rallypoint.rpc._errors import NOT_INITIALIZED, RpcError

T = TypeVar("T")


class Current(Generic[T]):
    """Holds the one running ``T`` of this process, if any."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value: T | None = None

    def set(self, value: T) -> None:
        self._value = value

    def clear(self, value: T | None = None) -> None:
        """Empty the slot (only if it still holds ``value``, when one is given)."""
        if value is None or self._value is value:
            self._value = None

    def peek(self) -> T | None:
        return self._value

    def get(self) -> T:
        """The running instance; ``RpcError`` (torch's "not initialized") if there is none."""
        value = self._value
        if value is None:
            raise RpcError(NOT_INITIALIZED)
        return value
