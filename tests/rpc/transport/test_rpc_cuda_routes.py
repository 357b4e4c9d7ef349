"""Which way a CUDA tensor goes (pure logic, on CPU): CUDA IPC on one host when both
workers allow it and the receiver sees the sender's GPU, else staged through pinned host
memory with one log line per peer and reason; what a worker publishes for that; and the
wire form of a tensor mapped to a GPU (decoded tolerantly, it reports what went wrong)."""

from __future__ import annotations

import logging

import pytest
import torch

from rallypoint.rpc import RallypointRpcBackendOptions
from rallypoint.rpc._group._groups import WorkerRecord
from rallypoint.rpc._transport import _wire
from rallypoint.rpc._transport._cuda_routes import (
    CudaInfo,
    CudaPath,
    CudaRouter,
    Peer,
    Route,
    choose,
)

CUDA0 = torch.device("cuda", 0)


def _info(visible: tuple[str, ...] | None = None, **changes: object) -> CudaInfo:
    base = {"ipc": True, "why_not": "", "ipc_ns": 7, "order": "FASTEST_FIRST", "visible": visible}
    base.update(changes)
    return CudaInfo(**base)  # type: ignore[arg-type]


def _peer(name: str, info: CudaInfo | None, host: str = "h", count: int = 2) -> Peer:
    return Peer(name, host, info, count)


ME = _peer("w0", _info())


def test_this_process_publishes_its_visible_devices_without_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    info = CudaInfo.of_this_process(True)
    assert info.ipc and info.visible is None and info.order == "FASTEST_FIRST"
    assert info.gpu(1) == "FASTEST_FIRST:1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-abc")
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    info = CudaInfo.of_this_process(True)
    assert info.visible == ("3", "GPU-abc")
    assert (info.gpu(0), info.gpu(1), info.gpu(2)) == ("PCI_BUS_ID:3", "GPU-abc", None)
    assert CudaInfo.from_json(info.to_json()) == info
    off = CudaInfo.of_this_process(False)
    assert not off.ipc and off.why_not == "cuda_ipc=False in its options"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1234")
    mig = CudaInfo.of_this_process(True)
    assert not mig.ipc and "MIG" in mig.why_not


def test_records_carry_it_and_older_records_without_it_still_read() -> None:
    record = WorkerRecord(
        name="w0", rank=0, host="127.0.0.1", port=1, uds="u", host_key="h", device_count=1,
        device_maps={"w1": {CUDA0: CUDA0}}, devices=[], cuda=_info(("0",)),
    )  # fmt: skip
    assert WorkerRecord.from_json(record.to_json()) == record
    old = record.to_json().replace(', "cuda": ' + _cuda_json(record), "")
    assert '"cuda"' not in old and WorkerRecord.from_json(old).cuda is None


def _cuda_json(record: WorkerRecord) -> str:
    import json

    assert record.cuda is not None
    return json.dumps(record.cuda.to_json())


def test_the_option_is_a_bool() -> None:
    assert RallypointRpcBackendOptions().cuda_ipc is True
    with pytest.raises(TypeError, match="cuda_ipc must be True or False"):
        RallypointRpcBackendOptions(cuda_ipc="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.5, "1k", True])
def test_the_ipc_threshold_is_a_byte_count(bad: object) -> None:
    assert RallypointRpcBackendOptions().cuda_ipc_threshold == 256 << 10
    with pytest.raises((TypeError, ValueError), match="cuda_ipc_threshold"):
        RallypointRpcBackendOptions(cuda_ipc_threshold=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("peer", "source", "target", "expected"),
    [
        (_peer("w1", _info()), 0, CUDA0, Route(CudaPath.IPC, index=0)),
        (_peer("w1", _info()), 1, torch.device("cuda", 0), Route(CudaPath.IPC, index=1)),
        (_peer("w1", _info()), 0, torch.device("cpu"), "the map sends it to cpu"),
        (_peer("w0", _info()), 0, CUDA0, "the receiver is this process"),
        (_peer("w1", _info(), host="other"), 0, CUDA0, "the receiver is on another host"),
        (_peer("w1", _info(ipc=False, why_not="x")), 0, CUDA0, "CUDA IPC is off on w1: x"),
        (_peer("w1", None), 0, CUDA0, "CUDA IPC is off on w1: it published no GPU information"),
        (_peer("w1", _info(ipc_ns=8)), 0, CUDA0, "w1 is in another IPC namespace"),
        (_peer("w1", _info(), count=1), 1, CUDA0, "w1 does not see this worker's cuda:1"),
        (_peer("w1", _info(order="PCI_BUS_ID")), 0, CUDA0, "does not see this worker's cuda:0"),
    ],
    ids=[
        "same-gpu",
        "opened-on-the-receivers-index-of-that-gpu",
        "mapped-to-cpu",
        "itself",
        "other-host",
        "peer-off",
        "peer-unknown",
        "other-container",
        "gpu-not-visible",
        "other-device-order",
    ],
)
def test_routes(peer: Peer, source: int, target: torch.device, expected: Route | str) -> None:
    route = choose(ME, peer, source, target)
    if isinstance(expected, Route):
        assert route == expected
    else:
        assert route.path is CudaPath.STAGED and expected in route.reason, route


def test_gpus_are_matched_by_their_visible_names() -> None:
    """The sender's cuda:1 is physical GPU 3; the receiver sees GPUs 3 and 5 as cuda:0 and
    cuda:1: it opens the memory on its cuda:0. A UUID names the same GPU whatever the order."""
    me = _peer("w0", _info(("2", "3")))
    assert choose(me, _peer("w1", _info(("3", "5"))), 1, CUDA0) == Route(CudaPath.IPC, index=0)
    assert choose(me, _peer("w1", _info(("5",))), 1, CUDA0).path is CudaPath.STAGED
    everything = _peer("w1", _info(None), count=4)  # no CUDA_VISIBLE_DEVICES: GPU 3 is cuda:3
    assert choose(me, everything, 1, CUDA0) == Route(CudaPath.IPC, index=3)
    uuid = _peer("w0", _info(("GPU-a",), order="PCI_BUS_ID"))
    assert choose(uuid, _peer("w1", _info(("GPU-b", "GPU-a"))), 0, CUDA0).index == 1
    off = _peer("w0", _info(ipc=False, why_not="cuda_ipc=False in its options"))
    assert (
        "off on this worker: cuda_ipc=False" in choose(off, _peer("w1", _info()), 0, CUDA0).reason
    )


def test_the_router_logs_each_fallback_once_and_follows_record_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    peers = {"w1": _peer("w1", _info(ipc_ns=8)), "w2": _peer("w2", _info(), host="other")}
    router = CudaRouter(ME, peers.get)
    with caplog.at_level(logging.INFO, logger="rallypoint.rpc"):
        for _ in range(3):
            assert router.route("w1", CUDA0, CUDA0).path is CudaPath.STAGED
            assert router.route("w2", CUDA0, CUDA0).path is CudaPath.STAGED
        assert router.route("w3", CUDA0, CUDA0).reason == "w3 is not in the group"
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (
            logging.WARNING,
            "rallypoint.rpc: CUDA tensors from w0 to w1 are staged through pinned host memory: "
            "w1 is in another IPC namespace",
        ),
        (
            logging.INFO,
            "rallypoint.rpc: CUDA tensors from w0 to w2 are staged through pinned host memory: "
            "the receiver is on another host",
        ),
    ]
    peers["w1"] = _peer("w1", _info())  # it left and joined again, now in our namespace
    assert router.route("w1", CUDA0, CUDA0) == Route(CudaPath.IPC, index=0)


