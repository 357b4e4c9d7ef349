"""Device-map rules: ours and torch's functions side by side (same errors, same results)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.distributed.rpc import backend_registry as torch_registry

from rallypoint.rpc import RallypointRpcBackendOptions, _device_maps

d = torch.device
CPU = d("cpu")

IMPLS = {
    "rallypoint": (
        _device_maps.validate_device_maps,
        _device_maps.create_reverse_mapping,
        _device_maps.create_device_list,
    ),
    "torch": (
        torch_registry._validate_device_maps,
        torch_registry._create_reverse_mapping,
        torch_registry._create_device_list,
    ),
}


@pytest.fixture(params=sorted(IMPLS))
def impl(request: pytest.FixtureRequest) -> tuple[Any, Any, Any]:
    return IMPLS[request.param]


def _group(
    maps: dict[str, dict[str, dict[torch.device, torch.device]]],
    devices: dict[str, list[torch.device]] | None = None,
    counts: dict[str, int] | None = None,
) -> tuple[list[str], dict[str, int], dict[str, Any], dict[str, list[torch.device]]]:
    names = sorted(maps)
    return (
        names,
        counts or dict.fromkeys(names, 2),
        maps,
        devices or {n: [] for n in names},
    )


def test_valid_cpu_group_passes(impl: Any) -> None:
    validate, _, _ = impl
    validate(*_group({"a": {"b": {CPU: CPU}}, "b": {}}))


def test_valid_cuda_group_with_stated_counts(impl: Any) -> None:
    validate, _, _ = impl
    maps = {"a": {"b": {d("cuda:0"): d("cuda:1")}}, "b": {"a": {d("cuda:1"): d("cuda:0")}}}
    validate(*_group(maps))


CASES = [
    (
        "duplicated devices",
        {"a": {}, "b": {}},
        {"a": [d("cuda:0"), d("cuda:0")], "b": []},
        None,
        True,
        "Node a has duplicated devices",
    ),
    (
        "invalid device index",
        {"a": {}, "b": {}},
        {"a": [d("cuda:5")], "b": []},
        None,
        True,
        "Node a has devices with invalid indices",
    ),
    (
        "unknown target name",
        {"a": {"zz": {CPU: CPU}}, "b": {}},
        None,
        None,
        True,
        "Node a has invalid target node names in its device maps",
    ),
    (
        "duplicated target devices",
        {"a": {"b": {d("cuda:0"): d("cuda:1"), d("cuda:1"): d("cuda:1")}}, "b": {}},
        None,
        None,
        True,
        "Node a has duplicated target devices in its device map for b",
    ),
    (
        "unexpected source device",
        {"a": {"b": {d("cuda:1"): d("cuda:0")}}, "b": {}},
        {"a": [d("cuda:0")], "b": []},
        None,
        True,
        "Node a has unexpected source devices in its device map for b",
    ),
    (
        "source index out of range",
        {"a": {"b": {d("cuda:3"): d("cuda:0")}}, "b": {}},
        None,
        None,
        True,
        "Node a has source devices with invalid indices in its device map for b",
    ),
    (
        "unexpected target device",
        {"a": {"b": {d("cuda:0"): d("cuda:1")}}, "b": {}},
        {"a": [], "b": [d("cuda:0")]},
        None,
        True,
        "Node a has unexpected target devices in its device map for b",
    ),
    (
        "target index out of range",
        {"a": {"b": {d("cuda:0"): d("cuda:1")}}, "b": {}},
        None,
        {"a": 2, "b": 1},
        True,
        "Node a has target devices with invalid indices in its device map for b",
    ),
]


@pytest.mark.parametrize(
    ("maps", "devices", "counts", "static", "message"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_invalid_maps_raise_torchs_message(
    impl: Any, maps: Any, devices: Any, counts: Any, static: bool, message: str
) -> None:
    validate, _, _ = impl
    names, all_counts, all_maps, all_devices = _group(maps, devices, counts)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(names, all_counts, all_maps, all_devices, static)


def test_messages_identical_to_torch() -> ValueError | None:
    for _, maps, devices, counts, static, _ in CASES:
        args = _group(maps, devices, counts)
        errors = []
        for fn in (_device_maps.validate_device_maps, torch_registry._validate_device_maps):
            with pytest.raises(ValueError) as info:
                fn(*args, static)
            errors.append(str(info.value))
        assert errors[0] == errors[1]
    return None


def test_unknown_target_allowed_in_dynamic_group(impl: Any) -> None:
    validate, _, _ = impl
    names, counts, maps, devices = _group({"a": {"later": {CPU: CPU}}, "b": {}})
    validate(names, counts, maps, devices, False)


def test_reverse_mapping_and_device_list(impl: Any) -> None:
    _, reverse, device_list = impl
    maps = {
        "a": {"b": {d("cuda:0"): d("cuda:1")}},
        "b": {"a": {d("cuda:1"): d("cuda:0")}, "c": {d("cuda:0"): d("cuda:0")}},
        "c": {"b": {d("cuda:0"): d("cuda:2")}},
    }
    rev = reverse("b", ["a", "b", "c"], maps)
    assert rev == {"a": {d("cuda:1"): d("cuda:0")}, "c": {d("cuda:2"): d("cuda:0")}}
    assert device_list([], maps["b"], rev) == [d("cuda:0"), d("cuda:1"), d("cuda:2")]
    assert device_list([d("cuda:3"), d("cuda:1")], maps["b"], rev) == [d("cuda:1"), d("cuda:3")]


def test_device_list_drops_cpu(impl: Any) -> None:
    _, reverse, device_list = impl
    maps = {"a": {"b": {CPU: CPU}}, "b": {}}
    assert device_list([], maps["a"], reverse("a", ["a", "b"], maps)) == []


def test_options_normalise_and_reject_many_to_one() -> None:
    opts = RallypointRpcBackendOptions(device_maps={"w1": {0: 1, "cpu": "cpu"}})
    assert opts.device_maps == {"w1": {d("cuda:0"): d("cuda:1"), CPU: CPU}}
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping"):
        RallypointRpcBackendOptions(device_maps={"w1": {0: 1, 2: 1}})
    opts.set_device_map("w1", {2: 3})
    assert opts.device_maps["w1"][d("cuda:2")] == d("cuda:3")
    with pytest.raises(ValueError, match="`set_device_map` only supports 1-to-1 mapping"):
        opts.set_device_map("w1", {0: 2})
    with pytest.raises(ValueError, match="expect a list of CUDA devices"):
        opts.set_devices(["cpu"])
    opts.set_devices([0, "cuda:1"])
    assert opts.devices == [d("cuda:0"), d("cuda:1")]
    with pytest.raises(TypeError, match="device_maps must be a dict"):
        RallypointRpcBackendOptions(device_maps=[("w1", {})])  # type: ignore[arg-type]


TORCH_REFUSAL = (
    "TensorPipe RPC backend only supports CPU tensors by default, please move your tensors to "
    "CPU before sending them over RPC, or call `set_device_map` on "
    "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
)


def test_cuda_tensor_without_map_is_refused_before_sending_in_torchs_words() -> None:
    from rallypoint.rpc._transport import _wire

    with pytest.raises(RuntimeError) as request:
        _wire._send_device(_FakeCuda(), None, "w1")  # type: ignore[arg-type]
    text = str(request.value)
    assert text.startswith(
        TORCH_REFUSAL + "Request device mapping is not available for destination w1 for device "
        "cuda:0 but received a tensor on that device"
    )
    assert "set_device_map('w1', {'cuda:0': ...})" in text
    with pytest.raises(RuntimeError, match="Response device mapping is not available for de"):
        _wire._send_device(_FakeCuda(), {CPU: CPU}, "w0", True)  # type: ignore[arg-type]
    mapped = {d("cuda:0"): d("cuda:1")}
    assert _wire._send_device(_FakeCuda(), mapped, "w1") == "cuda:1"  # type: ignore[arg-type]
    assert _wire._send_device(torch.ones(1), None, "w1") is None
    assert _wire._send_device(torch.ones(1), {CPU: d("cuda:2")}, "w1") == "cuda:2"


class _FakeCuda:
    device = d("cuda:0")


# ---- which map applies in which direction -------------------------------------------------
# Maps that are not each other's inverse, so that every direction has a map of its own.
DIRECTED = {
    "w0": {"w1": {d("cuda:0"): d("cuda:1")}, "w2": {CPU: d("cuda:0")}},
    "w1": {"w0": {d("cuda:2"): d("cuda:3")}},
    "w2": {},
}
NAMES = ["w0", "w1", "w2"]


def _inverse(map_: dict[torch.device, torch.device]) -> dict[torch.device, torch.device]:
    return {v: k for k, v in map_.items()}


@pytest.mark.parametrize("me", NAMES)
def test_calls_and_replies_use_torchs_maps(me: str) -> None:
    """A call goes with the caller's own map; the callee's reply with the inverse of that
    map, which is torch's reverse map for the caller (``_create_reverse_mapping``)."""
    own = DIRECTED[me]
    torchs = torch_registry._create_reverse_mapping(me, NAMES, DIRECTED)
    assert _device_maps.create_reverse_mapping(me, NAMES, DIRECTED) == torchs
    for peer in NAMES:
        call = _device_maps.send_map(_device_maps.Sent.CALL, peer, own, torchs)
        reply = _device_maps.send_map(_device_maps.Sent.REPLY, peer, own, torchs)
        assert call == own.get(peer, {})
        assert reply == torchs.get(peer, {})
        # what the peer's reply to this worker's call comes with is the inverse of the call's
        theirs = torch_registry._create_reverse_mapping(peer, NAMES, DIRECTED)
        assert _device_maps.send_map(_device_maps.Sent.REPLY, me, DIRECTED[peer], theirs) == (
            _inverse(call)
        )


