"""One quorum change in one line, as the lighthouse says it and the report draws it:
``quorum 7: groups 0, 2 (group 1 left: rank 0 killed by SIGKILL; group 3 joined at step 40)``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["quorum_line"]


def quorum_line(
    quorum: object,
    groups: Sequence[str],
    left: Sequence[tuple[str, str | None]] = (),
    joined: Sequence[tuple[str, object | None]] = (),
) -> str:
    """``left``: ``(group, why)``, ``joined``: ``(group, step)``; ``None`` where not known."""
    notes = [f"group {g} left: {why}" if why else f"group {g} left" for g, why in left]
    notes += [
        f"group {g} joined at step {step}" if step is not None else f"group {g} joined"
        for g, step in joined
    ]
    tail = f" ({'; '.join(notes)})" if notes else ""
    noun = "group" if len(groups) == 1 else "groups"
    return f"quorum {quorum}: {noun} {', '.join(groups)}{tail}"
