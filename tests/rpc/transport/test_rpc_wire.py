"""Wire format, out-of-band tensors, frame parsing and shared-memory segments (in-process)."""

from __future__ import annotations

import gc
import pickle
import socket
import threading
import time
from typing import Any

import pytest
import torch

from rallypoint.rpc import RpcProtocolError
from rallypoint.rpc._transport import _wire
from rallypoint.rpc._transport._connection import Connection
from rallypoint.rpc._transport._framing import Frame, FrameReader
from rallypoint.rpc._transport._shm import PARALLEL_COPY_BYTES, SegmentPool, copy_in


def _roundtrip(obj: Any) -> Any:
    data, raws = _wire.encode(obj)
    assert b"torch._utils" not in data  # dense tensors never go through pickle
    copies = [r.clone() for r in raws]
    return _wire.decode(data, copies)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.arange(10, dtype=torch.int64)[2:8:2],
        torch.randn(4, 5).t(),
        torch.tensor(3.5),
        torch.empty(0, 7),
        torch.ones(5, dtype=torch.bool),
        torch.randn(6).to(torch.bfloat16),
        torch.randn(6).to(torch.float16),
        torch.randn(3, dtype=torch.complex64),
    ],
    ids=["float", "strided-slice", "transposed", "0-d", "empty", "bool", "bf16", "fp16", "cplx"],
)
def test_tensor_roundtrip(tensor: torch.Tensor) -> None:
    out = _roundtrip({"t": tensor, "n": 1})
    assert out["n"] == 1
    assert out["t"].dtype == tensor.dtype and out["t"].shape == tensor.shape
    assert torch.equal(out["t"], tensor)


def test_requires_grad_parameter_and_shared_tensor() -> None:
    leaf = torch.randn(3, requires_grad=True)
    param = torch.nn.Parameter(torch.ones(2))
    shared = torch.randn(2)
    out = _roundtrip((leaf, param, [shared, shared]))
    assert out[0].requires_grad and torch.equal(out[0], leaf)
    assert isinstance(out[1], torch.nn.Parameter)
    assert torch.equal(out[2][0], shared) and torch.equal(out[2][1], shared)


def test_tensors_that_need_grad_reach_the_receive_hook_together_in_sender_order() -> None:
    base = torch.randn(4, 3, requires_grad=True) * 1  # two views of one storage need grad
    row, col = base[1], base.t()
    param = torch.nn.Parameter(torch.ones(2))
    plain = torch.arange(3.0)
    sink: list[torch.Tensor] = []
    data, raws = _wire.encode((row, plain, {"p": param, "again": row}, col), grad_sink=sink)
    assert (
        len(sink) == 3
        and [a is b for a, b in zip(sink, (row, param, col), strict=True)] == [True] * 3
    )
    seen: list[list[torch.Tensor]] = []

    def hook(received: list[torch.Tensor]) -> list[torch.Tensor]:
        seen.append(received)
        return [t * 10 for t in received]

    copies = [r.clone() for r in raws]
    a, p, d, t = _wire.decode(data, copies, recv_hook=hook)
    (received,) = seen  # one call per message, with every tensor that needs grad
    assert [r.requires_grad for r in received] == [True, True, True]
    assert isinstance(received[1], torch.nn.Parameter) and torch.equal(received[2], col)
    assert torch.equal(a, row * 10) and d["again"] is a and torch.equal(t, col * 10)
    assert torch.equal(d["p"], param * 10) and torch.equal(p, plain) and not p.requires_grad
    # without a hook (outside distributed autograd) they arrive as tensors that need grad
    a, p, d, t = _wire.decode(data, [r.clone() for r in raws])
    assert a.requires_grad and isinstance(d["p"], torch.nn.Parameter) and d["again"] is a


def _func(*args: Any, **kwargs: Any) -> None:
    return None


LEAN_TENSORS = [
    torch.randn(3, 4),
    torch.tensor(3.5),
    torch.ones(5, dtype=torch.bool),
    torch.arange(6, dtype=torch.int64).reshape(2, 3),
    torch.randn(6).to(torch.bfloat16),
    torch.randn(3, dtype=torch.complex128),
    torch.randint(0, 255, (7,), dtype=torch.uint8),
]


