"""A fault at every rank's position, one attempt each: the script of the position tests.

Data-parallel SGD on a tiny model with gloo, a snapshot every step; gradients averaged by
hand (one ``all_reduce`` per parameter) or by ``DistributedDataParallel``.

argv: OUT KIND GRAD STEPS. At attempt ``k`` (``TORCHELASTIC_RESTART_COUNT``) below the world
size, rank ``k`` faults ``GAP`` steps after the attempt's first step, once its snapshot is
complete everywhere; the other ranks are then in the next step's collectives, waiting on
each other as gloo's rings and trees order them. KIND:

- ``kill``: rank ``k`` SIGKILLs itself;
- ``spin``: rank ``k`` spins in Python without calling a collective (``--hang-timeout``);
- ``mixed``: ``kill`` at even attempts, ``spin`` at odd ones;
- ``early``: rank ``k`` raises before ``init_process_group``, while the others wait in it.

Every entry into the function writes ``OUT/enter-<restart>-<rank>``: ``pid start``; rank 0
writes the final parameters to ``OUT/final.pt``.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import rallypoint
from rallypoint import snapshot

GAP = 3
OUT, KIND, GRAD, STEPS = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
state = {"model": model, "optimizer": opt}


def _fault(restart: int) -> None:
    kind = KIND if KIND != "mixed" else ("kill", "spin")[restart % 2]
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        pass


@rallypoint.restartable
def train() -> None:
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if KIND == "early" and restart == int(os.environ["RANK"]):
        time.sleep(0.5)  # the others are in init_process_group's rendezvous
        raise ValueError(f"rank {restart} found a bad configuration")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    start = snapshot.restore(state) or 0
    entry = os.path.join(OUT, f"enter-{restart}-{rank}")
    with open(entry + ".tmp", "w") as fp:
        fp.write(f"{os.getpid()} {start}")
    os.replace(entry + ".tmp", entry)
    net = DDP(model, bucket_cap_mb=0.0005) if GRAD == "ddp" else model  # a bucket a parameter
    try:
        _steps(net, rank, world, restart, start)
    except rallypoint.RestartInterrupt:  # the documented name, on the top-level package
        open(os.path.join(OUT, f"interrupted-{restart}-{rank}"), "w").close()
        raise
    snapshot.wait()
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, f"{OUT}/final.pt")
    dist.destroy_process_group()


def _steps(net: torch.nn.Module, rank: int, world: int, restart: int, start: int) -> None:
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        loss = net(torch.randn(32, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        if GRAD == "hand":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        snapshot.save(state, step=step + 1)
        rallypoint.progress()  # for --hang-timeout
        if KIND != "early" and restart < world and rank == restart and step + 1 == start + GAP:
            _fault(restart)


train()
