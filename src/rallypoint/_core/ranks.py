"""A list of ranks in a few characters: ``ranks 0-3,7`` (hang reports, stragglers, the
report's lanes)."""

from __future__ import annotations

__all__ = ["ranks_text"]


def ranks_text(ranks: list[int]) -> str:
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    return ("ranks " if len(ranks) > 1 else "rank ") + ",".join(parts)