def test_flat_messages_take_the_lean_form_and_come_back_equal() -> None:
    call = (_func, (*LEAN_TENSORS, 3, "s", None), {"k": torch.randn(2), "n": 1.5})
    for message in (call, LEAN_TENSORS[0], tuple(LEAN_TENSORS), list(LEAN_TENSORS)):
        data, raws = _wire.encode(message)
        assert data[:1] == b"L", type(message)
        out = _wire.decode(data, [r.clone() for r in raws])
        assert type(out) is type(message)
        flat_in = [*call[1], *call[2].values()] if message is call else message
        flat_out = [*out[1], *out[2].values()] if message is call else out
        if isinstance(message, torch.Tensor):
            flat_in, flat_out = [message], [out]
        for a, b in zip(flat_in, flat_out, strict=True):
            if isinstance(a, torch.Tensor):
                assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
            else:
                assert a == b
    out = _wire.decode(*_wire.encode(call))
    assert out[0] is _func and list(out[2]) == ["k", "n"] and out[2]["n"] == 1.5


@pytest.mark.parametrize(
    "message",
    [
        (_func, (torch.arange(10.0)[2:5],), {}),  # a view: the general form keeps its strides
        (_func, (torch.randn(4, 5).t(),), {}),  # not contiguous
        (_func, (torch.nn.Parameter(torch.ones(2)),), {}),  # a Parameter stays one
        (_func, (torch.empty(0),), {}),
        (_func, ([torch.ones(2)],), {}),  # nested
        (_func, (torch.ones(2, dtype=torch.int64).to(torch.uint16),), {}),  # dtype not listed
    ],
    ids=["view", "transposed", "parameter", "empty", "nested", "uint16"],
)
def test_other_messages_take_the_general_form(message: Any) -> None:
    data, raws = _wire.encode(message)
    assert data[:1] != b"L"
    out = _wire.decode(data, [r.clone() for r in raws])
    assert type(out[1][0]) is type(message[1][0])


def test_one_tensor_twice_arrives_as_one_tensor() -> None:
    shared = torch.randn(3)
    data, raws = _wire.encode((_func, (shared, shared), {}))
    assert data[:1] != b"L"  # the general form: both arguments share one storage on arrival
    _, (a, b), _ = _wire.decode(data, [r.clone() for r in raws])
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_a_device_map_takes_the_general_form() -> None:
    data, _ = _wire.encode(torch.ones(2), device_map={torch.device("cpu"): torch.device("cpu")})
    assert data[:1] != b"L"


