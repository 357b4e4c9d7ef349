"""Each launch option is declared once, as a ``LaunchConfig`` field whose metadata holds its
default, its check and its flag: ``rallypoint run``'s parser, its ``PET_*`` defaults and
``launch()``'s keywords are made from the declarations, the groups take the checked values
as they are, and the option is named nowhere else but where it is used."""

from __future__ import annotations

import dataclasses
import os
import re
from datetime import timedelta
from pathlib import Path

import pytest

from rallypoint._cli._args import config_from_args
from rallypoint._cli._parser import RunFlags, build_parser, command_line
from rallypoint._launch._config import _GROUPS, OPTION_NAMES, LaunchConfig
from rallypoint._launch._option import Flag, declared, flag_default
from rallypoint.launcher import launch

SRC = Path(__file__).resolve().parents[2] / "src" / "rallypoint"
DECLARED = list(declared(LaunchConfig))
FLAGS = [(name, option.flag) for name, option in DECLARED if option.flag]
RUN_FLAGS = list(declared(RunFlags))


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``PET_*`` or SLURM variable of the machine running the tests."""
    for name in list(os.environ):
        if name.startswith(("PET_", "SLURM_", "TORCHELASTIC_", "TORCH_ELASTIC_")):
            monkeypatch.delenv(name)


def _sample(flag: Flag) -> list[str]:
    """A value other than the flag's default, as words of the command line."""
    if flag.switch:
        return []
    if flag.choices:
        return [next(c for c in flag.choices if c != flag.default)]
    return [next(v for v in ("3", "4") if v != flag.default)]  # a count, a duration, a host...


def _parsed(argv: list[str], dest: str) -> object:
    return getattr(build_parser().parse_args([*argv, "train.py"]), dest)


@pytest.mark.parametrize(("name", "flag"), FLAGS + RUN_FLAGS, ids=[n for n, _ in FLAGS + RUN_FLAGS])
def test_every_flag_takes_both_spellings_and_its_pet_variable(
    name: str, flag: Flag, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = _parsed([], flag.dest)
    given = [_parsed([spelling, *_sample(flag)], flag.dest) for spelling in flag.spellings]
    monkeypatch.setenv(flag.pet, (_sample(flag) or ["1"])[0])
    from_pet = _parsed([], flag.dest)
    assert given == [from_pet] * len(flag.spellings) and from_pet != default, name


@pytest.mark.parametrize("name", sorted(OPTION_NAMES))
def test_every_option_is_a_keyword_of_launch_and_a_bad_value_is_refused_by_name(
    name: str,
) -> None:
    defaults = LaunchConfig()
    again = LaunchConfig(**{name: getattr(defaults, name)})  # reads back as it is taken
    assert again == defaults
    with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b") as error:
        launch(print, **{name: object()})
    assert "unexpected keyword" not in str(error.value)


def test_the_default_command_line_is_the_default_config(tmp_path: Path) -> None:
    """torchrun's flag defaults (``--rdzv-id none``, ``--nnodes 1:1``, ``--rdzv-backend
    static``...) mean what ``launch()`` does when the option is left out."""
    script = tmp_path / "train.py"
    script.write_text("")
    config, _ = config_from_args(build_parser().parse_args([str(script)]))
    assert config == LaunchConfig()


def test_the_help_groups_and_order_come_from_the_declarations() -> None:
    order = [name for name, _, _ in command_line()]
    assert order.index("rdzv_conf") + 1 == order.index("standalone")
    assert order[order.index("role") + 1 : order.index("role") + 4] == [
        "module",
        "no_python",
        "run_path",
    ]
    of = {name: section for name, section, _ in command_line()}
    assert of["event_log_handler"] == "output" and of["numa_binding"] == "workers"
    assert order[-3:] == ["snapshot_dir", "snapshot_every", "snapshot_resume_from"]
    titles = [g.title for g in build_parser()._action_groups][2:]
    assert titles == [
        "nodes and rendezvous",
        "workers",
        "output",
        "single-node store",
        "rallypoint",
    ]
    assert len(order) == len(set(order)) == len(FLAGS) + len(RUN_FLAGS)


def _names(path: Path, name: str, flag: Flag | None) -> bool:
    """Whether ``path`` names the option: its name, or one of its flag's spellings."""
    words = [name, *(flag.spellings if flag else ())]
    text = path.read_text()
    return any(re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", text) for w in words)


JOINED = {
    "nnodes",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_conf",
    "node_rank",
    "master_addr",
    "master_port",
    "prefix",
    "shutdown_timeout",
    "env",
}
"""The options whose value on the command line depends on other flags: ``_args`` uses them."""


@pytest.mark.parametrize("name", [name for name, _ in DECLARED])
def test_the_command_line_code_names_no_option(name: str) -> None:
    """The parser and the arguments' mapping are made from the declarations: adding an
    option touches its declaration and the code that uses it, not these. (``RunFlags``
    places its flags after an option, by name; ``_args`` joins a few options' flags.)"""
    flag = dict(DECLARED)[name].flag
    if name not in {extra.after for _, extra in RUN_FLAGS}:
        assert not _names(SRC / "_cli" / "_parser.py", name, flag)
    if name not in JOINED:
        assert not _names(SRC / "_cli" / "_args.py", name, flag)


@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("spare_workers", "_supervise"),
        ("restart_grace", "_supervise"),
        ("hot_spare", "_elastic"),
        ("health_check_timeout", "_elastic"),
        ("straggler_window", "_watch"),
        ("flight_recorder", "_watch"),
    ],
)
def test_an_option_is_named_in_its_declaration_and_where_it_is_used(name: str, part: str) -> None:
    """Once spelt in seven files (a TypedDict, the groups' picks, a read-back descriptor,
    the parser, the arguments' mapping...): now its declaration and its part."""
    flag = dict(FLAGS)[name]
    files = {
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if path.parts[len(SRC.parts)] != part and _names(path, name, flag)
    }
    assert files == {"_launch/_config.py"}


