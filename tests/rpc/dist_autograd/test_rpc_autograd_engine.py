"""The distributed autograd engine, one worker at a time, without processes.

A received tensor is made as the codec makes it (``receive_message``: one node per
message); a "send" is a gradient edge given to the round as a source, as the codec records
it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rallypoint.rpc._agent._codec import TAG_MAGIC, Codec
from rallypoint.rpc._worker_info import WorkerInfo
from rallypoint.rpc.dist_autograd._autograd import DistAutograd
from rallypoint.rpc.dist_autograd._context import (
    AutogradContext,
    RecvRecord,
    SendRecord,
    edge_of,
    receive_message,
)
from rallypoint.rpc.dist_autograd._engine import Round, execute


def _received(recvs: dict[Any, RecvRecord], raw: torch.Tensor, message: int = 9) -> torch.Tensor:
    (out,) = receive_message(recvs, "peer", message, [raw.requires_grad_(True)])
    return out


class _Counted(torch.autograd.Function):
    """Identity that records the gradients its backward receives."""

    calls: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Counted.calls.append(grad.clone())
        return grad


def test_one_source_gives_leaf_and_received_gradients() -> None:
    recvs: dict[Any, RecvRecord] = {}
    w = torch.randn(3, 3, requires_grad=True)
    raw = torch.randn(3)
    x = _received(recvs, raw.clone())
    y = torch.tanh(w @ x)
    g = torch.randn(3)
    rnd = Round(1, False, [((5, 0), *edge_of(y))], recvs)
    out = execute(rnd, rnd.plan([((5, 0), g)]))
    xr = raw.clone().requires_grad_(True)
    ref_w, ref_x = torch.autograd.grad(torch.tanh(w @ xr), [w, xr], g)
    assert [t for t, _ in out.leaves] == [w]
    torch.testing.assert_close(out.leaves[0][1], ref_w)
    assert len(out.recv) == 1 and out.recv[0][0] is x.grad_fn
    torch.testing.assert_close(out.recv[0][1][0], ref_x)
    assert rnd.settled


def test_a_node_two_sources_reach_runs_once_with_the_summed_gradient() -> None:
    _Counted.calls.clear()
    w = torch.randn(3, 3, requires_grad=True)
    v = torch.randn(3)
    h = _Counted.apply(w @ v)  # used in the loss (root) and "sent" (a second source)
    root = torch.sin(h).sum() + (w * 3).sum()  # w also has a path of its own
    g_sent = torch.randn(3)
    sources = [((-1, 0), *edge_of(root)), ((5, 0), *edge_of(h))]
    rnd = Round(1, False, sources, {})
    first = execute(rnd, rnd.plan([((-1, 0), torch.ones(()))]))
    assert not rnd.settled  # h still waits for the sent gradient
    torch.testing.assert_close(dict(first.leaves)[w], torch.full((3, 3), 3.0))
    second = execute(rnd, rnd.plan([((5, 0), g_sent)]))
    assert rnd.settled
    total = dict(first.leaves)[w] + dict(second.leaves)[w]
    wr = w.detach().requires_grad_(True)
    hr = wr @ v
    (ref,) = torch.autograd.grad(torch.sin(hr).sum() + (wr * 3).sum() + (hr * g_sent).sum(), [wr])
    torch.testing.assert_close(total, ref)
    nonzero = [c for c in _Counted.calls if c.abs().sum() > 0]
    assert len(nonzero) == 1  # it ran once with both gradients (a held-back run sees zeros)
    torch.testing.assert_close(nonzero[0], torch.cos(hr.detach()) + g_sent)


def test_a_source_without_gradient_kills_what_only_it_reaches() -> None:
    recvs: dict[Any, RecvRecord] = {}
    x = _received(recvs, torch.randn(3))
    y = x * 2
    rnd = Round(1, False, [((5, 0), *edge_of(y))], recvs)
    out = execute(rnd, rnd.plan([((5, 0), None)]))
    assert out.leaves == [] and out.recv == [(x.grad_fn, {})]
    assert rnd.settled


def test_a_gradient_arriving_twice_is_an_error() -> None:
    y = torch.randn(3, requires_grad=True) * 2
    rnd = Round(1, False, [((5, 0), *edge_of(y))], {})
    rnd.plan([((5, 0), torch.ones(3))])
    with pytest.raises(RuntimeError, match="arrived twice or too late"):
        rnd.plan([((5, 0), torch.ones(3))])


def test_a_received_tensor_sent_on_passes_its_gradient_without_the_engine() -> None:
    recvs: dict[Any, RecvRecord] = {}
    x = _received(recvs, torch.randn(3))
    g = torch.randn(3)
    rnd = Round(1, False, [((5, 0), *edge_of(x))], recvs)
    plan = rnd.plan([((5, 0), g)])
    assert plan.outputs == [] and plan.recv_passed == [(x.grad_fn, {0: g})]
    assert execute(rnd, plan).recv == [(x.grad_fn, {0: g})]


def test_context_gradients_accumulate_in_place_without_aliasing() -> None:
    ctx = AutogradContext(0)
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    shared = torch.ones(2)  # one gradient given to two leaves (an add's backward does that)
    ctx.accumulate([(a, shared), (b, shared)])
    first_a = ctx.grads[a]
    ctx.accumulate([(a, torch.ones(2))])
    assert ctx.grads[a] is first_a and first_a.tolist() == [2.0, 2.0]
    assert ctx.grads[b].tolist() == [1.0, 1.0]


def test_a_leaf_twice_in_one_pass_gets_the_sum_as_torch_accumulates_it() -> None:
    """A parameter sent in two messages gets two gradients in one pass (each arrives
    straight at its leaf): the context adds them, as torch's AccumulateGrad does for a
    leaf used twice, and later passes add in place."""
    grads = [torch.tensor([1.0, 2, 3]), torch.tensor([10.0, 20, 30]), torch.ones(3)]
    reference = torch.zeros(3, requires_grad=True)  # torch's own accumulation
    for grad in (grads[0], grads[1], grads[2], grads[2]):
        (reference * 1).backward(grad)
    ctx = AutogradContext(0)
    leaf, other = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    # the gradients are the engine's or the wire's: nobody else holds them (clones here)
    g1, g2, g3 = (grad.clone() for grad in grads)
    ctx.accumulate([(leaf, g1), (other, g3), (leaf, g2)])
    assert torch.equal(ctx.grads[leaf], grads[0] + grads[1])
    assert torch.equal(ctx.grads[other], grads[2])
    kept = ctx.grads[leaf]
    ctx.accumulate([(leaf, grads[2].clone()), (leaf, grads[2].clone())])  # there: in place
    assert ctx.grads[leaf] is kept and torch.equal(kept, reference.grad)


class _Peers:
    device_maps: dict[str, Any] = {}
    reverse_maps: dict[str, Any] = {}


class _Caller:
    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def oneway(self, to: str, func: Any, *args: Any, device_map: Any = None) -> bool:
        self.sent.append((to, func.__name__, *args))
        return True


def _autograd(rank: int) -> DistAutograd:
    return DistAutograd(
        WorkerInfo(f"w{rank}", rank),
        _Caller(),
        timeout=5.0,
        dead_workers=list,  # type: ignore[arg-type]
    )


def _stage(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_codec_tags_only_messages_in_a_context() -> None:
    sender, receiver = _autograd(0), _autograd(1)
    out_codec = Codec(_Peers(), None, sender)  # type: ignore[arg-type]
    in_codec = Codec(_Peers(), None, receiver)  # type: ignore[arg-type]
    x = torch.ones(2, requires_grad=True) * 3
    data, raws = out_codec.call("w1", (_stage, (x,), {}))
    assert data[:2] != TAG_MAGIC and in_codec.decode("w0", data, raws)[1] is None
    ctx = sender.new_context()
    try:
        assert ctx.id == 0
        data, raws = out_codec.call("w1", (_stage, (x,), {}), ctx)
        assert data[:2] == TAG_MAGIC and len(ctx.sends) == 1 and ctx.known == {"w1"}
        (_, (got,), _), remote = in_codec.decode("w0", data, raws)
        assert remote is not None and remote.id == ctx.id and len(receiver) == 1
        assert got.grad_fn.name() == "torch::distributed::autograd::RecvRpcBackward"
        assert remote.known == {"w0"}
        assert list(remote.recvs.values()) == [RecvRecord("w0", next(iter(ctx.sends)), 1)]
        plain, _ = in_codec.reply("w0", 5, remote)  # no tensor that needs grad: untagged
        assert plain[:2] != TAG_MAGIC
    finally:
        sender.exit_context(ctx.id)
    assert len(sender) == 0
    sender.send_releases()
    assert sender._caller.sent == [("w1", "_release", [0], "w0")]  # type: ignore[attr-defined]


def test_a_round_starts_by_answering_received_tensors_nothing_reaches() -> None:
    autograd = _autograd(1)
    ctx = autograd.get_or_create(7)
    unused = _received(ctx.recvs, torch.randn(3), message=3)
    used = _received(ctx.recvs, torch.randn(3), message=4)
    y = used * 2
    ctx.sends[11] = SendRecord("w0", [edge_of(y)])
    outgoing, _ = autograd._step(ctx, 1, False, [((11, 0), torch.ones(3))], ())
    items = {m: g for m, _, g in outgoing.items["peer"]}
    assert items[3] is None and torch.equal(items[4], torch.full((3,), 2.0))
    assert unused.grad_fn in ctx.recvs


_TRACKING = """
import torch
from rallypoint.rpc.dist_autograd import _engine as engine