def test_lean_tensors_that_need_grad_reach_the_receive_hook_in_slot_order() -> None:
    x = torch.randn(2, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    plain = torch.randn(4)
    sink: list[torch.Tensor] = []
    data, raws = _wire.encode((_func, (x, plain), {"y": y}), grad_sink=sink)
    assert data[:1] == b"L" and sink[0] is x and sink[1] is y and len(sink) == 2
    seen: list[list[torch.Tensor]] = []

    def hook(received: list[torch.Tensor]) -> list[torch.Tensor]:
        seen.append(received)
        return [t * 10 for t in received]

    _, (a, p), kw = _wire.decode(data, [r.clone() for r in raws], recv_hook=hook)
    (received,) = seen
    assert [r.requires_grad for r in received] == [True, True]
    assert torch.equal(a, x * 10) and torch.equal(kw["y"], y * 10)
    assert torch.equal(p, plain) and not p.requires_grad
    _, (a, _), kw = _wire.decode(data, [r.clone() for r in raws])  # no hook: leaves
    assert a.requires_grad and a.is_leaf and kw["y"].requires_grad


def test_a_bad_lean_header_is_refused() -> None:
    data, raws = _wire.encode((_func, (torch.ones(2),), {}))
    with pytest.raises(ValueError, match="bad lean header"):
        _wire.decode(data, [*raws, raws[0]])
    forged = bytearray(data)
    forged[6] = 200  # the dtype code
    with pytest.raises(ValueError, match="bad lean dtype code 200"):
        _wire.decode(bytes(forged), raws)


def test_a_bad_grad_table_is_refused() -> None:
    x = torch.randn(2, requires_grad=True)
    data, raws = _wire.encode([[x]], grad_sink=[])  # nested: the general form
    assert data[:1] == b"G"
    size = int.from_bytes(data[1:5], "little")
    not_a_table = pickle.dumps(5)
    forged = b"G" + len(not_a_table).to_bytes(4, "little") + not_a_table + data[5 + size :]
    with pytest.raises(ValueError, match="bad grad table"):
        _wire.decode(forged, raws)
    with pytest.raises(RuntimeError, match="can only be unpickled by the RPC agent"):
        _wire._rebuild_view(0, 0, torch.float32, (2,), (1,), True, None, False)
    with pytest.raises(ValueError, match="bad grad table reference 3"):
        _wire._received(3)


@torch.jit.script
def _scripted(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_torchscript_functions_travel_by_qualified_name() -> None:
    data, _ = _wire.encode((_scripted, (1,), {}))
    assert _scripted.qualified_name.encode() in data and b"TorchScript" not in data
    func, args, kwargs = _wire.decode(data, [])
    assert (
        type(func) is torch.jit.ScriptFunction and func.qualified_name == _scripted.qualified_name
    )
    assert args == (1,) and kwargs == {} and torch.equal(func(torch.zeros(2)), torch.ones(2))
    with pytest.raises(RuntimeError, match=r"__torch__\.nowhere is not compiled on this worker"):
        _wire._script_function("__torch__.nowhere")


def test_sparse_tensors_pickle_with_their_parts_out_of_band() -> None:
    sparse = torch.eye(3).to_sparse()
    data, raws = _wire.encode(sparse)
    assert len(raws) == 2  # indices and values travel as raw tensors
    assert torch.equal(_wire.decode(data, raws).to_dense(), torch.eye(3))


def test_sparse_tensors_keep_requires_grad_layout_and_coalescing_and_are_not_kept() -> None:
    """torch's own pickling of a sparse tensor drops ``requires_grad`` (so distributed
    autograd never saw one) and parks every tensor it rebuilds in a list that only
    ``torch.load`` empties (a leak per received message)."""
    from torch import _utils

    indices = torch.tensor([[0, 1, 1], [2, 0, 2]])
    coo = torch.sparse_coo_tensor(indices, torch.tensor([3.0, 4.0, 5.0]), (2, 3))
    coo.requires_grad_(True)
    csr = torch.randn(4, 5).to_sparse_csr()
    param = torch.nn.Parameter(torch.eye(3).to_sparse())
    sink: list[torch.Tensor] = []
    data, raws = _wire.encode((coo, csr, coo.detach().coalesce(), param), grad_sink=sink)
    assert sink == [coo, param]  # both need a gradient: recorded as a send
    hooked: list[torch.Tensor] = []
    _utils._sparse_tensors_to_validate.clear()
    got_coo, got_csr, coalesced, got_param = _wire.decode(
        data, [r.clone() for r in raws], recv_hook=lambda ts: hooked.extend(ts) or ts
    )
    assert len(hooked) == 2 and hooked[0] is got_coo and hooked[1] is got_param
    assert got_coo.layout == torch.sparse_coo and got_coo.requires_grad
    assert not got_coo.is_coalesced() and coalesced.is_coalesced()
    assert torch.equal(got_coo.detach().to_dense(), coo.detach().to_dense())
    assert got_csr.layout == torch.sparse_csr and torch.equal(got_csr.to_dense(), csr.to_dense())
    assert type(got_param) is torch.nn.Parameter and got_param.layout == torch.sparse_coo
    assert _utils._sparse_tensors_to_validate == []


def test_a_message_that_falls_back_to_the_general_form_collects_each_tensor_once() -> None:
    """The lean form gave up on a message (here: one tensor twice, or a view after a plain
    tensor) only after collecting its tensors that need grad; the general form collected
    them again, so the sender waited for a gradient that never came (torch's
    test_backward_multiple_round_trips, 4 workers, hung until every worker was asked)."""
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    view = torch.arange(6.0)[1:3].requires_grad_(True)
    for message, expected in (((_func, (x, x), {}), [x]), ((_func, (y, view), {}), [y, view])):
        sink: list[torch.Tensor] = []
        data, raws = _wire.encode(message, grad_sink=sink)
        assert data[:1] != b"L"
        assert len(sink) == len(expected) and all(
            a is b for a, b in zip(sink, expected, strict=True)
        )
        received: list[int] = []

        def hook(tensors: list[torch.Tensor], seen: list[int] = received) -> list[torch.Tensor]:
            seen.append(len(tensors))
            return tensors

        _wire.decode(data, [r.clone() for r in raws], recv_hook=hook)
        assert received == [len(expected)]  # the receiver's node: one output per tensor


class _Ref:
    """Stands for an RRef: the codec forks one with its hook, once per message."""

    def __init__(self, name: str) -> None:
        self.name = name


def _unpickle_ref(name: str) -> tuple[str, str]:
    return ("forked", name)


def test_rrefs_ride_the_lean_form_and_are_forked_once() -> None:
    forks: list[str] = []

    def hook(ref: _Ref) -> _wire.ReduceValue:
        forks.append(ref.name)
        return (_unpickle_ref, (ref.name,))

    def encode(message: Any) -> tuple[bytes, list[torch.Tensor]]:
        return _wire.encode(message, rref_type=_Ref, rref_hook=hook)

    data, raws = encode((_func, (_Ref("a"), torch.ones(3), 2), {"k": _Ref("b")}))
    assert data[:1] == b"L" and forks == ["a", "b"]
    _, args, kwargs = _wire.decode(data, [r.clone() for r in raws])
    assert args[0] == ("forked", "a") and torch.equal(args[1], torch.ones(3)) and args[2] == 2
    assert kwargs == {"k": ("forked", "b")}
    forks.clear()
    data, raws = encode((_func, (_Ref("c"), 5), {}))  # no tensor: a plain pickle
    assert raws == [] and data[:1] == b"\x80" and forks == ["c"]
    assert _wire.decode(data, []) == (_func, (("forked", "c"), 5), {})
    forks.clear()
    data, raws = encode((_Ref("d"), torch.ones(2)))  # a reply
    assert data[:1] == b"L" and _wire.decode(data, [r.clone() for r in raws])[0] == ("forked", "d")
    forks.clear()
    data, raws = encode((_func, (_Ref("e"), torch.arange(6.0)[1:3]), {}))  # a view: general
    assert data[:1] != b"L" and forks == ["e"]  # forked once, by the general form
    assert _wire.decode(data, [r.clone() for r in raws])[1][0] == ("forked", "e")


def test_plain_data_arguments_take_the_plain_or_lean_form() -> None:
    data = {"a": (1, "x"), "b": [None, 2.5]}
    encoded, raws = _wire.encode((_func, ([1, 2], data), {"k": (3,)}))
    assert raws == [] and encoded[:1] == b"\x80"
    assert _wire.decode(encoded, []) == (_func, ([1, 2], data), {"k": (3,)})
    encoded, raws = _wire.encode((_func, ([1, 2], torch.ones(2)), {}))
    assert encoded[:1] == b"L"
    out = _wire.decode(encoded, [r.clone() for r in raws])
    assert out[1][0] == [1, 2] and torch.equal(out[1][1], torch.ones(2))
    deep: Any = [1]
    for _ in range(50):
        deep = [deep]
    for message in (
        (_func, (deep, torch.ones(2)), {}),  # any depth or length: checked by pickling
        (_func, (list(range(10_000)), torch.ones(2)), {"z": 2j, "f": [len, _func]}),
        ((deep, {"k": {1, 2}}, torch.ones(2))),  # a reply
    ):
        encoded, raws = _wire.encode(message)
        assert encoded[:1] == b"L"
        out = _wire.decode(encoded, [r.clone() for r in raws])
        if callable(message[0]):
            assert out[1][0] == message[1][0] and torch.equal(out[1][1], message[1][1])
            assert out[2] == message[2]
        else:
            assert out[:2] == message[:2] and torch.equal(out[2], message[2])
    for message in (
        (_func, ([torch.ones(2)], torch.ones(2)), {}),  # a tensor inside: the general form
        (_func, ({"k": (1, [torch.ones(2)])},), {}),
        (_func, ([1, object()], torch.ones(2)), {}),  # any other object too
        ([1, torch.ones(2)], torch.ones(2)),
    ):
        encoded, raws = _wire.encode(message)
        assert encoded[:1] != b"L"
        out = _wire.decode(encoded, [r.clone() for r in raws])
        assert len(out) == len(message)
    for message in (
        (_func, (deep, [2j, len, _func], {"s": {1}}), {"k": (3,)}),  # data only: plain
        [deep, {"a": b"x"}],
        {"k": [1, 2], 3: None},
    ):
        encoded, raws = _wire.encode(message)
        assert raws == [] and encoded[:1] == b"\x80" and _wire.decode(encoded, []) == message
    encoded, raws = _wire.encode({torch.ones(1).sum().item(): torch.ones(2)})  # a tensor value
    assert raws and encoded[:1] == b"\x80"  # the general form: its tensor travels raw


def test_atomic_calls_use_plain_pickle() -> None:
    data, raws = _wire.encode((max, (1, 2.0, "x", None), {"k": b"v"}))
    assert raws == [] and _wire.decode(data, []) == (max, (1, 2.0, "x", None), {"k": b"v"})


def _frame(kind: int = _wire.FrameKind.CALL, rid: int = 1, data: bytes = b"abc") -> bytes:
    return _wire.HEADER.pack(_wire.MAGIC, kind, 0, 0, rid, len(data)) + data


def test_reader_parses_many_frames_per_recv_and_rejects_garbage() -> None:
    a, b = socket.socketpair()
    try:
        payload = _frame(rid=1) + _frame(rid=2, data=b"x" * 300_000) + _frame(rid=3)
        writer = threading.Thread(target=a.sendall, args=(payload,))
        writer.start()
        reader = FrameReader(b, uds=False)
        frames = [reader.read_frame() for _ in range(3)]
        writer.join(5)
        assert [f.request_id for f in frames] == [1, 2, 3]
        assert frames[1].data == b"x" * 300_000
        a.sendall(b"GARBAGE-GARBAGE-GARBAGE-GARBAGE")
        with pytest.raises(RpcProtocolError, match="bad frame header"):
            reader.read_frame()
    finally:
        a.close()
        b.close()


def test_reader_rejects_oversized_frames_and_shm_over_tcp() -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(_wire.HEADER.pack(_wire.MAGIC, _wire.FrameKind.CALL, 0, 0, 1, 1 << 40))
        with pytest.raises(RpcProtocolError, match="frame too large"):
            FrameReader(b, uds=False).read_frame()
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    try:
        header = _wire.HEADER.pack(_wire.MAGIC, _wire.FrameKind.CALL, 0, 1, 1, 0)
        a.sendall(header + _wire.DESC.pack(_wire.WHERE_SHM, 1, 0, 5, 100))
        with pytest.raises(RpcProtocolError, match="bad tensor descriptor"):
            FrameReader(b, uds=False).read_frame()
        a.close()
        with pytest.raises(EOFError):
            FrameReader(b, uds=False).read_frame()
    finally:
        b.close()


def test_segment_pool_limits() -> None:
    pool = SegmentPool(max_bytes=1 << 20)
    first = pool.put(torch.ones(600_000, dtype=torch.uint8))
    assert first is not None and not first.free
    assert pool.put(torch.ones(600_000, dtype=torch.uint8)) is None  # pool full, busy segment
    first.mm[0] = 0  # the receiver released it
    again = pool.put(torch.ones(600_000, dtype=torch.uint8))
    assert again is first
    pool.close()


@pytest.mark.parametrize("nbytes", [PARALLEL_COPY_BYTES - 1, 2 * PARALLEL_COPY_BYTES + 12345])
def test_large_copies_into_segments_split_across_threads_and_stay_exact(nbytes: int) -> None:
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    pool = SegmentPool(max_bytes=1 << 30)
    segment = pool.put(source)
    assert segment is not None
    assert torch.equal(segment.view[:nbytes], source)
    pool.close()


def test_large_copies_work_in_a_forked_child() -> None:
    """The copy threads do not survive a fork; the child starts its own."""
    import os

    source = torch.randint(0, 256, (3 * PARALLEL_COPY_BYTES,), dtype=torch.uint8)
    target = torch.zeros_like(source)
    copy_in(target, source)  # the parent's pool now has threads
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        torch.set_num_threads(1)  # torch's own OpenMP team does not survive a fork
        again = torch.zeros_like(source)
        copy_in(again, source)
        os._exit(0 if torch.equal(again, source) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(target, source)


class _Collect:
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.event = threading.Event()
        self.lost: list[BaseException | None] = []

    def handle_frame(self, conn: Connection, frame: Frame) -> None:
        self.frames.append(frame)
        self.event.set()

    def connection_lost(self, conn: Connection, exc: BaseException | None) -> None:
        self.lost.append(exc)

    def callbacks(self) -> dict[str, Any]:
        return {"on_frame": self.handle_frame, "on_lost": self.connection_lost}


def test_shared_memory_segments_are_passed_once_and_reused() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    pool = SegmentPool(1 << 26)
    stats = {"inline_tensor_bytes": 0, "shm_tensor_bytes": 0}
    sink = _Collect()
    kwargs: dict[str, Any] = {"peer_id": 0, "uds": True, "shm_threshold": 1024, "stats": stats}
    sender = Connection(a, peer_name="rx", pool=pool, **_Collect().callbacks(), **kwargs)
    receiver = Connection(b, peer_name="tx", pool=None, **sink.callbacks(), **kwargs)
    receiver.start()
    try:
        payload = torch.arange(1 << 18, dtype=torch.int32).view(torch.uint8)  # 1 MiB
        sender.send_frame(_wire.FrameKind.CALL, 1, b"", [payload])
        assert sink.event.wait(5)
        got = sink.frames.pop().tensors[0]
        assert torch.equal(got, payload) and stats["shm_tensor_bytes"] == payload.numel()
        segment = pool.segments()[0]
        assert not segment.free
        del got
        gc.collect()
        deadline = time.monotonic() + 5
        while not segment.free and time.monotonic() < deadline:
            time.sleep(0.01)
        assert segment.free  # the receiver dropped its view: the segment is reusable
        sink.event.clear()
        sender.send_frame(_wire.FrameKind.CALL, 2, b"", [payload])
        assert sink.event.wait(5)
        assert len(pool.segments()) == 1 and torch.equal(sink.frames.pop().tensors[0], payload)
        small = torch.ones(10, dtype=torch.uint8)
        sink.event.clear()
        sender.send_frame(_wire.FrameKind.CALL, 3, b"", [small])
        assert sink.event.wait(5)
        assert stats["inline_tensor_bytes"] == 10
    finally:
        sender.close()
        receiver.close()
        pool.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("uds", [True, False], ids=["unix", "tcp"])
def test_every_way_a_frame_carries_tensors_delivers_them_exactly(uds: bool) -> None:
    """Small tensors are copied into the frame; more bytes than ``COPIED_BYTES`` go out
    from the tensors' own memory; large ones on a Unix socket go through shared memory;
    a frame with more descriptors than the read buffer holds is parsed in pieces. The lean
    form's raw tensors keep their tensor's shape (as bytes), the general form's are 1-D."""
    from rallypoint.rpc._transport._connection import COPIED_BYTES

    if uds:
        a, b = socket.socketpair(socket.AF_UNIX)
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
        listener.close()
    pool = SegmentPool(1 << 26) if uds else None
    stats = {"inline_tensor_bytes": 0, "shm_tensor_bytes": 0}
    sink = _Collect()
    kwargs: dict[str, Any] = {"peer_id": 0, "uds": uds, "shm_threshold": 1 << 20, "stats": stats}
    sender = Connection(a, peer_name="rx", pool=pool, **_Collect().callbacks(), **kwargs)
    receiver = Connection(b, peer_name="tx", pool=None, **sink.callbacks(), **kwargs)
    receiver.start()
    messages: list[Any] = [
        (_func, (torch.randn(32, 64), torch.tensor(2.5), 7), {}),  # copied, 0-d among them
        (_func, (torch.randn(3, 2, 1), torch.arange(6).view(2, 3)), {"k": torch.ones(5)}),
        (_func, (torch.randn(COPIED_BYTES // 4 + 1),), {}),  # over the copy limit
        (_func, (torch.randn(512, 1024),), {}),  # 2 MiB: shared memory on a Unix socket
        (_func, (torch.arange(10.0)[2:5],), {}),  # the general form's 1-D raw of a view
        [torch.full((1,), float(i)) for i in range(17_000)],  # 272 KB of descriptors
    ]
    try:
        for rid, message in enumerate(messages, start=1):
            data, raws = _wire.encode(message)
            sink.event.clear()
            sender.send_frame(_wire.FrameKind.CALL, rid, data, raws)
            assert sink.event.wait(20), rid
            frame = sink.frames.pop()
            assert frame.request_id == rid
            out = _wire.decode(frame.data, frame.tensors)
            flat_in = [*message[1], *message[2].values()] if rid < 6 else message
            flat_out = [*out[1], *out[2].values()] if rid < 6 else out
            for sent, got in zip(flat_in, flat_out, strict=True):
                if isinstance(sent, torch.Tensor):
                    assert got.shape == sent.shape and torch.equal(got, sent), rid
                else:
                    assert got == sent
        assert stats["shm_tensor_bytes"] == (512 * 1024 * 4 if uds else 0)
    finally:
        sender.close()
        receiver.close()
        if pool is not None:
            pool.close()


def _wait_free(segment: Any) -> bool:
    deadline = time.monotonic() + 5
    while not segment.free and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return bool(segment.free)


def test_a_received_tensor_sent_back_is_handed_back_and_its_segment_reused() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    owner_pool, peer_pool = SegmentPool(1 << 26), SegmentPool(1 << 26)
    stats = {"inline_tensor_bytes": 0, "shm_tensor_bytes": 0, "returned_tensor_bytes": 0}
    kwargs: dict[str, Any] = {"peer_id": 0, "uds": True, "shm_threshold": 1024, "stats": stats}
    at_owner, at_peer = _Collect(), _Collect()
    owner = Connection(a, peer_name="peer", pool=owner_pool, **at_owner.callbacks(), **kwargs)
    peer = Connection(b, peer_name="owner", pool=peer_pool, **at_peer.callbacks(), **kwargs)
    owner.start()
    peer.start()
    try:
        first = torch.arange(1 << 18, dtype=torch.int32).view(torch.uint8)  # 1 MiB
        owner.send_frame(_wire.FrameKind.CALL, 1, b"", [first])
        assert at_peer.event.wait(5)
        received = at_peer.frames.pop().tensors[0]
        peer.send_frame(_wire.FrameKind.REPLY, 1, b"", [received])  # back to its owner
        assert at_owner.event.wait(5)
        back = at_owner.frames.pop().tensors[0]
        assert torch.equal(back, first) and stats["returned_tensor_bytes"] == first.numel()
        assert peer_pool.segments() == []  # nothing was copied on the way back
        segment = owner_pool.segments()[0]
        # each side writes its own view; neither sees the other's write
        received.fill_(1)
        back.fill_(2)
        assert bool((received == 1).all()) and bool((back == 2).all())
        del back, received
        assert _wait_free(segment)
        # the peer's mapping is shared again: the segment's next bytes are visible there
        second = torch.full((1 << 20,), 9, dtype=torch.uint8)
        at_peer.event.clear()
        owner.send_frame(_wire.FrameKind.CALL, 2, b"", [second])
        assert at_peer.event.wait(5)
        assert owner_pool.segments() == [segment]
        assert torch.equal(at_peer.frames.pop().tensors[0], second)
    finally:
        owner.close()
        peer.close()
        owner_pool.close()
        peer_pool.close()
