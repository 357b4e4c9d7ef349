"""One distributed backward pass, as one worker runs its share of it (torch's FAST mode).

A round (one ``dist_autograd.backward`` call) works, on each worker it touches, on the
local graph between the worker's sources (the roots, and the tensors it sent, whose
gradients come back) and its sinks (leaves, and received messages, whose gradients go
back to their senders). As in torch, a node runs once every edge from all sources has
delivered its gradient, so a node shared by two sources runs once with the summed
gradient. :meth:`Round.plan` simulates that counting and :func:`execute` runs the local
engine once per arrival over the plan. Leaves are never held back: their gradients add up
in the context, and their ``AccumulateGrad`` post hooks run here once the round is settled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from rallypoint._core.torch_c import accumulate_grad_class
from rallypoint.rpc.dist_autograd import _ddp

_ACC: Any = accumulate_grad_class
_ENGINE: Any = torch.autograd.Variable._execution_engine

SourceKey = tuple[int, int]
"""``(message id, tensor index)`` of a sent tensor; ``(-1, i)`` for the i-th root."""
Grads = dict[int, torch.Tensor]
"""Gradients by position: a received message's node has one output per tensor."""
PostHook = Callable[[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], Any]
"""A node's post hook (``node.register_hook``): ``hook(grad_inputs, grad_outputs)``."""


def leaf_of(node: Node) -> torch.Tensor:
    """The leaf tensor of an ``AccumulateGrad`` node."""
    leaf: torch.Tensor = node.variable  # type: ignore[attr-defined]
    return leaf


@dataclass(slots=True)
class Plan:
    """What one pass does: the engine call's outputs and inputs, and what to report."""

    outputs: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    leaves: dict[Node, None] = field(default_factory=dict)  # AccumulateGrad nodes, ordered
    recv_done: list[Node] = field(default_factory=list)  # received messages: gradients done
    recv_dead: list[Node] = field(default_factory=list)  # received messages: no gradient
    recv_passed: list[tuple[Node, Grads]] = field(default_factory=list)  # no engine
    pending: list[tuple[Node, int]] = field(default_factory=list)  # (node, input) to capture
    direct: list[tuple[Node, torch.Tensor]] = field(default_factory=list)  # leaf's node, grad


@dataclass(slots=True)
class Outcome:
    """What the engine computed for a plan."""

    leaves: list[tuple[torch.Tensor, torch.Tensor]]
    recv: list[tuple[Node, Grads]]  # a received message's gradients (missing: none)
    hooks: list[tuple[list[PostHook], torch.Tensor]] = field(default_factory=list)
    """Post hooks of leaves' ``AccumulateGrad`` nodes to run (after the context has the
    gradients), each with the leaf's gradient in the round."""


