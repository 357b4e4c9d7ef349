"""``with obj:`` for every object that has a ``close()``."""

from __future__ import annotations

from types import TracebackType
from typing import Self

__all__ = ["Closing"]


class Closing:
    """Mixin: ``__enter__`` returns the object, ``__exit__`` calls ``close()``."""

    __slots__ = ()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
