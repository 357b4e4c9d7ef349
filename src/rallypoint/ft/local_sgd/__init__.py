"""Semi-synchronous training: ``LocalSGD`` and ``DiLoCo`` (streaming, with fragments).

Each replica group takes ``sync_every`` optimizer steps on its own; then the groups agree
on a quorum and average the parameters (``LocalSGD``) or the pseudo-gradients of one model
fragment, stepped by an outer optimizer (``DiLoCo``; several fragments are synced in turn:
streaming DiLoCo). A sync is one manager step: it commits on every group of the quorum or
on none, and a failed one puts DiLoCo's model back at the last outer step. A group that
comes back heals from a live group at the current outer step. Only the manager's public
methods are used (and ``_use_async_quorum``, which torchft's DiLoCo reads). docs/ft.md.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any, Literal

import torch
from torch import nn, optim
from torch.utils.hooks import RemovableHandle

from rallypoint.ft.local_sgd._fragment import Fragment, as_param, local_copy

__all__ = ["USE_BUCKETIZATION_ENV", "DiLoCo", "LocalSGD", "extract_local_tensor"]

USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"
"""``True`` in the environment turns bucketization on for every DiLoCo (torchft's)."""


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` (of its local shard, for a DTensor), with no gradient."""
    return local_copy(t)


class _Hooked:
    """Calls ``_after_step`` after each step of the inner optimizer, inside ``with``."""

    _local_optimizer: optim.Optimizer
    _manager: Any

    def __init__(self) -> None:
        self._hooks: list[RemovableHandle] = []

    def __enter__(self) -> Any:
        opt = self._local_optimizer
        self._hooks.append(opt.register_step_pre_hook(self._step_pre_hook))
        self._hooks.append(opt.register_step_post_hook(self._step_post_hook))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> Literal[False]:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        return False

    def _step_pre_hook(self, _opt: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._manager.disallow_state_dict_read()

    def _step_post_hook(self, _opt: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._manager.allow_state_dict_read()
        self._after_step()

    def _after_step(self) -> None:
        raise NotImplementedError


def _check_sync_every(sync_every: object) -> int:
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int of at least 1, got {sync_every!r}")
    return sync_every


class LocalSGD(_Hooked):
    """Averages the model's parameters over the quorum every ``sync_every`` steps of
    ``optimizer`` (a context manager: the sync runs in the optimizer's step hook). A sync
    that does not commit leaves each group's parameters as they are."""

    def __init__(
        self, manager: Any, model: nn.Module, optimizer: optim.Optimizer, sync_every: int
    ) -> None:
        super().__init__()
        self._manager = manager
        self._model = model
        self._local_optimizer = optimizer
        self._sync_every = _check_sync_every(sync_every)
        self._local_step = 0

    def __enter__(self) -> LocalSGD:
        return super().__enter__()  # type: ignore[no-any-return]

    def _after_step(self) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    def sync(self) -> None:
        """Average the parameters over a new quorum now."""
        self._manager.start_quorum()
        self._perform_sync()
        self._local_step = 0

    def _perform_sync(self) -> None:
        averaged = self._average()
        if self._manager.should_commit():
            with torch.no_grad():
                for p, avg in zip(self._model.parameters(), averaged, strict=True):
                    p.data.copy_(as_param(avg, p))

    def _average(self) -> list[torch.Tensor]:
        copies = [local_copy(p.data) for p in self._model.parameters()]
        works = [self._manager.allreduce(t) for t in copies]
        for work in works:
            work.wait()
        return copies


class DiLoCo(_Hooked):
    """DiLoCo over ``model_fragments``, streaming when there are several: every
    ``sync_every / len(model_fragments)`` inner steps one fragment (``current_step() %
    len(model_fragments)``) averages its pseudo-gradient, started ``fragment_sync_delay``
    steps before it is waited for, and takes its outer optimizer's step if the quorum
    commits. Needs a manager with ``use_async_quorum=False`` (a group heals before its
    pseudo-gradient is taken). ``should_quantize=True`` is refused: the quantized
    collectives need triton and a GPU."""

    def __init__(
        self,
        manager: Any,
        model_fragments: list[nn.Module],
        inner_optimizer: optim.Optimizer,
        outer_optimizer: optim.Optimizer | list[optim.Optimizer],
        sync_every: int,
        backup_device: torch.device | None = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: int | None = None,
        should_quantize: bool = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        super().__init__()
        n = len(model_fragments)
        _check_arguments(manager, n, outer_optimizer, sync_every, should_quantize)
        if sync_every < n or sync_every % n:
            raise ValueError(
                f"sync_every ({sync_every}) must be a multiple of the number of model "
                f"fragments ({n}): one fragment is synced every sync_every / {n} steps"
            )
        self._sync_every = sync_every // n
        if isinstance(fragment_sync_delay, bool) or not isinstance(fragment_sync_delay, int):
            raise TypeError(f"fragment_sync_delay must be an int, got {fragment_sync_delay!r}")
        if not 0 <= fragment_sync_delay < self._sync_every:
            raise ValueError(
                f"fragment_sync_delay ({fragment_sync_delay}) must be at least 0 and below "
                f"sync_every / fragments ({self._sync_every}): a fragment's sync must end "
                "before the next one starts"
            )
        if not 0 <= fragment_update_alpha <= 1:
            raise ValueError(
                f"fragment_update_alpha must be between 0 and 1, got {fragment_update_alpha}"
            )
        self._manager = manager
        self._local_optimizer = inner_optimizer
        self._fragment_sync_delay = fragment_sync_delay
        self._local_step = 0
        bucketize = use_bucketization or os.environ.get(USE_BUCKETIZATION_ENV) == "True"
        outers = outer_optimizer if isinstance(outer_optimizer, list) else [outer_optimizer] * n
        self._fragments = [
            Fragment(
                manager,
                fragment,
                i,
                outers[i],
                backup_device=None if backup_device is None else torch.device(backup_device),
                pin_memory=pin_memory,
                use_bucketization=bucketize,
                bucket_cap_mb=bucket_cap_mb,
                fragment_update_alpha=fragment_update_alpha,
            )
            for i, fragment in enumerate(model_fragments)
        ]
        for fragment in self._fragments:
            fragment.save_parameters()
            fragment.register_state_dict_fn()

    def __enter__(self) -> DiLoCo:
        return super().__enter__()  # type: ignore[no-any-return]

    def _current_fragment(self) -> int:
        return int(self._manager.current_step()) % len(self._fragments)

    def _after_step(self) -> None:
        self._local_step += 1
        if self._local_step == self._sync_every - self._fragment_sync_delay:
            # every group starts the same fragment: the one of the step they agree on
            self._manager.start_quorum()
            self._fragments[self._current_fragment()].prepare_sync()
        if self._local_step == self._sync_every:
            self._fragments[self._current_fragment()].perform_sync()
            self._local_step = 0

    def _save_parameters(self) -> None:
        for fragment in self._fragments:
            fragment.save_parameters()

    def _restore_parameters(self) -> None:
        for fragment in self._fragments:
            fragment.restore_parameters()


def _check_arguments(
    manager: Any,
    n: int,
    outer_optimizer: optim.Optimizer | list[optim.Optimizer],
    sync_every: object,
    should_quantize: bool,
) -> None:
    if n < 1:
        raise ValueError("DiLoCo needs at least one model fragment")
    if isinstance(outer_optimizer, list) and len(outer_optimizer) != n:
        raise ValueError(
            f"{len(outer_optimizer)} outer optimizers for {n} model fragments: give one "
            "per fragment, or one for all"
        )
    _check_sync_every(sync_every)
    if should_quantize:
        raise ValueError(
            "DiLoCo(should_quantize=True) is not supported by rallypoint.ft: quantized "
            "collectives need triton and a GPU; pass should_quantize=False"
        )
    # torchft's contract: DiLoCo reads this attribute of the manager (its tests set it)
    if getattr(manager, "_use_async_quorum", False) is True:
        raise ValueError(
            "DiLoCo needs a synchronous quorum (a group heals before it takes its "
            "pseudo-gradient): create the Manager with use_async_quorum=False"
        )
