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


def test_cuda_tensor_without_map_is_refused_before_sending() -> None:
    from rallypoint.rpc._transport import _wire

    with pytest.raises(RuntimeError, match="no device map entry for cuda:0"):
        _wire._send_device(_FakeCuda(), None, "w1")  # type: ignore[arg-type]
    mapped = {d("cuda:0"): d("cuda:1")}
    assert _wire._send_device(_FakeCuda(), mapped, "w1") == "cuda:1"  # type: ignore[arg-type]
    assert _wire._send_device(torch.ones(1), None, "w1") is None


class _FakeCuda:
    device = d("cuda:0")
