"""The control channel between the agent and a worker that runs a restartable function.

Each worker gets one end of a ``SOCK_SEQPACKET`` pair (``RALLYPOINT_CONTROL_FD``); the
agent keeps the other. Messages are small JSON objects, one a packet: the worker runs the
user's code, so the agent never unpickles what it sends. Worker -> agent: :class:`Hello`,
:class:`Raised`, :class:`Parked`, :class:`Done`; agent -> worker: :class:`Interrupt`,
:class:`Verdict`, :class:`Assign`, :class:`Stop`. Each class says when it is sent.
"""

from __future__ import annotations

import enum
import json
import socket
from dataclasses import dataclass, field
from typing import TypeAlias

__all__ = [
    "Assign",
    "Done",
    "Hello",
    "Interrupt",
    "Message",
    "Parked",
    "Raised",
    "Stop",
    "Verdict",
    "decode",
    "encode",
    "pair",
    "receive",
]

MAX_MESSAGE = 1 << 22
"""Largest packet (an :class:`Assign` carries a worker's whole environment)."""


class Kind(enum.Enum):
    HELLO = "hello"
    RAISED = "raised"
    PARKED = "parked"
    DONE = "done"
    INTERRUPT = "interrupt"
    VERDICT = "verdict"
    ASSIGN = "assign"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Hello:
    """Worker -> agent: it entered ``@rallypoint.restartable`` (it can restart in process)."""

    pid: int


@dataclass(frozen=True, slots=True)
class Raised:
    """Worker -> agent: the function raised on its own; it waits for a :class:`Verdict`."""

    traceback: str
    """The exception as Python prints it (the agent tells a vanished peer by it)."""


@dataclass(frozen=True, slots=True)
class Parked:
    """Worker -> agent: it left the function and tore torch.distributed down; it waits for an
    :class:`Assign`."""


@dataclass(frozen=True, slots=True)
class Done:
    """Worker -> agent: the function returned (the process goes on to exit as usual)."""


@dataclass(frozen=True, slots=True)
class Interrupt:
    """Agent -> worker: leave the function now."""

    reason: str


@dataclass(frozen=True, slots=True)
class Verdict:
    """Agent -> worker: whether a :class:`Raised` is a failure of its own, or the consequence
    of a fault elsewhere."""

    restart: bool
    """True: a fault elsewhere caused it (restart in process); False: its own failure."""


@dataclass(frozen=True, slots=True)
class Assign:
    """Agent -> worker: the next attempt's environment."""

    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Stop:
    """Agent -> worker, just before it forwards a SIGINT (a Ctrl-C): the job stops. The
    worker leaves as its SIGINT handlers say, restarts nothing, prints no traceback of
    the stop, and cuts its attempt's connections if it is still there a moment later."""


Message: TypeAlias = Hello | Raised | Parked | Done | Interrupt | Verdict | Assign | Stop

_KINDS: dict[type[Message], Kind] = {
    Hello: Kind.HELLO,
    Raised: Kind.RAISED,
    Parked: Kind.PARKED,
    Done: Kind.DONE,
    Interrupt: Kind.INTERRUPT,
    Verdict: Kind.VERDICT,
    Assign: Kind.ASSIGN,
    Stop: Kind.STOP,
}
_TYPES = {kind: cls for cls, kind in _KINDS.items()}


def encode(msg: Message) -> bytes:
    fields = {name: getattr(msg, name) for name in msg.__slots__}
    return json.dumps({"kind": _KINDS[type(msg)].value, **fields}).encode()


def decode(data: bytes) -> Message:
    """The message in ``data``; ``ValueError`` for anything else."""
    try:
        obj = json.loads(data)
        cls = _TYPES[Kind(obj.pop("kind"))]
        return cls(**obj)
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a control message: {data[:80]!r}") from exc


def pair() -> tuple[socket.socket, socket.socket]:
    """``(agent end, worker end)``; the agent's does not block."""
    agent, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent.setblocking(False)
    return agent, worker


def receive(sock: socket.socket) -> list[Message] | None:
    """Every message waiting on the agent's end (non-blocking); ``None`` once the worker's
    end is closed (it exited). A malformed packet is dropped."""
    out: list[Message] = []
    while True:
        try:
            data = sock.recv(MAX_MESSAGE)
        except BlockingIOError:
            return out
        except OSError:
            return out or None
        if not data:
            return out or None
        try:
            out.append(decode(data))
        except ValueError:
            continue
