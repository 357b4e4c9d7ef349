"""A model-parallel RNN trained with distributed autograd: a torch RPC program, import changed.

The skeleton of pytorch/examples ``distributed/rpc/rnn`` (embedding and decoder on the
parameter server, an LSTM on the trainer), with deterministic weights and data so that
every run gives the same numbers. The lines between the two ``imports`` markers are the
only ones that differ from torch's program (:data:`TORCH_IMPORTS`), and
:func:`torch_version` writes that program out, so that a test can run both and compare.
``run_program(backend)`` runs in every worker and returns plain lists that compare
exactly with ``==``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn, optim

# ---- imports (the only lines a torch program changes) ----
from rallypoint import rpc
from rallypoint.rpc import RRef, dist_autograd
from rallypoint.rpc.optim import DistributedOptimizer

# ---- end of imports ----

TORCH_IMPORTS = """\
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer
from torch.distributed.rpc import RRef
"""

NTOKEN, NINP, NHID, NLAYERS = 10, 4, 6, 2
SEQ, BATCH, STEPS = 5, 3, 4


def _call_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method: Any, rref: Any, *args: Any, **kwargs: Any) -> Any:
    args = (method, rref, *args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


def _parameter_rrefs(module: nn.Module) -> list[Any]:
    return [RRef(param) for param in module.parameters()]


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken: int, ninp: int) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        with torch.no_grad():
            self.encoder.weight.normal_(generator=torch.Generator().manual_seed(1))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.encoder(input)
        return out


class Decoder(nn.Module):
    def __init__(self, ntoken: int, nhid: int) -> None:
        super().__init__()
        self.decoder = nn.Linear(nhid, ntoken)
        with torch.no_grad():
            self.decoder.weight.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(2))
            self.decoder.bias.zero_()

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(output)
        return out


class RNNModel(nn.Module):
    def __init__(self, ps: str, ntoken: int, ninp: int, nhid: int, nlayers: int) -> None:
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp))
        torch.manual_seed(3)
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid))

    def forward(
        self, input: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self) -> list[Any]:
        remote_params = []
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        remote_params.extend(_parameter_rrefs(self.rnn))
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params


def _batches() -> Any:
    generator = torch.Generator().manual_seed(4)
    for _ in range(STEPS):
        data = torch.randint(NTOKEN, (SEQ, BATCH), generator=generator)
        target = torch.randint(NTOKEN, (SEQ * BATCH,), generator=generator)
        yield data, target


def _train() -> dict[str, Any]:
    model = RNNModel("ps", NTOKEN, NINP, NHID, NLAYERS)
    opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.5)
    criterion = nn.CrossEntropyLoss()
    hidden = (torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID))
    losses: list[float] = []
    first_grads: list[Any] = []
    for data, target in _batches():
        with dist_autograd.context() as context_id:
            hidden[0].detach_()
            hidden[1].detach_()
            output, hidden = model(data, hidden)
            loss = criterion(output.view(-1, NTOKEN), target)
            dist_autograd.backward(context_id, [loss])
            if not first_grads:
                grads = dist_autograd.get_gradients(context_id)
                first_grads = [grads[p].tolist() for p in model.rnn.parameters()]
            opt.step(context_id)
            losses.append(loss.item())
    params = [rref.to_here().tolist() for rref in model.parameter_rrefs()]
    return {"losses": losses, "first_grads": first_grads, "params": params}


def run_program(backend: str) -> dict[str, Any] | None:
    """One worker of the program (rank 0: trainer, rank 1: ps) on ``backend``."""
    rank = int(os.environ["RANK"])
    name = "trainer" if rank == 0 else "ps"
    rpc.init_rpc(name, backend=rpc.BackendType[backend], rank=rank, world_size=2)
    out = _train() if rank == 0 else None
    rpc.shutdown()
    return out


def torch_version(directory: Path, module_name: str = "torch_rnn_program") -> Path:
    """Write this program with torch's imports (and nothing else changed) into ``directory``."""
    from rallypoint.testing._rpc import _torch_program

    return _torch_program.torch_version(__file__, TORCH_IMPORTS, directory, module_name)
