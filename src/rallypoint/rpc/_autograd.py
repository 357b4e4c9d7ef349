"""Distributed autograd on the rallypoint agent: contexts, sends and receives, backward.

torch's design (FAST mode), in Python:

- A *context* (:class:`AutogradContext`) is created by ``dist_autograd.context()`` and
  named by an id unique in the job (the worker's rank in the high 16 bits, as torch's).
  The thread that created it has it as its current context; a worker that receives a
  call made in a context creates its own copy (same id) and runs the call in it, so
  nested calls carry it on. Leaving the ``with`` block releases the context here and,
  through one-way messages, on every worker it touched.
- In a context, every call carries the context id; a message with tensors that require
  grad also carries a *message id*. The sender records a *send* (the tensors' gradient
  edges); the receiver wraps each such tensor in a ``RecvRpcBackward`` node and records
  a *receive*. The codec does both (:class:`~rallypoint.rpc._codec.Codec`).
- ``backward(context_id, roots)`` runs the local pass from the roots; every received
  tensor it reaches sends its gradient to the sender (``_propagate``), which runs its own
  pass from the matching send, and so on. A ``_propagate`` call returns only when the
  passes it caused, on every worker, are done, so ``backward`` returns when the whole
  distributed pass is. The dependency counting lives in :mod:`._autograd_engine`.
- Leaf gradients accumulate in the context (``get_gradients``), never in ``.grad``.

Unlike torch, a send whose gradient never comes (its result was unused) does not hang the
pass: a received tensor that no source reaches tells its sender "no gradient".
"""

from __future__ import annotations

import itertools
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

import torch
from torch.autograd.graph import Node, get_gradient_edge

from rallypoint.rpc._autograd_engine import Round, SourceKey, execute
from rallypoint.rpc._backend import Caller
from rallypoint.rpc._constants import UNSET_RPC_TIMEOUT
from rallypoint.rpc._current import Current
from rallypoint.rpc._groups import WorkerInfo
from rallypoint.rpc.functions import async_execution

Grad: TypeAlias = "torch.Tensor | None"
Items: TypeAlias = "list[tuple[int, int, Grad]]"  # (message id, tensor index, gradient)
Status: TypeAlias = "tuple[str, int, bool, list[str]]"
"""A worker's state in a round: name, passes run, settled, the workers it talked to."""
Report: TypeAlias = "tuple[str | None, list[Status]] | None"
"""A pass's outcome: ``None`` if it went well and no worker it reached ever reported
being unsettled; else ``(error, statuses)``. The status with the most passes is the
latest, so a worker that was waiting and is done by the end is seen as done."""

_ID_BITS = 48
_tls = threading.local()


def current_context() -> AutogradContext | None:
    """The context of the calling thread, if any."""
    return getattr(_tls, "ctx", None)