TORCHRUNS_OWN = {"rdzv_backend", "node_rank", "shutdown_timeout", "prefix"}
"""The options whose default on the command line is not ``launch()``'s: torchrun's
``static`` backend and node rank 0, torch's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, torch's
``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``."""


def test_a_default_is_written_once() -> None:
    """The groups' records declare no default: each option's is its declaration's, and its
    flag's default and the one its help shows are made from it."""
    for make in _GROUPS.values():
        for item in dataclasses.fields(make):
            assert item.default is dataclasses.MISSING, (make.__name__, item.name)
            assert item.default_factory is dataclasses.MISSING, (make.__name__, item.name)
    for name, option in DECLARED:
        flag = option.flag
        if flag is None or flag.switch or flag.repeat:
            continue
        assert "{default}" not in flag.help
        if name not in TORCHRUNS_OWN:
            assert flag.default == flag_default(option.default), name
    parser = build_parser()
    grace = next(a for a in parser._actions if "--restart-grace" in a.option_strings)
    assert grace.default == 10.0 and "(default 10)" in str(grace.help)
    assert LaunchConfig().restart_grace == timedelta(seconds=10)


def test_an_option_is_checked_once_for_launch_and_the_command_line(tmp_path: Path) -> None:
    """The one check of an option runs on ``launch()``'s keyword and on the flag's value."""
    with pytest.raises(TypeError, match="restart_grace must be a datetime"):
        LaunchConfig(restart_grace=5)
    with pytest.raises(ValueError, match="restart_grace must be > 0"):
        LaunchConfig(restart_grace=timedelta(0))
    with pytest.raises(ValueError, match="spare_workers must be >= 0"):
        LaunchConfig(spare_workers=-1)
    script = tmp_path / "train.py"
    script.write_text("")
    args = build_parser().parse_args(["--spare-workers", "-1", str(script)])
    with pytest.raises(ValueError, match="spare_workers must be >= 0"):
        config_from_args(args)
