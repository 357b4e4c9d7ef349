"""Distributed autograd on the rallypoint agent: contexts, sends and receives, backward.

torch's design (FAST mode), in Python. A context, named by an id unique in the job, is
carried by every call made in it; a message with tensors that require grad records a send
on the sender and a receive (a ``RecvRpcBackward`` node) on the receiver, which the codec
does. ``backward`` runs the local pass from the roots, and every received tensor it
reaches sends its gradient to its sender, which runs its own pass, and so on (one
worker's share of a pass: :mod:`._engine`). The pass ends by credit: :class:`DistAutograd`
hands out a credit of 1, every propagation carries an exact share, and ``backward``
returns when all of it is back, with any error. Leaf gradients accumulate in the context
(``get_gradients``), never in ``.grad``.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch.autograd.graph import Node

from rallypoint.rpc._backend import Caller
from rallypoint.rpc._current import Current
from rallypoint.rpc._device_maps import DeviceMap
from rallypoint.rpc._transport._spin import WAITS
from rallypoint.rpc._transport._wire import Unreadable
from rallypoint.rpc._worker_info import WorkerInfo
from rallypoint.rpc.dist_autograd import _routes as routes
from rallypoint.rpc.dist_autograd._checks import check_roots
from rallypoint.rpc.dist_autograd._context import (
    AutogradContext,
    SendRecord,
    edge_of,
    receive_message,
)
from rallypoint.rpc.dist_autograd._engine import Round, SourceKey, execute, track_node_hooks
from rallypoint.rpc.dist_autograd._routes import Notice, Offer, Outgoing

Grad: TypeAlias = "torch.Tensor | None"
Items: TypeAlias = "list[tuple[int, int, Grad]]"  # (message id, tensor index, gradient)
Status: TypeAlias = "tuple[str, int, bool, list[str]]"
"""A worker's state in a round: name, passes run, settled, the workers it talked to. Only
workers that waited at some point report; the status with the most passes is the latest."""
Weight: TypeAlias = "tuple[int, int]"
"""A share of a round's credit, as a fraction (numerator, denominator)."""
_Message: TypeAlias = (
    "tuple[Items, str, Weight, tuple[int, ...], list[Status], "
    "list[tuple[int, Offer]] | None, list[Notice] | None]"
)
"""A propagation: gradients, the worker that called backward, the credit share, the ranks
the gradients came through (torch's error text names them), statuses on their way, routes
offered, and notices of routed sends (see :mod:`._autograd_routes`)."""

_ONE: Weight = (1, 1)
_BACKWARD = "backward"  # the spin site of the thread waiting for a backward pass
_POLL = 0.05

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


