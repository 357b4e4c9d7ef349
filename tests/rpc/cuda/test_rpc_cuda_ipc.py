"""The same-host GPU path (marked ``cuda``; skipped without a GPU): two processes on cuda:0.

- CUDA IPC is chosen between two processes of one host, staging when either worker turns
  it off (``cuda_ipc=False``, said once in the log) or the map sends the tensor to the CPU;
  a tensor received by CUDA IPC is one torch refuses to share again, which tells them apart.
- What the receiver got does not change when the sender writes its tensor right after the
  call (nor the other way round), by either path.
- The receiver's stream waits for the sender's work, and a reply used on another stream
  than the one it was decoded on is ready there.
- No GPU memory growth over 1,000 echoes (torch's IPC "limbo" is collected).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest
import torch
from _gpu import need_gpus

from rallypoint import rpc
from rallypoint._core.envvars import RPC_SECRET
from rallypoint.testing import run_workers

ENV = {RPC_SECRET: "cuda-ipc"}
N = 1 << 20
_KEPT: list[torch.Tensor] = []
_LOG: list[str] = []


class _Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _LOG.append(record.getMessage())


def _init(ipc: dict[int, bool], target: Any = 0) -> int:
    rank = int(os.environ["RANK"])
    logging.getLogger("rallypoint.rpc").addHandler(_Lines())
    options = rpc.RallypointRpcBackendOptions(rpc_timeout=60, cuda_ipc=ipc.get(rank, True))
    if rank == 0:
        options.set_device_map("w1", {0: target})
    torch.cuda.set_device(0)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    return rank


def _by_ipc(x: torch.Tensor) -> bool:
    """Whether ``x`` came by CUDA IPC: torch will not share a storage it received."""
    if x.device.type != "cuda":
        return False
    try:
        x.untyped_storage()._share_cuda_()
    except RuntimeError as exc:
        return "received from another process" in str(exc)
    return False


def _how(ipc: dict[int, bool], target: Any) -> tuple[bool, str, list[str]] | None:
    rank = _init(ipc, target)
    out = None
    if rank == 0:
        x = torch.ones(N, device="cuda:0")
        for _ in range(3):
            came, device = rpc.rpc_sync("w1", _arrival, args=(x,))
        out = (came, device, [line for line in _LOG if "staged" in line])
    rpc.shutdown()
    return out


def _arrival(x: torch.Tensor) -> tuple[bool, str]:
    return _by_ipc(x), str(x.device)


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("ipc", "target", "expected"),
    [
        ({}, 0, (True, "cuda:0", [])),
        ({0: False}, 0, (False, "cuda:0", ["CUDA IPC is off on this worker: cuda_ipc=False"])),
        ({1: False}, 0, (False, "cuda:0", ["CUDA IPC is off on w1: cuda_ipc=False"])),
        ({}, "cpu", (False, "cpu", [])),
    ],
    ids=["ipc", "off-on-the-sender", "off-on-the-receiver", "mapped-to-cpu"],
)
def test_ipc_on_one_host_staging_otherwise(
    ipc: dict[int, bool], target: Any, expected: tuple[bool, str, list[str]]
) -> None:
    need_gpus(1)
    came, device, lines = run_workers(_how, 2, ipc, target, timeout=200, env=ENV)[0]
    assert (came, device) == expected[:2]
    assert len(lines) == len(expected[2])  # one line, however many tensors went that way
    for line, reason in zip(lines, expected[2], strict=True):
        assert line.startswith("rallypoint.rpc: CUDA tensors from w0 to w1 are staged") and (
            reason in line
        ), line


def _by_size(threshold: int | None) -> list[tuple[int, bool, bool]]:
    rank = int(os.environ["RANK"])
    extra = {} if threshold is None else {"cuda_ipc_threshold": threshold}
    options = rpc.RallypointRpcBackendOptions(rpc_timeout=60, **extra)
    if rank == 0:
        options.set_device_map("w1", {0: 0})
    torch.cuda.set_device(0)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out = []
    if rank == 0:
        for nbytes in (4, 1 << 10, (256 << 10) - 4, 256 << 10, 1 << 20):
            x = torch.arange(nbytes // 4, dtype=torch.float32, device="cuda:0")
            came, _ = rpc.rpc_sync("w1", _arrival, args=(x,))
            back = rpc.rpc_sync("w1", _echo, args=(x,))
            out.append((nbytes, came, torch.equal(back, x)))
    rpc.shutdown()
    return out


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("threshold", [None, 0], ids=["default", "always-ipc"])
def test_small_tensors_travel_inline_and_large_ones_by_ipc(threshold: int | None) -> None:
    need_gpus(1)
    out = run_workers(_by_size, 2, threshold, timeout=200, env=ENV)[0]
    limit = 256 << 10 if threshold is None else 0
    assert out == [(n, n >= limit, True) for n in (4, 1 << 10, (256 << 10) - 4, 256 << 10, 1 << 20)]


def _keep(x: torch.Tensor) -> None:
    _KEPT.append(x)


def _kept_sum(i: int) -> float:
    return float(_KEPT[i].sum())


def _zero_kept(i: int) -> None:
    _KEPT[i].zero_()


def _writes(ipc: bool) -> dict[str, float]:
    rank = _init({0: ipc, 1: ipc})
    out: dict[str, float] = {}
    if rank == 0:
        t = torch.ones(N, device="cuda:0")
        fut = rpc.rpc_async("w1", _keep, args=(t,))
        t.add_(1)  # right after the call, before it is done
        fut.wait()
        out["async"] = rpc.rpc_sync("w1", _kept_sum, args=(0,))
        u = torch.ones(N, device="cuda:0")
        rpc.rpc_sync("w1", _keep, args=(u,))
        u.mul_(5)
        out["sync"] = rpc.rpc_sync("w1", _kept_sum, args=(1,))
        rpc.rpc_sync("w1", _zero_kept, args=(1,))  # the receiver writes its own
        out["sender_after_receiver_wrote"] = float(u.sum())
    rpc.shutdown()
    return out


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ipc", [True, False], ids=["ipc", "staged"])
def test_writes_after_the_call_do_not_reach_the_other_side(ipc: bool) -> None:
    need_gpus(1)
    out = run_workers(_writes, 2, ipc, timeout=200, env=ENV)[0]
    assert out == {"async": float(N), "sync": float(N), "sender_after_receiver_wrote": 5.0 * N}


def _sum_now(x: torch.Tensor) -> float:
    return float(x.sum())


def _slow_ones(n: int) -> torch.Tensor:
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream, then the value
    return torch.ones(n, device="cuda:0")


def _streams(ipc: bool) -> dict[str, float]:
    rank = _init({0: ipc, 1: ipc})
    out: dict[str, float] = {}
    if rank == 0:
        x = torch.zeros(N, device="cuda:0")
        torch.cuda._sleep(200_000_000)
        x.fill_(1)  # still queued behind the sleep when the call goes out
        out["receiver_waited"] = rpc.rpc_sync("w1", _sum_now, args=(x,))
        fut = rpc.rpc_async("w1", _slow_ones, args=(N,))
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            y = fut.wait()
            total = y.sum()
        other.synchronize()
        out["reply_on_another_stream"] = float(total)
    rpc.shutdown()
    return out


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ipc", [True, False], ids=["ipc", "staged"])
def test_streams_wait_for_the_work_that_made_the_tensor(ipc: bool) -> None:
    need_gpus(1)
    out = run_workers(_streams, 2, ipc, timeout=200, env=ENV)[0]
    assert out == {"receiver_waited": float(N), "reply_on_another_stream": float(N)}


def _allocated() -> tuple[int, int, int]:
    """This process's allocated and reserved bytes after emptying its cache, and the device's
    free bytes: a block the allocator keeps cached is reserved, not leaked."""
    torch.cuda.synchronize()
    time.sleep(0.2)  # the monitor collects torch's IPC limbo every 50 ms
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(), reserved, torch.cuda.mem_get_info()[0]


def _echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _memory() -> dict[str, int]:
    """Allocated bytes on both sides and the device's free bytes after 20 warm-up echoes,
    then after each of two rounds of 1,000: what a leak makes grows in both rounds."""
    rank = _init({})
    out: dict[str, int] = {}
    if rank == 0:
        x = torch.rand(N // 4, device="cuda:0")  # 1 MiB: by CUDA IPC
        seen = []
        for echoes in (20, 1000, 1000):
            for _ in range(echoes):
                y = rpc.rpc_sync("w1", _echo, args=(x,))
            assert torch.equal(y, x)
            del y
            theirs, _, _ = rpc.rpc_sync("w1", _allocated)  # its cache emptied before ours is read
            mine, _, free = _allocated()
            seen.append((mine, theirs, free))
        (mine0, theirs0, free0), (_, _, free1), (mine2, theirs2, free2) = seen
        out = {
            "w0": mine2 - mine0,
            "w1": theirs2 - theirs0,
            "device, first 1000": free0 - free1,
            "device, second 1000": free1 - free2,
        }
    rpc.shutdown()
    return out


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_no_gpu_memory_growth_over_2000_echoes() -> None:
    """The driver's memory may grow once while the first echoes run (on an H100, 90 MiB
    over the first 1,000 with torch's allocated bytes unchanged); a leak grows again."""
    need_gpus(1)
    out = run_workers(_memory, 2, timeout=250, env=ENV)[0]
    print(out)
    assert out["w0"] <= 2 << 20 and out["w1"] <= 2 << 20, out  # at most a block in limbo
    assert out["device, second 1000"] <= 8 << 20, out  # nothing leaks outside torch's allocator
