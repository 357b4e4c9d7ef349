"""``PGTransport``: a state sent over a process group's point-to-point ``send``/``recv``.

torchft's signature (``PGTransport(pg, timeout, device, state_dict=None)``) and ranks (the
source's and the healers' ranks in ``pg``, the manager's process group across the quorum).
What goes over the wire is rallypoint's, not torchft's pickle: a header of typed JSON
(``rallypoint.ft._state.encoding``: the state's skeleton, its tensors' dtypes and shapes, the
step) as a byte tensor, then each tensor's bytes. A receiver never unpickles a peer's bytes.
With ``state_dict`` (a function returning this rank's state), tensors are received in place
into that state's tensors where the structure, dtype, shape and device type match.

The process group needs torchft's ``send(tensors, dst_rank, tag)`` and
``recv(tensors, src_rank, tag)`` returning works (torch's process groups have them).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from rallypoint.ft._state.encoding import (
    MAX_HEADER,
    HealError,
    dtype_named,
    encode_skeleton,
    header_bytes,
    parse_header,
    unpack,
)
from rallypoint.ft.checkpointing.transport import CheckpointTransport

__all__ = ["PGTransport"]

T = TypeVar("T")
_LENGTH, _HEADER, _FIRST = 1, 2, 3  # tags: the header's length, the header, the tensors


class PGTransport(CheckpointTransport[T]):
    """Sends a state to the healing ranks over ``pg`` (see the module docstring).

    Args:
        pg: the process group to send over
        timeout: how long each send and receive may take
        device: where tensors travel (``cpu`` for gloo, ``cuda`` for NCCL)
        state_dict: this rank's state, to receive into in place (optional)
    """

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        device: torch.device,
        state_dict: Callable[[], object] | None = None,
    ) -> None:
        for method in ("send", "recv"):
            if not callable(getattr(pg, method, None)):
                raise TypeError(
                    f"PGTransport needs a process group with send and recv; "
                    f"{type(pg).__name__} has no {method}()"
                )
        self._pg = pg
        self._timeout = timeout
        self._device = device
        self._state_dict = state_dict

    def metadata(self) -> str:
        return "<n/a>"

    def disallow_checkpoint(self) -> None:
        pass  # sends are done when send_checkpoint returns

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        tensors: list[torch.Tensor] = []
        skeleton = encode_skeleton(state_dict, tensors)
        flat = [t.detach().contiguous() for t in tensors]
        meta = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in flat]
        body = header_bytes({"step": step, "skeleton": skeleton, "tensors": meta})
        length = torch.tensor([len(body)], dtype=torch.int64, device=self._device)
        header = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(self._device)
        works = []
        for dst in dst_ranks:
            works.append(self._pg.send([length], dst, _LENGTH))
            works.append(self._pg.send([header], dst, _HEADER))
        for i, t in enumerate(flat):
            if not t.numel():
                continue
            wire = _bytes_of(t.to(self._device))
            sent = [self._pg.send([wire], dst, _FIRST + i) for dst in dst_ranks]
            if t.device != wire.device:  # a copy: free it before the next one
                for work in sent:
                    work.wait(timeout)
            else:
                works.extend(sent)
        for work in works:
            work.wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        length = torch.zeros(1, dtype=torch.int64, device=self._device)
        self._pg.recv([length], src_rank, _LENGTH).wait(timeout)
        size = int(length.item())
        if not 0 < size <= MAX_HEADER:
            raise HealError(f"rank {src_rank}: a state header of {size} bytes")
        raw = torch.empty(size, dtype=torch.uint8, device=self._device)
        self._pg.recv([raw], src_rank, _HEADER).wait(timeout)
        header = parse_header(raw.cpu().numpy().tobytes())
        if header.get("step") != step:
            raise HealError(
                f"rank {src_rank} sent the state of step {header.get('step')}, not {step}"
            )
        into = self._targets(header)
        tensors: list[torch.Tensor] = []
        works = []
        for i, (dtype, shape) in enumerate(header["tensors"]):
            shape = [int(s) for s in shape]
            target = into[i] if into is not None else None
            t = (
                target
                if target is not None
                else torch.empty(shape, dtype=dtype_named(str(dtype)), device=self._device)
            )
            if t.numel():
                work = self._pg.recv([_bytes_of(t)], src_rank, _FIRST + i)
                if target is None:
                    work.wait(timeout)  # then to the CPU, as torchft does
                    t = t.cpu()
                else:
                    works.append(work)
            tensors.append(t)
        for work in works:
            work.wait(timeout)
        return cast(T, unpack(header, tensors))

    def _targets(self, header: dict[str, Any]) -> list[torch.Tensor | None] | None:
        """This rank's own tensors to receive into, where they fit the header's."""
        if self._state_dict is None:
            return None
        mine: list[torch.Tensor] = []
        if encode_skeleton(self._state_dict(), mine) != header["skeleton"]:
            return None  # another structure: nothing is received in place
        out: list[torch.Tensor | None] = []
        for t, (dtype, shape) in zip(mine, header["tensors"], strict=True):
            fits = (
                t.is_contiguous()
                and t.device.type == self._device.type
                and str(t.dtype).removeprefix("torch.") == dtype
                and list(t.shape) == [int(s) for s in shape]
            )
            out.append(t.detach() if fits else None)
        return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat byte tensor (the same memory)."""
    return t.reshape(-1).view(torch.uint8)
