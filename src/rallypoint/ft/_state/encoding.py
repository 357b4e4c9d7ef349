"""A state dict as typed JSON plus raw tensor bytes: how every transport carries a state.

Nothing is unpickled. The skeleton is JSON that names every type (dicts with any scalar
keys, lists, tuples, numbers, strings, bytes, dtypes, devices, ``torch.Size``), with each
tensor replaced by a reference into a list of tensors whose dtypes and shapes the header
names; a DTensor travels as its local tensor and its spec (the mesh's device type, ranks
and dimension names, its placements, its global shape and stride). The receiver builds
empty tensors of exactly those dtypes and shapes and reads their bytes into them.

Used by the heal stream (``_heal``) and by ``rallypoint.ft.checkpointing``'s transports.
"""

from __future__ import annotations

import base64
import json
import math
from collections import OrderedDict
from typing import Any

import torch

__all__ = [
    "MAX_HEADER",
    "HealError",
    "decode_skeleton",
    "dtype_named",
    "empty_tensors",
    "encode_skeleton",
    "header_bytes",
    "pack",
    "parse_header",
    "raw_bytes",
    "unpack",
]

MAX_HEADER = 64 << 20
"""The largest header a receiver reads (a state's skeleton, not its tensors)."""


class HealError(RuntimeError):
    """A heal that cannot be done: what and from where."""


# ---------------------------------------------------------------------- the skeleton
def encode_skeleton(obj: Any, tensors: list[torch.Tensor], path: str = "state") -> Any:
    """``obj`` as JSON that says every type; tensors go to ``tensors`` (by reference)."""
    if obj is None or isinstance(obj, bool | str | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, torch.Tensor):
        if _is_dtensor(obj):
            tensors.append(obj._local_tensor)  # type: ignore[attr-defined]
            return {"DT": [len(tensors) - 1, _encode_spec(obj, path)]}
        tensors.append(obj)
        return {"T": len(tensors) - 1}
    if isinstance(obj, dict):
        return {
            "d": [
                [
                    encode_skeleton(k, tensors, f"{path} key"),
                    encode_skeleton(v, tensors, f"{path}[{k!r}]"),
                ]
                for k, v in obj.items()
            ]
        }
    if isinstance(obj, list):
        return {"l": [encode_skeleton(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, torch.Size):
        return {"sz": list(obj)}
    if isinstance(obj, tuple):
        return {"t": [encode_skeleton(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, torch.dtype):
        return {"dt": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"dev": str(obj)}
    if isinstance(obj, bytes):
        return {"b": base64.b64encode(obj).decode()}
    raise HealError(
        f"{path}: a {type(obj).__name__} cannot be sent to a healing group (a state dict "
        "holds tensors, numbers, strings and containers of them)"
    )


def decode_skeleton(node: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`encode_skeleton`; ``ValueError`` for anything else."""
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"not a heal skeleton node: {str(node)[:80]}")
    ((kind, value),) = node.items()
    if kind == "T":
        return tensors[int(value)]
    if kind == "DT":
        index, spec = value
        return _decode_dtensor(tensors[int(index)], spec)
    if kind == "d":
        return OrderedDict(
            (_hashable(decode_skeleton(k, tensors)), decode_skeleton(v, tensors)) for k, v in value
        )
    if kind == "l":
        return [decode_skeleton(v, tensors) for v in value]
    if kind == "t":
        return tuple(decode_skeleton(v, tensors) for v in value)
    if kind == "sz":
        return torch.Size(int(v) for v in value)
    if kind == "f":
        return float(str(value))
    if kind == "dt":
        return dtype_named(str(value))
    if kind == "dev":
        return torch.device(str(value))
    if kind == "b":
        return base64.b64decode(str(value))
    raise ValueError(f"unknown heal skeleton kind {kind!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        raise ValueError("a dict key cannot be a list")
    return key


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


# ---------------------------------------------------------------------- DTensors
def _is_dtensor(obj: torch.Tensor) -> bool:
    return type(obj) is not torch.Tensor and hasattr(obj, "_spec") and hasattr(obj, "_local_tensor")


def _encode_spec(obj: Any, path: str) -> dict[str, Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    spec = obj._spec
    placements: list[Any] = []
    for p in spec.placements:
        if type(p) is Shard:
            placements.append(["S", p.dim])
        elif type(p) is Replicate:
            placements.append(["R"])
        elif type(p) is Partial:
            placements.append(["P", str(p.reduce_op)])
        else:
            raise HealError(f"{path}: a DTensor placed {p!r} cannot be sent")
    mesh = spec.mesh
    meta = spec.tensor_meta
    return {
        "device": mesh.device_type,
        "mesh": mesh.mesh.tolist(),
        "names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": placements,
        "shape": list(meta.shape),
        "stride": list(meta.stride),
        "dtype": str(meta.dtype).removeprefix("torch."),
    }


def _decode_dtensor(local: torch.Tensor, spec: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    if not isinstance(spec, dict):
        raise ValueError("a DTensor's spec is not an object")
    names = spec["names"]
    mesh = DeviceMesh(
        str(spec["device"]),
        torch.tensor(spec["mesh"], dtype=torch.int),
        mesh_dim_names=tuple(str(n) for n in names) if names is not None else None,
        _init_backend=False,
    )
    placements: list[Any] = []
    for p in spec["placements"]:
        kind = p[0]
        if kind == "S":
            placements.append(Shard(int(p[1])))
        elif kind == "R":
            placements.append(Replicate())
        elif kind == "P":
            placements.append(Partial(str(p[1])))
        else:
            raise ValueError(f"unknown DTensor placement {kind!r}")
    meta = TensorMeta(
        torch.Size(int(s) for s in spec["shape"]),
        tuple(int(s) for s in spec["stride"]),
        dtype_named(str(spec["dtype"])),
    )
    spec_ = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec_, requires_grad=False)  # type: ignore[no-untyped-call]


# ---------------------------------------------------------------------- the framing
def pack(state: Any, **extra: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """``state``'s header (its skeleton, its tensors' dtypes and shapes, and ``extra``) and
    its tensors on the CPU, contiguous, in the order the header names them."""
    tensors: list[torch.Tensor] = []
    skeleton = encode_skeleton(state, tensors)
    flat = [t.detach().to("cpu").contiguous() for t in tensors]
    meta = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in flat]
    return {**extra, "skeleton": skeleton, "tensors": meta}, flat


def header_bytes(header: dict[str, Any]) -> bytes:
    return json.dumps(header).encode()


def parse_header(raw: bytes) -> dict[str, Any]:
    """A header as :func:`header_bytes` wrote it; ``ValueError`` for anything else."""
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("a state header is not an object")
    return header


def empty_tensors(header: dict[str, Any], device: torch.device | None = None) -> list[torch.Tensor]:
    """Empty tensors of the dtypes and shapes ``header`` names, to read their bytes into."""
    return [
        torch.empty([int(s) for s in shape], dtype=dtype_named(str(dtype)), device=device)
        for dtype, shape in header["tensors"]
    ]


def raw_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable (to receive into) and readable."""
    if not t.numel():
        return memoryview(bytearray())
    return t.reshape(-1).view(torch.uint8).numpy().data


def unpack(header: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
    """The state ``header``'s skeleton names, over ``tensors`` (filled)."""
    return decode_skeleton(header["skeleton"], tensors)
