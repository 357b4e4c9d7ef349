"""A child's text on the launcher's terminal (rallypoint._core.terminal, and the worker
output sink that feeds it pipe reads): no escape sequence but colours, no control character
but tabs, a carriage return keeps the text after it, a long line is cut and says by how
much, whatever the pipe's reads cut the stream into."""

from __future__ import annotations

import pytest

from rallypoint._core.terminal import clean_line, split_clean
from rallypoint._supervise._output import _sink


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (b"step 1\tloss 2.5", b"step 1\tloss 2.5"),
        (b"a\x1b[2J\x1b[Hb", b"ab"),  # clear screen, cursor home
        (b"a\x1b]0;title\x07b\x1b]52;c;cGF5bG9hZA==\x1b\\c", b"abc"),  # title, clipboard
        (b"a\x1bPq#0;2;0;0;0\x1b\\b", b"ab"),  # DCS (sixel)
        ("a\u009b2Jb\u009d0;t\u009cc".encode(), b"abc"),  # the same in C1 form
        (b"\x1b[1;31mred\x1b[0m", b"\x1b[1;31mred\x1b[0m"),  # colours stay
        (b"a\x00b\x07c\x08d\x7fe", b"abcde"),
        (b" 10%|#   \r 50%|##  \r100%|####", b"100%|####"),  # a progress bar's last state
        (b"windows\r", b"windows"),
    ],
)
def test_a_line_is_fit_for_a_terminal(raw: bytes, shown: bytes) -> None:
    assert clean_line(raw) == shown


@pytest.mark.timeout(10)
def test_a_long_line_is_cut_on_a_character_and_says_by_how_much() -> None:
    assert clean_line("é".encode() * 10, 5) == "éé".encode() + b" [... 16 bytes cut]"
    assert clean_line(b"x" * 10, 10) == b"x" * 10
    assert clean_line(b"\x1b[31m" * 2, 5, colours=False) == b""
    lines = [b"ok", b"x" * 20, b""]
    assert split_clean(b"\n".join(lines), 10) == [b"ok", b"x" * 10 + b" [... 10 bytes cut]", b""]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("read", [1, 7, 4096, 1 << 16])
def test_worker_lines_are_the_same_whatever_the_reads(
    read: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown: list[bytes] = []
    monkeypatch.setattr(_sink, "write_console", lambda _stream, data: shown.append(data))
    limit = _sink.LINE_LIMIT
    stream = (
        b"plain\r\n"
        + b"x" * (3 * limit)
        + b"\n"
        + b"".join(b"\r%d%%" % p for p in range(0, 101, 10))
        + b"\n\x1b[2Jcleared\n"
        + b"y" * (limit + 5)  # not ended when the pipe closes
    )
    sink = _sink.Sink(1, b"[rank0]:", True, None)
    for at in range(0, len(stream), read):
        sink.feed(stream[at : at + read])
    sink.close()
    assert b"".join(shown).split(b"\n") == [
        b"[rank0]:plain",
        b"[rank0]:" + b"x" * limit + b" [... %d bytes cut]" % (2 * limit),
        b"[rank0]:100%",
        b"[rank0]:cleared",
        b"[rank0]:" + b"y" * limit + b" [... 5 bytes cut]",
        b"",
    ]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("read", [1, 13, 1 << 16])
def test_a_c10d_warnings_stack_folds_whatever_the_reads(
    read: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown: list[bytes] = []
    monkeypatch.setattr(_sink, "write_console", lambda _stream, data: shown.append(data))
    warning = b"[W1129 19:45:49.520557169 TCPStore.cpp:138] [c10d] recv failed: got 0 bytes"
    stack = b"Exception raised from recvBytes at Utils.hpp:787:\n" + b"".join(
        b"frame #%d: f%d\n" % (i, i) for i in range(3)
    )
    stream = (
        warning + b"\n" + stack + b"<omitting python frames>\nframe #9: g\n\nafter\n"
        + b"[E1129 1:2:3.4 x.cpp:1] [c10d] an error\n" + stack  # an error's: kept
        + warning + b"\n" + stack  # the stream ends inside a stack
    )  # fmt: skip
    sink = _sink.Sink(2, b"[rank1]: ", True, None)
    for at in range(0, len(stream), read):
        sink.feed(stream[at : at + read])
    sink.close()
    note = b"[rank1]:   (the warning's C++ stack, %d lines, is left out of the console)"
    assert b"".join(shown).split(b"\n") == [
        b"[rank1]: " + warning,
        note % 6,
        b"[rank1]: after",
        b"[rank1]: [E1129 1:2:3.4 x.cpp:1] [c10d] an error",
        b"[rank1]: Exception raised from recvBytes at Utils.hpp:787:",
        *(b"[rank1]: frame #%d: f%d" % (i, i) for i in range(3)),
        b"[rank1]: " + warning,
        note % 4,
        b"",
    ]
