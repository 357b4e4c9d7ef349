"""``CheckpointTransport``: how a healing replica group gets a live group's state.

torchft's interface, with torchft's methods. The ``Manager`` of every group calls them at
each quorum: ``metadata()`` says where this rank's state can be fetched (it travels in the
group's asks to the lighthouse); a group that some group heals from calls
``send_checkpoint(dst_ranks, step, state_dict, timeout)``, a healing group calls
``recv_checkpoint(src_rank, metadata, step, timeout)`` with its source's metadata, and every
group calls ``disallow_checkpoint()`` once the step's commit is decided (the state may
change after it). ``shutdown(wait)`` ends the transport with its manager. Ranks are ranks
in the process group across the quorum (the source's and the healers' replica ranks).

rallypoint's own authenticated stream is the default (``Manager(checkpoint_transport=None)``);
``HTTPTransport`` and ``PGTransport`` are the others. A transport of rallypoint's never
unpickles what a peer sent: a state travels as typed JSON and raw tensor bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, TypeVar

__all__ = ["CheckpointTransport"]

T = TypeVar("T")


class CheckpointTransport(Generic[T], ABC):
    """Moves one replica group's state to the groups that heal from it."""

    @abstractmethod
    def metadata(self) -> str:
        """What a peer's ``recv_checkpoint`` needs to fetch this rank's state."""

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Offer (or send) ``state_dict`` of ``step`` to ``dst_ranks``; may return at once."""

    def disallow_checkpoint(self) -> None:
        """Stop offering the state; once this returns it may change."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """The state of ``step`` from ``src_rank``, found with its ``metadata``."""

    def shutdown(self, wait: bool = True) -> None:
        """End the transport (its servers, its threads)."""