class Round:
    """One worker's state for one backward round of one context."""

    def __init__(
        self,
        round_id: int,
        retain_graph: bool,
        sources: Iterable[tuple[SourceKey, Node, int]],
        recvs: dict[Node, Any],
    ) -> None:
        self.id = round_id
        self.retain_graph = retain_graph
        self.recvs = recvs  # node -> its RecvRecord (the context's, shared)
        self._edges: dict[SourceKey, tuple[Node, int]] = {}
        self._children: dict[Node, list[tuple[Node, int]]] = {}
        self._remaining: dict[Node, int] = {}
        self._buffers: dict[Node, dict[int, torch.Tensor]] = {}
        self._unresolved = 0
        stack: list[Node] = []
        for key, node, input_nr in sources:
            self._edges[key] = (node, input_nr)
            if type(node) is not _ACC:
                self._count(node, stack)
        self._walk(stack)
        # how many edges reach each received message's node: a send can be routed past
        # this worker only if its edges are all of them (see pass_through)
        # (a copy: a reader thread may decode another message of the context meanwhile)
        self._reached = {
            node: self._remaining[node] for node in list(recvs) if node in self._remaining
        }
        self._unarrived = len(self._edges)
        # one source (the common case: a stage's reply): every node runs in its one pass
        self._single = next(iter(self._edges)) if self._unarrived == 1 else None
        self.passes = 0  # passes run so far: orders this worker's reports of the round
        self.ddp: _ddp.DDPRound | None = None  # DDP reducers running in this round
        # leaves whose AccumulateGrad node has post hooks: the hooks, the round's gradient
        self.hooked: dict[Node, tuple[list[PostHook], torch.Tensor]] = {}
        self.reported_unsettled = False
        # routes offered for gradients this worker sends, by (peer, message id); see
        # _autograd_routes
        self.routes: dict[tuple[str, int], Any] = {}

    # ---- the graph ---------------------------------------------------------------------
    def _count(self, node: Node, stack: list[Node]) -> None:
        count = self._remaining.get(node)
        if count is None:
            self._remaining[node] = 1
            self._unresolved += 1
            stack.append(node)
        else:
            self._remaining[node] = count + 1

    def _walk(self, stack: list[Node]) -> None:
        """Count, for every node reachable from the sources, the edges that reach it
        (:meth:`_count`, inlined: this runs for every node of every pass)."""
        children, recvs, remaining = self._children, self.recvs, self._remaining
        while stack:
            node = stack.pop()
            if node in recvs:  # a received tensor: its gradient leaves this worker
                children[node] = []
                continue
            kids = [(child, nr) for child, nr in node.next_functions if child is not None]
            children[node] = kids
            for child, _ in kids:
                if type(child) is not _ACC:
                    count = remaining.get(child)
                    if count is None:
                        remaining[child] = 1
                        self._unresolved += 1
                        stack.append(child)
                    else:
                        remaining[child] = count + 1

    def reaches(self, node: Node) -> bool:
        """Whether ``node`` is in this round's graph."""
        return node in self._remaining

    @property
    def settled(self) -> bool:
        """Every source arrived and every node ran or died: nothing more will happen here."""
        return not self._unarrived and not self._unresolved

    def pass_through(self, message_id: int, count: int) -> tuple[Node, list[int]] | None:
        """A send whose gradients have not arrived and would only pass through: each of its
        ``count`` tensors is an output of one received message's node, which nothing else
        reaches. That node and its input for each tensor."""
        node: Node | None = None
        inputs: list[int] = []
        for index in range(count):
            edge = self._edges.get((message_id, index))
            if edge is None or edge[0] not in self.recvs or node not in (None, edge[0]):
                return None
            node = edge[0]
            inputs.append(edge[1])
        if node is None or self._reached.get(node) != count or len(set(inputs)) != count:
            return None
        return node, inputs

    # ---- one pass ----------------------------------------------------------------------
    def plan(self, arrivals: Iterable[tuple[SourceKey, torch.Tensor | None]]) -> Plan:
        """Deliver ``arrivals`` (``None``: that source gets no gradient) and plan the pass.

        A node whose count reaches zero executes (if it received any gradient) or is dead (a
        dead received message tells its sender "no gradient"). A node with a gradient but a
        non-zero count is pending: the gradient that reached it so far is captured and the
        node runs in a later pass.
        """
        self.passes += 1
        if self._single is not None:
            single = list(arrivals)
            if len(single) == 1 and single[0][0] == self._single:
                return self._plan_single(single[0][1])
            arrivals = single
        plan = Plan()
        ready: list[Node] = []
        touched: dict[Node, set[int]] = {}
        for key, grad in arrivals:
            edge = self._edges.pop(key, None)
            if edge is None:
                raise RuntimeError(
                    f"distributed autograd: no pending send for message {key[0]} (tensor "
                    f"{key[1]}) in round {self.id}; its gradient arrived twice or too late"
                )
            self._unarrived -= 1
            node, input_nr = edge
            if type(node) is _ACC:
                if grad is not None:
                    plan.direct.append((node, grad))
                continue
            if grad is not None:
                self._buffer(node, input_nr, grad)
            self._arrive(node, ready)
        while ready:
            self._resolve(ready.pop(), plan, ready, touched)
        remaining = self._remaining
        for node, inputs in touched.items():
            if remaining[node] > 0:
                plan.pending.extend((node, nr) for nr in sorted(inputs))
        return plan

    def _plan_single(self, grad: torch.Tensor | None) -> Plan:
        """The only source arrived: everything it reaches runs (or dies) now."""
        node, input_nr = self._edges.pop(self._single)  # type: ignore[arg-type]
        self._single = None
        self._unarrived = self._unresolved = 0
        plan = Plan()
        if type(node) is _ACC:
            if grad is not None:
                plan.direct.append((node, grad))
            return plan
        recvs = self.recvs
        if grad is None:
            plan.recv_dead.extend(n for n in self._children if n in recvs)
            return plan
        if node in recvs:
            plan.recv_passed.append((node, {input_nr: grad}))
            return plan
        plan.outputs.append(GradientEdge(node, input_nr))
        plan.grads.append(grad)
        for n, kids in self._children.items():
            if n in recvs:
                plan.recv_done.append(n)
            else:
                for child, _ in kids:
                    if type(child) is _ACC:
                        plan.leaves[child] = None
        return plan

    def _buffer(self, node: Node, input_nr: int, grad: torch.Tensor) -> None:
        slots = self._buffers.setdefault(node, {})
        old = slots.get(input_nr)
        slots[input_nr] = grad if old is None else old + grad

    def _arrive(self, node: Node, ready: list[Node]) -> None:
        count = self._remaining[node] - 1
        self._remaining[node] = count
        if count == 0:
            self._unresolved -= 1
            ready.append(node)

    def _resolve(
        self, node: Node, plan: Plan, ready: list[Node], touched: dict[Node, set[int]]
    ) -> None:
        buffered = self._buffers.pop(node, None)
        is_recv = node in self.recvs
        if buffered is None and node not in touched:  # dead: no gradient reached it
            if is_recv:
                plan.recv_dead.append(node)
            for child, _ in self._children[node]:
                if type(child) is not _ACC:
                    self._arrive(child, ready)
            return
        if is_recv and node not in touched and buffered:
            # received tensors sent on as they were: their gradients are what came back
            plan.recv_passed.append((node, buffered))
            return
        if buffered:
            for input_nr, grad in buffered.items():
                plan.outputs.append(GradientEdge(node, input_nr))
                plan.grads.append(grad)
        if is_recv:
            plan.recv_done.append(node)
            return
        for child, input_nr in self._children[node]:
            if type(child) is _ACC:
                plan.leaves[child] = None
            else:
                touched.setdefault(child, set()).add(input_nr)
                self._arrive(child, ready)

    def hook_leaf(self, node: Node, grad: torch.Tensor) -> None:
        """A leaf got ``grad`` in a pass: keep it for its post hooks (if it has any)."""
        seen = self.hooked.pop(node, None)  # re-inserted: hooks run in the order leaves complete
        if seen is not None:  # a new tensor: the first one may be the context's, updated in place
            self.hooked[node] = (seen[0], seen[1] + grad)
        elif hooks := post_hooks(node):
            self.hooked[node] = (hooks, grad)

    def capture(self, node: Node, input_nr: int, grad: torch.Tensor | None) -> None:
        """Keep the partial gradient a pending node received in a pass."""
        if grad is not None:
            self._buffer(node, input_nr, grad)

    def leads_to(self, start: Node, targets: set[Node]) -> bool:
        """Whether a node below ``start`` is in ``targets``."""
        stack = [start]
        seen: set[Node] = set()
        children = self._children
        while stack:
            for child, _ in children.get(stack.pop(), ()):
                if child in targets:
                    return True
                if child not in seen and type(child) is not _ACC:
                    seen.add(child)
                    stack.append(child)
        return False


