"""A remote exception on the caller: its type (its own, and torch's where they differ) and
torch's text (:class:`ErrorReply`, also used for an error stored on an RRef's owner).

torch raises a remote ``ValueError`` or ``TypeError`` as that type and every other remote
exception as ``RuntimeError``. rallypoint raises the remote exception's own type, so
``except KeyError`` works; a type that is not already one of those three becomes a
subclass of itself and ``RuntimeError`` (named and pickled as the original), so code
written against torch's ``except RuntimeError`` keeps working too. The text is torch's:
futures put the type's name in front, ``to_here()`` does not (:func:`plain_errors`).
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from rallypoint._core.forking import fork_safe_lock

if TYPE_CHECKING:
    from rallypoint.rpc._worker_info import WorkerInfo

_TORCH_KEEPS = (RuntimeError, ValueError, TypeError)
_cache: dict[tuple[type[BaseException], bool], type[BaseException]] = {}
_lock = fork_safe_lock()
_PLAIN = "_rallypoint_plain_errors"
_ORIGINAL = "_rallypoint_original"

F = TypeVar("F", bound=Callable[..., Any])


def plain_errors(func: F) -> F:
    """Mark a function served over RPC whose errors reach the caller with no type name in
    front of their text (as torch's ``to_here()`` raises them)."""
    setattr(func, _PLAIN, True)
    return func


def has_plain_errors(func: object) -> bool:
    return getattr(func, _PLAIN, False) is True


def with_type_name(exc: BaseException) -> BaseException:
    """``exc`` as a call's future raises it under torch: its text is ``Type: text``, with
    ``str()`` of the rebuilt exception after the name (a ``KeyError``'s quotes too)."""
    original: type[BaseException] = getattr(type(exc), _ORIGINAL, type(exc))
    message = f"{original.__name__}: {exc}"
    kind = type(exc)
    if original.__str__ is not BaseException.__str__:  # else KeyError quotes the text again
        kind = _combined(original, plain_str=True)
    try:
        again = kind(message)
    except Exception:  # the type took the text once; keep that exception if not twice
        return exc
    again.__cause__ = exc.__cause__
    return again


def _reduce(exc: BaseException) -> tuple[object, ...]:
    original = type(exc).__mro__[1]
    return (original, exc.args)


def catchable_as_torch(kind: type[BaseException]) -> type[BaseException]:
    """``kind``, or a subclass of ``kind`` and ``RuntimeError`` when torch raises a
    ``RuntimeError`` for it (``kind`` itself where the two cannot be combined)."""
    if issubclass(kind, _TORCH_KEEPS) or not issubclass(kind, Exception):
        return kind
    return _combined(kind, plain_str=False)


def _combined(kind: type[BaseException], *, plain_str: bool) -> type[BaseException]:
    """The subclass of ``kind`` (and ``RuntimeError`` where torch raises that); with
    ``plain_str`` its ``str()`` is its text as it is (no ``KeyError`` quotes)."""
    with _lock:
        combined = _cache.get((kind, plain_str))
        if combined is None:
            bases = (kind,) if issubclass(kind, _TORCH_KEEPS) else (kind, RuntimeError)
            namespace: dict[str, Any] = {
                "__module__": kind.__module__,
                "__qualname__": kind.__qualname__,
                "__reduce__": _reduce,
                _ORIGINAL: kind,
            }
            if plain_str:
                namespace["__str__"] = BaseException.__str__
            try:
                combined = type(kind.__name__, bases, namespace)
            except TypeError:  # an incompatible layout: keep the remote type alone
                combined = kind
            _cache[(kind, plain_str)] = combined
    return combined


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An ERROR frame: the remote exception as torch's text, and its pickled type."""

    text: str
    exc_type: bytes  # b"" when the type could not be pickled (then text names it)
    type_name: bool = True  # raised with the type's name in front of the text (torch's future)

    @classmethod
    def of(cls, where: WorkerInfo, exc: BaseException, type_name: bool = True) -> ErrorReply:
        text = remote_error_text(repr(where), exc)
        try:
            return cls(text, pickle.dumps(type(exc)), type_name)
        except Exception:
            return cls(f"{type(exc).__qualname__}: {text}", b"", type_name)

    def rebuild(self) -> BaseException:
        """The exception to raise on the caller (its own type when that can be rebuilt)."""
        exc = self._rebuilt()
        return with_type_name(exc) if self.type_name else exc

    def _rebuilt(self) -> BaseException:
        kind: Any = None
        if self.exc_type:
            try:
                kind = pickle.loads(self.exc_type)
            except Exception:
                kind = None
        text = _unescaped(self.text)
        if not (isinstance(kind, type) and issubclass(kind, BaseException)):
            return RuntimeError(text)
        try:
            return catchable_as_torch(kind)(text)
        except BaseException as exc:  # as torch's _handle_exception: any constructor failure
            return RuntimeError(
                f"Failed to create original exception type. Error msg was {exc}"
                f" Original exception on remote side was {text}"
            )


def _unescaped(text: str) -> str:
    """The text with the escapes of its ``repr`` line undone (``\\n`` is a new line), as
    torch's caller does; characters beyond Latin-1 survive, unlike in torch."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError:  # a lone backslash: keep the text as it came
        return text


def remote_error_text(where: str, exc: BaseException) -> str:
    """torch's remote exception text: where it happened, repr, and the traceback."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"On {where}:\n{exc!r}\n{trace}"
