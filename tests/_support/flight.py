"""Reading the hang and failure reports in tests."""

from __future__ import annotations

import re


def root_causes(text: str) -> list[dict[str, str]]:
    """Each ``Root cause (Flight Recorder):`` block of ``text`` as ``{field: value}``."""
    blocks = []
    for chunk in text.split("Root cause (Flight Recorder):")[1:]:
        fields: dict[str, str] = {}
        last = ""
        for line in chunk.splitlines()[1:]:
            m = re.match(r"^  (rank|host|collective|issued at|waiting) +: (.*)$", line)
            if m:
                last = m.group(1)
                fields[last] = m.group(2)
            elif line.startswith("               ") and last:
                fields[last] += "; " + line.strip()  # a continued field
            elif not line.startswith("  "):
                break
        blocks.append(fields)
    return blocks
