"""Patterns of real ``torch.distributed.rpc`` programs, part of the RPC contract.

Each pattern is the skeleton of a public example program (pytorch/examples
``distributed/rpc``) with the heavy parts (gym, torchvision) replaced by small
deterministic stand-ins, so that every backend must give the same results:
``observer_agent`` (RRef-heavy RL agent and observers), ``parameter_server`` (trainers
waiting in ``shutdown()`` longer than the RPC timeout), ``process_group_and_rpc`` (both on
one ``MASTER_PORT``), ``model_parallel_rnn`` and ``ddp_rpc`` (torch programs with only their
imports changed: ``_program_rnn``, ``_program_ddp``) and ``pipeline`` (micro-batches in
flight across two shards held in RRefs; :func:`pipeline_reference` trains the same model in
one process). :func:`run_rpc_pattern` runs one of them.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc.functions import async_execution
from rallypoint.testing._rpc._program_ddp import run_program as _ddp_rpc
from rallypoint.testing._rpc._program_rnn import run_program as _model_parallel_rnn
from rallypoint.testing._workers import run_reference_workers, run_workers

BIND_ERRORS = ("failed to bind", "EADDRINUSE", "address already in use")
_OBSERVERS = 4
_STEPS = 12
_EPISODES = 3
_PS_RPC_TIMEOUT = 3.0
_PS_TRAIN_SECONDS = 5.0
"""The master trains this long after its init_rpc returned: the trainers, in shutdown()
from their own init_rpc on (which may return up to a second or two later on a busy host),
are still called for longer than the RPC timeout."""
_SERVED: list[float] = []  # when this trainer finished each training round (monotonic)


def _init(backend: str, name: str, rank: int, world_size: int, rpc_timeout: float) -> None:
    from rallypoint import rpc

    kind = rpc.BackendType[backend]
    opts = rpc.construct_rpc_backend_options(kind, rpc_timeout=rpc_timeout)
    rpc.init_rpc(name, backend=kind, rank=rank, world_size=world_size, rpc_backend_options=opts)


# ---- observer / agent ------------------------------------------------------------------
class _Observer:
    """A tiny deterministic environment: the reward is 1 when the action is the parity."""

    def __init__(self, ob_id: int) -> None:
        self.id = ob_id

    def run_episode(self, agent_rref: Any, batch: bool) -> list[float]:
        from rallypoint import rpc

        select = _Agent.select_action_batch if batch else _Agent.select_action
        rewards = []
        for step in range(_STEPS):
            state = torch.tensor([[float(self.id), float(step), step % 3 - 1.0, 0.5]])
            action = rpc.rpc_sync(agent_rref.owner(), select, args=(agent_rref, self.id, state))
            rewards.append(1.0 if action == (step + self.id) % 2 else 0.0)
        return rewards


class _Agent:
    def __init__(self) -> None:
        from rallypoint import rpc

        torch.manual_seed(0)
        self.agent_rref = rpc.RRef(self)
        self.ob_rrefs = [
            rpc.remote(f"observer{r}", _Observer, args=(r - 1,)) for r in range(1, _OBSERVERS + 1)
        ]
        self.policy = torch.nn.Linear(4, 2)
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=0.05)
        self.lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.states = torch.zeros(_OBSERVERS, 4)
        self.pending = _OBSERVERS
        self.future_actions: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self.log_probs: dict[int, list[torch.Tensor]] = {i: [] for i in range(_OBSERVERS)}

    @staticmethod
    @async_execution
    def select_action_batch(agent_rref: Any, ob_id: int, state: torch.Tensor) -> Any:
        self: _Agent = agent_rref.local_value()
        self.states[ob_id].copy_(state[0])
        future = self.future_actions.then(lambda fut: int(fut.wait()[ob_id].item()))
        with self.lock:
            self.pending -= 1
            if self.pending == 0:
                self.pending = _OBSERVERS
                log_probs = torch.log_softmax(self.policy(self.states.clone()), dim=1)
                actions = log_probs.argmax(dim=1)
                for i in range(_OBSERVERS):
                    self.log_probs[i].append(log_probs[i, actions[i]])
                done, self.future_actions = self.future_actions, torch.futures.Future()
                done.set_result(actions)
        return future

    @staticmethod
    def select_action(agent_rref: Any, ob_id: int, state: torch.Tensor) -> int:
        self: _Agent = agent_rref.local_value()
        with self.lock:
            log_probs = torch.log_softmax(self.policy(state), dim=1)[0]
            action = int(log_probs.argmax().item())
            self.log_probs[ob_id].append(log_probs[action])
        return action

    def run_episode(self, batch: bool) -> float:
        futures = [ob.rpc_async().run_episode(self.agent_rref, batch) for ob in self.ob_rrefs]
        rewards = torch.tensor([f.wait() for f in futures])
        log_probs = torch.stack([torch.stack(self.log_probs[i]) for i in range(_OBSERVERS)])
        loss = -(log_probs * (rewards - 0.5)).sum()
        self.optimizer.zero_grad()
        torch.autograd.backward(loss)
        self.optimizer.step()
        self._reset()
        return float(rewards.sum())


def _observer_agent(backend: str) -> Any:
    from rallypoint import rpc

    rank = int(os.environ["RANK"])
    name = "agent" if rank == 0 else f"observer{rank}"
    _init(backend, name, rank, _OBSERVERS + 1, rpc_timeout=30)
    out: Any = None
    if rank == 0:
        agent = _Agent()
        rewards = [agent.run_episode(batch) for batch in (True, False) for _ in range(_EPISODES)]
        out = {
            "rewards": rewards,
            "weights": [round(float(p.detach().sum()), 6) for p in agent.policy.parameters()],
        }
    rpc.shutdown()
    return out


# ---- parameter server ------------------------------------------------------------------
class _BatchUpdateServer:
    """Averages one gradient per trainer per round, then steps (pytorch/examples' PS)."""

    def __init__(self, trainers: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.trainers = trainers
        self.updates = 0
        self.lock = threading.Lock()
        self.future_model: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def parameters(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    @staticmethod
    @async_execution
    def update_and_fetch(ps_rref: Any, grads: list[torch.Tensor]) -> Any:
        self: _BatchUpdateServer = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads, strict=True):
                assert p.grad is not None
                p.grad += g
            self.updates += 1
            future = self.future_model
            if self.updates == self.trainers:
                for p in self.model.parameters():
                    assert p.grad is not None
                    p.grad /= self.trainers
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.updates = 0
                self.future_model = torch.futures.Future()
                future.set_result(self.parameters())
        return future


def _train_round(ps_rref: Any, round_: int) -> float:
    """One step on a trainer: fetch, forward, backward, push the gradients."""
    from rallypoint import rpc

    rank = rpc.get_worker_info().id
    weight, bias = ps_rref.rpc_sync().parameters()
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    gen = torch.Generator().manual_seed(1000 * round_ + rank)
    inputs = torch.randn(16, 8, generator=gen)
    target = inputs.sum(dim=1, keepdim=True)
    loss = torch.nn.functional.mse_loss(inputs @ weight.t() + bias, target)
    torch.autograd.backward(loss)
    assert weight.grad is not None and bias.grad is not None
    rpc.rpc_sync(
        ps_rref.owner(),
        _BatchUpdateServer.update_and_fetch,
        args=(ps_rref, [weight.grad, bias.grad]),
    )
    _SERVED.append(time.monotonic())
    return float(loss.detach())


def _parameter_server(backend: str) -> Any:
    from rallypoint import rpc

    rank = int(os.environ["RANK"])
    trainers = [f"trainer{r}" for r in (1, 2)]
    _init(backend, "ps" if rank == 0 else f"trainer{rank}", rank, 3, rpc_timeout=_PS_RPC_TIMEOUT)
    start = time.monotonic()
    out: Any = None
    if rank == 0:
        ps = _BatchUpdateServer(len(trainers))
        ps_rref = rpc.RRef(ps)
        losses = []
        rounds = 0
        # train for longer than the RPC timeout while the trainers wait in shutdown()
        while rounds < 10 or time.monotonic() - start < _PS_TRAIN_SECONDS:
            futures = [rpc.rpc_async(t, _train_round, args=(ps_rref, rounds)) for t in trainers]
            losses.append(round(sum(f.wait() for f in futures), 5))
            rounds += 1
            time.sleep(0.05)
        out = {"losses": losses[:10], "rounds_ok": rounds >= 10}
    entered = time.monotonic()
    rpc.shutdown()
    if rank != 0:  # still served the master's rounds for longer than the RPC timeout
        out = {"called_in_shutdown": bool(_SERVED) and _SERVED[-1] - entered > _PS_RPC_TIMEOUT}
    return out


# ---- pipeline parallelism ------------------------------------------------------------------
_PIPE_SIZES = ((6, 8, 1), (8, 3, 2))  # (in, out, seed) of the two shards
_PIPE_STEPS = 3
_PIPE_MICRO = 2  # two micro-batches: their gradients add up exactly in either order


class _Shard(torch.nn.Module):
    def __init__(self, d_in: int, d_out: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lock = threading.Lock()
        self.seq = torch.nn.Sequential(torch.nn.Linear(d_in, d_out), torch.nn.Tanh())

    def forward(self, x_rref: Any) -> torch.Tensor:
        x = x_rref.to_here()
        with self.lock:
            out: torch.Tensor = self.seq(x)
        return out

    def parameter_rrefs(self) -> list[Any]:
        from rallypoint import rpc

        return [rpc.RRef(p) for p in self.parameters()]

    def gradients(self, context_id: int) -> list[list[Any]]:
        from rallypoint.rpc import dist_autograd

        grads = dist_autograd.get_gradients(context_id)
        return [grads[p].tolist() for p in self.parameters()]


def _owner_optimizer(param_rrefs: list[Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p.to_here() for p in param_rrefs], lr=0.1)


def _pipe_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))
        for _ in range(_PIPE_STEPS)
    ]


