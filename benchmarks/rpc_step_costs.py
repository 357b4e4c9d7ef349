"""Where the distributed-autograd training step of ``rpc_step.py`` spends its time.

Runs the rallypoint group of :mod:`rpc_step` alone (three processes: the driver and two
stages) with probes on the agent's pieces, each recording wall and thread CPU time when
it starts and ends: encoding a message (``Codec.call``/``reply``), decoding one, sending
(``sendmsg``), the local autograd engine (``run_backward``), the stages' user code
(``Stage.forward``), a stage's optimizer step (gradients from the context and the
SGD update), and the rest of a local backward pass (``DistAutograd._step``).
Prints, per piece, the median over steps of its CPU time per step summed over the three
processes, and the step's wall time less all of them (waiting for messages to arrive,
waking up, and the CPU time the probes do not cover; approximate where processes work
at once, as the two stages' optimizer steps do). With ``--timeline``
it also prints one step's events, merged across the processes in time order, with each
event's wall and CPU time since the same thread's previous event; with ``--hops``, how
long each message of a step took from its send to its decode (the wake-up and transfer
that no probe covers).

The probes cost a few microseconds each (about 40 a step): the step is slower than in
``rpc_step.py``. Usage: ``python benchmarks/rpc_step_costs.py [--steps N] [--timeline] [--hops]``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import rpc_step
import torch
from ports import free_port

from rallypoint import rpc

Event = tuple[float, float, int, str]  # wall, thread CPU, thread, what
_events: list[Event] = []
WARMUP = 100


def _mark(what: str) -> None:
    _events.append((time.perf_counter(), time.thread_time(), threading.get_ident(), what))


def _probe(owner: Any, attribute: str, label: str) -> None:
    """Record ``label>`` and ``label<`` around every call of ``owner.attribute``."""
    original: Callable[..., Any] = getattr(owner, attribute)

    def probed(*args: Any, **kwargs: Any) -> Any:
        _mark(label + ">")
        try:
            return original(*args, **kwargs)
        finally:
            _mark(label + "<")

    setattr(owner, attribute, probed)


class _ProbedEngine:
    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, *args: Any) -> Any:
        _mark("engine>")
        try:
            return self._engine.run_backward(*args)
        finally:
            _mark("engine<")


def _install_probes() -> None:
    from rallypoint.rpc import optim
    from rallypoint.rpc._agent import _codec
    from rallypoint.rpc._transport import _connection as _transport
    from rallypoint.rpc.dist_autograd import _autograd
    from rallypoint.rpc.dist_autograd import _engine as _autograd_engine

    for name in ("call", "reply"):
        _probe(_codec.Codec, name, "encode")
    _probe(_codec.Codec, "decode", "decode")
    _probe(_transport, "sendmsg_all", "send")
    _probe(_autograd.DistAutograd, "_step", "pass")
    _probe(rpc_step.Stage, "forward", "user")
    _probe(optim._LocalOptimizer, "step", "optimizer")
    _autograd_engine._ENGINE = _ProbedEngine(_autograd_engine._ENGINE)


def _member(rank: int, port: int, steps: int, out: Connection) -> None:
    _install_probes()
    rpc_step.join_group("RALLYPOINT", rank, port)
    if rank == 0:
        step = rpc_step.training_step()
        for index in range(WARMUP + steps):
            if index == WARMUP:
                _events.clear()
            _mark("step>")
            step()
            _mark("step<")
    rpc.shutdown()
    out.send(_events)


def _run(steps: int) -> dict[int, list[Event]]:
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    pipes, procs = [], []
    for rank in range(3):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_member, args=(rank, port, steps, theirs))
        proc.start()
        pipes.append(ours)
        procs.append(proc)
    events = {}
    for rank, pipe in enumerate(pipes):
        if not pipe.poll(600):
            raise RuntimeError(f"worker{rank} sent no events")
        events[rank] = pipe.recv()
    for proc in procs:
        proc.join(60)
    return events


def _steps(events: dict[int, list[Event]]) -> list[tuple[float, float]]:
    starts = [e[0] for e in events[0] if e[3] == "step>"]
    ends = [e[0] for e in events[0] if e[3] == "step<"]
    return list(zip(starts, ends, strict=False))


def _costs(events: dict[int, list[Event]]) -> dict[str, float]:
    """Per piece: median over steps of its thread CPU time per step, all processes (µs).

    CPU, not wall time: a thread that wakes another may lose its CPU to it in the middle
    of a piece (a ``send`` that wakes the receiver on the sender's CPU). A piece counts
    only while no other probe of its thread is open inside it (a ``pass`` excludes the
    engine and the encoding it does)."""
    steps = _steps(events)
    per_step: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(steps))
    for rank_events in events.values():
        open_at: dict[int, list[tuple[str, float]]] = defaultdict(list)
        index = 0
        for wall, cpu, thread, what in rank_events:
            while index < len(steps) and wall >= steps[index][1]:
                index += 1
            if index >= len(steps):
                break
            label, edge = what[:-1], what[-1]
            if label == "step":
                continue
            stack = open_at[thread]
            if stack:  # the CPU time so far belongs to the innermost open piece
                inner, since = stack[-1]
                if wall >= steps[index][0]:
                    per_step[inner][index] += cpu - since
            if edge == ">":
                stack.append((label, cpu))
            elif stack:
                stack.pop()
            if stack:
                stack[-1] = (stack[-1][0], cpu)
    costs = {label: statistics.median(values) * 1e6 for label, values in per_step.items()}
    costs["step"] = statistics.median(end - start for start, end in steps) * 1e6
    return costs


def _timeline(events: dict[int, list[Event]], which: int) -> None:
    start, end = _steps(events)[which]
    merged = sorted(
        (wall, cpu, rank, thread, what)
        for rank, rank_events in events.items()
        for wall, cpu, thread, what in rank_events
        if start <= wall <= end
    )
    last: dict[tuple[int, int], tuple[float, float]] = {}
    threads: dict[tuple[int, int], int] = {}
    for wall, cpu, rank, thread, what in merged:
        key = (rank, thread)
        threads.setdefault(key, len([k for k in threads if k[0] == rank]))
        then = last.get(key, (wall, cpu))
        last[key] = (wall, cpu)
        print(
            f"{(wall - start) * 1e6:8.0f} µs  wall +{(wall - then[0]) * 1e6:5.0f}  "
            f"cpu +{(cpu - then[1]) * 1e6:5.0f}  {'  ' * 12 * rank}"
            f"worker{rank}.{threads[key]} {what}"
        )


def _hops(events: dict[int, list[Event]]) -> list[tuple[int, int, int, float, int]]:
    """Per message of a step, in order: (position, sender, receiver, median latency in
    seconds, steps seen), where the latency runs from the sender's ``send>`` to the
    receiver's ``decode>``: the wake-up and the transfer, the part of a hop that is no
    CPU work. The sender is the other process that began a send last (a guess that holds
    in this sequential pipeline); messages seen in fewer than half of the steps (their
    order varies) are left out."""
    steps = _steps(events)
    latencies: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for start, end in steps:
        merged = sorted(
            (wall, rank, what)
            for rank, rank_events in events.items()
            for wall, _, _, what in rank_events
            if start <= wall <= end and what in ("send>", "decode>")
        )
        began: dict[int, float] = {}
        position = 0
        for wall, rank, what in merged:
            if what == "send>":
                began[rank] = wall
                continue
            others = [(at, sender) for sender, at in began.items() if sender != rank]
            if others:
                at, sender = max(others)
                latencies[(position, sender, rank)].append(wall - at)
            position += 1
    return [
        (position, sender, receiver, statistics.median(values), len(values))
        for (position, sender, receiver), values in sorted(latencies.items())
        if len(values) * 2 > len(steps)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps measured (after 100)")
    parser.add_argument("--timeline", action="store_true", help="print one step's events")
    parser.add_argument(
        "--hops", action="store_true", help="print each message's wake-up and transfer time"
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be 1 or more")
    events = _run(args.steps)
    costs = _costs(events)
    step = costs.pop("step")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.steps} steps (probed)")
    print(f"step (median): {step:.0f} µs")
    for label, value in sorted(costs.items(), key=lambda item: -item[1]):
        print(f"  {label:9s} {value:6.0f} µs CPU per step (3 processes)")
    print(f"  the rest of the step's wall time: {step - sum(costs.values()):.0f} µs")
    if args.hops:
        hops = _hops(events)
        for position, sender, receiver, latency, seen in hops:
            print(
                f"  message {position}: worker{sender} -> worker{receiver}, "
                f"{latency * 1e6:4.0f} µs from send to decode (median of {seen} steps)"
            )
        total = sum(hop[3] for hop in hops)
        print(f"  together {total * 1e6:.0f} µs of the {step:.0f} µs step")
    if args.timeline:
        _timeline(events, len(_steps(events)) // 2)


if __name__ == "__main__":
    main()
