"""A torchft program: data-parallel replica groups, as torchft's examples write them.

argv: OUT STEPS. Environment: REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE (as torchft's), and FT_IMPL
(``torchft`` to run torchft itself, else ``rallypoint.ft``), FT_KILL ("G1,G2:STEP": those
groups' first processes SIGKILL themselves after that step), FT_FAIL ("GROUP:STEP": that group
raises after that step, in every process), FT_MIN (min_replica_size, 1), FT_WIDTH (the hidden
layer, 32), FT_STEP_SLEEP (seconds, 0.05), FT_HOLD ("STEP:GROUP": after that step, wait until
that group's process has started: a late group then joins while the others still train, however
slow a loaded machine starts it), FT_BALLAST_MB (a tensor of that size in the state, 0),
FT_DIE_SERVING ("GROUP:STEP": from that step on, that group's first process SIGKILLs itself 20
ms after it starts sending its state to a healing group), FT_BACKEND (``nccl``: the model on the
visible GPU and ProcessGroupNCCL across groups; ``cuda-gloo``: the model on the visible GPU and
ProcessGroupGloo, which takes CUDA tensors), FT_HANG ("GROUP:STEP:SECONDS[:RANK]": after that
step, that group's first process (or its RANK) stands still in its main thread for that long,
its other threads running, as in a deadlock), FT_TOGETHER (N: wait until groups 0..N-1 have all
started before asking for a quorum, so that none trains alone from step 0 however slowly a
loaded machine starts the others).
Every committed step appends ``time step participants pid`` to OUT/steps-<group>; the end writes
the parameters to OUT/final-<group>.pt (a group's rank r > 0: final-<group>-rank<r>.pt).
"""

import importlib
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch

torchft = importlib.import_module(os.environ.get("FT_IMPL", "rallypoint.ft"))
OUT, STEPS = sys.argv[1], int(sys.argv[2])
GROUP = int(os.environ["REPLICA_GROUP_ID"])
SLEEP = float(os.environ.get("FT_STEP_SLEEP", "0.05"))
kill_groups, _, kill_step = os.environ.get("FT_KILL", "-1:-1").partition(":")
fail_group, _, fail_step = os.environ.get("FT_FAIL", "-1:-1").partition(":")
WIDTH = int(os.environ.get("FT_WIDTH", "32"))
hold_step, _, hold_group = os.environ.get("FT_HOLD", "-1:-1").partition(":")
BALLAST = torch.zeros(int(float(os.environ.get("FT_BALLAST_MB", "0")) * 2**18))
die_group, _, die_step = os.environ.get("FT_DIE_SERVING", "-1:-1").partition(":")
hang_group, hang_step, hang_seconds, *hang_rank = os.environ.get("FT_HANG", "-1:-1:0").split(":")
FIRST = not os.path.exists(os.path.join(OUT, f"started-{GROUP}"))
open(os.path.join(OUT, f"started-{GROUP}"), "a").close()
HANGS = (int(os.environ.get("RANK", "0")) == int(hang_rank[0])) if hang_rank else FIRST

together = int(os.environ.get("FT_TOGETHER", "0"))
deadline = time.monotonic() + 120
while FIRST and not all(os.path.exists(os.path.join(OUT, f"started-{g}")) for g in range(together)):
    assert time.monotonic() < deadline, "the other groups never started"
    time.sleep(0.05)

torch.manual_seed(GROUP)  # different on purpose: the first quorum's heal makes them equal
NCCL = os.environ.get("FT_BACKEND") == "nccl"
ON_GPU = NCCL or os.environ.get("FT_BACKEND") == "cuda-gloo"
DEVICE = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")
model = torch.nn.Sequential(torch.nn.Linear(16, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, 4))
model = model.to(DEVICE)
inner = torch.optim.Adam(model.parameters(), lr=1e-3)


def load_state_dict(state):
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["optim"])
    BALLAST.copy_(state["ballast"])


def _die_soon():
    time.sleep(0.02)  # the state is on its way by then
    os.kill(os.getpid(), signal.SIGKILL)


def state_dict():
    serving = threading.current_thread() is not threading.main_thread()  # to a healing group
    if FIRST and serving and die_group == str(GROUP) and manager.current_step() >= int(die_step):
        threading.Thread(target=_die_soon).start()
    return {"model": model.state_dict(), "optim": inner.state_dict(), "ballast": BALLAST}


manager = torchft.Manager(
    pg=(torchft.ProcessGroupNCCL if NCCL else torchft.ProcessGroupGloo)(
        timeout=timedelta(seconds=10)
    ),
    min_replica_size=int(os.environ.get("FT_MIN", "1")),
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    replica_id=f"{GROUP}",
    timeout=timedelta(seconds=10),
)
ddp = torchft.DistributedDataParallel(manager, model)
optimizer = torchft.Optimizer(manager, inner)
with open(os.path.join(OUT, f"steps-{GROUP}"), "a", buffering=1) as log:
    while manager.current_step() < STEPS:
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * step + GROUP)
        optimizer.zero_grad()
        ddp(torch.randn(8, 16, generator=g).to(DEVICE)).pow(2).mean().backward()
        optimizer.step()
        if manager.current_step() > step:
            now = manager.current_step()
            log.write(f"{time.time()!r} {now} {manager.num_participants()} {os.getpid()}\n")
        now = manager.current_step()
        if FIRST and str(GROUP) in kill_groups.split(",") and now >= int(kill_step):
            os.kill(os.getpid(), signal.SIGKILL)
        if int(fail_group) == GROUP and now >= int(fail_step):
            raise RuntimeError(f"group {GROUP} fails at step {now}, every time")
        if HANGS and int(hang_group) == GROUP and now >= int(hang_step):
            hang_group = "-1"
            threading.Event().wait(float(hang_seconds))  # only this thread stands still
        time.sleep(SLEEP)
        if int(hold_step) >= 0 and now >= int(hold_step):
            hold_step = "-1"
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(OUT, f"started-{hold_group}")):
                assert time.monotonic() < deadline, f"group {hold_group} never started"
                time.sleep(0.05)
devices = {str(p.device) for p in model.parameters()}
devices |= {str(p.grad.device) for p in model.parameters() if p.grad is not None}
with open(os.path.join(OUT, f"devices-{GROUP}"), "w") as f:  # parameters' and gradients'
    f.write(" ".join(sorted(devices)))
RANK = int(os.environ.get("RANK", "0"))  # a group's ranks heal at step 0 from the group their
# rank picks (as torchft: its primary is group_rank % up-to-date groups), so each is compared
# with the same rank of the other groups
torch.save(
    {k: v.cpu() for k, v in model.state_dict().items()},
    f"{OUT}/final-{GROUP}.pt" if RANK == 0 else f"{OUT}/final-{GROUP}-rank{RANK}.pt",
)
manager.shutdown()
