"""A DiLoCo program written for torchft: replica groups, each its own ``rallypoint run``.

argv: OUT OUTER_STEPS. Environment: REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE (as torchft's),
FT_IMPL (``torchft`` to run torchft itself, else ``rallypoint.ft``), FT_FRAGMENTS (model
fragments, 1), FT_SYNC_EVERY (4), FT_DELAY (fragment_sync_delay, 1), FT_KILL ("GROUP:STEP":
that group's first process SIGKILLs itself mid-sync once the outer step reaches STEP: its
quorum asked for and its average sent, before the commit; OUT/killed-<group> says it did),
FT_TOGETHER (N: a first process starts training once groups 0..N-1 have made their
managers, so every group is in the first quorum and, the lighthouse waiting for every live
member of the last quorum, in each one after), FT_HOLD ("STEP:GROUP": from that outer step
on, once that group was killed, wait once until its second process is about to ask for a
quorum, so that it comes back before the others end, however slowly a loaded machine
restarts it; never before the kill, which a hold would keep from happening: the held
groups ask for no quorum, so the killed group's never forms). Every new outer step appends
``time step participants pid`` to OUT/steps-<group> (a heal too: the step it healed to);
the end writes the parameters to OUT/final-<group>.pt.
"""

import importlib
import os
import signal
import sys
import time
from datetime import timedelta

import torch

IMPL = os.environ.get("FT_IMPL", "rallypoint.ft")
torchft = importlib.import_module(IMPL)
local_sgd = importlib.import_module(f"{IMPL}.local_sgd")
OUT, STEPS = sys.argv[1], int(sys.argv[2])
GROUP = int(os.environ["REPLICA_GROUP_ID"])
FRAGMENTS = int(os.environ.get("FT_FRAGMENTS", "1"))
SYNC_EVERY = int(os.environ.get("FT_SYNC_EVERY", "4"))
DELAY = int(os.environ.get("FT_DELAY", "1"))
kill_group, _, kill_step = os.environ.get("FT_KILL", "-1:-1").partition(":")
FIRST = not os.path.exists(os.path.join(OUT, f"started-{GROUP}"))
open(os.path.join(OUT, f"started-{GROUP}"), "a").close()
hold_step, _, hold_group = os.environ.get("FT_HOLD", "-1:-1").partition(":")
together = int(os.environ.get("FT_TOGETHER", "0"))

torch.manual_seed(GROUP)  # different on purpose: the first quorum's heal makes them equal
layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(FRAGMENTS)]
model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 4))
fragments = [*layers[:-1], torch.nn.Sequential(layers[-1], model[-1])]
inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]


def load_state_dict(state):
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["inner"])


def state_dict():
    return {"model": model.state_dict(), "inner": inner.state_dict()}


manager = torchft.Manager(
    pg=torchft.ProcessGroupGloo(timeout=timedelta(seconds=10)),
    min_replica_size=1,
    load_state_dict=load_state_dict,
    state_dict=state_dict,
    replica_id=f"{GROUP}",
    use_async_quorum=False,
    timeout=timedelta(seconds=10),
)
diloco = local_sgd.DiLoCo(
    manager, fragments, inner, outers, sync_every=SYNC_EVERY, fragment_sync_delay=DELAY
)
if not FIRST:  # it asks for its first quorum a few inner steps from now
    open(os.path.join(OUT, f"restarted-{GROUP}"), "a").close()
open(os.path.join(OUT, f"ready-{GROUP}"), "a").close()  # its manager said hello
deadline = time.monotonic() + 120
while FIRST and not all(os.path.exists(os.path.join(OUT, f"ready-{g}")) for g in range(together)):
    assert time.monotonic() < deadline, "the other groups never made their managers"
    time.sleep(0.05)
inner_step = 0
with diloco, open(os.path.join(OUT, f"steps-{GROUP}"), "a", buffering=1) as log:
    while manager.current_step() < STEPS:
        step = manager.current_step()
        g = torch.Generator().manual_seed(100_000 * GROUP + inner_step)
        inner_step += 1
        inner.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        inner.step()  # every SYNC_EVERY / FRAGMENTS steps, DiLoCo syncs a fragment here
        now = manager.current_step()
        if now > step:
            log.write(f"{time.time()!r} {now} {manager.num_participants()} {os.getpid()}\n")
        mid_sync = diloco._local_step == SYNC_EVERY // FRAGMENTS - DELAY  # quorum asked, sent
        if FIRST and str(GROUP) == kill_group and now >= int(kill_step) and mid_sync:
            open(os.path.join(OUT, f"killed-{GROUP}"), "a").close()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.03)
        killed = os.path.exists(os.path.join(OUT, f"killed-{hold_group}"))
        if int(hold_step) >= 0 and now >= int(hold_step) and killed:
            hold_step = "-1"
            deadline = time.monotonic() + 120
            while not os.path.exists(os.path.join(OUT, f"restarted-{hold_group}")):
                assert time.monotonic() < deadline, f"group {hold_group} never came back"
                time.sleep(0.05)
torch.save(model.state_dict(), f"{OUT}/final-{GROUP}.pt")
manager.shutdown()
