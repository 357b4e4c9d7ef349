"""LaunchConfig: flat options in, small parsed option groups stored, flat names read back."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from rallypoint._launch._config import OPTION_NAMES
from rallypoint.launcher import LaunchConfig


def test_options_are_stored_parsed_in_groups() -> None:
    cfg = LaunchConfig(
        nproc=2,
        nnodes="2:4",
        rdzv_endpoint="n0:29400",
        preload="json,,email.parser",
        redirects="0:1,1:2",
        tee=3,
        local_ranks_filter=[1, 0],
        signals_to_handle="SIGTERM, SIGINT",
        events=__file__,
    )
    assert (cfg.rendezvous.min_nodes, cfg.rendezvous.max_nodes) == (2, 4)
    assert cfg.nnodes == "2:4" and cfg.min_nodes == 2 and cfg.max_nodes == 4 and cfg.multi_node
    assert cfg.workers.preload == ("json", "email.parser")
    assert cfg.output.redirects == {0: 1, 1: 2} and cfg.output.tee == 3
    assert cfg.output.local_ranks_filter == frozenset({0, 1})
    assert cfg.stop.signals_to_handle == ("SIGTERM", "SIGINT")
    assert cfg.signals_to_handle == "SIGTERM,SIGINT"
    assert cfg.std_mask("redirects", 1) == 2 and cfg.std_mask("tee", 7) == 3
    assert cfg.rdzv_endpoint == "n0:29400" and cfg.rdzv_backend == "c10d"
    assert cfg.events == __file__


def test_defaults_and_read_back() -> None:
    cfg = LaunchConfig()
    assert cfg.nproc == 1 and cfg.nnodes == "1" and not cfg.multi_node
    assert cfg.monitor_interval == timedelta(seconds=0.1)
    assert cfg.total_world_size == 1 and cfg.parallel is None
    assert LaunchConfig(nproc=3, nnodes=1).nnodes == "1"
    assert LaunchConfig(nproc=2) == LaunchConfig(nproc=2)
    for name in OPTION_NAMES:  # every flat option reads back
        getattr(cfg, name)


def test_groups_are_frozen_and_take_the_checked_values() -> None:
    cfg = LaunchConfig(nproc=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers = LaunchConfig(nproc=3).workers  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.workers.nproc = 3  # type: ignore[misc]
    with pytest.raises(ValueError, match="nproc must be >= 1"):
        LaunchConfig(nproc=0)
    with pytest.raises(ValueError, match="signals_to_handle"):
        LaunchConfig(signals_to_handle="SIGKILL")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"nnodes": "2:1"}, ValueError, "0 < MIN <= MAX"),
        ({"nnodes": "a"}, ValueError, "N or MIN:MAX"),
        ({"nnodes": "1:2:3"}, ValueError, "N or MIN:MAX"),
        ({"nnodes": "2", "rdzv_endpoint": "h:1", "rank_offset": 1}, ValueError, "rank_offset"),
        (
            {"nnodes": "2", "rdzv_backend": "static", "rdzv_endpoint": "h:1"},
            ValueError,
            "node-rank",
        ),
        (
            {"nnodes": "2", "rdzv_backend": "nope", "rdzv_endpoint": "h:1"},
            ValueError,
            "rdzv_backend",
        ),
        ({"node_rank": "1"}, TypeError, "node_rank must be an int"),
        ({"max_restarts": True}, TypeError, "max_restarts must be an int"),
        ({"monitor_interval": timedelta(0)}, ValueError, "monitor_interval must be > 0"),
        ({"shutdown_timeout": 3.0}, TypeError, "shutdown_timeout must be a datetime.timedelta"),
        ({"signals_to_handle": "SIGTERM,SIGFOO"}, ValueError, "SIGFOO"),
        ({"env": {"A": 1}}, TypeError, "env must be a mapping of str to str"),
        ({"prefix": 3}, TypeError, "prefix must be a str or None"),
        ({"role": ""}, ValueError, "role"),
        ({"max_restarts": 1, "nproc": 1, "world_size": 2}, ValueError, "whole world"),
        ({"nprocs": 2}, TypeError, "unexpected keyword argument 'nprocs'"),
    ],
)
def test_bad_options(kwargs: dict[str, object], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match):
        LaunchConfig(**kwargs)  # type: ignore[arg-type]
