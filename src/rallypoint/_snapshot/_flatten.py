"""A training state as tensors plus a picklable skeleton, and back into the live objects.

``state`` maps names to:

- objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers,
  samplers): their state dict is saved, and ``load_state_dict`` restores it;
- tensors: saved, and copied back into the same tensor (in place);
- anything else picklable: saved, and put back into ``state`` under its name.

Inside state dicts, dicts, lists and tuples are walked; every strided tensor becomes a
:class:`Ref` to one entry of the tensor list (the same tensor object once, so tied weights
stay tied); everything else is pickled with the skeleton.
"""

from __future__ import annotations

import pickle
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Flat", "Ref", "apply", "check_restorable", "check_state", "flatten"]


_DICTS = (dict, OrderedDict)


class Ref:
    """Placeholder for the tensor at ``index`` of a snapshot's tensor list."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (Ref, (self.index,))

    def __repr__(self) -> str:
        return f"Ref({self.index})"


@dataclass(slots=True)
class Flat:
    skeleton: bytes
    tensors: list[torch.Tensor]
    paths: list[str]


def _stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and not isinstance(value, torch.Tensor)


def _is_dtensor(value: object) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(value, cls)


def check_state(state: object, what: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{what}: state must be a dict of name -> object, e.g. "
            f"{{'model': model, 'optimizer': optimizer}}; got {type(state).__name__}"
        )
    for key in state:
        if not isinstance(key, str):
            raise TypeError(f"{what}: state keys must be str, got {key!r}")
    return state


def check_restorable(state: Mapping[str, Any]) -> None:
    for key, value in state.items():
        if _stateful(value) and not callable(getattr(value, "load_state_dict", None)):
            raise TypeError(
                f"restore: state[{key!r}] has state_dict() but no load_state_dict(); "
                "give it one, or put its state dict in the state instead"
            )


class _Walker:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.paths: list[str] = []
        self._seen: dict[int, int] = {}

    def walk(self, obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if _is_dtensor(obj):
                raise TypeError(
                    f"{path}: DTensor state is not supported by rallypoint.snapshot; "
                    "save it with torch.distributed.checkpoint"
                )
            if obj.layout is not torch.strided:
                return obj  # sparse, quantized...: pickled with the skeleton
            index = self._seen.get(id(obj))
            if index is None:
                index = self._seen[id(obj)] = len(self.tensors)
                self.tensors.append(obj.detach())
                self.paths.append(path)
            return Ref(index)
        if type(obj) in (list, tuple):
            return type(obj)(self.walk(v, f"{path}/{i}") for i, v in enumerate(obj))
        if type(obj) in _DICTS:
            out = type(obj)()
            for k, v in obj.items():
                out[k] = self.walk(v, f"{path}/{k}")
            if hasattr(obj, "_metadata"):  # nn.Module.state_dict() versions
                out._metadata = obj._metadata
            return out
        return obj


def flatten(state: Mapping[str, Any]) -> Flat:
    """Split ``state`` into tensors (with their paths) and a pickled skeleton."""
    walker = _Walker()
    items: list[tuple[str, str, Any]] = []
    for key, value in check_state(state, "save").items():
        if _stateful(value):
            sd = value.state_dict()
            if not isinstance(sd, Mapping):
                raise TypeError(
                    f"save: state[{key!r}].state_dict() returned {type(sd).__name__}, not a dict"
                )
            items.append((key, "stateful", walker.walk(sd, key)))
        elif isinstance(value, torch.Tensor):
            items.append((key, "tensor", walker.walk(value, key)))
        else:
            items.append((key, "value", walker.walk(value, key)))
    try:
        skeleton = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        bad = _unpicklable(items)
        raise TypeError(f"save: state[{bad!r}] cannot be pickled: {exc}") from None
    return Flat(skeleton, walker.tensors, walker.paths)


def _unpicklable(items: list[tuple[str, str, Any]]) -> str:
    for key, _, value in items:
        try:
            pickle.dumps(value)
        except Exception:
            return key
    return "?"


def _resolve(obj: Any, get: Callable[[int], torch.Tensor]) -> Any:
    if isinstance(obj, Ref):
        return get(obj.index)
    if type(obj) in (list, tuple):
        return type(obj)(_resolve(v, get) for v in obj)
    if type(obj) in _DICTS:
        out = type(obj)()
        for k, v in obj.items():
            out[k] = _resolve(v, get)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    return obj


def _into(saved: Any, live: Any, tensors: _Tensors) -> Any:
    """Like :func:`_resolve` with private tensors, but a saved tensor whose live
    counterpart (the same place in the object's current state dict) has its shape and dtype
    is copied into that tensor, which is reused: an optimizer with state gets its moments
    back without a new allocation."""
    if isinstance(saved, Ref):
        view = tensors.views[saved.index]
        if isinstance(live, torch.Tensor) and live.shape == view.shape and live.dtype == view.dtype:
            with torch.no_grad():
                live.copy_(view)
            return live
        return tensors.owned(saved.index)
    if type(saved) in (list, tuple):
        same = isinstance(live, list | tuple) and len(live) == len(saved)
        return type(saved)(
            _into(v, live[i] if same else None, tensors) for i, v in enumerate(saved)
        )
    if type(saved) in _DICTS:
        current = live if isinstance(live, Mapping) else {}
        out = type(saved)()
        for k, v in saved.items():
            out[k] = _into(v, current.get(k), tensors)
        if hasattr(saved, "_metadata"):
            out._metadata = saved._metadata
        return out
    return saved


class _Tensors:
    """The restored tensors: the views themselves where the consumer copies (modules,
    in-place tensors), private copies on their device where it keeps them (optimizers).
    With ``owned`` the given tensors are private already (read from disk)."""

    def __init__(self, views: list[torch.Tensor], devices: list[str], owned: bool) -> None:
        self.views = views
        self.devices = devices
        self._owned: dict[int, torch.Tensor] = {}
        self._private = owned

    def view(self, index: int) -> torch.Tensor:
        device = self.devices[index]
        return self.views[index] if device == "cpu" else self.owned(index)

    def owned(self, index: int) -> torch.Tensor:
        if index not in self._owned:
            view, device = self.views[index], self.devices[index]
            copy = not (self._private and device == "cpu")
            self._owned[index] = view.to(device, copy=copy)
        return self._owned[index]


def apply(
    state: MutableMapping[str, Any],
    skeleton: bytes,
    views: list[torch.Tensor],
    devices: list[str],
    *,
    owned: bool = False,
) -> list[str]:
    """Load a snapshot into ``state`` in place; returns notes about what did not fit.

    ``views`` are the snapshot's tensors (on the CPU; ``devices`` says where each was);
    ``owned``: they are private to this call (else they are shared memory and are copied
    where a consumer keeps them)."""
    items: list[tuple[str, str, Any]] = pickle.loads(skeleton)
    tensors = _Tensors(views, devices, owned)
    notes = []
    for key, kind, saved in items:
        live: Any = state.get(key)
        if kind == "stateful" and isinstance(live, torch.nn.Module):
            live.load_state_dict(_resolve(saved, tensors.view))  # it copies: views will do
        elif kind == "stateful" and _stateful(live):
            live.load_state_dict(_into(saved, live.state_dict(), tensors))
        elif kind == "tensor" and isinstance(live, torch.Tensor):
            value = _resolve(saved, tensors.view)
            if live.shape == value.shape and live.dtype == value.dtype:
                with torch.no_grad():
                    live.copy_(value)
            else:
                state[key] = value.to(live.device, copy=True)
                notes.append(f"{key}: the live tensor's shape or dtype differs; replaced it")
        else:
            if key in state and kind == "stateful":
                notes.append(f"{key}: not an object with load_state_dict(); put its state dict")
            state[key] = _resolve(saved, tensors.owned)
    missing = sorted(set(state) - {key for key, _, _ in items})
    if missing:
        notes.append(f"not in the snapshot (left as they are): {', '.join(missing)}")
    return notes
