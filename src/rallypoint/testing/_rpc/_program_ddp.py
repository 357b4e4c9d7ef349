"""DDP and RPC in one model, trained with distributed autograd: a torch program, imports changed.

Our CPU version of pytorch/examples ``distributed/rpc/ddp_rpc``: a ``RemoteModule``
embedding on the parameter server, a ``DistributedDataParallel`` linear on two trainers
over gloo, a distributed backward and a ``DistributedOptimizer`` step. Changed from the
example so that every run gives the same numbers: seeded weights and data, fewer steps, a
file rendezvous, and the trainers take turns at the optimizer step. The lines between the
two ``imports`` markers are the only ones that differ from torch's program
(:data:`TORCH_IMPORTS`); :func:`torch_version` writes that program out.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

# ---- imports (the only lines a torch program changes) ----
from rallypoint import rpc
from rallypoint.rpc import RRef, dist_autograd
from rallypoint.rpc.nn import RemoteModule
from rallypoint.rpc.optim import DistributedOptimizer

# ---- end of imports ----

TORCH_IMPORTS = """\
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
"""

NUM_EMBEDDINGS, EMBEDDING_DIM, CLASSES = 100, 16, 8
TRAINERS, WORLD_SIZE = 2, 4  # ranks 0 and 1 train, 2 is the master, 3 the ps
EPOCHS, BATCHES = 2, 3


class HybridModel(nn.Module):
    """A remote embedding table (sparse part) and a local DDP linear (dense part)."""

    def __init__(self, remote_emb_module: Any, rank: int) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, CLASSES))
        self.rank = rank

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        emb_lookup = self.remote_emb_module.forward(indices, offsets)
        out: torch.Tensor = self.fc(emb_lookup)
        return out


def _batches(rank: int, epoch: int) -> Any:
    rng = random.Random(100 * epoch + rank)
    generator = torch.Generator().manual_seed(100 * epoch + rank)
    for _ in range(BATCHES):
        num_indices = rng.randint(20, 50)
        indices = torch.randint(NUM_EMBEDDINGS, (num_indices,), generator=generator)
        offsets = []
        start = 0
        while start < num_indices:
            offsets.append(start)
            start += rng.randint(1, 10)
        target = torch.randint(CLASSES, (len(offsets),), generator=generator)
        yield indices, torch.tensor(offsets), target


def _run_trainer(remote_emb_module: Any, rank: int) -> dict[str, Any]:
    torch.manual_seed(10 + rank)  # DDP starts every replica from rank 0's weights
    model = HybridModel(remote_emb_module, rank)
    model_parameter_rrefs = model.remote_emb_module.remote_parameters()
    for param in model.fc.parameters():
        model_parameter_rrefs.append(RRef(param))
    opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)
    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    first_grads: list[Any] = []
    for epoch in range(EPOCHS):
        for indices, offsets, target in _batches(rank, epoch):
            with dist_autograd.context() as context_id:
                output = model(indices, offsets)
                loss = criterion(output, target)
                dist_autograd.backward(context_id, [loss])
                if not first_grads:
                    grads = dist_autograd.get_gradients(context_id)
                    first_grads = [grads[p].tolist() for p in model.fc.parameters()]
                for turn in range(TRAINERS):
                    if turn == rank:
                        opt.step(context_id)
                    dist.barrier()
            losses.append(loss.item())
    return {
        "losses": losses,
        "first_fc_grads": first_grads,
        "fc": [p.tolist() for p in model.fc.parameters()],
        "fc_grad_is_none": [p.grad is None for p in model.fc.parameters()],
    }


def _master() -> dict[str, Any]:
    remote_emb_module = RemoteModule(
        "ps",
        nn.EmbeddingBag,
        args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
        kwargs={"mode": "sum"},
    )
    futs = [
        rpc.rpc_async(f"trainer{rank}", _run_trainer, args=(remote_emb_module, rank))
        for rank in range(TRAINERS)
    ]
    trainers = [fut.wait() for fut in futs]
    (table,) = [rref.to_here().tolist() for rref in remote_emb_module.remote_parameters()]
    return {"trainers": trainers, "embedding": table}


def run_program(backend: str) -> dict[str, Any] | None:
    """One worker of the program on ``backend``; the master returns the results."""
    rank = int(os.environ["RANK"])
    torch.manual_seed(rank)
    kind = rpc.BackendType[backend]
    out = None
    if rank == 2:
        rpc.init_rpc("master", backend=kind, rank=rank, world_size=WORLD_SIZE)
        out = _master()
    elif rank < TRAINERS:
        store = Path(tempfile.gettempdir()) / f"ddp_rpc_{os.getppid()}_{os.environ['MASTER_PORT']}"
        dist.init_process_group("gloo", rank=rank, world_size=TRAINERS, init_method=store.as_uri())
        rpc.init_rpc(f"trainer{rank}", backend=kind, rank=rank, world_size=WORLD_SIZE)
    else:
        rpc.init_rpc("ps", backend=kind, rank=rank, world_size=WORLD_SIZE)
    rpc.shutdown()
    if rank < TRAINERS:
        dist.destroy_process_group()
    return out


def assert_same_training(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The master's results of two runs agree (up to float rounding)."""

    def close(got: Any, expected: Any) -> None:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))

    close(ours["embedding"], theirs["embedding"])
    for mine, other in zip(ours["trainers"], theirs["trainers"], strict=True):
        close(mine["losses"], other["losses"])
        for key in ("first_fc_grads", "fc"):
            for got, expected in zip(mine[key], other[key], strict=True):
                close(got, expected)
        assert mine["fc_grad_is_none"] == other["fc_grad_is_none"] == [True, True]


def torch_version(directory: Path, module_name: str = "torch_ddp_rpc_program") -> Path:
    """Write this program with torch's imports (and nothing else changed) into ``directory``."""
    from rallypoint.testing._rpc import _torch_program

    return _torch_program.torch_version(__file__, TORCH_IMPORTS, directory, module_name)
