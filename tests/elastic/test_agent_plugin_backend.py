"""A third-party rendezvous backend through the launcher, as a user installs one.

The plugin is a real distribution, ``pip install``ed into a venv of the test's own (which
sees the project's venv through a ``.pth``): it declares ``mybackend`` in the entry point
group ``rallypoint.rendezvous_backends``, wraps the built-in ``file`` backend and records
each handler it makes and each round it runs. ``rallypoint run --rdzv-backend mybackend``
then runs the job's rounds (a failure and its restart) on the plugin's handler, and
``rallypoint stacks`` asks through it; an unknown name is one line that lists the known
ones, the installed plugin's included.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PLUGIN = '''
"""A rendezvous backend that wraps rallypoint's ``file`` backend and records its use."""

import os

from rallypoint.rendezvous import RendezvousHandler
from rallypoint.rendezvous._backends import create_file_handler


def _record(line):
    with open(os.environ["RP_PLUGIN_LOG"], "a") as fp:
        fp.write(line + "\\n")


class Recording(RendezvousHandler):
    def __init__(self, inner):
        self.inner = inner

    def get_backend(self):
        return "mybackend"

    @property
    def use_agent_store(self):
        return self.inner.use_agent_store

    def next_rendezvous(self):
        info = self.inner.next_rendezvous()
        _record(f"round {self.inner.round} rank {info.rank} of {info.world_size}")
        return info

    def is_closed(self):
        return self.inner.is_closed()

    def set_closed(self):
        self.inner.set_closed()

    def num_nodes_waiting(self):
        return self.inner.num_nodes_waiting()

    def get_run_id(self):
        return self.inner.get_run_id()

    def shutdown(self):
        return self.inner.shutdown()

    @property
    def round(self):
        return self.inner.round

    def open_run_store(self, namespace):
        return self.inner.open_run_store(namespace)

    def liveness_window(self):
        return self.inner.liveness_window()

    @property
    def node_id(self):
        return self.inner.node_id

    @property
    def hosts_store(self):
        return self.inner.hosts_store

    def leave(self):
        self.inner.leave()

    @property
    def spare_round(self):
        return self.inner.spare_round


def create(params):
    _record(f"create {params.backend} {params.run_id}")
    return Recording(create_file_handler(params))
