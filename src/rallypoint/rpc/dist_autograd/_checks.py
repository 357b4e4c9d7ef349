"""Arguments of the distributed autograd API, checked with torch's messages (in torch's
order), so a program that catches torch's errors sees the same ones."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch


def check_context_id(context_id: object) -> int:
    if type(context_id) is int:  # the usual case, without the ABC's isinstance (2 calls)
        return context_id
    if not isinstance(context_id, numbers.Integral) or isinstance(context_id, bool):
        raise TypeError(f"context_id must be an int, got {type(context_id).__name__}")
    return int(context_id)


def root_list(roots: object) -> list[torch.Tensor]:
    """``roots`` as a list of tensors (a ``TypeError`` otherwise, as torch's binding)."""
    # list and tuple first: they match before the ABC's check (two calls of Python)
    if not isinstance(roots, (list, tuple, Sequence)) or not all(
        isinstance(r, torch.Tensor) for r in roots
    ):
        raise TypeError(
            f"backward(): roots must be a sequence of tensors, got {type(roots).__name__}"
        )
    return list(roots)


def check_roots(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """torch's checks and messages, in torch's order."""
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for root in roots:
        if not root.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if root.numel() != 1:
            raise RuntimeError(" is not a scalar, all roots need to be scalar")
        if root.grad_fn is None:
            raise RuntimeError(" does not have a valid gradient function.")
    return roots