class DistAutograd:
    """One worker's distributed autograd: its contexts, and the backward protocol.

    A context id has the worker's rank in its high bits, as torch's. The thread that
    created a context has it as its current one; a worker that receives a call made in it
    creates its own copy (same id), so nested calls carry it on. Leaving the ``with`` block
    releases the context here and, through one-way messages batched by the monitor, on
    every worker it touched. Termination by credit: a worker splits its share among the
    propagations its pass sends and gives it back to the caller of ``backward``
    (``_credit``) when it sends none. Any error in a pass (a local pass, sending or reading
    a gradient) fails the pass at once and comes back with the credit. A received tensor's
    gradient goes back with the inverse of the device map it came with. Unlike torch, a
    send whose gradient never comes does not hang the pass: a received tensor that no
    source reaches tells its sender "no gradient".
    """

    def __init__(
        self,
        me: WorkerInfo,
        caller: Caller,
        *,
        timeout: float,
        dead_workers: Callable[[], list[str]],
        worker_id: Callable[[str], int | None] = lambda name: None,
    ) -> None:
        self.me = me
        self._caller = caller
        track_node_hooks()
        self.timeout = timeout  # bounds a whole backward pass, as torch's RPC timeout does
        self._dead_workers = dead_workers
        self._worker_id = worker_id  # a peer's rank (None: not in the group any more)
        self._waiters: dict[tuple[int, int], _Waiter] = {}
        self._releases: queue.SimpleQueue[tuple[str, int]] = queue.SimpleQueue()
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
        """Drop a context; the workers it exchanged messages with hear of it in batches."""
        with self._lock:
            ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            return False
        for peer in ctx.known - {self.me.name, sender}:
            self._releases.put((peer, context_id))
        return True

    def send_releases(self) -> None:
        """Tell peers which contexts were released (the agent's monitor calls this)."""
        batches: dict[str, list[int]] = {}
        while True:
            try:
                peer, context_id = self._releases.get_nowait()
            except queue.Empty:
                break
            batches.setdefault(peer, []).append(context_id)
        for peer, ids in batches.items():
            self._caller.oneway(peer, _release, ids, self.me.name)

    def has_releases(self) -> bool:
        return not self._releases.empty()

    def __len__(self) -> int:
        return len(self._contexts)

    # ---- what torch's private helpers show (see _autograd_inspect) ------------------------
    def max_context_id(self) -> int:
        """The largest context id this worker can make (torch's ``_get_max_id``)."""
        return (self.me.id << _ID_BITS) + (1 << _ID_BITS) - 1

    def known_worker_ids(self, ctx: AutogradContext) -> set[int]:
        """The ranks of the workers ``ctx`` exchanged messages with (this one excluded)."""
        ids = {self._worker_id(name) for name in list(ctx.known) if name != self.me.name}
        return {i for i in ids if i is not None}

    def backward_passes(self) -> int:
        """Contexts with a backward pass running on this worker now: one it called, or
        one whose gradients it still expects."""
        running = {context_id for context_id, _ in list(self._waiters)}
        for ctx in list(self._contexts.values()):
            rnd = ctx.round
            if rnd is not None and not rnd.settled:
                running.add(ctx.id)
        return len(running)

    def close(self) -> None:
        with self._lock:
            self._contexts.clear()

    # ---- the codec's hooks ---------------------------------------------------------------
    def record_send(
        self,
        ctx: AutogradContext,
        dst: str,
        tensors: list[torch.Tensor],
        device_map: DeviceMap | None = None,
    ) -> int:
        """A message to ``dst`` (placed by ``device_map``) carries ``tensors`` that require
        grad: its message id."""
        message_id = next(self._message_ids)
        ctx.sends[message_id] = SendRecord(dst, [edge_of(t) for t in tensors], device_map)
        return message_id

    def receiver(
        self, ctx: AutogradContext, src: str, message_id: int, device_map: DeviceMap | None = None
    ) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
        """The hook that wraps the tensors of message ``message_id`` from ``src``, whose
        gradients go back with ``device_map``."""

        def receive(raws: list[torch.Tensor]) -> list[torch.Tensor]:
            return receive_message(ctx.recvs, src, message_id, raws, device_map)

        return receive

    # ---- backward ------------------------------------------------------------------------
    def backward(self, context_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        """Run the distributed backward pass from ``roots``; returns when it is done."""
        ctx = self.retrieve(context_id)
        roots = check_roots(roots)
        if any(key[0] == context_id for key in list(self._waiters)):
            raise RuntimeError(
                f"a distributed backward pass of context {context_id} is already running "
                "(on another thread); run one pass at a time in a context"
            )
        round_id = next(self._message_ids)
        arrivals: list[tuple[SourceKey, Grad]] = [
            ((-1, i), torch.ones_like(r)) for i, r in enumerate(roots)
        ]
        waiter = self._waiters[(context_id, round_id)] = _Waiter()
        try:
            try:
                outgoing, statuses = self._step(ctx, round_id, retain_graph, arrivals, roots)
            except Exception as exc:
                raise RuntimeError(self._error((), exc)) from exc
            trail = (self.me.id,)
            self._forward(ctx, round_id, retain_graph, outgoing, _ONE, trail, statuses)
            self._wait(waiter, context_id)
            asked = {self.me.name}
            while (targets := self._unheard(waiter, asked, context_id)) is not None:
                # workers wait for gradients from workers no pass reached: ask those
                # (their received tensors that no source reaches answer "no gradient")
                asked.update(targets)
                waiter = self._waiters[(context_id, round_id)] = _Waiter(waiter.latest)
                asking = Outgoing(items={target: [] for target in targets})
                self._forward(ctx, round_id, retain_graph, asking, _ONE, trail, [])
                self._wait(waiter, context_id)
        finally:
            self._waiters.pop((context_id, round_id), None)

    def _wait(self, waiter: _Waiter, context_id: int) -> None:
        """Until every share of the credit came back; raise the first error."""
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        already = set(self._dead_workers())
        while not WAITS.wait_lock(waiter.done, _POLL, _BACKWARD):
            dead = sorted(set(self._dead_workers()) - already)
            if dead:
                raise RuntimeError(
                    f"Error on Node {self.me.id}: workers {dead} died during the distributed "
                    f"backward pass of context {context_id}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(
                    f"Error on Node {self.me.id}: the distributed backward pass of context "
                    f"{context_id} did not finish within the RPC timeout ({self.timeout} s)"
                )
        if waiter.error is not None:
            raise RuntimeError(f"Error on Node {self.me.id}: {waiter.error}")

    def _unheard(self, waiter: _Waiter, asked: set[str], context_id: int) -> list[str] | None:
        """Workers to ask because others still wait for them; ``None``: all is done."""
        waiting = [s for s in waiter.latest.values() if not s[2]]
        if not waiting:
            return None
        targets = [w for s in waiting for w in s[3] if w not in asked]
        if not targets:
            raise RuntimeError(
                f"Error on Node {self.me.id}: the distributed backward pass of context "
                f"{context_id} cannot finish: workers {sorted(s[0] for s in waiting)} still "
                "wait for gradients of tensors they sent, and every worker they exchanged "
                "messages with has been asked"
            )
        return list(dict.fromkeys(targets))

    def serve(self, context_id: int, round_id: int, retain_graph: bool, message: _Message) -> None:
        """Gradients for tensors this worker sent arrived: run the pass they start."""
        items, origin, weight, trail, statuses, offers, notices = message
        mine, carried = routes.split(notices, self.me.name)
        try:
            unreadable: list[Any] = [g for _, _, g in items if isinstance(g, Unreadable)]
            if unreadable:  # decoded tolerantly: a gradient this worker could not place
                raise RuntimeError(f"could not read a gradient: {unreadable[0].error}")
            ctx = self.retrieve(context_id)
            arrivals: list[tuple[SourceKey, Grad]] = [((m, i), g) for m, i, g in items]
            outgoing, status = self._step(ctx, round_id, retain_graph, arrivals, (), offers, mine)
        except Exception as exc:
            error = self._error(trail, exc)
            self._give_back(origin, context_id, round_id, weight, error, statuses, carried)
            return
        if status:
            statuses = [*statuses, *status]
        trail = (*trail, self.me.id)
        self._forward(
            ctx, round_id, retain_graph, outgoing, weight, trail, statuses, origin, carried
        )

    def _step(
        self,
        ctx: AutogradContext,
        round_id: int,
        retain_graph: bool,
        arrivals: list[tuple[SourceKey, Grad]],
        roots: Sequence[torch.Tensor],
        offers: list[tuple[int, Offer]] | None = None,
        notices: list[int] | None = None,
    ) -> tuple[Outgoing, list[Status]]:
        """One local pass (under the context's lock): what to send, per peer, and this
        worker's status if the initiator must hear it (it waited at some point)."""
        with ctx.lock:
            rnd = ctx.round
            dead: list[Node] = []
            if rnd is None or rnd.id != round_id:
                rnd = ctx.round = Round(round_id, retain_graph, ctx.sources(roots), ctx.recvs)
                # received tensors that no source reaches get no gradient in this round
                dead = [node for node in list(ctx.recvs) if not rnd.reaches(node)]
            if offers:
                routes.learn(rnd, offers)
            skip = routes.routed_nodes(ctx, notices) if notices else ()
            if notices:  # gradients that went straight on: their sends are done here
                arrivals = arrivals + [
                    ((m, i), None) for m in notices for i in range(len(ctx.sends[m].edges))
                ]
            plan = rnd.plan(arrivals)
            plan.recv_dead.extend(dead)
            outcome = execute(rnd, plan)
            ctx.accumulate(outcome.leaves)
            for hooks, grad in outcome.hooks:  # an AccumulateGrad node's, after it ran
                for hook in hooks:
                    hook((), (grad,))
            outgoing = Outgoing()
            for node, sent in outcome.recv:
                if node in skip:
                    continue
                record = ctx.recvs[node]
                me, peer, message_id = self.me.name, record.peer, record.message_id
                if rnd.routes and routes.add(outgoing, rnd, me, peer, message_id, sent):
                    continue
                grads = [(message_id, i, sent.get(i)) for i in range(record.outputs)]
                outgoing.add(peer, grads, record.device_map)
            if outgoing.items:
                routes.offer(ctx, rnd, (self.me.name, self.me.id), outgoing)
            settled = rnd.settled
            if not settled:
                rnd.reported_unsettled = True
            elif not rnd.reported_unsettled:
                return outgoing, []
            known = [] if settled else sorted(ctx.known)
            return outgoing, [(self.me.name, rnd.passes, settled, known)]

    def _forward(
        self,
        ctx: AutogradContext,
        round_id: int,
        retain_graph: bool,
        outgoing: Outgoing,
        weight: Weight,
        trail: tuple[int, ...],
        statuses: list[Status],
        origin: str | None = None,
        carried: list[Notice] | None = None,
    ) -> None:
        """Send the gradients on, each with a share of the credit (or give the credit back).

        Notices for the origin travel with the credit, as statuses do: no message of their own."""
        origin = origin or self.me.name
        carried, direct = routes.sort_notices(outgoing, origin, carried)
        peers = list(dict.fromkeys([*outgoing.items, *direct]))
        if not peers:
            self._give_back(origin, ctx.id, round_id, weight, None, statuses, carried)
            return
        sends: list[tuple[str, Items, DeviceMap, bool]] = [
            (peer, outgoing.items.get(peer, []), outgoing.maps.get(peer, {}), True)
            for peer in peers
        ]
        sends += [(peer, items, device_map, False) for peer, device_map, items in outgoing.extra]
        share = weight if len(sends) == 1 else _split(weight, len(sends))
        saved = getattr(_tls, "ctx", None)
        _tls.ctx = None  # protocol messages are not part of the context's forward pass
        try:
            for peer, items, device_map, first in sends:
                via = outgoing.via.get(peer) if first else None
                message: _Message = (
                    items,
                    origin,
                    share,
                    trail if via is None else (*trail, via),
                    statuses,
                    outgoing.offers or None,
                    ([*direct.get(peer, ()), *carried] or None) if first else None,
                )
                error = self._send(peer, ctx.id, round_id, retain_graph, message, device_map)
                if error is not None:
                    error = error if origin == self.me.name else self._error(trail[:-1], error)
                    self._give_back(origin, ctx.id, round_id, share, error, statuses, carried)
                statuses, carried = [], []
        finally:
            _tls.ctx = saved

    def _send(
        self,
        peer: str,
        context_id: int,
        round_id: int,
        retain_graph: bool,
        message: _Message,
        device_map: DeviceMap,
    ) -> str | None:
        """Send one propagation; why it could not go (the caller gives its share back with
        that error, so the pass fails at once), or ``None``."""
        try:
            sent = self._caller.oneway(
                peer, _propagate, context_id, round_id, retain_graph, *_flat(message),
                device_map=device_map,
            )  # fmt: skip
        except Exception as exc:  # e.g. a gradient on a device the map has no entry for
            return str(exc)
        return None if sent else f"cannot reach worker {peer}"

    def _give_back(
        self,
        origin: str,
        context_id: int,
        round_id: int,
        weight: Weight,
        error: str | None,
        statuses: list[Status],
        notices: list[Notice] | None = None,
    ) -> None:
        if origin == self.me.name:
            self.credit(context_id, round_id, weight, error, statuses, notices)
            return
        # only atomic arguments in the common case: the codec's fastest path
        num, den = weight
        self._caller.oneway(
            origin,
            _credit,
            context_id,
            round_id,
            num,
            den,
            error,
            statuses or None,
            notices or None,
        )

    def credit(
        self,
        context_id: int,
        round_id: int,
        weight: Weight,
        error: str | None,
        statuses: list[Status],
        notices: list[Notice] | None = None,
    ) -> None:
        """A share of a round's credit came back (to the worker that called backward), with
        notices of this worker's sends that went straight on (its pass settles them)."""
        ctx = self._contexts.get(context_id)
        rnd = None if ctx is None else ctx.round
        if notices and ctx is not None and rnd is not None and rnd.id == round_id:
            try:
                mine = [message_id for _, message_id in notices]
                _, status = self._step(ctx, round_id, False, [], (), None, mine)
                statuses = [*statuses, *status]
            except Exception as exc:
                error = error or self._error((), exc)
        with self._lock:
            waiter = self._waiters.get((context_id, round_id))
            if waiter is not None:
                waiter.add(weight, error, statuses)

    def _error(self, trail: tuple[int, ...], exc: BaseException | str) -> str:
        """torch's text: ``Error on Node N: `` for every worker the gradient came through."""
        via = "".join(f"Error on Node {node}: " for node in trail[1:])
        return f"{via}Error on Node {self.me.id}: {exc}"


def _reduced(num: int, den: int) -> Weight:
    common = math.gcd(num, den)
    return (num // common, den // common)


def _split(weight: Weight, n: int) -> Weight:
    """One of ``n`` equal shares of ``weight`` (exact: integers, no ``Fraction``, whose
    arithmetic is slow on the path that ends a backward pass)."""
    return _reduced(weight[0], weight[1] * n)


def _held_lock() -> threading.Lock:
    lock = threading.Lock()
    lock.acquire()
    return lock


@dataclass(slots=True, eq=False)
class _Waiter:
    """The worker that called backward: the credit that came back, errors, statuses."""

    latest: dict[str, Status] = field(default_factory=dict)
    credit: Weight = (0, 1)  # the credit back so far, as a reduced fraction
    error: str | None = None
    # a latch: held until all the credit is back. A lock wakes the waiting thread with one
    # futex wake, where an Event's condition variable costs the waker and the woken thread
    # a second lock hand-over (about 50 us per backward pass on 2 busy vCPUs)
    done: threading.Lock = field(default_factory=_held_lock)
    finished: bool = False
    thread: int = field(default_factory=threading.get_ident)  # the one that waits

    def add(self, weight: Weight, error: str | None, statuses: list[Status]) -> None:
        (num, den), (add_num, add_den) = self.credit, weight
        self.credit = _reduced(num * add_den + add_num * den, den * add_den)
        if error is not None and self.error is None:
            self.error = error
        for status in statuses:
            seen = self.latest.get(status[0])
            if seen is None or status[1] >= seen[1]:
                self.latest[status[0]] = status
        if self.credit[0] >= self.credit[1] and not self.finished:
            self.finished = True
            WAITS.waking(self.thread)
            self.done.release()


CURRENT_AUTOGRAD: Current[DistAutograd] = Current()


# ---- functions that run on the other workers ---------------------------------------------
def _flat(message: _Message) -> tuple[Any, ...]:
    """A propagation as plain data and then its gradients, each an argument of its own: the
    codec's lean form takes it (see :mod:`._flat_wire`) when the gradients are plain tensors."""
    items, *rest = message
    return ([(m, i) for m, i, _ in items], *rest), *(grad for _, _, grad in items)


def _propagate(context_id: int, round_id: int, retain_graph: bool, meta: Any, *grads: Grad) -> None:
    keys, *rest = meta
    items = [(m, i, grad) for (m, i), grad in zip(keys, grads, strict=True)]
    message: _Message = (items, *rest)
    CURRENT_AUTOGRAD.get().serve(context_id, round_id, retain_graph, message)


def _credit(
    context_id: int,
    round_id: int,
    num: int,
    den: int,
    error: str | None,
    statuses: list[Status] | None,
    notices: list[Notice] | None = None,
) -> None:
    CURRENT_AUTOGRAD.get().credit(context_id, round_id, (num, den), error, statuses or [], notices)


def _release(context_ids: list[int], sender: str) -> None:
    autograd = CURRENT_AUTOGRAD.peek()
    if autograd is not None:
        for context_id in context_ids:
            autograd.release(context_id, sender)