def test_a_tensor_mapped_to_a_gpu_is_marked_and_a_tolerant_decode_reports_it() -> None:
    """On a worker without CUDA, a CPU tensor mapped to cuda:0 cannot be placed: a call
    fails with the reason, a one-way call gets an ``Unreadable`` in the tensor's place."""
    x = torch.arange(6.0)
    data, raws = _wire.encode((len, (x, 3), {}), dst="w1", device_map={torch.device("cpu"): CUDA0})
    assert data[:1] == b"C"
    if torch.cuda.is_available():
        pytest.skip("this worker has CUDA: the tensor is placed")
    with pytest.raises(RuntimeError, match="tensor was mapped to cuda:0 but this worker has no"):
        _wire.decode(data, raws)
    _, (got, three), _ = _wire.decode(data, raws, tolerant=True)
    assert isinstance(got, _wire.Unreadable) and three == 3
    assert "RuntimeError: tensor was mapped to cuda:0" in got.error
    plain, plain_raws = _wire.encode((len, (x.view(2, 3).t(),), {}), dst="w1")
    assert plain[:1] != b"C" and torch.equal(
        _wire.decode(plain, plain_raws)[1][0], x.view(2, 3).t()
    )


def test_a_message_of_shared_tensors_only_decodes_with_its_grad_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA IPC sends no bytes: a message whose tensors are all shared has no raw tensors,
    yet may carry a grad table. CPU stand-ins for torch's IPC calls and for a GPU tensor
    (every tensor takes the IPC path here) check the wire's side of it."""
    from rallypoint.rpc._transport import _cuda

    shared: dict[int, torch.Tensor] = {}

    def share(tensor: torch.Tensor, index: int) -> tuple[object, ...]:
        shared[len(shared)] = tensor.detach().clone()
        return (None,) * 6 + (index,) + (None,) * 4 + (b"/torch_counter", len(shared) - 1)

    monkeypatch.setattr(_cuda, "share", share)
    monkeypatch.setattr(_cuda, "open_shared", lambda args: shared[args[12]])
    monkeypatch.setattr(
        _wire._Encoder,
        "_reduce_tensor",
        lambda self, obj, target, is_param: self._share_cuda(
            obj, "cuda:0", is_param, bool(obj.requires_grad)
        ),
    )
    router = CudaRouter(ME, lambda name: _peer(name, _info()))
    x = torch.arange(4.0, requires_grad=True) * 1
    sink: list[torch.Tensor] = []
    data, raws = _wire.encode(
        (len, (x, torch.ones(2)), {}),
        dst="w1",
        device_map={torch.device("cpu"): CUDA0},
        grad_sink=sink,
        cuda=router,
    )
    assert data[:2] == b"CG" and raws == [] and sink == [x] and router.shared == 2
    devices: set[torch.device] = set()
    _, (got, other), _ = _wire.decode(
        data, raws, recv_hook=lambda ts: [t * 1 for t in ts], devices=devices
    )
    assert got.requires_grad and torch.equal(got, x) and torch.equal(other, torch.ones(2))
    assert devices == {torch.device("cpu")}  # where the stand-in "opened" them