@pytest.mark.parametrize("me", NAMES)
def test_gradients_go_back_with_the_inverse_of_the_map_they_came_with(me: str) -> None:
    """torch's RecvRpcBackward keeps the reverse of the message's map: the gradients of a
    received call go back with torch's reverse map for the caller (not this worker's own
    map for it, which may be missing: the hang of the issue), those of a received reply
    with this worker's own map for the callee."""
    own = DIRECTED[me]
    torchs = torch_registry._create_reverse_mapping(me, NAMES, DIRECTED)
    for peer in NAMES:
        peers_reverse = torch_registry._create_reverse_mapping(peer, NAMES, DIRECTED)
        # a call from ``peer`` came with ``peer``'s own map for this worker
        came = _device_maps.send_map(_device_maps.Sent.CALL, me, DIRECTED[peer], peers_reverse)
        back = _device_maps.gradient_map(_device_maps.Sent.CALL, peer, own, torchs)
        assert back == _inverse(came) == torchs.get(peer, {})
        # a reply from ``peer`` came with the inverse of this worker's map for ``peer``
        came = _device_maps.send_map(_device_maps.Sent.REPLY, me, DIRECTED[peer], peers_reverse)
        back = _device_maps.gradient_map(_device_maps.Sent.REPLY, peer, own, torchs)
        assert back == _inverse(came) == own.get(peer, {})


def test_the_issues_group_sends_the_gradient_back_on_the_mapped_device() -> None:
    """w0 maps cuda:0 to w1's cuda:0 and w1 has no map: w1 still sends the gradient of
    w0's tensor back to cuda:0 (w1's own map for w0 is empty, which refused it)."""
    maps: dict[str, dict[str, dict[torch.device, torch.device]]] = {
        "w0": {"w1": {d("cuda:0"): d("cuda:0")}},
        "w1": {},
    }
    torchs = torch_registry._create_reverse_mapping("w1", ["w0", "w1"], maps)
    back = _device_maps.gradient_map(_device_maps.Sent.CALL, "w0", maps["w1"], torchs)
    assert back == {d("cuda:0"): d("cuda:0")} and maps["w1"].get("w0") is None
