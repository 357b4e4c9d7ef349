"""A failure anywhere in a distributed backward pass fails the caller's ``backward`` at once
(well within a second on an idle machine), never at the RPC timeout (60 s here); the tests
bound it far from both (``AT_ONCE``), for a loaded machine.

Real processes on CPU: an error raised by the callee's own backward (a custom
``autograd.Function``); a gradient the callee cannot send (a tensor on a device its map
has no entry for: the issue's hang, staged here by making the callee see the gradient as
a ``cuda:0`` tensor); and a gradient the caller cannot place (the callee sends it, with
the reverse of the caller's map, to ``cuda:0``, which a CPU-only caller lacks). The last
one also shows which map the gradient goes back with: the inverse of the caller's map,
although the callee has no map of its own.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.rpc import dist_autograd
from rallypoint.testing import run_workers

ENV = {RPC_SECRET: "autograd-errors"}
AT_ONCE = 20.0
"""Seconds: "at once", against the 60 s RPC timeout a lost error waits for (what it takes on
an idle machine, a fraction of a second, is a benchmark's business; a loaded CI is slow)."""
MARK = (7,)  # the shape of the tensor the callee sees as a cuda:0 tensor


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom in the callee's backward")


def _fails_in_backward(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _FailsInBackward.apply(x)  # type: ignore[no-untyped-call]
    return out.sum()


def _double_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum()


class _OnCuda:
    """What ``_send_device`` reads of a tensor: its device."""

    device = torch.device("cuda", 0)


def _see_marked_tensors_on_cuda() -> None:
    """This worker takes tensors of shape ``MARK`` for cuda:0 tensors when it sends them,
    in the general wire form (the lean form takes only CPU tensors without a map)."""
    from rallypoint.rpc._transport import _flat_wire, _wire

    real = _wire._send_device

    def send_device(tensor: Any, device_map: Any, dst: str, response: bool = False) -> Any:
        seen: Any = _OnCuda() if tuple(tensor.shape) == MARK else tensor
        return real(seen, device_map, dst, response)

    _wire._send_device = send_device
    _flat_wire.encode = lambda *args, **kwargs: None


def _one_backward(case: str) -> tuple[str, float, list[float] | None]:
    rank = int(os.environ["RANK"])
    options = rpc.RallypointRpcBackendOptions(rpc_timeout=60)
    if case == "mapped":
        from rallypoint.rpc._group import _groups

        _groups.device_count = lambda: 1  # a map onto cuda:0 is valid on a CPU-only machine
        if rank == 0:
            options.set_device_map("w1", {0: 0})  # w1 has no map: only the reverse one
    if rank == 1 and case in ("refused", "mapped"):
        _see_marked_tensors_on_cuda()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out: tuple[str, float, list[float] | None] = ("", 0.0, None)
    if rank == 0:
        fn = _fails_in_backward if case == "remote" else _double_sum
        t = torch.ones(MARK, requires_grad=True)
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("w1", fn, args=(t,))
            t0 = time.monotonic()
            try:
                dist_autograd.backward(cid, [loss])
                grad = dist_autograd.get_gradients(cid)[t]
                out = (f"ok on {grad.device}", time.monotonic() - t0, grad.cpu().tolist())
            except RuntimeError as exc:
                out = (str(exc), time.monotonic() - t0, None)
    rpc.shutdown()
    return out


def _run(case: str) -> tuple[str, float, list[float] | None]:
    result: tuple[str, float, list[float] | None] = run_workers(
        _one_backward, 2, case, timeout=100, env=ENV
    )[0]
    return result


@pytest.mark.timeout(120)
def test_an_error_in_the_callees_backward_fails_the_caller_at_once() -> None:
    text, seconds, _ = _run("remote")
    assert seconds < AT_ONCE, (seconds, text)
    assert text.startswith("Error on Node 0: Error on Node 1: "), text
    assert "boom in the callee's backward" in text


@pytest.mark.timeout(120)
def test_a_gradient_the_callee_cannot_send_fails_the_caller_at_once() -> None:
    """The issue's hang: the callee has no device map entry for its gradient's device. The
    refusal (torch's words) comes back with the pass's credit instead of being lost."""
    text, seconds, _ = _run("refused")
    assert seconds < AT_ONCE, (seconds, text)
    assert text.startswith("Error on Node 0: Error on Node 1: TensorPipe RPC backend only "), text
    assert "Request device mapping is not available for destination w0" in text
    assert "set_device_map('w0', {'cuda:0': ...})" in text


@pytest.mark.timeout(120)
def test_the_gradient_goes_back_with_the_reverse_of_the_callers_map() -> None:
    """w0 maps its cuda:0 to w1's cuda:0 and w1 has no map: the gradient of w0's tensor
    goes back to w0's cuda:0. Without a GPU, w0 cannot place it there, and says so at once
    (one-way propagations are decoded tolerantly); with one, it arrives there."""
    text, seconds, grad = _run("mapped")
    if torch.cuda.device_count() > 0:
        assert text == "ok on cuda:0" and grad == [2.0] * MARK[0], text
        return
    assert seconds < AT_ONCE, (seconds, text)
    assert text.startswith("Error on Node 0: Error on Node 1: Error on Node 0: could not "), text
    assert "tensor was mapped to cuda:0 but this worker has no CUDA" in text
