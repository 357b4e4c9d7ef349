"""A worker's identity: :class:`WorkerInfo` (its name and rank), and the rule for names."""

from __future__ import annotations

from dataclasses import dataclass

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_:")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker's name and id (its rank), as in ``torch.distributed.rpc.WorkerInfo``."""

    name: str
    id: int

    def __post_init__(self) -> None:
        # torch's constructor checks the name, with this type and message
        if not isinstance(self.name, str) or not _valid_name(self.name):
            raise RuntimeError(_name_error(self.name))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    __str__ = __repr__


def _valid_name(name: str) -> bool:
    return bool(name) and len(name) < 128 and set(name) <= _NAME_CHARS


def _name_error(name: object) -> str:
    return (
        "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter "
        f"than 128 chars, got {name!r}"
    )


def validate_name(name: object) -> str:
    if not isinstance(name, str):
        raise TypeError(f"worker name must be a str, got {type(name).__name__}")
    if not _valid_name(name):
        raise ValueError(_name_error(name))
    return name