'''

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "rp-plugin-probe"
version = "0.1"

[project.entry-points."rallypoint.rendezvous_backends"]
mybackend = "rp_plugin_probe:create"
"""

WORKER = """
import os
print("attempt", os.environ["TORCHELASTIC_RESTART_COUNT"], "rank", os.environ["RANK"], flush=True)
if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    raise SystemExit(3)  # the first attempt fails: the restart is a round of its own
"""


@pytest.fixture(scope="module")
def plugin_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a venv that sees the project's packages and has the plugin installed."""
    root = tmp_path_factory.mktemp("plugin")
    venv = root / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    # the project's venv (rallypoint, torch, setuptools), its own .pth files included
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d)]
    lines = [f"import site; site.addsitedir({d!r})" for d in dirs]
    (Path(purelib) / "project_venv.pth").write_text("\n".join(lines) + "\n")
    src = root / "rp-plugin-probe"
    (src / "rp_plugin_probe").mkdir(parents=True)
    (src / "rp_plugin_probe" / "__init__.py").write_text(PLUGIN)
    (src / "pyproject.toml").write_text(PYPROJECT)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-build-isolation", "--no-index", "--disable-pip-version-check",
         str(src)],
        check=True, timeout=240,
    )  # fmt: skip
    listed = subprocess.run(
        [str(python), "-c", textwrap.dedent("""
            from importlib.metadata import entry_points
            print([e.name for e in entry_points(group="rallypoint.rendezvous_backends")])
        """)],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "mybackend" in listed, listed
    return python


def _run(
    python: Path, *argv: str, log: Path, command: str = "run"
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RP_PLUGIN_LOG": str(log)}
    env.pop("PYTHONPATH", None)  # the venv's own paths only
    return subprocess.run(
        [str(python), "-m", "rallypoint", command, *argv],
        capture_output=True, text=True, timeout=200, env=env,
    )  # fmt: skip


def test_the_agent_runs_its_rounds_on_an_installed_plugins_handler(
    plugin_python: Path, tmp_path: Path
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    log = tmp_path / "plugin.log"
    done = _run(
        plugin_python,
        "--nnodes", "1:2", "--nproc-per-node", "2",
        "--rdzv-backend", "mybackend", "--rdzv-endpoint", str(tmp_path / "rdzv"),
        "--rdzv-id", "plug", "--rdzv-conf", "last_call_timeout=0.2",
        "--max-restarts", "1", "--shutdown-timeout", "5",
        str(script),
        log=log,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    assert "attempt 1 rank 1" in text, text[-4000:]  # the restart ran
    records = log.read_text().splitlines() if log.exists() else []
    assert records and records[0] == "create mybackend plug", records
    rounds = [r for r in records if r.startswith("round ")]
    # the first attempt and the restart, each a round of the plugin's handler
    assert len(rounds) >= 2 and all(r.endswith("rank 0 of 1") for r in rounds), records


def test_an_unknown_backend_is_one_line_that_lists_the_known_ones(
    plugin_python: Path, tmp_path: Path
) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the job must not start')\n")
    log = tmp_path / "plugin.log"
    for nnodes in ("2", "1"):  # a multi-node job and a single node alike
        done = _run(
            plugin_python,
            "--nnodes", nnodes, "--rdzv-backend", "nobackend",
            "--rdzv-endpoint", "127.0.0.1:1", str(script),
            log=log,
        )  # fmt: skip
        assert done.returncode == 2, (done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert lines == [
            "rallypoint run: error: --rdzv-backend 'nobackend' is not a rendezvous backend; "
            "known: c10d, etcd, etcd-v3, file, mybackend, static (a plugin adds its own "
            "through the entry point group rallypoint.rendezvous_backends)"
        ], done.stderr
    assert not log.exists(), "no handler was made"


@pytest.mark.timeout(60)
def test_launch_takes_a_registered_backend_and_refuses_an_unknown_one() -> None:
    """``launch()`` and ``LaunchConfig`` ask the same registry (no plugin installed here)."""
    from rallypoint._launch._config import LaunchConfig
    from rallypoint.rendezvous import rendezvous_handler_registry
    from rallypoint.rendezvous._backends import create_file_handler

    with pytest.raises(ValueError, match=r"^rdzv_backend 'mine' is not a rendezvous backend"):
        LaunchConfig(nnodes="2", rdzv_backend="mine", rdzv_endpoint="/tmp/x")
    rendezvous_handler_registry.register("mine", create_file_handler)
    try:
        config = LaunchConfig(nnodes="2", rdzv_backend="mine", rdzv_endpoint="/tmp/x")
        assert config.rendezvous.backend == "mine"
    finally:
        rendezvous_handler_registry._registry.pop("mine")


def test_rallypoint_stacks_asks_through_the_plugins_handler(
    plugin_python: Path, tmp_path: Path
) -> None:
    log = tmp_path / "plugin.log"
    flags = ["--rdzv-endpoint", str(tmp_path / "rdzv"), "--rdzv-id", "plug", "--timeout", "2"]
    done = _run(plugin_python, "--rdzv-backend", "mybackend", *flags, log=log, command="stacks")
    # no job runs there: the plugin's handler was asked, and found none
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [
        "rallypoint stacks: error: no agent of this run has published its node count: is it "
        "running?"
    ], done.stderr
    assert log.read_text().splitlines() == ["create mybackend plug"]
    done = _run(plugin_python, "--rdzv-backend", "nobackend", *flags, log=log, command="stacks")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith(
        "rallypoint stacks: error: --rdzv-backend 'nobackend' is not a rendezvous backend; "
        "known: c10d, etcd, etcd-v3, file, mybackend, static "
    ), done.stderr