def _no_gradient(grads: tuple[torch.Tensor | None, ...]) -> tuple[None, ...]:
    return tuple(None for _ in grads)


def _probe(grad_inputs: Any, grad_outputs: Any) -> None:
    return None


_node_hooks_seen = False


def track_node_hooks() -> None:
    """Notice from now on when any autograd node gets a Python post hook, so that
    :func:`post_hooks` need not probe the leaves of every pass while none ever did.

    torch registers every ``node.register_hook`` (Python and C++ nodes alike) through
    ``Function._register_hook``; wrapping it once is cheaper than a probe per leaf per
    pass (a hook handle made and removed in Python each time). Installed when the first
    agent starts: a hook registered before that on a node that is still alive is found
    only if another one is later."""
    hook_mixin: Any = torch.autograd.function._HookMixin
    register = hook_mixin._register_hook
    if getattr(register, "_rallypoint_tracked", False):
        return

    def tracking(backward_hooks: Any, hook: Any) -> Any:
        global _node_hooks_seen
        _node_hooks_seen = True
        return register(backward_hooks, hook)

    tracking._rallypoint_tracked = True  # type: ignore[attr-defined]
    hook_mixin._register_hook = staticmethod(tracking)


def post_hooks(node: Node) -> list[PostHook]:
    """The post hooks registered on ``node`` with ``node.register_hook``, in order.

    torch keeps them in one dict per node that only their handles expose: registering a
    probe returns a handle to that dict; the probe is removed at once. Nothing to probe
    while no node ever got a hook (see :func:`track_node_hooks`)."""
    if not _node_hooks_seen:
        return []
    handle = node.register_hook(_probe)
    hooks = handle.hooks_dict_ref()
    handle.remove()
    return list(hooks.values()) if hooks else []


