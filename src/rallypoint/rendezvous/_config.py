"""The dynamic handler's settings, and reading them from ``RendezvousParameters``.

Options come as ``RendezvousParameters`` keyword arguments or ``--rdzv-conf k=v,...``:
the names torch reads plus a few of ours; the table with defaults is in
docs/rendezvous.md. Durations accept fractions of a second (torch accepts integers).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from rallypoint._core.checks import check_int, to_timedelta
from rallypoint.rendezvous._api import RendezvousParameters

__all__ = ["DynamicRendezvousConfig", "config_from_params", "seconds_option"]


@dataclass(kw_only=True, slots=True)
class DynamicRendezvousConfig:
    """Settings of a :class:`DynamicRendezvousHandler` (durations as ``timedelta``).

    ``close_timeout`` bounds :meth:`~DynamicRendezvousHandler.set_closed` and
    :meth:`~DynamicRendezvousHandler.shutdown`, as in torch: a store that stops answering
    makes them give up after it instead of blocking for the store's own timeout.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    join_timeout: timedelta = timedelta(seconds=600)
    last_call_timeout: timedelta = timedelta(seconds=30)
    close_timeout: timedelta = timedelta(seconds=30)
    keep_alive_interval: timedelta = timedelta(seconds=5)
    keep_alive_max_attempt: int = 3
    local_addr: str | None = None
    use_agent_store: bool = True

    @staticmethod
    def from_parameters(params: RendezvousParameters) -> DynamicRendezvousConfig:
        """The settings ``RendezvousParameters`` describe (options above)."""
        return config_from_params(params)

    def __post_init__(self) -> None:
        if not self.run_id:
            raise ValueError("The run id must be a non-empty string.")
        if any(c in self.run_id for c in "/\x00"):
            raise ValueError(f"The run id {self.run_id!r} must not contain '/' or NUL.")
        check_int(self.min_nodes, "min_nodes")
        check_int(self.max_nodes, "max_nodes")
        if self.min_nodes < 1:
            raise ValueError(
                f"The minimum number of nodes ({self.min_nodes}) must be greater than zero."
            )
        if self.max_nodes < self.min_nodes:
            raise ValueError(
                f"The maximum number of nodes ({self.max_nodes}) must be greater than or equal "
                f"to the minimum number of nodes ({self.min_nodes})."
            )
        for name in ("join", "last_call", "close"):
            value = getattr(self, f"{name}_timeout")
            if not isinstance(value, timedelta):
                raise TypeError(f"{name}_timeout must be a datetime.timedelta, got {value!r}")
            if value <= timedelta(0):
                raise ValueError(f"The {name} timeout ({value}) must be positive.")
        if not isinstance(self.keep_alive_interval, timedelta) or (
            self.keep_alive_interval <= timedelta(0)
        ):
            raise ValueError(
                f"keep_alive_interval ({self.keep_alive_interval!r}) must be a positive timedelta."
            )
        check_int(self.keep_alive_max_attempt, "keep_alive_max_attempt", minimum=1)


def seconds_option(
    params: RendezvousParameters, key: str, default: float | None
) -> timedelta | None:
    """A duration option: seconds (int, float, a numeric string) or a ``timedelta``."""
    value = params.get(key, default)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(
                f"The rendezvous configuration option '{key}' does not represent a valid "
                "number of seconds."
            ) from None
    return to_timedelta(value, f"The rendezvous configuration option '{key}'")


def _reject_none(params: RendezvousParameters, *keys: str) -> None:
    for key in keys:
        if key in params.config and params.get(key) is None:
            raise TypeError(f"You passed '{key}=None' as a rendezvous configuration option")


def config_from_params(params: RendezvousParameters) -> DynamicRendezvousConfig:
    """The handler settings the parameters describe (``ValueError`` names a bad option)."""
    timeouts: dict[str, Any] = {}
    for name in ("join", "last_call", "close"):
        value = seconds_option(params, f"{name}_timeout", None)
        if value is not None:
            timeouts[f"{name}_timeout"] = value
    _reject_none(params, "keep_alive_interval", "keep_alive_max_attempt")
    interval = seconds_option(params, "keep_alive_interval", 5.0)
    attempts = params.get_as_int("keep_alive_max_attempt", 3)
    agent_store = params.get_as_bool("use_agent_store", True)
    assert interval is not None and attempts is not None and agent_store is not None
    return DynamicRendezvousConfig(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        keep_alive_interval=interval,
        keep_alive_max_attempt=attempts,
        local_addr=params.local_addr,
        use_agent_store=agent_store,
        **timeouts,
    )
