"""How a launch option is declared: once, as a dataclass field whose metadata holds its
default, its check (the given value as its group's field), the group that stores it, and
how the command line spells it (:class:`Flag`: spellings, ``PET_`` variable, help).

``LaunchConfig``'s fields are the options of ``launch()``; ``rallypoint run``'s parser, its
``PET_*`` defaults, the flags' defaults and the defaults in their help are derived from the
same metadata (``_cli``). The groups' records take the checked values as they are.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

from rallypoint._core.checks import check_seconds

__all__ = ["UNSET", "Flag", "Option", "cli_flag", "declared", "flag", "option", "store"]

_KEY: Final = "rallypoint.option"


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final[Any] = _Unset()
"""An option not given (it takes its declared default), or a flag's default left to be
derived from its option's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Flag:
    """An option on ``rallypoint run``'s command line."""

    spellings: tuple[str, ...]
    """``--dashed-name`` first, then torchrun's ``--underscored_name`` (or a short form)."""
    help: str
    """Its help; ``{default}`` stands for the option's default."""
    section: str = ""
    """The ``--help`` group it starts (``""``: the one of the flag before it)."""
    after: str = ""
    """A flag of ``rallypoint run`` alone: the flag it follows in ``--help``, by name, or
    the section it ends."""
    default: Any = UNSET
    """The flag's default, as text or a number (a callable: asked when the parser is made);
    left out, the option's default as the command line gives it (:func:`option`). Given
    only where the command line's default is not ``launch()``'s (torchrun's own)."""
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
    default: Any = None
    """The option's value when it is not given (as ``launch()`` takes it)."""
    attr: str | tuple[str, ...] = ""
    """Its field(s) in the group (default: the option's name)."""
    parse: Callable[[Any, str], Any] | None = None
    """The given value (and the option's name, for errors) as the group's field (a tuple
    for several fields), checked: ``TypeError``/``ValueError`` name the option. Left out:
    a duration's or a switch's check from its flag, else the value as it is."""
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
    default: Any = None,
    flag: Flag | None = None,
    attr: str | tuple[str, ...] = "",
    parse: Callable[[Any, str], Any] | None = None,
    read: Callable[[Any], Any] | None = None,
) -> Any:
    """A dataclass field declaring one launch option (see :class:`Option`): its flag's
    default and the ``{default}`` of its help come from ``default`` (left out: ``None``)."""
    if flag is not None:
        text = flag_default(default)
        details: dict[str, Any] = {"help": flag.help.replace("{default}", _shown(text))}
        if flag.default is UNSET:
            details["default"] = text
        flag = dataclasses.replace(flag, **details)
        parse = parse or _check_of(flag, allow_none=default is None)
    meta = Option(group=group, default=default, attr=attr, parse=parse, read=read, flag=flag)
    return field(default=UNSET, metadata={_KEY: meta})


def cli_flag(*spellings: str, help: str, **details: Any) -> Any:
    """A dataclass field declaring a flag of ``rallypoint run`` that is no launch option."""
    details.setdefault("default", None)
    return field(default=None, metadata={_KEY: flag(*spellings, help=help, **details)})


def flag_default(value: Any) -> Any:
    """An option's default as its flag's (what the command line would give for it)."""
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or value == () or value == {}:
        return None  # a switch's is off; an empty list is no flag
    return value


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _check_of(flag: Flag, *, allow_none: bool) -> Callable[[Any, str], Any] | None:
    """The check of a switch's or a duration's value as ``launch()`` takes it."""
    if flag.switch:
        return _switch
    if flag.seconds is not None:
        limit, zero = flag.seconds, flag.zero

        def duration(value: Any, name: str) -> Any:
            check_seconds(value, name, allow_zero=zero, allow_none=allow_none, maximum=limit)
            return value

        return duration
    return None


def _switch(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def declared(cls: type) -> Iterator[tuple[str, Any]]:
    """``(name, Option or Flag)`` for each declared field of ``cls``, in order."""
    for item in dataclasses.fields(cls):
        if _KEY in item.metadata:
            yield item.name, item.metadata[_KEY]


def store(
    config: Any,
    options: Iterable[tuple[str, Option]],
    groups: Mapping[str, Callable[..., Any]],
) -> None:
    """Make each of ``config``'s groups (in the order of ``groups``: the first bad option's
    error wins) from its options' checked values, the default for each not given; then
    each option reads back from its group (a frozen ``config``'s fields, set here)."""
    init, options = object.__setattr__, tuple(options)
    for group, make in groups.items():
        kwargs: dict[str, Any] = {}
        for name, opt in options:
            if opt.group != group:
                continue
            value = getattr(config, name)
            if value is UNSET:
                value = copy.copy(opt.default)  # {} is no value to share
            parsed = value if opt.parse is None else opt.parse(value, name)
            attr = opt.attr or name
            kwargs.update(
                zip(attr, parsed, strict=True) if isinstance(attr, tuple) else {attr: parsed}
            )
        init(config, group, make(**kwargs))
    for name, opt in options:
        if opt.group is not None:
            part, attr = getattr(config, opt.group), opt.attr or name
            init(config, name, opt.read(part) if opt.read else getattr(part, str(attr)))
        elif getattr(config, name) is UNSET:
            init(config, name, opt.default)
