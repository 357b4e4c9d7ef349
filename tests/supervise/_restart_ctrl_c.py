"""A Ctrl-C's script (``test_inprocess_ctrl_c.py``): four ranks of ``@rallypoint.restartable``
gloo steps, each process with a SIGINT handler of its own.

argv: OUT PHASE HANDLER. The handler writes ``OUT/handler-<rank>-<pid>``, then (HANDLER
``raise``) raises ``KeyboardInterrupt`` or (``linger``) sleeps 60 s, a save that never
ends. PHASE ``steady``: the ranks step until stopped; rank 0 writes ``OUT/steady`` after
five steps. PHASE ``restart``: on the first attempt rank 1 SIGKILLs itself after ten steps;
its replacement's set-up writes ``OUT/slow-setup`` and sleeps 60 s, while the kept ranks
wait for it in ``init_process_group``.
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import rallypoint

OUT, PHASE, HANDLER = sys.argv[1], sys.argv[2], sys.argv[3]


def _on_sigint(signum: int, frame: object) -> None:
    open(os.path.join(OUT, f"handler-{os.environ['RANK']}-{os.getpid()}"), "w").close()
    if HANDLER == "linger":
        time.sleep(60)
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, _on_sigint)
if PHASE == "restart" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "1":
    open(os.path.join(OUT, "slow-setup"), "w").close()
    time.sleep(60)


@rallypoint.restartable
def train() -> None:
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(1 << 14)
    for step in range(1_000_000):
        dist.all_reduce(t)
        if step == 5 and rank == 0:
            open(os.path.join(OUT, "steady"), "w").close()
        if PHASE == "restart" and restart == 0 and rank == 1 and step == 10:
            os.kill(os.getpid(), signal.SIGKILL)


train()
