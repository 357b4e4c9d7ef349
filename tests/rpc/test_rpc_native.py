"""The compiled fast path (``rallypoint build-native``) and its Python twins agree.

Each compiled function (``rallypoint/rpc/_native.cpp``) is run beside its Python version on
the same input, and both must give the same bytes, tensors and errors; whole programs must
train to the same numbers with the fast path off (a fresh interpreter with
``RALLYPOINT_NATIVE=0``) as with it on (this process and its workers).
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd.graph import GradientEdge

from rallypoint._core.envvars import NATIVE, NATIVE_DIR
from rallypoint.rpc import _autograd_context, _framing, _lean, _native, _wire
from rallypoint.testing._rpc_patterns import run_rpc_pattern

NATIVE_MODULE = _native.NATIVE_MODULE
needs_native = pytest.mark.skipif(NATIVE_MODULE is None, reason="the fast path is not in use")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++")


def test_the_fast_path_is_used_wherever_a_compiler_is() -> None:
    """``./dev setup`` builds it: a broken build must fail here, not fall back silently."""
    if _compiler() is None or os.environ.get(NATIVE) == "0":
        pytest.skip("no C++ compiler here, or the fast path is turned off")
    assert NATIVE_MODULE is not None, (
        f"a C++ compiler is here but the fast path is not built ({_native.module_path()}): "
        "run `rallypoint build-native`"
    )
    assert _lean._describe is NATIVE_MODULE.describe
    assert _lean._views is NATIVE_MODULE.views
    assert _autograd_context._recv_wrap is NATIVE_MODULE.recv_wrap
    assert _framing.tensor_view is NATIVE_MODULE.tensor_bytes
    assert _framing._copy_out is NATIVE_MODULE.copy_out
    assert _framing._parse_inline is NATIVE_MODULE.parse_inline


def _neg_view() -> torch.Tensor:
    return torch._neg_view(torch.randn(3))  # type: ignore[attr-defined]


TENSORS: dict[str, Callable[[], torch.Tensor]] = {
    "float": lambda: torch.randn(3, 4),
    "0-d": lambda: torch.tensor(2.5),
    "5-d": lambda: torch.randn(1, 2, 1, 3, 2),
    "int64": lambda: torch.arange(6),
    "bool": lambda: torch.tensor([True, False]),
    "bf16": lambda: torch.randn(4).to(torch.bfloat16),
    "fp16": lambda: torch.randn(4).to(torch.float16),
    "complex": lambda: torch.randn(3, dtype=torch.complex64),
    "uint8": lambda: torch.arange(5, dtype=torch.uint8),
    "leaf needing grad": lambda: torch.randn(2, 3, requires_grad=True),
    "result needing grad": lambda: torch.randn(2, requires_grad=True) * 2,
    "transposed": lambda: torch.randn(3, 4).t(),
    "offset": lambda: torch.arange(10.0)[2:],
    "part of its storage": lambda: torch.arange(10.0)[:4],
    "empty": lambda: torch.empty(0, 3),
    "conjugate": lambda: torch.randn(3, dtype=torch.complex64).conj(),
    "negative view": _neg_view,
    "sparse": lambda: torch.randn(3, 3).to_sparse(),
    "quantized": lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8),
    "uint16 (no code)": lambda: torch.zeros(3, dtype=torch.uint16),
    "meta": lambda: torch.empty(3, device="meta"),
}


def _same_description(tensor: torch.Tensor, position: int) -> Any:
    assert NATIVE_MODULE is not None
    ours = NATIVE_MODULE.describe(tensor, position)
    python = _lean.describe_py(tensor, position)
    if python is None:
        assert ours is None
        return None
    assert ours is not None
    head, raw, address, needs_grad = ours
    assert head == python[0] and address == python[2] and needs_grad == python[3]
    assert raw.dtype == python[1].dtype == torch.uint8 and raw.shape == python[1].shape
    assert torch.equal(raw, python[1]) and not raw.requires_grad
    assert raw.data_ptr() == tensor.data_ptr()  # a view: no copy
    return ours


@needs_native
@pytest.mark.parametrize("name", list(TENSORS))
def test_describe_agrees_with_python(name: str) -> None:
    tensor = TENSORS[name]()
    described = _same_description(tensor, 7)
    lean = name in {"float", "0-d", "5-d", "int64", "bool", "bf16", "fp16", "complex", "uint8"}
    lean = lean or name.endswith("needing grad")
    assert (described is not None) == lean


@needs_native
def test_describe_refuses_a_slot_out_of_range_as_python_does() -> None:
    assert NATIVE_MODULE is not None
    for position in (-1, 0x10000):
        with pytest.raises(ValueError, match="bad lean slot"):
            NATIVE_MODULE.describe(torch.ones(1), position)
        with pytest.raises(ValueError, match="bad lean slot"):
            _lean.describe_py(torch.ones(1), position)


def _func(*args: Any, **kwargs: Any) -> None:
    return None


def _frame(*tensors: torch.Tensor) -> tuple[bytes, list[torch.Tensor]]:
    data, raws = _wire.encode((_func, tensors, {}), grad_sink=[])
    assert data[:1] == b"L"
    return data, [raw.reshape(-1).clone() for raw in raws]  # as the receiver gets them


def _same_views(data: bytes | memoryview, raws: list[torch.Tensor]) -> Any:
    assert NATIVE_MODULE is not None
    offset, slots, tensors, grads = NATIVE_MODULE.views(data, raws, _lean._HEAD.size)
    expected = _lean.views_py(data, raws, _lean._HEAD.size)
    assert (offset, slots, grads) == (expected[0], expected[1], expected[3])
    for got, want in zip(tensors, expected[2], strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.requires_grad == want.requires_grad and torch.equal(got, want)
    return tensors


@needs_native
def test_views_agree_with_python_on_every_lean_dtype_and_shape() -> None:
    sent = [TENSORS[name]() for name in ("float", "0-d", "5-d", "bool", "bf16", "complex")]
    sent.append(torch.randn(2, requires_grad=True))
    data, raws = _frame(*sent)
    got = _same_views(data, raws)
    assert _same_views(memoryview(data), raws)  # the codec passes a memoryview
    for tensor, original in zip(got, sent, strict=True):
        assert torch.equal(tensor, original.detach())


@needs_native
@pytest.mark.parametrize(
    ("forge", "error", "match"),
    [
        (lambda data, raws: (data[:9], raws), ValueError, "bad lean header"),
        (lambda data, raws: (data, [*raws, raws[0]]), ValueError, "bad lean (header|dtype)"),
        (lambda data, raws: (data[:6] + b"\xc8" + data[7:], raws), ValueError, "dtype code 200"),
        (lambda data, raws: (data, [raws[0][:-4]]), RuntimeError, "shape"),
    ],
    ids=["header cut", "more tensors than headers", "dtype code", "bytes do not fit"],
)
def test_views_refuse_forged_frames_as_python_does(
    forge: Callable[[bytes, list[torch.Tensor]], tuple[bytes, list[torch.Tensor]]],
    error: type[Exception],
    match: str,
) -> None:
    assert NATIVE_MODULE is not None
    data, raws = forge(*_frame(torch.randn(3, 4)))
    with pytest.raises(error, match=match) as ours:
        NATIVE_MODULE.views(data, raws, _lean._HEAD.size)
    with pytest.raises(error, match=match):
        _lean.views_py(data, raws, _lean._HEAD.size)
    assert "frame #" not in str(ours.value)  # torch's message without its C++ stack


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 4), max_size=4), min_size=1, max_size=5),
    dtype=st.sampled_from(_lean._DTYPES),
    grad=st.booleans(),
)
def test_random_messages_encode_to_the_same_bytes_and_decode_alike(
    shapes: list[list[int]], dtype: torch.dtype, grad: bool
) -> None:
    sent = []
    for shape in shapes:
        tensor = torch.randn(shape).to(dtype) if dtype != torch.bool else torch.ones(shape) > 0
        if grad and (tensor.is_floating_point() or tensor.is_complex()):
            tensor.requires_grad_(True)
        sent.append(tensor)
    for tensor in sent:
        _same_description(tensor, 3)
    data, raws = _frame(*sent)
    for tensor, original in zip(_same_views(data, raws), sent, strict=True):
        assert torch.equal(tensor.detach(), original.detach())


@needs_native
def test_the_compiled_receive_node_is_torchs_and_its_gradients_can_be_captured() -> None:
    assert NATIVE_MODULE is not None
    raws = [torch.randn(2, 3, requires_grad=True), torch.randn(4, requires_grad=True)]
    ours = NATIVE_MODULE.recv_wrap(raws)
    python = _autograd_context.recv_wrap_py(raws)
    node = ours[0].grad_fn
    assert node is ours[1].grad_fn and [t.output_nr for t in ours] == [0, 1]
    assert node.name() == python[0].grad_fn.name()
    assert node.name() == "torch::distributed::autograd::RecvRpcBackward"
    assert type(node).__name__ == "CppFunction" == type(python[0].grad_fn).__name__
    assert "grad_fn=<RecvRpcBackward>" in repr(ours[0])
    assert node.next_functions == ()  # torch's node has no edges past the worker
    for got, want in zip(ours, python, strict=True):
        assert torch.equal(got, want) and got.requires_grad and not got.is_leaf
        assert got.data_ptr() == want.data_ptr()  # detached views, no copies
    seen = []
    node.register_prehook(lambda grads: seen.append("pre") or None)
    loss = (ours[0] * 3).sum() + (ours[1] * 5).sum()
    edges = [GradientEdge(node, 0), GradientEdge(node, 1)]
    grads = torch.autograd.grad(loss, edges, retain_graph=True)
    assert torch.equal(grads[0], torch.full((2, 3), 3.0))
    assert torch.equal(grads[1], torch.full((4,), 5.0))
    loss.backward()  # the node runs and stops there: nothing accumulates past it
    assert seen == ["pre"] and raws[0].grad is None and raws[1].grad is None


@needs_native
@pytest.mark.parametrize("nbytes", [0, 1, 7, 4096])
def test_frame_bytes_agree_with_python(nbytes: int) -> None:
    assert NATIVE_MODULE is not None
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    ours = NATIVE_MODULE.tensor_bytes(raw)
    assert bytes(ours) == bytes(_framing.tensor_view_py(raw)) == raw.numpy().tobytes()
    assert ours.readonly and (nbytes == 0 or ours.nbytes == nbytes)
    buffer = memoryview(bytearray(b"head" + raw.numpy().tobytes() + b"tail"))
    got = NATIVE_MODULE.copy_out(buffer, 4, nbytes)
    want = _framing.copy_out_py(buffer, 4, nbytes)
    assert got.dtype == want.dtype == torch.uint8 and torch.equal(got, want)
    assert torch.equal(got, raw)
    buffer[4:8] = b"\xff\xff\xff\xff"  # a copy: the read buffer is reused
    assert torch.equal(got, raw)
    for start, size in ((-1, 1), (0, len(buffer) + 1), (len(buffer), 1), (0, -1)):
        with pytest.raises(ValueError, match="bytes out of range"):
            NATIVE_MODULE.copy_out(buffer, start, size)
        with pytest.raises(ValueError, match="bytes out of range"):
            _framing.copy_out_py(buffer, start, size)
    for bad in (torch.arange(6.0).reshape(2, 3).t(),):
        with pytest.raises(ValueError, match="not a contiguous CPU tensor"):
            NATIVE_MODULE.tensor_bytes(bad)
        with pytest.raises(ValueError, match="not a contiguous CPU tensor"):
            _framing.tensor_view_py(bad)


def _wire_frame(kind: int, rid: int, data: bytes, tensors: list[bytes], where: int = 0) -> bytes:
    header = _wire.HEADER.pack(_wire.MAGIC, kind, 3, len(tensors), rid, len(data))
    descs = [_wire.DESC.pack(where, 0, 0, 0, len(t)) for t in tensors]
    return b"".join([header, data, *descs, *tensors])


FRAMES = {
    "no tensors": _wire_frame(1, 7, b"call", []),
    "tensors": _wire_frame(2, 8, b"reply", [b"abcd", b"", bytes(range(256)) * 40]),
    "larger than the read buffer": _wire_frame(4, 9, b"x" * 300_000, [b"y" * 70_000]),
    "bad magic": b"XX" + _wire_frame(1, 1, b"", [])[2:],
    "bad kind": _wire_frame(99, 1, b"", []),
    "cut short": _wire_frame(2, 1, b"reply", [b"abcd"])[:-2],
    "shared memory over TCP": _wire_frame(2, 1, b"", [b"abcd"], where=1),
}


def _read_all(payload: bytes, fast: bool, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every frame (or the error) a reader gets from ``payload`` sent on a socket pair."""
    monkeypatch.setattr(_framing, "_parse_inline", NATIVE_MODULE.parse_inline if fast else None)
    a, b = socket.socketpair()
    try:
        writer = threading.Thread(target=lambda: (a.sendall(payload), a.close()))
        writer.start()
        reader = _framing.FrameReader(b, uds=False)
        got: list[Any] = []
        while True:
            try:
                frame = reader.read_frame()
            except Exception as exc:  # compared below
                got.append((type(exc).__name__, str(exc)))
                break
            tensors = [bytes(t.numpy().tobytes()) for t in frame.tensors]
            dtypes = {t.dtype for t in frame.tensors}
            got.append((frame.kind, frame.flags, frame.request_id, frame.data, tensors, dtypes))
        writer.join(10)
        return got
    finally:
        b.close()