probes = []
register = torch.autograd.function._HookMixin._register_hook
def counting(hooks, hook):
    probes.append(hook)
    return register(hooks, hook)
torch.autograd.function._HookMixin._register_hook = staticmethod(counting)
engine.track_node_hooks()
engine.track_node_hooks()  # installed once
w = torch.randn(3, requires_grad=True)
node = (w * 2).grad_fn.next_functions[0][0]
assert engine.post_hooks(node) == [] and probes == [], probes  # no hook yet: no probe
seen = lambda grad_inputs, grad_outputs: None
node.register_hook(seen)
v = torch.randn(3, requires_grad=True)
other = (v * 3).grad_fn.next_functions[0][0]
assert engine.post_hooks(node) == [seen]
assert engine.post_hooks(other) == []
print("ok")
"""


@pytest.mark.timeout(60)
def test_leaves_are_probed_for_post_hooks_only_once_some_node_got_one() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _TRACKING], capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_credit_shares_add_up_to_exactly_one_however_they_split() -> None:
    """Shares split among 3, then 7, then 2 peers come back to exactly 1: the waiter
    finishes on the last share, never before (exact integer fractions, as ``Fraction``)."""
    from fractions import Fraction

    from rallypoint.rpc.dist_autograd._autograd import _ONE, _split, _Waiter

    third = _split(_ONE, 3)
    seventh = _split(third, 7)
    exact = [third, third, *[seventh] * 6, *[_split(seventh, 2)] * 2]
    assert sum(Fraction(*s) for s in exact) == 1 and seventh == (1, 21)
    waiter = _Waiter()
    for share in exact[:-1]:
        waiter.add(share, None, [])
        assert not waiter.finished and not waiter.done.acquire(blocking=False)
    waiter.add(exact[-1], None, [])
    assert waiter.finished and waiter.credit == (1, 1) and waiter.done.acquire(blocking=False)
