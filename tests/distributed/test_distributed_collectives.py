"""Differentiable collectives: forward and gradients equal a single-process reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import rallypoint.distributed as rd
from rallypoint.testing import run_workers

WORLD = 4

# name -> (input shape, keyword arguments)
CASES: dict[str, tuple[tuple[int, ...], dict[str, int]]] = {
    "all_to_all": ((8, 3), {}),
    "all_to_all_dims": ((2, 8, 3), {"scatter_dim": 1, "gather_dim": 0}),
    "all_to_all_last": ((4, 6), {"scatter_dim": -2, "gather_dim": -1}),
    "all_gather": ((2, 3), {"dim": 0}),
    "all_gather_dim1": ((2, 3), {"dim": 1}),
    "reduce_scatter": ((8, 3), {"dim": 0}),
    "reduce_scatter_dim1": ((3, 4), {"dim": 1}),
}


def _op(name: str) -> Callable[..., torch.Tensor]:
    fn: Callable[..., torch.Tensor] = getattr(rd, name.split("_dim")[0].removesuffix("_last"))
    return fn


def _input(case: str, rank: int) -> torch.Tensor:
    shape, _ = CASES[case]
    gen = torch.Generator().manual_seed(1000 * rank + len(case))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _weight(shape: torch.Size, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(77 + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _reference(case: str, inputs: list[torch.Tensor], members: list[int]) -> list[torch.Tensor]:
    """What each member of one group gets, computed in this process with plain torch."""
    _, kwargs = CASES[case]
    n = len(members)
    xs = [inputs[r] for r in members]
    if case.startswith("all_to_all"):
        s, g = kwargs.get("scatter_dim", 0), kwargs.get("gather_dim", 0)
        return [torch.cat([x.chunk(n, dim=s)[i] for x in xs], dim=g) for i in range(n)]
    dim = kwargs["dim"]
    if case.startswith("all_gather"):
        return [torch.cat(xs, dim=dim) for _ in range(n)]
    total = torch.stack(xs).sum(0)
    return list(total.chunk(n, dim=dim))


def _expected(case: str, groups: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    inputs = [_input(case, r).requires_grad_() for r in range(WORLD)]
    outputs: list[torch.Tensor] = [torch.empty(0)] * WORLD
    for members in groups:
        for rank, out in zip(members, _reference(case, inputs, members), strict=True):
            outputs[rank] = out
    loss = sum((out * _weight(out.shape, r)).sum() for r, out in enumerate(outputs))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    grads = [x.grad for x in inputs]
    assert all(g is not None for g in grads)
    return [o.detach() for o in outputs], [g for g in grads if g is not None]


def _run_cases(group_spec: str | None, tensor_parallel: int) -> dict[str, Any]:
    rd.init_parallel_groups(tensor_parallel=tensor_parallel)
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for case, (_, kwargs) in CASES.items():
        x = _input(case, rank).requires_grad_()
        y = _op(case)(x, group_spec, **kwargs)
        (y * _weight(y.shape, rank)).sum().backward()
        results[case] = (y.detach(), x.grad)
    rd.destroy_process_group()
    return results


@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    ("group_spec", "tensor_parallel", "groups"),
    [(None, 1, [[0, 1, 2, 3]]), ("tp", 2, [[0, 1], [2, 3]])],
    ids=["world", "tp-groups"],
)
def test_forward_and_gradients_equal_the_reference(
    group_spec: str | None, tensor_parallel: int, groups: list[list[int]]
) -> None:
    per_rank = run_workers(_run_cases, WORLD, group_spec, tensor_parallel, timeout=30)
    for case in CASES:
        outputs, grads = _expected(case, groups)
        for rank in range(WORLD):
            y, grad = per_rank[rank][case]
            torch.testing.assert_close(y, outputs[rank], msg=f"{case} forward, rank {rank}")
            torch.testing.assert_close(grad, grads[rank], msg=f"{case} gradient, rank {rank}")


def _explicit_group_and_double_backward() -> tuple[torch.Tensor, torch.Tensor]:
    groups = rd.init_parallel_groups(pipeline_parallel=2)
    rank = dist.get_rank()
    x = torch.full((2,), float(rank), requires_grad=True)
    # all_to_all twice with swapped dims is the identity, and so is its gradient
    y = rd.all_to_all(rd.all_to_all(x, groups.dp_group), groups.dp_group)
    (grad,) = torch.autograd.grad((y * y).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), x)
    rd.destroy_process_group()
    return y.detach(), second


@pytest.mark.timeout(30)
def test_round_trip_with_a_process_group_object_and_double_backward() -> None:
    for rank, (y, second) in enumerate(run_workers(_explicit_group_and_double_backward, 4)):
        torch.testing.assert_close(y, torch.full((2,), float(rank)))
        torch.testing.assert_close(second, torch.full((2,), 2.0))


def _uneven() -> None:
    rd.init_process_group()
    rd.all_to_all(torch.zeros(6))


@pytest.mark.timeout(20)
def test_uneven_split_is_a_clear_error_on_every_rank() -> None:
    for exc in run_workers(_uneven, 4, timeout=15, return_exceptions=True):
        assert isinstance(exc, ValueError)
        assert "dimension 0 has size 6, which the group of 4 ranks cannot split" in str(exc)


@pytest.mark.parametrize("name", ["all_to_all", "all_gather", "reduce_scatter"])
def test_identity_without_a_process_group(name: str) -> None:
    assert not dist.is_initialized()
    x = torch.randn(3, 4, requires_grad=True)
    y = getattr(rd, name)(x)
    assert y is x
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.ones(3, 4))


def test_bad_input() -> None:
    with pytest.raises(TypeError, match=r"all_to_all expects a torch.Tensor, got list"):
        rd.all_to_all([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"scatter_dim=2 is out of range for a tensor with 2"):
        rd.all_to_all(torch.zeros(2, 2), scatter_dim=2)
    with pytest.raises(TypeError, match=r"dim must be an int"):
        rd.all_gather(torch.zeros(2), dim=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dim=-3 is out of range"):
        rd.reduce_scatter(torch.zeros(2, 2), dim=-3)
