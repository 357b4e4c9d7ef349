"""A replica group stopped while it takes part comes back when continued, however long.

SIGSTOP (^Z, a debugger, a paused VM) can hold a member for any time. The others go on
without it, the lighthouse deletes the rounds nobody needs and, past twice the heartbeat
timeout, forgets the member. Continued, the member must be taken back within about a
heartbeat timeout, wherever it stopped: between two asks or waiting on the next round.
A real lighthouse, two members that keep asking (threads), the stopped one a thread
that stops asking and beating, or a process stopped with real signals.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from rallypoint.ft._quorum.client import LighthouseLink
from rallypoint.ft._quorum.records import Request
from rallypoint.ft.lighthouse import LighthouseServer

BEAT_MS = 2000
"""The lighthouse's heartbeat timeout: a member is dead 2 s after its last beat is read,
forgotten 4 s later."""


@pytest.fixture
def house() -> Iterator[LighthouseServer]:
    server = LighthouseServer(
        "[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=BEAT_MS, say=print
    )
    yield server
    server.shutdown()


class _Asking:
    """Members that ask round after round (a step of 20 ms) until stopped."""

    def __init__(self, address: str, names: list[str]) -> None:
        self.rounds: dict[str, list[tuple[float, int, tuple[str, ...]]]] = {n: [] for n in names}
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(address, n), daemon=True) for n in names
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, address: str, name: str) -> None:
        try:
            link = LighthouseLink(address, f"{name}:x", name, connect_timeout=10, heartbeat=0.05)
            step = 0
            while not self._stop.is_set():
                quorum = link.quorum(Request(link.member, name, step, 1), 60)
                self.rounds[name].append((time.monotonic(), quorum.round, tuple(quorum.ids())))
                step += 1
                time.sleep(0.02)
            link.close("done")
        except BaseException as exc:  # handed to the test's thread
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        assert not self.errors, self.errors[:2]

    def last_round(self) -> int:
        return max(r for rounds in self.rounds.values() for _, r, _ in rounds)


def _wait_for(what: str, ok: object, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _known(house: LighthouseServer, member: str) -> bool:
    return member in house.loop.decider.members


@pytest.mark.timeout(120)
@pytest.mark.parametrize("forgotten", [False, True], ids=["remembered", "forgotten"])
def test_a_member_stopped_between_two_asks_is_taken_back_when_it_asks(
    house: LighthouseServer, forgotten: bool
) -> None:
    """The position of a run lost in CI: the member took round L and stops before its
    next ask; the others go on for more rounds than the lighthouse keeps (8)."""
    others = _Asking(house.address(), ["a", "b"])
    link = LighthouseLink(house.address(), "c:x", "c", connect_timeout=10, heartbeat=None)
    beating = threading.Event()
    beating.set()
    ended = threading.Event()

    def beat() -> None:
        while not ended.wait(0.05):
            if beating.is_set():
                link.beat()

    threading.Thread(target=beat, daemon=True).start()
    try:
        for step in range(5):
            taken = link.quorum(Request(link.member, "c", step, 1), 30)
        assert "c:x" in taken.ids()
        beating.clear()  # stopped: no beat, no ask
        _wait_for("the others did not go on", lambda: others.last_round() >= taken.round + 20)
        if forgotten:
            _wait_for("never forgotten", lambda: not _known(house, "c:x"))
        assert _known(house, "c:x") != forgotten
        beating.set()
        began = time.monotonic()
        back = link.quorum(Request(link.member, "c", 5, 1), 30)
        took = time.monotonic() - began
        assert "c:x" in back.ids() and back.round > taken.round + 20, back
        assert took < 3.0, f"taken back after {took:.1f} s"
    finally:
        ended.set()
        others.stop()


_MEMBER = """
import sys, time
from rallypoint.ft._quorum.client import LighthouseLink
from rallypoint.ft._quorum.records import Request
link = LighthouseLink(sys.argv[1], "c:x", "c", connect_timeout=10, heartbeat=0.05)
step = 0
while True:
    quorum = link.quorum(Request(link.member, "c", step, 1), 60)
    print(time.monotonic(), quorum.round, "c:x" in quorum.ids(), flush=True)
    step += 1
    time.sleep(0.02)
"""


@pytest.mark.timeout(120)
def test_a_member_process_stopped_while_it_waits_comes_back_when_continued(
    house: LighthouseServer,
) -> None:
    """SIGSTOP past the point where the lighthouse forgets it, wherever the member was
    (almost always waiting on the next round, its ask posted), then SIGCONT."""
    others = _Asking(house.address(), ["a", "b"])
    member = subprocess.Popen(
        [sys.executable, "-c", _MEMBER, house.address()],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    lines: list[str] = []
    out = member.stdout
    assert out is not None
    threading.Thread(target=lambda: lines.extend(iter(out.readline, "")), daemon=True).start()
    try:
        _wait_for("the member never took a quorum", lambda: len(lines) >= 5)
        member.send_signal(signal.SIGSTOP)
        _wait_for("never forgotten", lambda: not _known(house, "c:x"))
        before = others.last_round()
        member.send_signal(signal.SIGCONT)
        continued = time.monotonic()

        def back() -> bool:
            return any(
                line.split()[2] == "True" and int(line.split()[1]) > before
                for line in lines
                if len(line.split()) == 3
            )

        _wait_for(f"not taken back: {''.join(lines[-5:])}", back, within=30)
        took = time.monotonic() - continued
        assert took < 4.0, f"taken back {took:.1f} s after SIGCONT:\n{''.join(lines[-8:])}"
    finally:
        member.kill()
        member.wait(10)
        others.stop()
