"""A fault while the other ranks import what a first step imports: the script of
``test_inprocess_imports.py``.

argv: OUT KIND DELAY STEPS. Three ranks, gloo. Nothing is imported above the function but
torch and rallypoint, so every process's first ``torch.optim.Adam`` imports
``torch._dynamo`` and sympy (about a second on an idle machine). On the first attempt, once
every rank has passed ``init_process_group``, rank 1 waits DELAY seconds and faults (KIND
``kill``: SIGKILLs itself; ``raise``: raises ``ValueError``) while the others build their
model and their first Adam, then train STEPS steps of data-parallel Adam, a snapshot every
step.

Every entry into the function writes ``OUT/enter-<restart>-<rank>``: its pid. A rank that
leaves the function interrupted writes ``OUT/left-<restart>-<rank>``: where it was
(``barrier``, ``adam`` or ``steps``) and the exception's name. Rank 0 writes
``OUT/done`` once the last step is done.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import rallypoint
from rallypoint import snapshot

OUT, KIND, DELAY, STEPS = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
FAULT_RANK = 1


def _write(name: str, text: str) -> None:
    path = os.path.join(OUT, name)
    with open(path + ".tmp", "w") as fp:
        fp.write(text)
    os.replace(path + ".tmp", path)


def _fault() -> None:
    time.sleep(DELAY)
    if KIND == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"rank {FAULT_RANK} failed {DELAY} s into its first step")


@rallypoint.restartable
def train() -> None:
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    if restart == 0:  # else the fault would not come while the others import them
        assert "torch._dynamo" not in sys.modules, "torch._dynamo imported before the step"
    _write(f"enter-{restart}-{rank}", str(os.getpid()))
    dist.init_process_group("gloo")
    where = "barrier"  # a fault at once can reach a kept rank still leaving the barrier
    try:
        dist.barrier()
        if restart == 0 and rank == FAULT_RANK:
            _fault()
        where = "adam"
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        state = {"model": model, "optimizer": opt}
        start = snapshot.restore(state) or 0
        where = "steps"
        for step in range(start, STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            loss = model(torch.randn(32, 8, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            snapshot.save(state, step=step + 1)
            rallypoint.progress()
    except BaseException as exc:  # the interruption, or a collective or store wait it cut
        _write(f"left-{restart}-{rank}", f"{where} {type(exc).__name__}")
        raise
    snapshot.wait()
    if rank == 0:
        _write("done", str(STEPS))
    dist.destroy_process_group()


train()
