"""A restartable training script with rallypoint.snapshot (see docs/snapshot.md).

    rallypoint run --nproc-per-node 2 --max-restarts 1 examples/snapshot_train.py --crash-at 37
    rallypoint run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint node0:29400 --rdzv-id job1 --snapshot-dir /shared/ck \
        examples/snapshot_train.py

Every step is a function of (step, rank): the data of step ``s`` comes from a
``DistributedSampler`` epoch and a position computed from ``s``, so a restart that restores
the model, the optimizer, the LR schedule and the step continues exactly where the last
snapshot was taken: the final model is bit-for-bit the one of an uninterrupted run.
``--crash-at STEP`` kills rank 1 once, at that step, to watch a restart.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, TensorDataset

import rallypoint
from rallypoint import snapshot


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument("--out", default=None, help="rank 0 saves the final model here")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same data and initial model on every rank, every attempt
    data = TensorDataset(torch.randn(4096, 16), torch.randint(0, 4, (4096,)))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    batches = len(sampler) // args.batch_size
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)

    # everything that changes during training; restore() loads it in place
    state = {"model": model, "optimizer": optimizer, "schedule": schedule}
    start = snapshot.restore(state) or 0  # the newest step every rank has, or a fresh start
    if rank == 0:
        print(f"starting at step {start} (restart {os.environ['TORCHELASTIC_RESTART_COUNT']})")

    indices: list[int] = []
    for step in range(start, args.steps):
        epoch, position = divmod(step, batches)
        if position == 0 or not indices:  # this epoch's order, whatever step we start at
            sampler.set_epoch(epoch)
            indices = list(sampler)
        batch = indices[position * args.batch_size : (position + 1) * args.batch_size]
        x, y = data[batch]
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        rallypoint.progress()  # for --hang-timeout; a no-op otherwise
        snapshot.save(state, step=step + 1)  # returns once staged; the rest overlaps the next step
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")
        first_attempt = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        if step + 1 == args.crash_at and rank == 1 and first_attempt:
            snapshot.wait()  # (only so that the demo crash comes after a complete snapshot)
            os.kill(os.getpid(), signal.SIGKILL)

    snapshot.wait()
    if rank == 0 and args.out:
        torch.save(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
