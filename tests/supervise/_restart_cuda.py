"""The GPU training script of the in-process restart tests (run where a GPU is lent).

argv: OUT PARAMS STEPS [spare]. Every rank holds a model of about PARAMS parameters and Adam on
``cuda:0`` (ranks share the GPU), built once per process above the restartable function.
Inside it: a gloo world group (ranks share one GPU, which NCCL refuses) for a small
all_reduce per step, and an NCCL group of this rank alone, used every step, so that a kept
process must abort and re-create NCCL communicators (without it under the environment's
``RESTART_CUDA_NCCL=0``). On the first attempt rank 1 writes
``OUT/fault`` (the time) and SIGKILLs itself after step 5 (with ``spare``: once a spare
worker, run with ``--spare-workers 1``, has written ``OUT/spare-ready-<pid>``).

Every entry into the function writes ``OUT/enter-<restart>-<rank>``: ``pid data_ptr``
(of the model's first parameter: the same in a kept process, the model never rebuilt);
the first step finished after an entry writes ``OUT/step-<restart>-<rank>`` (the time).
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import rallypoint

OUT, PARAMS, STEPS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
SPARE = sys.argv[4:] == ["spare"]
NCCL = os.environ.get("RESTART_CUDA_NCCL", "1") == "1"

torch.cuda.set_device(0)
width = max(1, int((PARAMS / 4) ** 0.5))
model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
torch.cuda.synchronize()
if "RANK" not in os.environ:  # a spare worker (--spare-workers): its set-up is done
    open(os.path.join(OUT, f"spare-ready-{os.getpid()}"), "w").close()


@rallypoint.restartable
def train() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if NCCL:
        groups = [dist.new_group([r], backend="nccl") for r in range(dist.get_world_size())]
        alone = groups[rank]  # every rank makes every group, in the same order
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    ptr = next(model.parameters()).data_ptr()
    with open(os.path.join(OUT, f"enter-{restart}-{rank}"), "w") as fp:
        fp.write(f"{os.getpid()} {ptr}")
    x = torch.randn(64, width, device="cuda")
    for step in range(STEPS):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if NCCL:
            dist.all_reduce(loss.detach().clone(), group=alone)
        dist.all_reduce(loss.detach().cpu())  # gloo, the whole world
        torch.cuda.synchronize()
        if step == 0:
            with open(os.path.join(OUT, f"step-{restart}-{rank}"), "w") as fp:
                fp.write(str(time.time()))
        if step == 5 and rank == 1 and restart == 0:
            while SPARE and not any(n.startswith("spare-ready-") for n in os.listdir(OUT)):
                time.sleep(0.01)  # the fault once the spare's set-up is done
            with open(os.path.join(OUT, "fault"), "w") as fp:
                fp.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()


train()