@needs_native
@pytest.mark.parametrize("name", list(FRAMES))
def test_frames_parse_alike_with_and_without_the_fast_path(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = FRAMES["tensors"] + FRAMES[name] + FRAMES["no tensors"]
    fast = _read_all(payload, True, monkeypatch)
    assert fast == _read_all(payload, False, monkeypatch)
    assert fast[0][2] == 8 and fast[0][4][2] == bytes(range(256)) * 40
    assert fast[-1][0] in ("EOFError", "RpcProtocolError")


@needs_native
def test_parse_inline_leaves_what_it_cannot_take_to_the_reader() -> None:
    assert NATIVE_MODULE is not None
    whole = FRAMES["tensors"]
    buffer = memoryview(bytearray(whole + b"next"))
    end, kind, flags, rid, data, tensors = NATIVE_MODULE.parse_inline(buffer, 0, len(buffer))
    assert (end, kind, flags, rid, data) == (len(whole), 2, 3, 8, b"reply")
    assert [t.dtype for t in tensors] == [torch.uint8] * 3 and bytes(tensors[0].numpy()) == b"abcd"
    for cut in (0, 10, 24, len(whole) - 1):  # not all buffered yet
        assert NATIVE_MODULE.parse_inline(buffer, 0, cut) is None
    for name in ("bad magic", "shared memory over TCP", "larger than the read buffer"):
        frame = memoryview(bytearray(FRAMES[name]))
        assert NATIVE_MODULE.parse_inline(frame, 0, min(len(frame), 1 << 18)) is None
    assert NATIVE_MODULE.parse_inline(buffer, 0, len(buffer) + 1) is None  # out of range


def _fresh_python(code: str, env: dict[str, str], timeout: float = 240) -> Any:
    """Run ``code`` in a fresh interpreter; it prints a pickled result as hex last."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return pickle.loads(bytes.fromhex(done.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(300)
def test_programs_train_to_the_same_numbers_with_the_fast_path_off() -> None:
    code = """
        from rallypoint.rpc import _autograd_context, _framing, _lean, _native
        from rallypoint.testing._rpc_patterns import run_rpc_pattern
        assert _native.NATIVE_MODULE is None and _lean._describe is _lean.describe_py
        assert _autograd_context._recv_wrap is _autograd_context.recv_wrap_py
        assert _framing.tensor_view is _framing.tensor_view_py
        assert _framing._parse_inline is None
        results = {p: run_rpc_pattern("RALLYPOINT", p) for p in ("model_parallel_rnn", "pipeline")}
        print(__import__("pickle").dumps(results).hex())
    """
    python = _fresh_python(code, {NATIVE: "0"})
    for pattern in ("model_parallel_rnn", "pipeline"):
        assert run_rpc_pattern("RALLYPOINT", pattern) == python[pattern], pattern


def test_a_bad_switch_value_is_refused_on_import() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import rallypoint.rpc"],
        env={**os.environ, NATIVE: "yes"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "RALLYPOINT_NATIVE='yes': use 0" in done.stderr


def _build_native(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rallypoint", "build-native", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_build_native_says_what_is_missing(tmp_path: Path) -> None:
    where = {NATIVE_DIR: str(tmp_path)}
    done = _build_native("--check", env=where)
    assert done.returncode == 1 and "not used (not built; looked for" in done.stdout
    done = _build_native(env={**where, "CXX": str(tmp_path / "no-such-compiler")})
    assert done.returncode == 1
    assert "no C++ compiler: " in done.stderr and "install g++, or set CXX" in done.stderr
    done = _build_native(env={**where, "CXX": "false"})
    assert done.returncode == 1 and "compiling _native.cpp failed (exit 1)" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left
    assert _build_native("--bogus", env=where).returncode == 2
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    done = _build_native(env={NATIVE_DIR: str(not_a_directory / "native")})
    assert done.returncode == 1 and "cannot write the compiled module into" in done.stderr
    assert "set RALLYPOINT_NATIVE_DIR to a writable directory" in done.stderr
    not_a_directory.unlink()
    done = _build_native("--check", env={**where, NATIVE: "0"})
    assert done.returncode == 1 and "turned off by RALLYPOINT_NATIVE=0" in done.stdout


@pytest.mark.timeout(300)
@pytest.mark.skipif(_compiler() is None, reason="no C++ compiler")
def test_build_native_builds_a_module_that_loads(tmp_path: Path) -> None:
    where = {NATIVE_DIR: str(tmp_path)}
    done = _build_native(env=where)
    assert done.returncode == 0, done.stderr
    (built,) = tmp_path.iterdir()
    assert built.name.startswith(_native.module_name()) and str(built) in done.stdout
    done = _build_native("--check", env=where)
    assert done.returncode == 0 and "built and used" in done.stdout
    # a module that does not load (not a shared object) is not used, with a warning
    built.write_bytes(b"not a shared object")
    code = """
        import pickle, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from rallypoint.rpc import _native
        said = [str(w.message) for w in caught]
        print(pickle.dumps((_native.NATIVE_MODULE is None, said)).hex())
    """
    unused, said = _fresh_python(code, where)
    assert unused and any("not using the compiled fast path" in text for text in said)
