"""One fragment of a DiLoCo model: its global copy, its pseudo-gradient, its outer step.

A fragment keeps the parameters of the last outer step (``original_parameters``, the
global model, on ``backup_device``). At its sync it averages ``global - local`` (the
pseudo-gradient) over the quorum, puts the global copy back, and, only if the quorum
commits, takes the outer optimizer's step from there and mixes the local parameters back
in by ``fragment_update_alpha``. Its global copy and outer optimizer are part of the
group's state, so a healed group starts from the live groups' outer step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn, optim
from torch.distributed.tensor import DTensor

__all__ = ["Fragment", "local_copy"]


def local_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t`` (of its local shard, for a DTensor), with no ``grad``."""
    out = (t.to_local() if isinstance(t, DTensor) else t).detach().clone()
    out.grad = None
    return out


def as_param(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` in the form of ``like`` (a DTensor of the same mesh and placements)."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class Fragment:
    """The sync state of one model fragment (torchft's ``_StreamingDiLoCoFragment``)."""

    bucket_cap_mb: int = 1 << 30
    """The largest flat buffer of one allreduce when bucketized, in bytes (torchft's name)."""

    def __init__(
        self,
        manager: Any,
        model_fragment: nn.Module,
        fragment_id: int,
        outer_optimizer: optim.Optimizer,
        *,
        backup_device: torch.device | None,
        pin_memory: bool,
        use_bucketization: bool,
        bucket_cap_mb: float | None,
        fragment_update_alpha: float,
    ) -> None:
        self._fragment_id = fragment_id
        self._manager = manager
        self._model_fragment = model_fragment
        self._outer_optimizer = outer_optimizer
        self._alpha = fragment_update_alpha
        self.use_bucketization = use_bucketization
        self.should_quantize = False
        if bucket_cap_mb is not None:
            self.bucket_cap_mb = int(bucket_cap_mb * (1 << 20))
        self._grads: dict[str, torch.Tensor] = {}
        self._local_parameters: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[Any, torch.Tensor | None, list[torch.Tensor]]] = []
        self._prepared = False
        device = backup_device or torch.device("cpu")
        pin = pin_memory and device.type == "cpu" and torch.accelerator.is_available()
        self.original_parameters: dict[str, torch.Tensor] = {}
        for name, p in model_fragment.named_parameters():
            local = _local(p.data)
            backup = torch.empty(tuple(local.shape), dtype=local.dtype, device=device)
            self.original_parameters[name] = backup.pin_memory() if pin else backup

    # ------------------------------------------------------------------ state
    def register_state_dict_fn(self) -> None:
        """The global copy and the outer optimizer travel with the group's state."""

        def load(state: dict[str, Any]) -> None:
            for name, value in state["original_parameters"].items():
                if name in self.original_parameters:
                    self.original_parameters[name].copy_(value)
            self._outer_optimizer.load_state_dict(state["outer_optimizer"])

        def save() -> dict[str, Any]:
            return {
                "outer_optimizer": self._outer_optimizer.state_dict(),
                "original_parameters": {
                    name: local_copy(t) for name, t in self.original_parameters.items()
                },
            }

        key = f"StreamingDiLoCoFragment_{self._fragment_id}"
        self._manager.register_state_dict_fn(key, load, save)

    def save_parameters(self) -> None:
        """The current parameters become the global copy."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                self.original_parameters[name].copy_(_local(p.data))

    def restore_parameters(self) -> None:
        """The parameters go back to the global copy."""
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                p.data.copy_(as_param(self.original_parameters[name].to(p.device), p))

    # ------------------------------------------------------------------ pseudo-gradients
    def _save_grads(self) -> None:
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                local = _local(p.data)
                self._grads[name] = self.original_parameters[name].to(local.device) - local

    def _average_grads(self) -> None:
        """Start the average of the pseudo-gradients over the quorum (not waited for)."""
        grads = list(self._grads.values())
        if not self.use_bucketization:
            for g in grads:
                self._pending.append((self._allreduce(g), None, []))
            return
        for bucket in _buckets(grads, self.bucket_cap_mb):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self._pending.append((self._allreduce(flat), flat, bucket))

    def _allreduce(self, t: torch.Tensor) -> Any:
        return self._manager.allreduce(t, should_quantize=self.should_quantize)

    def wait(self) -> None:
        """Waits for the averages under way (a failure is recorded on the manager)."""
        pending, self._pending = self._pending, []
        for work, flat, bucket in pending:
            work.wait()
            if flat is not None:
                for g, part in zip(
                    bucket, torch.split(flat, [g.numel() for g in bucket]), strict=True
                ):
                    g.copy_(part.view_as(g))

    def _set_grads(self) -> None:
        """The averaged pseudo-gradients become the parameters' gradients."""
        self.wait()
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                p.grad = as_param(self._grads.pop(name), p)

    # ------------------------------------------------------------------ a sync
    def prepare_sync(self) -> None:
        """The pseudo-gradients, and their average started."""
        assert not self._pending, "a fragment's sync was prepared twice"
        self._save_grads()
        self._average_grads()
        self._prepared = True

    def perform_sync(self) -> bool:
        """Wait for the average, go back to the global copy, and take the outer step if
        the quorum commits; whether it did."""
        assert self._prepared, "perform_sync() before prepare_sync()"
        self._prepared = False
        self.wait()
        if self._alpha > 0:
            with torch.no_grad():
                self._local_parameters = {
                    name: local_copy(p.data) for name, p in self._model_fragment.named_parameters()
                }
        self.restore_parameters()
        committed = bool(self._manager.should_commit())
        if committed:
            self._set_grads()
            self._outer_optimizer.step()
            self.save_parameters()
            self._merge_parameters()
        self._grads.clear()
        self._outer_optimizer.zero_grad()
        self._local_parameters = {}
        return committed

    def _merge_parameters(self) -> None:
        if self._alpha <= 0:
            return
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                local = self._local_parameters[name].to(_local(p.data).device)
                p.data.lerp_(as_param(local, p), self._alpha)


def _buckets(grads: list[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """``grads`` in order, in runs of one dtype and device of at most ``cap_bytes`` each (a
    larger tensor is a run of its own)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = out[-1] if out else None
        if (
            last is None
            or (last[0].dtype, last[0].device) != (g.dtype, g.device)
            or size + nbytes > cap_bytes
        ):
            out.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return out
