"""How a launch option is declared: once, as a dataclass field whose metadata says where it
goes (the part's option group that stores it parsed) and how the command line spells it
(:class:`Flag`: spellings, ``PET_`` variable, help, what its text means).

``LaunchConfig``'s fields are the options of ``launch()``; ``rallypoint run``'s parser, its
``PET_*`` defaults and the flags' values are derived from the same metadata (``_cli``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

__all__ = ["UNSET", "Flag", "Option", "cli_flag", "declared", "flag", "option"]

_KEY: Final = "rallypoint.option"


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final[Any] = _Unset()
"""An option not given: its part's option group keeps its own default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """An option on ``rallypoint run``'s command line."""

    spellings: tuple[str, ...]
    """``--dashed-name`` first, then torchrun's ``--underscored_name`` (or a short form)."""
    help: str
    section: str = ""
    """The ``--help`` group it starts (``""``: the one of the flag before it)."""
    after: str = ""
    """A flag of ``rallypoint run`` alone: the flag it follows in ``--help``, by name, or
    the section it ends."""
    default: Any = None
    """The flag's default, as text or a number (a callable: asked when the parser is made)."""
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    switch: bool = False
    """``store_true``: ``PET_<NAME>`` turns it on unless it is empty, ``0``, ``false``, ``no``."""
    repeat: bool = False
    """Given once per value; ``PET_<NAME>`` holds one value a line."""
    seconds: float | None = None
    """A duration: a finite number of seconds up to this, a ``timedelta`` for ``launch()``."""
    zero: bool = False
    """A duration that may be 0 (else it must be > 0)."""
    value: Callable[[Any, str], Any] | None = None
    """What the parsed flag means as the keyword's value (``ValueError`` naming the flag,
    given as the second argument); default: itself (a switch: a bool)."""
    pet: str = ""
    """``PET_<LONGEST_SPELLING>``, as torchrun names it."""

    @property
    def dest(self) -> str:
        """The parsed namespace's attribute (torchrun's: from the last spelling)."""
        return self.spellings[-1].lstrip("-").replace("-", "_")

    @property
    def name(self) -> str:
        """The spelling that error messages use."""
        return self.spellings[0] if self.spellings[0].startswith("--") else self.spellings[-1]

    def keyword_value(self, parsed: Any) -> Any:
        """The keyword's value for ``parsed`` (``ValueError``/``TypeError`` name the flag)."""
        if self.switch:
            return bool(parsed)
        if self.value is not None:
            parsed = self.value(parsed, self.name)
        if self.seconds is not None and isinstance(parsed, int | float):
            parsed = timedelta(seconds=float(parsed))
        return parsed


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """Where a launch option is stored: a field of one of ``LaunchConfig``'s groups."""

    group: str | None
    """The ``LaunchConfig`` group (``None``: the option is kept as given)."""
    attr: str | tuple[str, ...] = ""
    """Its field(s) in the group (default: the option's name)."""
    parse: Callable[[Any, str], Any] | None = None
    """The given value (and the option's name, for errors) as the group's field (a tuple
    for several fields)."""
    read: Callable[[Any], Any] | None = None
    """The group's field(s) as the option reads back (default: the field itself)."""
    flag: Flag | None = None


def flag(*spellings: str, help: str, **details: Any) -> Flag:
    """A :class:`Flag` with torchrun's ``PET_`` name for it."""
    longest = max(spellings, key=len).lstrip("-").replace("-", "_")
    return Flag(spellings=spellings, help=help, pet=f"PET_{longest.upper()}", **details)


def option(
    group: str | None,
    *,
    flag: Flag | None = None,
    attr: str | tuple[str, ...] = "",
    parse: Callable[[Any, str], Any] | None = None,
    read: Callable[[Any], Any] | None = None,
    default: Any = UNSET,
) -> Any:
    """A dataclass field declaring one launch option (see :class:`Option`); left out, it
    takes its group's default."""
    meta = Option(group=group, attr=attr, parse=parse, read=read, flag=flag)
    return field(default=default, metadata={_KEY: meta})


def cli_flag(*spellings: str, help: str, **details: Any) -> Any:
    """A dataclass field declaring a flag of ``rallypoint run`` that is no launch option."""
    return field(default=None, metadata={_KEY: flag(*spellings, help=help, **details)})


def declared(cls: type) -> Iterator[tuple[str, Any]]:
    """``(name, Option or Flag)`` for each declared field of ``cls``, in order."""
    for item in dataclasses.fields(cls):
        if _KEY in item.metadata:
            yield item.name, item.metadata[_KEY]
