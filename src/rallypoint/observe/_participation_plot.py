"""Drawing replica-group participation (``_participation``) under a report's timeline.

One lane per replica group, filled where the group was in the step's quorum and empty
where it was out; a thin line at every new quorum, and a diamond where a group healed.
Every span, line and diamond has a tooltip (the quorum, who left and why, the heal).
"""

from __future__ import annotations

from typing import Any

from rallypoint.observe._participation import Participation

__all__ = ["IN_QUORUM_COLOR", "draw_participation", "participation_tooltips"]

IN_QUORUM_COLOR = "#43a047"
HEAL_COLOR = "#1565c0"
CHANGE_COLOR = "#9e9e9e"


def participation_tooltips(part: Participation) -> dict[str, str]:
    tips = {f"quorum-span-{i}": span.label for i, span in enumerate(part.spans)}
    tips.update({f"quorum-change-{i}": change.label for i, change in enumerate(part.changes)})
    tips.update({f"heal-{i}": heal.label for i, heal in enumerate(part.heals)})
    return tips


def draw_participation(ax: Any, part: Participation, span: float) -> None:
    """Draw ``part`` on ``ax`` (a matplotlib Axes sharing x with the timeline)."""
    y_of = {g: i for i, g in enumerate(part.groups)}
    tiny = span * 0.002
    for i, change in enumerate(part.changes):
        ax.axvline(change.t, color=CHANGE_COLOR, linewidth=0.8, gid=f"quorum-change-{i}")
    for i, s in enumerate(part.spans):
        ax.broken_barh(
            [(s.start, max(s.end - s.start, tiny))],
            (y_of[s.group] - 0.3, 0.6),
            facecolors=IN_QUORUM_COLOR,
            gid=f"quorum-span-{i}",
        )
    for i, heal in enumerate(part.heals):
        (mark,) = ax.plot(heal.t, y_of[heal.group], marker="D", markersize=7, color=HEAL_COLOR)
        mark.set_gid(f"heal-{i}")
    ax.set_yticks(range(len(part.groups)), [f"group {g}" for g in part.groups])
    ax.set_ylim(len(part.groups) - 0.5, -0.5)
    ax.set_title(
        f"replica groups in each step's quorum ({len(part.changes)} quorums); "
        "empty: out of the quorum; diamond: healed from a live group",
        loc="left",
        fontsize=9,
    )