def _pipeline_master() -> dict[str, Any]:
    from rallypoint import rpc
    from rallypoint.rpc import dist_autograd
    from rallypoint.rpc.optim import DistributedOptimizer

    shards = [rpc.remote(f"worker{i + 1}", _Shard, args=a) for i, a in enumerate(_PIPE_SIZES)]
    params = [p for s in shards for p in s.remote().parameter_rrefs().to_here()]
    owner_opt = rpc.remote("worker1", _owner_optimizer, args=(params[:2],))
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
    losses: list[float] = []
    first_grads: list[Any] = []
    for step, (xs, target) in enumerate(_pipe_batches()):
        with dist_autograd.context() as context_id:
            futures = []
            for x in torch.chunk(xs, _PIPE_MICRO):
                y_rref = shards[0].remote().forward(rpc.RRef(x))
                futures.append(shards[1].rpc_async().forward(y_rref))
            loss = torch.nn.functional.mse_loss(torch.cat(torch.futures.wait_all(futures)), target)
            dist_autograd.backward(context_id, [loss])
            if step == 0:
                first_grads = [g for s in shards for g in s.rpc_sync().gradients(context_id)]
            opt.step(context_id)
            owner_opt.rpc_sync().step()
            owner_opt.rpc_sync().zero_grad()
            losses.append(loss.item())
    return {
        "losses": losses,
        "first_grads": first_grads,
        "params": [p.to_here().tolist() for p in params],
    }


