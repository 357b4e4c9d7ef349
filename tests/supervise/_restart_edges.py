"""The script of the in-process restart's edge cases (``test_inprocess_edges.py``).

argv: OUT MODE. Four ranks, gloo, a step is one ``all_reduce``. Every entry into a
decorated function writes ``OUT/enter-<name>-<restart>-<rank>``: its pid. MODE:

- ``twice``: ``train`` is called twice (two phases of 10 steps); on attempt 0 rank 1 dies in
  the first call, on attempt 1 rank 2 dies in the second;
- ``nested``: ``outer`` calls the decorated ``inner`` (5 steps), then runs 5 steps of its
  own; on attempt 0 rank 1 dies in ``outer``'s steps, after ``inner`` returned;
- ``spare-hangs``: a spare worker's set-up (no ``LOCAL_RANK``) writes
  ``OUT/spare-<pid>`` and never ends; on attempt 0 rank 1 dies once that file exists;
- ``spare-lingers``: a spare's set-up installs a SIGTERM handler that sleeps 60 s and
  writes ``OUT/spare-<pid>``; nothing fails, and rank 0 writes ``OUT/done`` (the time)
  just before the function returns.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import rallypoint

OUT, MODE = sys.argv[1], sys.argv[2]

if "LOCAL_RANK" not in os.environ:  # a spare worker's set-up
    if MODE == "spare-lingers":
        signal.signal(signal.SIGTERM, lambda *_: time.sleep(60))
    open(os.path.join(OUT, f"spare-{os.getpid()}"), "w").close()
    while MODE == "spare-hangs":
        time.sleep(1)


def _enter(name: str) -> int:
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    path = os.path.join(OUT, f"enter-{name}-{restart}-{os.environ['RANK']}")
    with open(path + ".tmp", "w") as fp:
        fp.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    return restart


def _steps(n: int, die: bool) -> None:
    for step in range(n):
        dist.all_reduce(torch.ones(1))
        if die and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def _spare_started() -> bool:
    return any(name.startswith("spare-") for name in os.listdir(OUT))


@rallypoint.restartable
def train(phase: int) -> None:
    restart = _enter(f"train{phase}")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    if MODE.startswith("spare") and rank == 1 and restart == 0:
        while not _spare_started():
            time.sleep(0.05)
    die = (MODE == "twice" and restart == phase and rank == phase + 1) or (
        MODE == "spare-hangs" and restart == 0 and rank == 1
    )
    _steps(10, die)
    if MODE == "spare-lingers" and rank == 0:
        with open(os.path.join(OUT, "done"), "w") as fp:
            fp.write(repr(time.time()))


@rallypoint.restartable
def inner() -> None:
    _enter("inner")
    _steps(5, False)


@rallypoint.restartable
def outer() -> None:
    restart = _enter("outer")
    dist.init_process_group("gloo")
    inner()
    _steps(5, restart == 0 and dist.get_rank() == 1)
    dist.destroy_process_group()


if MODE == "nested":
    outer()
else:
    train(0)
    if MODE == "twice":
        train(1)
    dist.destroy_process_group()
