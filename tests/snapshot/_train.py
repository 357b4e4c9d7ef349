"""The training script of the snapshot tests: data-parallel Adam on a tiny model, gloo,
fixed seeds, a snapshot every step (``rallypoint.snapshot``).

argv: OUT MODE STEPS. MODE says how this run is interrupted at step 37:

- ``none``: it is not;
- ``crash``: rank 1 is SIGKILLed (first attempt only);
- ``node``: the last rank writes its pid to ``OUT/at37`` and sleeps, so the test kills its
  node (with ``SNAPSHOT_TEST_HOST`` set, the last local rank of a host other than ``h0``,
  which hosts the rendezvous store: ranks follow the nodes' arrival order);
- ``savecrash``: rank 1 dies in the middle of the save of step 37 (after staging, before
  the commit) on the first attempt;
- ``grow``: a world of one rank trains until the job grows (scale-up);
- ``fill``: rank 0 fills the file system of ``--snapshot-dir`` after step 18 (a file at
  ``SNAPSHOT_TEST_FILL``) and empties it again after step 33;
- ``readonly``: rank 0 remounts ``SNAPSHOT_TEST_MOUNT`` read-only after step 18;
- ``hold``: after the checkpoint of step 4 is written, rank 0 writes ``OUT/held`` and every
  rank waits for ``OUT/go`` (a job kept live while the test starts others).

Every worker writes ``OUT/start-<rank>-<pid>`` (the step it resumed at, the number of steps
its restored state had seen, the world size); rank 0 writes the parameters it restored
(``OUT/restored-<step>-<world>.pt``) and the final ones (``OUT/final.pt``).
"""

import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from rallypoint import snapshot


def _marks_the_node(rank: int, world: int) -> bool:
    host = os.environ.get("SNAPSHOT_TEST_HOST")
    if host is None:
        return rank == world - 1
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    return host != "h0" and local_rank == local_world - 1


def _fill(path: str) -> None:
    """Write ``path`` until its file system is full."""
    with open(path, "wb") as fp:
        try:
            while True:
                fp.write(b"\0" * (1 << 16))
                fp.flush()
        except OSError:
            pass


def _disk_trouble(mode: str, rank: int, step: int) -> None:
    if rank != 0 or mode not in ("fill", "readonly"):
        return
    if step == 18:
        snapshot.wait()  # step 15's checkpoint is complete; from step 20 on, writes fail
        if mode == "fill":
            _fill(os.environ["SNAPSHOT_TEST_FILL"])
        else:
            mount = os.environ["SNAPSHOT_TEST_MOUNT"]
            done = subprocess.run(["mount", "-o", "remount,ro", mount], capture_output=True)
            assert done.returncode == 0, done.stderr
    if step == 33 and mode == "fill":
        os.unlink(os.environ["SNAPSHOT_TEST_FILL"])


def _hold(out: str, rank: int) -> None:
    snapshot.wait()  # step 4's checkpoint is complete
    if rank == 0:
        with open(os.path.join(out, "held"), "w"):
            pass
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.05)


def train(out: str, mode: str, steps: int) -> None:
    """One worker of the job: ``steps`` steps from the newest snapshot, interrupted as
    ``mode`` says."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": model, "optimizer": opt, "progress": {"losses": []}}
    start = snapshot.restore(state) or 0
    with open(os.path.join(out, f"start-{rank}-{os.getpid()}"), "w") as fp:
        fp.write(f"{start} {len(state['progress']['losses'])} {world}")
    if rank == 0 and start:
        torch.save(dict(model.state_dict()), os.path.join(out, f"restored-{start}-{world}.pt"))

    if mode == "savecrash" and rank == 1 and first:
        from rallypoint._snapshot import _node

        stage = _node._copy

        def dying_copy(sources, targets):  # staged, then killed before the commit is sent
            stage(sources, targets)
            if state["progress"]["losses"] and len(state["progress"]["losses"]) == 37:
                os.kill(os.getpid(), signal.SIGKILL)

        _node._copy = dying_copy

    if mode == "grow" and world == 1:
        steps = 10**9  # alone: train until a second node joins (the agent restarts us then)
    for step in range(start, steps):
        if mode == "grow" and world == 1:
            time.sleep(0.02)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 8, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        state["progress"]["losses"].append(loss.item())
        snapshot.save(state, step=step + 1)
        _disk_trouble(mode, rank, step + 1)
        if mode == "hold" and step + 1 == 4:
            _hold(out, rank)
        if step + 1 == 37 and mode == "crash" and rank == 1 and first:
            snapshot.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        if step + 1 == 37 and mode == "node" and _marks_the_node(rank, world):
            marker = os.path.join(out, "at37")
            if not os.path.exists(marker):
                snapshot.wait()
                with open(marker + ".tmp", "w") as fp:
                    fp.write(str(os.getpid()))
                os.replace(marker + ".tmp", marker)
                time.sleep(600)
    snapshot.wait()
    if rank == 0:
        final = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(final, os.path.join(out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2], int(sys.argv[3]))
