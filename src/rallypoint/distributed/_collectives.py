"""Collectives that autograd can differentiate through.

Each of ``all_to_all``, ``all_gather`` and ``reduce_scatter`` is a
``torch.autograd.Function`` whose backward is the adjoint collective (the table is in
docs/distributed.md). They use torch's single-tensor collectives, which gloo supports on
CPU and NCCL on GPU. Without an initialised process group, or on a group of one rank,
each is the identity. ``group`` is a ``ProcessGroup``, ``None`` (the default group) or a
dimension name of the parallel groups (``"tp"``, ``"dp"``, ``"cp"``, ``"pp"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rallypoint._core.checks import check_int
from rallypoint.distributed._mesh import get_parallel_groups

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def _resolve_group(group: ProcessGroup | str | None) -> tuple[ProcessGroup | None, int]:
    """The group to use and its size (1 when there is nothing to communicate with)."""
    if not dist.is_available() or not dist.is_initialized():
        return None, 1
    if isinstance(group, str):
        group = get_parallel_groups().group(group)
    return group, dist.get_world_size(group)


def _check_tensor(tensor: object, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def _check_dim(tensor: torch.Tensor, dim: int, what: str) -> int:
    check_int(dim, what)
    if not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise ValueError(
            f"{what}={dim} is out of range for a tensor with {tensor.dim()} dimensions"
        )
    return dim % max(tensor.dim(), 1)


def _check_divisible(tensor: torch.Tensor, dim: int, size: int, what: str) -> None:
    if tensor.dim() == 0 or tensor.size(dim) % size != 0:
        length = tensor.size(dim) if tensor.dim() else "a 0-d tensor"
        raise ValueError(
            f"{what}: dimension {dim} has size {length}, which the group of {size} ranks "
            f"cannot split evenly; pad it to a multiple of {size}"
        )


def _split_stack(tensor: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    """``(parts, *chunk_shape)``: the chunks of ``tensor`` along ``dim``, stacked."""
    return torch.stack(tensor.chunk(parts, dim=dim)).contiguous()


def _apply(function: type[torch.autograd.Function], *args: Any) -> torch.Tensor:
    # torch's stubs leave Function.apply untyped; every Function here returns one tensor
    result: torch.Tensor = function.apply(*args)  # type: ignore[no-untyped-call]
    return result


def _unstack_cat(stacked: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat(stacked.unbind(0), dim=dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        group: ProcessGroup | None,
        size: int,
        scatter_dim: int,
        gather_dim: int,
    ) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        ctx.scatter_dim, ctx.gather_dim = scatter_dim, gather_dim
        send = _split_stack(tensor, scatter_dim, size)
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return _unstack_cat(received, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        result = _apply(_AllToAll, grad, ctx.group, ctx.size, ctx.gather_dim, ctx.scatter_dim)
        return result, None, None, None, None


def _save(
    ctx: Any, adjoint: type[torch.autograd.Function], group: Any, size: int, dim: int
) -> None:
    ctx.adjoint, ctx.group, ctx.size, ctx.dim = adjoint, group, size, dim


def _adjoint_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    """The backward of a collective along ``dim``: its adjoint collective on the gradient."""
    return _apply(ctx.adjoint, grad, ctx.group, ctx.size, ctx.dim), None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None, size: int, dim: int
    ) -> torch.Tensor:
        _save(ctx, _ReduceScatter, group, size, dim)
        tensor = tensor.contiguous()
        # the concatenated output form: gloo rejects the stacked one
        gathered = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_single(gathered, tensor, group=group)
        return _unstack_cat(gathered.view(size, *tensor.shape), dim)

    backward = staticmethod(_adjoint_backward)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None, size: int, dim: int
    ) -> torch.Tensor:
        _save(ctx, _AllGather, group, size, dim)
        send = _split_stack(tensor, dim, size)
        out = send.new_empty(send.shape[1:])
        dist.reduce_scatter_single(out, send.flatten(0, 1), group=group)
        return out

    backward = staticmethod(_adjoint_backward)


def all_to_all(
    tensor: torch.Tensor,
    group: ProcessGroup | str | None = None,
    *,
    scatter_dim: int = 0,
    gather_dim: int = 0,
) -> torch.Tensor:
    """Exchange equal chunks of ``tensor`` between the ranks of ``group``, differentiably.

    ``tensor`` is cut into ``group size`` equal chunks along ``scatter_dim``; chunk ``j``
    goes to rank ``j``; the chunks received from ranks ``0..n-1`` are concatenated along
    ``gather_dim``. With the default dims this is ``all_to_all_single``. The gradient is
    the ``all_to_all`` of the output gradients with ``scatter_dim`` and ``gather_dim``
    swapped. Every rank must pass a tensor of the same shape.
    """
    tensor = _check_tensor(tensor, "all_to_all")
    scatter_dim = _check_dim(tensor, scatter_dim, "scatter_dim")
    gather_dim = _check_dim(tensor, gather_dim, "gather_dim")
    pg, size = _resolve_group(group)
    if size == 1:
        return tensor
    _check_divisible(tensor, scatter_dim, size, "all_to_all")
    return _apply(_AllToAll, tensor, pg, size, scatter_dim, gather_dim)


def all_gather(
    tensor: torch.Tensor, group: ProcessGroup | str | None = None, *, dim: int = 0
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim`` (rank order), differentiably.

    The gradient of this rank's input is the sum over ranks of the output gradients'
    slice that came from this rank (a ``reduce_scatter``). Every rank must pass a tensor
    of the same shape.
    """
    tensor = _check_tensor(tensor, "all_gather")
    dim = _check_dim(tensor, dim, "dim")
    pg, size = _resolve_group(group)
    if size == 1:
        return tensor
    if tensor.dim() == 0:
        raise ValueError("all_gather needs a tensor with at least one dimension; unsqueeze it")
    return _apply(_AllGather, tensor, pg, size, dim)


def reduce_scatter(
    tensor: torch.Tensor, group: ProcessGroup | str | None = None, *, dim: int = 0
) -> torch.Tensor:
    """Sum ``tensor`` over the ranks and keep this rank's slice along ``dim``, differentiably.

    Rank ``r`` gets chunk ``r`` of the sum (``tensor.size(dim)`` must be a multiple of
    the group size). The gradient is the ``all_gather`` of the output gradients.
    """
    tensor = _check_tensor(tensor, "reduce_scatter")
    dim = _check_dim(tensor, dim, "dim")
    pg, size = _resolve_group(group)
    if size == 1:
        return tensor
    _check_divisible(tensor, dim, size, "reduce_scatter")
    return _apply(_ReduceScatter, tensor, pg, size, dim)
