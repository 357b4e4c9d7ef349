"""Demo: a small model trained with DDP on CPU (gloo), checkpointed every epoch.

Run it with rallypoint (or torchrun: the script only reads the standard environment)::

    rallypoint run --nproc-per-node 4 examples/train.py
    rallypoint run --nproc-per-node 4 --max-restarts 1 examples/train.py --fresh --crash-at-epoch 3
    rallypoint run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        --rdzv-id demo --max-restarts 2 --hang-timeout 60 examples/train.py   # on every node

Each step calls ``rallypoint.progress()``, so ``--hang-timeout`` notices a stuck step.

The data are synthetic and deterministic (a fixed random teacher network labels fixed random
inputs), so every run computes the same losses. Rank 0 writes a checkpoint after every
epoch (atomically) and, when the script starts again (a restart after a crash, or a second
run), every rank resumes from the last checkpoint; a finished run starts over.
``--crash-at-epoch N`` makes rank 1 die in epoch N of the first attempt to show a restart
resuming from that checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

try:  # rallypoint's hang detection (--hang-timeout); a no-op outside rallypoint
    from rallypoint import progress
except ImportError:  # run by torchrun without rallypoint installed

    def progress() -> None:
        pass


def make_data(n: int = 8192, dim: int = 32) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=gen)
    teacher = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        y = teacher(x)
        y = (y - y.mean()) / y.std() + 0.05 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y)


def make_model(dim: int = 32) -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(dim, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default="./checkpoints/demo")
    parser.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    parser.add_argument("--crash-at-epoch", type=int, default=-1, help="rank 1 dies once here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ckpt_dir = Path(args.checkpoint_dir)
    ckpt = ckpt_dir / "last.pt"

    model = make_model()
    ddp = DistributedDataParallel(model)
    optim = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    start_epoch = 0
    state = torch.load(ckpt, map_location="cpu") if ckpt.exists() else None
    if state is not None and restart == 0 and (args.fresh or state["epoch"] + 1 >= args.epochs):
        if rank == 0:
            why = "--fresh" if args.fresh else f"{ckpt} already has all {args.epochs} epochs"
            print(f"{why}: training from scratch")
        state = None
    if state is not None:
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        start_epoch = state["epoch"] + 1
        if rank == 0:
            print(f"resuming from {ckpt} after epoch {state['epoch']} (restart {restart})")

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    loss_fn = nn.MSELoss()
    for epoch in range(start_epoch, args.epochs):
        started = time.perf_counter()
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for step, (x, y) in enumerate(loader):
            if epoch == args.crash_at_epoch and restart == 0 and rank == 1 and step == 5:
                print(f"rank 1: simulated crash in epoch {epoch}", flush=True)
                os._exit(1)
            progress()
            optim.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            optim.step()
            total += torch.tensor([loss.item() * len(x), len(x)])
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"epoch {epoch:2d}  loss {total[0].item() / total[1].item():.5f}  "
                f"({time.perf_counter() - started:.2f} s)",
                flush=True,
            )
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save(
                {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": epoch}, tmp
            )
            os.replace(tmp, ckpt)
        dist.barrier()
    # Free DDP's reducer while the group is still registered, so that the group is torn
    # down by destroy_process_group() (which lets gloo's threads finish) and not by a
    # destructor that joins them while holding the GIL (a known torch shutdown hang).
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
