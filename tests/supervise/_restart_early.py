"""A rank fails before ``init_process_group`` in the first attempt while the others make
their process group: the script of ``test_inprocess_early.py``.

argv: OUT FAILING MODE. In attempt 0, rank FAILING writes ``OUT/failed`` (the time) and
raises; the others call ``init_process_group("gloo")`` and reduce three times. MODE:

- ``race``: rank FAILING raises at once, and the others call it at once: the interruption
  finds each anywhere, in its set-up, its store connection, or ``ProcessGroupGloo``'s
  constructor, which waits in the store for the failing rank's address;
- ``late``: rank FAILING raises once every rank entered the function; the others hold the
  wake-up signal, as a main thread in C++ does (its handler runs when the call returns),
  and call it ``LATE`` seconds after they were told to leave: its store connection is made
  after their attempt was cut, and after the store hosted by a single node was emptied.

Each process's set-up writes ``OUT/start-<restart>-<rank>``, each entry into the function
``OUT/enter-<restart>-<rank>``, and each rank done ``OUT/done-<restart>-<rank>``:
``pid time``.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import rallypoint
from rallypoint._worker_side import _restartable

OUT, FAILING, MODE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
LATE = 1.5  # past the single node's store reset (the agent's STORE_RESET_AFTER, 1 s)


def _write(name: str) -> None:
    with open(os.path.join(OUT, name + ".tmp"), "w") as fp:
        fp.write(f"{os.getpid()} {time.time()}")
    os.replace(os.path.join(OUT, name + ".tmp"), os.path.join(OUT, name))


def _all_entered() -> None:
    world = int(os.environ["WORLD_SIZE"])
    while not all(os.path.exists(os.path.join(OUT, f"enter-0-{r}")) for r in range(world)):
        time.sleep(0.01)


def _told_to_leave() -> None:
    channel = _restartable._CHANNEL
    assert channel is not None
    while not channel.interrupted:
        time.sleep(0.01)
    time.sleep(LATE)


_write(f"start-{os.environ['TORCHELASTIC_RESTART_COUNT']}-{os.environ['RANK']}")


@rallypoint.restartable
def train() -> None:
    restart, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    late = restart == 0 and MODE == "late" and rank != FAILING
    if late:
        signal.pthread_sigmask(signal.SIG_BLOCK, {_restartable.WAKE_SIGNAL})
    _write(f"enter-{restart}-{rank}")
    if restart == 0 and rank == FAILING:
        if MODE == "late":
            _all_entered()
        _write("failed")
        raise ValueError(f"rank {rank} found a bad configuration")
    try:
        if late:
            _told_to_leave()
        dist.init_process_group("gloo")
    finally:
        if late:  # the interruption comes now, if it came
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {_restartable.WAKE_SIGNAL})
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    _write(f"done-{restart}-{rank}")
    dist.destroy_process_group()


train()
