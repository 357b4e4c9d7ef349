"""A child process's text made fit for a terminal: workers' lines on the launcher's console
(``_supervise._output``) and the last lines of a failed health check (``_elastic._health``).

- Escape sequences that move the cursor, clear the screen, set the title or talk to the
  terminal (CSI, OSC, DCS, ...) and every other control character are removed; tabs stay,
  and so do colours (SGR, ``ESC [ ... m``) where ``colours`` is set.
- A carriage return keeps what a terminal would show last: the text after it (a progress
  bar's final state); a line's ``\\r\\n`` ending is a line end.
- A line longer than ``limit`` bytes is cut there (on a UTF-8 character boundary) and says
  how many bytes were cut.

Log files keep the raw bytes: only what reaches a terminal is cleaned.
"""

from __future__ import annotations

import re

__all__ = ["LINE_LIMIT", "clean_line", "cut_marker", "has_control", "split_clean"]

LINE_LIMIT = 16 * 1024
"""Bytes of a worker's line shown on the console; the rest is cut."""

# C0 controls but tab and newline, DEL, and C1 controls (U+0080-U+009F in UTF-8)
_CONTROL = rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]"
_UNSAFE = re.compile(_CONTROL)
_C0 = bytes([*range(0x09), *range(0x0B, 0x20), 0x7F])
_STRIP = re.compile(
    rb"(?:\x1b\[|\xc2\x9b)[0-?]*[ -/]*[@-~]"  # CSI ... final byte
    rb"|(?:\x1b[\]PX^_]|\xc2[\x90\x98\x9d\x9e\x9f])"  # OSC, DCS, SOS, PM, APC ...
    rb"[^\x07\x1b]*?(?:\x07|\x1b\\|\xc2\x9c|(?=\x1b)|\Z)"  # ... to BEL or ST
    rb"|\x1b[ -/]*[0-~]?"  # any other escape
    rb"|" + _CONTROL
)
_SGR = re.compile(rb"\x1b\[[0-9;:]*m")


def cut_marker(dropped: int) -> bytes:
    """What a cut line ends with."""
    return f" [... {dropped} bytes cut]".encode()


def _cut(line: bytes, limit: int) -> tuple[bytes, int]:
    """``line`` cut to at most ``limit`` bytes on a UTF-8 character boundary, and how many
    bytes were cut."""
    if len(line) <= limit:
        return line, 0
    end = limit
    while end > 0 and limit - end < 3 and line[end] & 0xC0 == 0x80:
        end -= 1  # not inside a multi-byte character
    return line[:end], len(line) - end


def _keep_colours(match: re.Match[bytes]) -> bytes:
    text = match.group()
    return text if _SGR.fullmatch(text) else b""


def clean_line(
    line: bytes, limit: int = LINE_LIMIT, *, colours: bool = True, dropped: int = 0
) -> bytes:
    """One line (without its ``\\n``) fit for a terminal; ``dropped`` bytes of it were cut
    already (a line too long to keep whole, cut as it came)."""
    line = line.rstrip(b"\r")
    cr = line.rfind(b"\r")
    if cr >= 0:
        line, dropped = line[cr + 1 :], 0
    if _UNSAFE.search(line) is not None:
        line = _STRIP.sub(_keep_colours if colours else b"", line)
    line, cut = _cut(line, limit)
    if cut or dropped:
        line += cut_marker(cut + dropped)
    return line


def has_control(text: bytes) -> bool:
    """Whether ``text`` holds a control character other than tab and newline (one pass at
    memory speed, for the common case of none)."""
    if len(text.translate(None, _C0)) != len(text):
        return True
    return b"\xc2" in text and _UNSAFE.search(text) is not None


def split_clean(
    text: bytes, limit: int = LINE_LIMIT, *, colours: bool = True, dropped: int = 0
) -> list[bytes]:
    """``text`` split at ``\n`` into lines fit for a terminal; ``dropped`` bytes of the
    first were cut already."""
    lines = text.split(b"\n")
    short = len(text) <= limit or max(map(len, lines)) <= limit
    if short and not dropped and not has_control(text):
        return lines  # nearly all output
    first = clean_line(lines[0], limit, colours=colours, dropped=dropped)
    return [first, *(clean_line(line, limit, colours=colours) for line in lines[1:])]
