"""Views, strides and shared storages across RPC, compared with torch's TensorPipe.

torch sends a tensor with its strides and storage offset, and tensors of one message that
share a storage share it on arrival (an in-place change to one shows in the others).
rallypoint does the same, sending only the bytes the message's views cover.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from rallypoint import rpc
from rallypoint.rpc._transport import _wire
from rallypoint.testing._workers import runner_for

SECRET = {"RALLYPOINT_RPC_SECRET": "views-secret"}


def _layout(*tensors: torch.Tensor) -> list[Any]:
    return [(tuple(t.shape), t.stride(), t.is_contiguous(), t.tolist()) for t in tensors]


def _zero_first(*tensors: torch.Tensor) -> list[Any]:
    tensors[0].zero_()  # shows in every tensor that shares its storage
    return [t.tolist() for t in tensors]


def _echo(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tensors


def _views() -> tuple[torch.Tensor, ...]:
    x = torch.arange(24.0).reshape(4, 6)
    return (x.t(), x[:, 1:3], x[1:3], torch.ones(3).expand(4, 3), x.permute(1, 0)[::2], x[1])


def _program(backend: str) -> dict[str, Any] | None:
    rank = int(os.environ["RANK"])
    kind = rpc.BackendType[backend]
    rpc.init_rpc(f"w{rank}", backend=kind, rank=rank, world_size=2)
    out = None
    if rank == 0:
        x = torch.arange(12.0).reshape(3, 4)
        out = {
            "args": rpc.rpc_sync("w1", _layout, args=_views()),
            "returned": _layout(*rpc.rpc_sync("w1", _echo, args=_views())),
            "aliases": rpc.rpc_sync("w1", _zero_first, args=(x.t(), x, x[2], x[:, 1])),
            "separate": rpc.rpc_sync("w1", _zero_first, args=(x, x.clone())),
            "same_twice": rpc.rpc_sync("w1", _zero_first, args=(x[1], x[1])),
            "sender_unchanged": x.tolist(),
        }
    rpc.shutdown()
    if rank == 0 and backend == "TENSORPIPE":
        time.sleep(0.5)  # torch's shutdown: the store host must outlive the other's barrier
    return out


@pytest.mark.timeout(120)
def test_views_strides_and_shared_storages_arrive_as_with_tensorpipe() -> None:
    results = {
        backend: runner_for(backend)(_program, 2, backend, timeout=60, env=SECRET)[0]
        for backend in ("TENSORPIPE", "RALLYPOINT")
    }
    assert results["RALLYPOINT"] == results["TENSORPIPE"]
    # what the comparison covers, so that it cannot pass on two empty results
    got = results["RALLYPOINT"]
    assert got["args"][0][1] == (1, 6) and got["args"][3][1] == (0, 1)
    assert got["aliases"][2] == [0.0] * 4 and got["separate"][1] != [[0.0] * 4] * 3


def _roundtrip(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    data, raws = _wire.encode(obj)
    return _wire.decode(data, [r.clone() for r in raws]), raws


def test_only_the_bytes_the_views_cover_are_sent() -> None:
    big = torch.arange(1 << 20, dtype=torch.float32)
    (got,), raws = _roundtrip((big[1000:1004],))
    assert got.tolist() == [1000.0, 1001.0, 1002.0, 1003.0]
    assert sum(r.numel() for r in raws) <= 16 + 2 * 16  # the span, padded to 16 bytes
    expanded = torch.arange(3.0).expand(1000, 3)
    (got,), raws = _roundtrip((expanded,))
    assert got.stride() == (0, 1) and sum(r.numel() for r in raws) == 12  # not 12,000
    assert torch.equal(got, expanded)


def test_views_of_other_dtypes_and_lazy_conjugates_keep_their_values() -> None:
    x = torch.arange(8, dtype=torch.float64)
    c = torch.complex(torch.ones(3), torch.arange(3.0)).conj()  # a lazy conjugate view
    (a, b, cc), _ = _roundtrip((x[3:], x.view(torch.int32)[1::3], c))
    assert torch.equal(a, x[3:]) and torch.equal(b, x.view(torch.int32)[1::3])
    assert torch.equal(cc, c.resolve_conj())
    assert b[2] != 0  # the high half of 3.0
    a.zero_()  # one storage on arrival, as on the sender's side
    assert b.tolist()[2:] == [0, 0, 0]


def test_a_bad_offset_is_refused() -> None:
    data, raws = _wire.encode((torch.arange(16.0)[8:],))
    assert data[:1] == b"S"  # bytes 32..64 are sent: the table says where they start
    assert torch.equal(_wire.decode(data, raws)[0], torch.arange(8.0, 16.0))
    bad = bytearray(data)
    lo = _wire._SPANS.size  # the first entry's lo: 30 leaves a view 2 bytes off a float
    bad[lo : lo + 8] = (30).to_bytes(8, "little", signed=True)
    with pytest.raises(ValueError, match="bad tensor offset"):
        _wire.decode(bytes(bad), raws)