def _pipeline(backend: str) -> Any:
    from rallypoint import rpc

    rank = int(os.environ["RANK"])
    _init(backend, "master" if rank == 0 else f"worker{rank}", rank, 3, rpc_timeout=30)
    out = _pipeline_master() if rank == 0 else None
    rpc.shutdown()
    return out


def pipeline_reference() -> dict[str, Any]:
    """The ``pipeline`` pattern's model and data trained with plain autograd, one process."""
    shards = [_Shard(*a) for a in _PIPE_SIZES]
    params = [p for s in shards for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    losses: list[float] = []
    first_grads: list[Any] = []
    for xs, target in _pipe_batches():
        out = shards[1].seq(shards[0].seq(xs))
        loss = torch.nn.functional.mse_loss(out, target)
        opt.zero_grad()
        torch.autograd.backward(loss)
        if not first_grads:
            first_grads = [p.grad.tolist() for p in params if p.grad is not None]
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "first_grads": first_grads, "params": [p.tolist() for p in params]}


# ---- a process group and RPC on one port --------------------------------------------------
def _next_rank(rank: int) -> int:
    return rank + 1


def _process_group_and_rpc(backend: str, rpc_first: bool = False) -> Any:
    # c10d logs store bind failures from C++ to fd 2: collect them
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 2)
        got, total = _pg_and_rpc(backend, rpc_first)
        sys.stderr.flush()
        log.seek(0)
        text = log.read().decode(errors="replace")
    return {"got": got, "total": total, "bind_errors": [e for e in BIND_ERRORS if e in text]}


def _pg_and_rpc(backend: str, rpc_first: bool) -> tuple[int, float]:
    import torch.distributed as dist

    from rallypoint import rpc

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rpc_first:
        _init(backend, f"w{rank}", rank, world_size, rpc_timeout=30)
    dist.init_process_group("gloo")
    if not rpc_first:
        _init(backend, f"w{rank}", rank, world_size, rpc_timeout=30)
    got = rpc.rpc_sync(f"w{(rank + 1) % world_size}", _next_rank, args=(rank,))
    total = torch.ones(1)
    dist.all_reduce(total)
    rpc.shutdown()
    dist.destroy_process_group()
    return int(got), float(total.item())


PATTERNS: dict[str, tuple[Callable[..., Any], int]] = {
    "observer_agent": (_observer_agent, _OBSERVERS + 1),
    "parameter_server": (_parameter_server, 3),
    "process_group_and_rpc": (_process_group_and_rpc, 3),
    "model_parallel_rnn": (_model_parallel_rnn, 2),
    "ddp_rpc": (_ddp_rpc, 4),
    "pipeline": (_pipeline, 3),
}


def run_rpc_pattern(
    backend: str,
    pattern: str,
    *args: Any,
    world_size: int | None = None,
    timeout: float = 90.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``pattern`` (a key of :data:`PATTERNS`) on ``backend``; results by rank."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown RPC pattern {pattern!r}; choose one of {sorted(PATTERNS)}")
    fn, default_size = PATTERNS[pattern]
    extra = {RPC_SECRET: "contract-secret", **(env or {})}
    run = run_reference_workers if backend == "TENSORPIPE" else run_workers
    return run(fn, world_size or default_size, backend, *args, timeout=timeout, env=extra)