def _leaf_hooks(leaf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` after the hooks of ``leaf`` (``Tensor.register_hook``), in order, as torch."""
    hooks = leaf._backward_hooks
    if hooks:
        for hook in list(hooks.values()):
            out = hook(grad)
            if out is not None:
                grad = out
    return grad


def execute(rnd: Round, plan: Plan) -> Outcome:
    """Run the local engine over ``plan``; leaf gradients and received tensors' gradients.

    Outputs are the arrived and the buffered gradients; inputs are the leaves, every output
    of the received messages that completed and the pending nodes. A pending node that
    leads to a captured node would run with a partial gradient: a pre-hook makes its
    gradient ``None`` for that pass, and the pass keeps the graph.

    Once the round is settled here, a DDP reducer that has not finished is an error."""
    outcome = _run(rnd, plan)
    if rnd.hooked and rnd.settled:
        outcome.hooks = list(rnd.hooked.values())
        rnd.hooked = {}
    if rnd.ddp is not None and rnd.settled:
        unfinished = rnd.ddp.unfinished()
        rnd.ddp.restore()
        rnd.ddp = None
        if unfinished:
            raise _ddp.unfinished_error(unfinished)
    return outcome


def _run(rnd: Round, plan: Plan) -> Outcome:
    # a leaf's gradient that came straight from a receiver: the engine never saw it, so
    # run the leaf's hooks here (the engine runs them for the leaves it computes)
    leaves: list[tuple[torch.Tensor, torch.Tensor]] = []
    for node, grad in plan.direct:
        leaf = leaf_of(node)
        leaves.append((leaf, _leaf_hooks(leaf, grad)))
        rnd.hook_leaf(node, leaves[-1][1])
    if leaves:
        _ddp.check_direct(leaves)
    recv: list[tuple[Node, Grads]] = [(node, {}) for node in plan.recv_dead]
    recv.extend(plan.recv_passed)
    if not plan.outputs:
        return Outcome(leaves, recv)
    leaf_nodes = list(plan.leaves)
    leaf_tensors = [node.variable for node in leaf_nodes]  # type: ignore[attr-defined]
    inputs: list[Any] = list(leaf_tensors)
    # a received message's node: one output per tensor that requires grad (its record's)
    recvs = rnd.recvs
    recv_edges = [(node, nr) for node in plan.recv_done for nr in range(recvs[node].outputs)]
    inputs += [GradientEdge(node, nr) for node, nr in recv_edges]
    inputs += [GradientEdge(node, nr) for node, nr in plan.pending]
    retain = rnd.retain_graph
    handles = []
    if plan.pending:
        targets: set[Node] = {*leaf_nodes, *plan.recv_done, *(n for n, _ in plan.pending)}
        for node in dict.fromkeys(n for n, _ in plan.pending):
            if rnd.leads_to(node, targets):
                # the engine would run it (something below it is captured): not yet
                handles.append(node.register_prehook(_no_gradient))
        retain = retain or bool(handles)
    if not inputs:
        return Outcome(leaves, recv)
    # DDP modules among the leaves: their reducers run in the round's passes (see _ddp)
    modules = _ddp.modules_of(leaf_tensors) if leaf_nodes else None
    if modules:
        if rnd.ddp is None:
            rnd.ddp = _ddp.DDPRound()
        rnd.ddp.reach(modules)
    ddp = rnd.ddp
    try:
        # torch.autograd.grad without its argument checks: every gradient here has its
        # tensor's shape already (a third of the cost of a small pass)
        grads = _ENGINE.run_backward(
            tuple(plan.outputs), tuple(plan.grads), retain, False, tuple(inputs), True, False
        )
    except BaseException:  # Ctrl-C too: DDP's hooks are restored
        if ddp is not None:
            ddp.restore()
            rnd.ddp = None
        raise
    finally:
        for handle in handles:
            handle.remove()
    n_leaves, n_recv = len(leaf_nodes), len(recv_edges)
    reduced = set() if ddp is None else ddp.parameter_ids
    hooked = _node_hooks_seen or bool(rnd.hooked)  # else hook_leaf has nothing to do
    for node, leaf, grad in zip(leaf_nodes, leaf_tensors, grads[:n_leaves], strict=True):
        if grad is not None and id(leaf) not in reduced:
            leaves.append((leaf, grad))
            if hooked:
                rnd.hook_leaf(node, grad)
    if ddp is not None:
        leaves.extend(ddp.collect())
    done: dict[Node, Grads] = {node: {} for node in plan.recv_done}
    for (node, nr), grad in zip(recv_edges, grads[n_leaves : n_leaves + n_recv], strict=True):
        if grad is not None:
            done[node][nr] = grad
    recv.extend(done.items())
    for (node, input_nr), grad in zip(plan.pending, grads[n_leaves + n_recv :], strict=True):
        rnd.capture(node, input_nr, grad)
    return Outcome(leaves, recv)
