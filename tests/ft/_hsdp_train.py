"""An HSDP program shaped like torchtitan's torchft integration: FSDP2 shards the model
inside a replica group (gloo on CPU), and ``ManagedProcessGroup`` averages across groups.

As torchtitan's ``components/ft/manager.py``: ``ProcessGroupGloo(timeout=...)``,
``Manager(..., use_async_quorum=True, load_state_dict=None, state_dict=None)`` and then
``register_state_dict_fn``, ``ManagedProcessGroup(manager)`` registered as
``"dp_replicate"``, and each FSDP module's all-reduce hook
``dist.all_reduce(output, group=replicate_pg, op=ReduceOp.AVG)``; and its state functions:
DCP's model and flat optimizer state dicts, each read once and kept (torchtitan's
``ModelWrapper`` and ``FTOptimizersContainer``). A heal sends each rank's DTensor shards.

argv: OUT STEPS. Environment: REPLICA_GROUP_ID, TORCHFT_LIGHTHOUSE, RANK/WORLD_SIZE (from
``rallypoint run --nproc-per-node 2``), FT_IMPL (``torchft`` to run torchft itself),
FT_KILL ("GROUP:RANK:STEP": that rank of that group's first processes SIGKILLs itself
after that step), FT_STEP_SLEEP (seconds, 0.05), FT_TOGETHER (N: wait until groups
0..N-1 have started), FT_HOLD ("STEP:GROUP": the other groups' first processes, once past
that step, wait until a restarted process of that group is about to ask for its first
quorum: it then heals while they still train, however slowly a loaded machine restarts
it). Rank 0 appends ``time step participants pid`` to OUT/steps-<group> for every
committed step; the end gathers the full state dict to OUT/final-<group>.pt.
"""

import importlib
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.distributed_c10d import ReduceOp
from torch.distributed.fsdp import FSDPModule, fully_shard

ft = importlib.import_module(os.environ.get("FT_IMPL", "rallypoint.ft"))
ft_process_group = importlib.import_module(f"{ft.__name__}.process_group")
OUT, STEPS = sys.argv[1], int(sys.argv[2])
GROUP, RANK = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
SLEEP = float(os.environ.get("FT_STEP_SLEEP", "0.05"))
kill_group, kill_rank, kill_step = os.environ.get("FT_KILL", "-1:-1:-1").split(":")
marker = os.path.join(OUT, f"started-{GROUP}-{RANK}")
FIRST = not os.path.exists(marker)
open(marker, "a").close()
hold_step, _, hold_group = os.environ.get("FT_HOLD", "-1:-1").partition(":")
together = int(os.environ.get("FT_TOGETHER", "0"))
deadline = time.monotonic() + 120
while FIRST and not all(
    os.path.exists(os.path.join(OUT, f"started-{g}-0")) for g in range(together)
):
    assert time.monotonic() < deadline, "the other groups never started"
    time.sleep(0.05)

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
torch.manual_seed(GROUP)  # different on purpose: the first quorum's heal makes them equal
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
inner = torch.optim.Adam(model.parameters(), lr=1e-3)


class ModelWrapper:
    """torchtitan's (``components/checkpoint.py``): DCP's model state dict read once and
    kept (its tensors are the parameters' own), read again after a load."""

    def __init__(self, model):
        self.model = model
        self.cache_state_dict = get_model_state_dict(model)

    def state_dict(self):
        return self.cache_state_dict

    def load_state_dict(self, state):
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=False))
        self.cache_state_dict = get_model_state_dict(self.model)


class FTOptimizersContainer:
    """torchtitan's (``components/optimizer.py``): the optimizer's state made at once (so
    that DCP never steps it to make it), its flat DCP state dict kept, and kept again after
    a load."""

    FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        get_optimizer_state_dict(model, optimizer)
        self.cache_state_dict = {}

    def init_cache_state_dict(self):
        self.cache_state_dict = get_optimizer_state_dict(
            self.model, self.optimizer, options=self.FLAT
        )

    def state_dict(self):
        return self.cache_state_dict

    def load_state_dict(self, state):
        self.cache_state_dict = {}
        set_optimizer_state_dict(self.model, self.optimizer, state, options=self.FLAT)
        self.init_cache_state_dict()


wrapper, container = ModelWrapper(model), FTOptimizersContainer(model, inner)
container.init_cache_state_dict()


def state_dict():
    return {"model": wrapper.state_dict(), "optimizer": container.state_dict()}


def load_state_dict(state):
    wrapper.load_state_dict(state["model"])
    container.load_state_dict(state["optimizer"])


manager = ft.Manager(
    pg=ft.ProcessGroupGloo(timeout=timedelta(seconds=10)),
    min_replica_size=1,
    load_state_dict=None,
    state_dict=None,
    use_async_quorum=True,
    replica_id=f"{GROUP}",
    timeout=timedelta(seconds=10),
)
manager.register_state_dict_fn("train", load_state_dict, state_dict)
replicate_pg = ft_process_group.ManagedProcessGroup(manager)
replicate_pg.register("dp_replicate")


def all_reduce_hook(output):
    dist.all_reduce(output, group=replicate_pg, op=ReduceOp.AVG)


for module in model.modules():
    if isinstance(module, FSDPModule):
        module.set_all_reduce_hook(all_reduce_hook)
optimizer = ft.Optimizer(manager, inner)
if not FIRST:  # about to ask for its first quorum (FT_HOLD)
    open(os.path.join(OUT, f"back-{GROUP}-{RANK}"), "a").close()
with open(os.path.join(OUT, f"steps-{GROUP}"), "a", buffering=1) as log:
    while manager.current_step() < STEPS:
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * step + 10 * GROUP + RANK)
        optimizer.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        optimizer.step()
        now = manager.current_step()
        if now > step and RANK == 0:
            log.write(f"{time.time()!r} {now} {manager.num_participants()} {os.getpid()}\n")
        if FIRST and (kill_group, kill_rank) == (str(GROUP), str(RANK)) and now >= int(kill_step):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(SLEEP)
        if FIRST and hold_group != str(GROUP) and 0 <= int(hold_step) <= now:
            hold_step, deadline = "-1", time.monotonic() + 120
            while not os.path.exists(os.path.join(OUT, f"back-{hold_group}-0")):
                assert time.monotonic() < deadline, f"group {hold_group} never came back"
                time.sleep(0.05)
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if RANK == 0:
    torch.save(full, os.path.join(OUT, f"final-{GROUP}.pt"))
manager.shutdown()
dist.destroy_process_group()
