"""The training script of the in-process restart tests: data-parallel SGD on a tiny model,
gloo, fixed seeds, gradients averaged with one ``all_reduce`` per parameter (a fixed
layout: a resumed run sums in the same order as an uninterrupted one), a snapshot every
step.

argv: OUT MODE STEPS [DECORATED]. On the first attempt (``TORCHELASTIC_RESTART_COUNT``
0), after step ``FAULT_STEP`` (10), rank ``FAULT_RANK`` (1):

- ``none``: nothing happens;
- ``kill``: SIGKILLs itself;
- ``raise``: raises ``ValueError`` in the function;
- ``node``: writes ``OUT/at-fault`` and sleeps: the test kills its node (before the fault,
  a world of one node waits in the function for the other node to join);
- ``spin``: spins in Python without calling a collective (``--hang-timeout`` finds it, or
  the others' collective times out: ``RESTART_TEST_PG_TIMEOUT`` seconds);
- ``ignore``: SIGKILLs itself, and rank 2 catches the interruption and spins on
  (``--restart-grace`` replaces it);
- ``spare``: as ``kill``, once a spare worker (``--spare-workers``; its set-up runs without
  a ``LOCAL_RANK``) has written ``OUT/spare-ready-<pid>`` at the end of its set-up, or, with
  ``RESTART_TEST_SPARE_EXITS`` set, has written ``OUT/spare-gone-<pid>`` and exited 3;
- ``every``: rank 1 SIGKILLs itself once every rank entered the function, on every
  attempt before the 20th, and rank 0 records its descriptors, threads and RSS on each
  entry.

Every entry into the function writes ``OUT/enter-<restart>-<rank>``: ``pid start``.
``OUT/setup-<pid>`` marks code above the function (once per process). Rank 0 writes the
final parameters to ``OUT/final.pt``. With DECORATED ``0`` the function is not decorated.
"""

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rallypoint
from rallypoint import snapshot

FAULT_STEP, FAULT_RANK = 10, 1
OUT, MODE, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])
DECORATED = len(sys.argv) < 5 or sys.argv[4] != "0"

open(os.path.join(OUT, f"setup-{os.getpid()}"), "w").close()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
state = {"model": model, "optimizer": opt}
if "LOCAL_RANK" not in os.environ:  # a spare worker: its set-up is done
    if os.environ.get("RESTART_TEST_SPARE_EXITS"):
        open(os.path.join(OUT, f"spare-gone-{os.getpid()}"), "w").close()
        print("the spare's set-up failed", file=sys.stderr, flush=True)
        os._exit(3)
    open(os.path.join(OUT, f"spare-ready-{os.getpid()}"), "w").close()


def _spare_done() -> bool:
    """A spare finished its set-up, or one exited (a zombie or reaped: gone for good)."""
    import psutil

    for name in os.listdir(OUT):
        if name.startswith("spare-ready-"):
            return True
        if name.startswith("spare-gone-"):
            try:
                gone = psutil.Process(int(name.rsplit("-", 1)[1])).status() == "zombie"
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                return True
    return False


def _usage() -> str:
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/statm") as fp:
        rss = int(fp.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return f"{fds} {threading.active_count()} {rss}"


def _fault(rank: int, restart: int) -> None:
    if restart != 0 and MODE != "node":  # a lost node spends no restart
        return
    if MODE == "spare" and rank == FAULT_RANK:
        while not _spare_done():
            time.sleep(0.05)
        snapshot.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE in ("kill", "ignore") and rank == FAULT_RANK:
        snapshot.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "raise" and rank == FAULT_RANK:
        raise ValueError("rank 1 found a bad batch")
    marker = os.path.join(OUT, "at-fault")
    if MODE == "node" and rank == FAULT_RANK and not os.path.exists(marker):
        snapshot.wait()  # the test kills this rank's whole node
        with open(os.path.join(OUT, "at-fault.tmp"), "w") as fp:
            fp.write(str(os.getpid()))
        os.replace(os.path.join(OUT, "at-fault.tmp"), marker)
        while True:
            time.sleep(1)
    if MODE == "spin" and rank == FAULT_RANK:
        while True:
            pass
    if MODE == "ignore" and rank == 2:
        while True:
            try:
                while True:
                    pass
            except BaseException:  # swallows the interruption: never leaves the function
                pass


def train() -> None:
    timeout = float(os.environ.get("RESTART_TEST_PG_TIMEOUT", "1800"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    start = snapshot.restore(state) or 0
    record = f"{os.getpid()} {start}"
    if MODE == "every" and rank == 0:
        record += " " + _usage()
    if MODE == "node":  # a membership change restarts without spending budget
        restart = os.path.exists(os.path.join(OUT, "at-fault"))
    entry = os.path.join(OUT, f"enter-{restart:d}-{rank}")
    with open(entry + ".tmp", "w") as fp:  # renamed: a reader never sees it half written
        fp.write(record)
    os.replace(entry + ".tmp", entry)
    lonely = world == int(os.environ["LOCAL_WORLD_SIZE"])
    if MODE == "node" and not restart and lonely:  # the other node came late (a loaded
        while True:  # machine): wait here until it joins and the round is interrupted
            time.sleep(0.05)
    if MODE == "every" and restart < 20:
        dist.barrier()  # rank 0 recorded its entry
        if rank == FAULT_RANK:
            os.kill(os.getpid(), signal.SIGKILL)
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        loss = model(torch.randn(32, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        snapshot.save(state, step=step + 1)
        rallypoint.progress()  # for --hang-timeout
        if step + 1 == FAULT_STEP:
            _fault(rank, restart)
    snapshot.wait()
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{OUT}/final.pt")
    dist.destroy_process_group()


(rallypoint.restartable(train) if DECORATED else train)()
