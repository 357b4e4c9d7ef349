"""The worker of ``test_agent_peer_loss_wait``: a ``@rallypoint.restartable`` function
that all-reduces on gloo, and on the first attempt of a full world (2 nodes of 2 ranks)
lets a peer vanish under the others' collective.

argv: OUT MODE.

- ``node``: rank 1 writes ``OUT/at-fault`` (its pid) and sleeps instead of joining the
  next all-reduce: the test wipes its node out (agent and workers, SIGKILL), and every
  other rank's all-reduce fails with gloo's "Connection closed by peer".
- ``reset``: every rank writes ``OUT/raised-<rank>`` (``time.time()``) and raises gloo's
  "Connection reset by peer", as a network fault that resets every connection between
  the ranks does: no process dies, no node is lost, and nobody decides on the others'
  behalf.

A later entry into the function (after the restart) does one all-reduce and returns.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import rallypoint

OUT, MODE = sys.argv[1], sys.argv[2]
RESET = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer"


def train() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(1)
    dist.all_reduce(t)
    again = os.path.exists(os.path.join(OUT, "at-fault")) or any(
        name.startswith("raised-") for name in os.listdir(OUT)
    )
    if not again and world == int(os.environ["LOCAL_WORLD_SIZE"]):
        while True:  # the other node came late (a loaded machine): wait here until it joins
            time.sleep(0.05)  # and the round is interrupted (a membership change)
    if not again and MODE == "node" and rank == 1:
        with open(os.path.join(OUT, "at-fault.tmp"), "w") as fp:
            fp.write(str(os.getpid()))
        os.replace(os.path.join(OUT, "at-fault.tmp"), os.path.join(OUT, "at-fault"))
        while True:  # never joins the next all-reduce: the test wipes its node out
            time.sleep(1)
    if not again and MODE == "reset":
        dist.barrier()  # every rank raises within the same moment
        with open(os.path.join(OUT, f"raised-{rank}"), "w") as fp:
            fp.write(repr(time.time()))
        raise RuntimeError(RESET)
    dist.all_reduce(t)
    dist.destroy_process_group()


rallypoint.restartable(train)()