def run_in(ctx: AutogradContext, func: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """Run ``func`` with ``ctx`` as the thread's context (a call that arrived in it)."""
    saved = getattr(_tls, "ctx", None)
    _tls.ctx = ctx
    try:
        return func(*args, **kwargs)
    finally:
        _tls.ctx = saved


class RecvRpc(torch.autograd.Function):
    """Wraps a received tensor; its node (``RecvRpcBackward``) marks where gradients leave."""

    @staticmethod
    def forward(ctx: Any, raw: torch.Tensor) -> torch.Tensor:
        return raw.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class RecvRecord(NamedTuple):
    peer: str
    message_id: int
    position: int  # of the tensor among the message's tensors that require grad


@dataclass(slots=True)
class SendRecord:
    peer: str
    edges: list[tuple[Node, int]]


@dataclass(slots=True, eq=False)
class AutogradContext:
    """One worker's part of a distributed autograd context."""

    id: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    sends: dict[int, SendRecord] = field(default_factory=dict)
    recvs: dict[Node, RecvRecord] = field(default_factory=dict)
    grads: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)
    round: Round | None = None

    def accumulate(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        old = self.grads.get(tensor)
        self.grads[tensor] = grad if old is None else old + grad

    def sources(self, roots: Sequence[torch.Tensor]) -> list[tuple[SourceKey, Node, int]]:
        """Where a round's gradients enter: the roots, and every tensor sent in the context."""
        found: list[tuple[SourceKey, Node, int]] = [
            ((-1, i), root.grad_fn, root.output_nr)  # type: ignore[misc]
            for i, root in enumerate(roots)
        ]
        for message_id, send in list(self.sends.items()):
            found.extend(((message_id, i), node, nr) for i, (node, nr) in enumerate(send.edges))
        return found


def _edge(tensor: torch.Tensor) -> tuple[Node, int]:
    edge = get_gradient_edge(tensor)
    return edge.node, edge.output_nr


def check_context_id(context_id: object) -> int:
    if not isinstance(context_id, numbers.Integral) or isinstance(context_id, bool):
        raise TypeError(f"context_id must be an int, got {type(context_id).__name__}")
    return int(context_id)


def root_list(roots: object) -> list[torch.Tensor]:
    """``roots`` as a list of tensors (a ``TypeError`` otherwise, as torch's binding)."""
    if not isinstance(roots, Sequence) or not all(isinstance(r, torch.Tensor) for r in roots):
        raise TypeError(
            f"backward(): roots must be a sequence of tensors, got {type(roots).__name__}"
        )
    return list(roots)


def check_roots(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch's checks and messages, in torch's order."""
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for root in roots:
        if not root.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if root.numel() != 1:
            raise RuntimeError(" is not a scalar, all roots need to be scalar")
        if root.grad_fn is None:
            raise RuntimeError(" does not have a valid gradient function.")
    return roots


def _done(value: Any) -> torch.futures.Future[Any]:
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(value)
    return future


class DistAutograd:
    """One worker's distributed autograd: its contexts, and the backward protocol."""

    def __init__(self, me: WorkerInfo, caller: Caller) -> None:
        self.me = me
        self._caller = caller
        self._contexts: dict[int, AutogradContext] = {}
        self._lock = threading.Lock()
        base = me.id << _ID_BITS
        self._context_ids = itertools.count(base)
        self._message_ids = itertools.count(base + 1)

    # ---- contexts ----------------------------------------------------------------------
    def new_context(self) -> AutogradContext:
        """A context for the calling thread (``dist_autograd.context().__enter__``)."""
        if current_context() is not None:
            raise RuntimeError("Already have an autograd context id for this thread.")
        ctx = AutogradContext(next(self._context_ids))
        with self._lock:
            self._contexts[ctx.id] = ctx
        _tls.ctx = ctx
        return ctx

    def retrieve(self, context_id: int) -> AutogradContext:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")
        return ctx

    def get_or_create(self, context_id: int) -> AutogradContext:
        """This worker's copy of a context that a message arrived in."""
        ctx = self._contexts.get(context_id)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.setdefault(context_id, AutogradContext(context_id))
        return ctx

    def exit_context(self, context_id: int) -> None:
        """The ``with`` block ended: forget the thread's context and release it everywhere."""
        ctx = current_context()
        if ctx is not None and ctx.id == context_id:
            _tls.ctx = None
        if not self.release(context_id):
            raise RuntimeError(f"Could not find autograd context with id: {context_id}")

    def release(self, context_id: int, sender: str | None = None) -> bool:
        """Drop a context and tell the workers it exchanged messages with."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            return False
        for peer in sorted(ctx.known - {self.me.name, sender}):
            self._caller.oneway(peer, _release, context_id, self.me.name)
        return True

    def __len__(self) -> int:
        return len(self._contexts)

    def close(self) -> None:
        with self._lock:
            self._contexts.clear()

    # ---- the codec's hooks ---------------------------------------------------------------
    def record_send(self, ctx: AutogradContext, dst: str, tensors: list[torch.Tensor]) -> int:
        """A message to ``dst`` carries ``tensors`` that require grad: its message id."""
        message_id = next(self._message_ids)
        ctx.sends[message_id] = SendRecord(dst, [_edge(t) for t in tensors])
        return message_id

    def receiver(
        self, ctx: AutogradContext, src: str, message_id: int
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The hook that wraps the tensors of message ``message_id`` from ``src``."""
        counter = itertools.count()
        recvs = ctx.recvs

        def receive(raw: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                out: torch.Tensor = RecvRpc.apply(raw)  # type: ignore[no-untyped-call]
            recvs[out.grad_fn] = RecvRecord(src, message_id, next(counter))  # type: ignore[index]
            return out

        return receive

    # ---- backward ------------------------------------------------------------------------
    def backward(self, context_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        """Run the distributed backward pass from ``roots``; returns when it is done."""
        ctx = self.retrieve(context_id)
        roots = check_roots(roots)
        round_id = next(self._message_ids)
        arrivals: list[tuple[SourceKey, Grad]] = [
            ((-1, i), torch.ones_like(r)) for i, r in enumerate(roots)
        ]
        try:
            outgoing = self._step(ctx, round_id, retain_graph, arrivals, roots)
        except Exception as exc:
            raise RuntimeError(self._error(exc)) from exc
        report = self._fan_out(ctx, round_id, retain_graph, outgoing).wait()
        latest: dict[str, Status] = {}
        asked = {self.me.name}
        while report is not None and report[0] is None:
            # workers wait for gradients from workers no pass reached: ask those (their
            # received tensors that no source reaches answer "no gradient")
            for status in report[1]:
                if status[1] >= latest.get(status[0], status)[1]:
                    latest[status[0]] = status
            waiting = [s for s in latest.values() if not s[2]]
            if not waiting:
                return
            targets = [w for s in waiting for w in s[3] if w not in asked]
            if not targets:
                raise RuntimeError(
                    f"Error on Node {self.me.id}: the distributed backward pass of context "
                    f"{context_id} cannot finish: workers {sorted(s[0] for s in waiting)} "
                    "still wait for gradients of tensors they sent, and every worker they "
                    "exchanged messages with has been asked"
                )
            asked.update(targets)
            outgoing = {target: [] for target in targets}
            report = self._fan_out(ctx, round_id, retain_graph, outgoing).wait()
        if report is not None:
            raise RuntimeError(report[0])

    def serve(
        self, context_id: int, round_id: int, retain_graph: bool, items: Items
    ) -> torch.futures.Future[Report]:
        """Gradients for tensors this worker sent arrived: run the pass they start."""
        try:
            ctx = self.retrieve(context_id)
            arrivals: list[tuple[SourceKey, Grad]] = [((m, i), g) for m, i, g in items]
            outgoing = self._step(ctx, round_id, retain_graph, arrivals, ())
        except Exception as exc:
            return _done((self._error(exc), []))
        return self._fan_out(ctx, round_id, retain_graph, outgoing)

    def _step(
        self,
        ctx: AutogradContext,
        round_id: int,
        retain_graph: bool,
        arrivals: list[tuple[SourceKey, Grad]],
        roots: Sequence[torch.Tensor],
    ) -> dict[str, Items]:
        """One local pass (under the context's lock); the gradients to send, per peer."""
        with ctx.lock:
            rnd = ctx.round
            dead: list[Node] = []
            if rnd is None or rnd.id != round_id:
                rnd = ctx.round = Round(round_id, retain_graph, ctx.sources(roots), ctx.recvs)
                # received tensors that no source reaches get no gradient in this round
                dead = [node for node in list(ctx.recvs) if not rnd.reaches(node)]
            plan = rnd.plan(arrivals)
            plan.recv_dead.extend(dead)
            outcome = execute(rnd, plan)
            for tensor, grad in outcome.leaves:
                ctx.accumulate(tensor, grad)
            outgoing: dict[str, Items] = {}
            for node, sent in outcome.recv:
                record = ctx.recvs[node]
                outgoing.setdefault(record.peer, []).append(
                    (record.message_id, record.position, sent)
                )
            return outgoing

    def _fan_out(
        self, ctx: AutogradContext, round_id: int, retain_graph: bool, outgoing: dict[str, Items]
    ) -> torch.futures.Future[Report]:
        """Send the gradients; the future completes with the merged report of every pass."""
        futures = []
        saved = getattr(_tls, "ctx", None)
        _tls.ctx = None  # protocol messages are not part of the context's forward pass
        try:
            for peer, items in outgoing.items():
                try:
                    futures.append(
                        self._caller.rpc_async(
                            peer,
                            _propagate,
                            (ctx.id, round_id, retain_graph, items),
                            {},
                            UNSET_RPC_TIMEOUT,
                        )
                    )
                except Exception as exc:
                    futures.append(_done((f"{exc}", [])))
        finally:
            _tls.ctx = saved
        if not futures:
            return _done(self._report(ctx, round_id, []))
        merged: torch.futures.Future[Any] = torch.futures.collect_all(futures)
        return merged.then(lambda done: self._report(ctx, round_id, done.value()))

    def _report(
        self, ctx: AutogradContext, round_id: int, done: list[torch.futures.Future[Any]]
    ) -> Report:
        error: str | None = None
        statuses: list[Status] = []
        for future in done:
            try:
                report: Report = future.value()
            except Exception as exc:
                report = (f"{exc}", [])
            if report is None:
                continue
            if report[0] is not None and error is None:
                error = f"Error on Node {self.me.id}: {report[0]}"
            statuses.extend(report[1])
        with ctx.lock:
            rnd = ctx.round
            if rnd is not None and rnd.id == round_id:
                if not rnd.settled:
                    rnd.reported_unsettled = True
                    statuses.append((self.me.name, rnd.passes, False, sorted(ctx.known)))
                elif rnd.reported_unsettled:
                    statuses.append((self.me.name, rnd.passes, True, []))
        if error is None and not statuses:
            return None
        return (error, statuses)

    def _error(self, exc: BaseException) -> str:
        return f"Error on Node {self.me.id}: {exc}"


CURRENT_AUTOGRAD: Current[DistAutograd] = Current()


# ---- functions that run on the other workers ---------------------------------------------
@async_execution
def _propagate(
    context_id: int, round_id: int, retain_graph: bool, items: Items
) -> torch.futures.Future[Report]:
    return CURRENT_AUTOGRAD.get().serve(context_id, round_id, retain_graph, items)


def _release(context_id: int, sender: str) -> None:
    autograd = CURRENT_AUTOGRAD.peek()
    if autograd is not None:
        autograd.release(context_id, sender)
