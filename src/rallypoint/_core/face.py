"""A public package's face: the names it re-exports, written once.

A face's ``__init__`` lists its public names in one ``if TYPE_CHECKING:`` block of
``from module import name as name`` lines, and ends with ``__all__ = face(globals())``::

    if TYPE_CHECKING:
        from rallypoint.observe._events import EventLog as EventLog
        from rallypoint.observe._progress import progress as progress

    __all__ = face(globals())

mypy checks that block, and :func:`face` reads it at import to make ``__all__``,
``__dir__`` and a lazy ``__getattr__`` (PEP 562).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, MutableMapping
from typing import Any

from rallypoint._core.public import set_public_module

__all__ = ["face", "read_table"]


def read_table(source: str) -> dict[str, tuple[str, str]]:
    """``{public name: (module, name there)}`` from the ``if TYPE_CHECKING:`` blocks of a
    face's source (string methods only: ``ast`` would make ``import rallypoint`` slow)."""
    table: dict[str, tuple[str, str]] = {}
    statement = ""
    inside = False
    for line in source.splitlines():
        if line.startswith("if TYPE_CHECKING:"):
            inside = True
            continue
        code = line.partition("#")[0].strip()
        if not inside or not code:
            continue  # outside the block, a blank line or a comment
        if not line[0].isspace():
            inside = False
            continue
        statement += " " + code
        if statement.count("(") != statement.count(")"):
            continue  # a parenthesized import goes on
        words = statement.replace("(", " ").replace(")", " ").split(maxsplit=3)
        statement = ""
        if len(words) < 4 or words[0] != "from" or words[2] != "import":
            raise ImportError(f"a face's TYPE_CHECKING block holds imports only: {line!r}")
        for item in words[3].split(","):
            parts = item.split()
            if not parts:
                continue
            if len(parts) != 3 or parts[1] != "as":
                raise ImportError(f"a face re-exports with 'name as name': {item.strip()!r}")
            table[parts[2]] = (words[1], parts[0])
    return table


def face(
    namespace: MutableMapping[str, Any],
    *,
    eager: bool = False,
    renamed: Mapping[str, str] | None = None,
) -> list[str]:
    """Install ``__getattr__`` and ``__dir__`` in the package whose globals are
    ``namespace``, from its table, and return its ``__all__``.

    Public names not starting with ``_`` make ``__all__``; a ``_`` name in the table (a
    private helper torch's users reach for) resolves but is not listed. A resolved class or
    function defined in a private rallypoint module reports the package as its
    ``__module__`` (see :func:`~rallypoint._core.public.set_public_module`). ``renamed``
    maps an old name to its public name: it resolves with a ``DeprecationWarning``.

    The table is read from the package's source once, at import: a misspelt name or module
    in it fails mypy. A face whose package must stay cheap to import stays lazy (each name
    imported on first access); ``eager=True`` imports every name at once. ``__getattr__`` is
    set here, not in the face's source, so mypy never treats an unknown attribute of a face
    as ``Any``.
    """
    package: str = namespace["__name__"]
    with open(namespace["__file__"], encoding="utf-8") as file:
        table = read_table(file.read())
    public = sorted(name for name in table if not name.startswith("_"))
    old_names = dict(renamed or {})

    def resolve(name: str) -> Any:
        module, attribute = table[name]
        if module == package:  # a subpackage: ``from rallypoint import rpc as rpc``
            value: Any = importlib.import_module(f"{package}.{attribute}")
        else:
            home = importlib.import_module(module)
            try:
                value = getattr(home, attribute)
            except AttributeError:
                value = importlib.import_module(f"{module}.{attribute}")
        namespace[name] = value
        set_public_module(package, namespace, [name])
        return value

    def __getattr__(name: str) -> Any:
        if name in table:
            return resolve(name)
        if name in old_names:
            import warnings

            new = old_names[name]
            warnings.warn(
                f"{package}.{name} is deprecated: it is {new}; the name goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return namespace[new] if new in namespace else resolve(new)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(public + [name for name in namespace if name.startswith("__")])

    namespace["__getattr__"] = __getattr__
    namespace["__dir__"] = __dir__
    if eager:
        for name in table:
            resolve(name)
    return public
