"""``--numa-binding`` / ``numa_binding=``: each worker on the CPUs torch's ``torch.numa.binding``
picks for GPU ``LOCAL_RANK``, found in a child of the warm process, bound after the fork.

Without a GPU, the launch-to-affinity path runs on a faked GPU topology: only torch's two
CUDA queries (a GPU's NUMA node, the GPU count) are replaced; torch's own rules read this
host's real ``/sys``. The ``cuda`` test checks the real thing on a GPU host.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rallypoint._supervise import _numa
from rallypoint._supervise._errors import WarmErrorKind
from rallypoint._supervise._numa import (
    NUMA_MODES,
    check_numa_binding,
    cpu_ranges,
    visible_gpu_count,
)
from rallypoint._supervise._warm._numa_probe import NumaProbeError, find_cpu_sets
from rallypoint.launcher import LaunchConfig, WarmProcessError, launch

pytestmark = pytest.mark.timeout(120)


def _torch_sets(mode: str, nproc: int) -> list[set[int]]:
    from torch.numa.binding import AffinityMode, NumaOptions, _get_logical_cpus_to_bind_to

    options = NumaOptions(affinity_mode=AffinityMode(mode))
    return [_get_logical_cpus_to_bind_to(gpu_index=i, numa_options=options) for i in range(nproc)]


def _affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _no_gpu_here() -> bool:
    return visible_gpu_count(None) == 0


def test_the_modes_are_torchs() -> None:
    from torch.numa.binding import AffinityMode

    assert tuple(mode.value for mode in AffinityMode) == NUMA_MODES


def test_gpus_are_counted_from_device_nodes_and_cuda_visible_devices(tmp_path: Path) -> None:
    assert visible_gpu_count(None, str(tmp_path)) == 0
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    dev = str(tmp_path)
    assert visible_gpu_count(None, dev) == 4
    assert visible_gpu_count("1,2", dev) == 2
    assert visible_gpu_count("GPU-8f3a,GPU-77b1", dev) == 2
    assert visible_gpu_count("0,1,2,3,4,5", dev) == 4  # no more than the node has
    assert visible_gpu_count("", dev) == 0
    assert visible_gpu_count("-1", dev) == 0
    assert visible_gpu_count("0,-1,2", dev) == 1  # CUDA stops at the first bad entry


def test_the_check_says_what_is_missing(tmp_path: Path) -> None:
    empty = str(tmp_path)
    with pytest.raises(ValueError, match=r"^NUMA binding \('node'\) .* this node has no GPU$"):
        check_numa_binding("node", 1, None, empty)
    for i in range(2):
        (tmp_path / f"nvidia{i}").touch()
    with pytest.raises(ValueError, match=r"CUDA_VISIBLE_DEVICES='' hides every GPU"):
        check_numa_binding("socket", 1, "", empty)
    with pytest.raises(ValueError, match=r"shows 2 GPUs for 3 workers; start at most 2"):
        check_numa_binding("exclusive", 3, None, empty)
    with pytest.raises(ValueError, match=r"'node', 'socket', 'exclusive', 'core-complex'"):
        check_numa_binding("numa", 1, None, empty)
    check_numa_binding("core-complex", 2, "1,0", empty)


def test_cpu_ranges() -> None:
    assert cpu_ranges({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"
    assert cpu_ranges({3}) == "3"
    assert cpu_ranges(set()) == ""


@pytest.mark.skipif(not _no_gpu_here(), reason="this host has a GPU")
def test_without_a_gpu_the_config_and_the_cli_refuse_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="this node has no GPU"):
        LaunchConfig(nproc=2, numa_binding="node")
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    for mode, says in (
        ("node", "rallypoint run: error: NUMA binding ('node') puts each worker on the CPUs "
         "near its GPU, but this node has no GPU"),
        ("numa", "rallypoint run: error: argument --numa-binding/--numa_binding: invalid "
         "choice: 'numa' (choose from 'node', 'socket', 'exclusive', 'core-complex')"),
    ):  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "rallypoint", "run", "--numa-binding", mode, str(script)],
            capture_output=True, text=True, timeout=60, env=env,
        )  # fmt: skip
        assert (proc.returncode, proc.stderr, proc.stdout) == (2, says + "\n", "")


def test_torchs_affinity_mode_is_accepted_as_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.numa.binding import AffinityMode

    monkeypatch.setattr(_numa, "visible_gpu_count", lambda visible, dev="/dev": 8)
    options = LaunchConfig(nproc=2, numa_binding=AffinityMode.CORE_COMPLEX).workers
    assert options.numa_binding == "core-complex" and type(options.numa_binding) is str


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> int:
    """Two GPUs on NUMA node 0, as far as torch's CUDA queries go (the config's device-node
    count too); everything else torch reads is this host's /sys."""
    import torch
    import torch.numa.binding as binding

    gpus = 2
    monkeypatch.setattr(_numa, "visible_gpu_count", lambda visible, dev="/dev": gpus)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(binding, "_get_gpu_count", lambda: gpus)

    def node_of(*, gpu_index: int) -> int:
        assert 0 <= gpu_index < gpus, gpu_index
        return 0

    monkeypatch.setattr(binding, "_get_numa_node_index_for_gpu_index", node_of)
    return gpus


@pytest.mark.parametrize("mode", NUMA_MODES)
def test_each_worker_is_bound_to_torchs_set_for_its_local_rank(fake_gpus: int, mode: str) -> None:
    expected = [sorted(s) for s in _torch_sets(mode, fake_gpus)]
    if mode == "exclusive" and len(os.sched_getaffinity(0)) >= 2:
        assert expected[0] != expected[1]  # one core each: a wrong GPU index would show
    assert launch(_affinity, nproc=fake_gpus, numa_binding=mode) == expected
    assert launch(_affinity, nproc=fake_gpus) == [_affinity()] * fake_gpus  # no binding


def test_a_spawned_worker_keeps_its_binding(fake_gpus: int) -> None:
    expected = [sorted(s) for s in _torch_sets("exclusive", fake_gpus)]
    got = launch(_affinity, nproc=fake_gpus, numa_binding="exclusive", start_method="spawn")
    assert got == expected


def test_a_gpu_index_is_the_local_rank_in_the_workers_cuda_visible_devices(
    fake_gpus: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """torchrun picks the CPUs from its own view of the GPUs, where GPU N is local rank N,
    even when each worker then sees only its own GPU (``virtual_local_rank``, which sets
    ``LOCAL_RANK=0`` in every worker); the probe's CUDA reads the workers'
    ``CUDA_VISIBLE_DEVICES`` (``env=``)."""
    import torch

    seen = tmp_path / "seen"

    def device_count() -> int:  # called in the probe's child
        seen.write_text(os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
        return fake_gpus

    monkeypatch.setattr(torch.cuda, "device_count", device_count)
    got = launch(
        _affinity,
        nproc=2,
        numa_binding="exclusive",
        virtual_local_rank=True,
        env={"CUDA_VISIBLE_DEVICES": "5,3"},
    )
    assert got == [sorted(s) for s in _torch_sets("exclusive", fake_gpus)]
    assert seen.read_text() == "5,3"


@pytest.mark.skipif(not _no_gpu_here(), reason="this host has a GPU")
def test_without_cuda_the_probe_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(NumaProbeError, match=r"^NUMA binding \('node'\) needs a GPU per local "
                       r"rank: torch sees 0 GPUs for 1 worker$"):  # fmt: skip
        find_cpu_sets("node", 1, dict(os.environ))
    monkeypatch.setattr(_numa, "visible_gpu_count", lambda visible, dev="/dev": 1)
    with pytest.raises(WarmProcessError, match="torch sees 0 GPUs") as info:
        launch(_affinity, nproc=1, numa_binding="socket")
    assert info.value.kind is WarmErrorKind.NUMA and "\n" not in str(info.value)


CUDA_SCRIPT = """
import json, os, sys
import torch
initialised = torch.cuda.is_initialized()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
torch.ones(1, device="cuda")
print("AFFINITY", json.dumps({"local_rank": int(os.environ["LOCAL_RANK"]),
      "cpus": sorted(os.sched_getaffinity(0)), "cuda_before_script": initialised}))
"""

TORCH_SETS = """
import json, sys
from torch.numa.binding import AffinityMode, NumaOptions, _get_logical_cpus_to_bind_to
mode, nproc = sys.argv[1], int(sys.argv[2])
options = NumaOptions(affinity_mode=AffinityMode(mode))
print(json.dumps([sorted(_get_logical_cpus_to_bind_to(gpu_index=i, numa_options=options))
                  for i in range(nproc)]))
"""


@functools.cache
def _cuda_gpus() -> int:
    """GPUs CUDA sees, asked in a child (not here: CUDA started in the suite's process would
    spoil every fork after it)."""
    if _no_gpu_here():
        return 0
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return int(probe.stdout.strip() or 0)


@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", NUMA_MODES)
def test_on_a_gpu_host_each_worker_runs_on_torchs_cpus(tmp_path: Path, mode: str) -> None:
    gpus = _cuda_gpus()
    if gpus == 0:
        pytest.skip("needs an NVIDIA GPU")
    nproc = min(2, gpus)
    expected = subprocess.run(
        [sys.executable, "-c", TORCH_SETS, mode, str(nproc)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    script = tmp_path / "affinity.py"
    script.write_text(CUDA_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", str(nproc),
         "--numa-binding", mode, str(script)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    seen = sorted(
        (json.loads(line.split("AFFINITY ", 1)[1]) for line in proc.stdout.splitlines()
         if "AFFINITY " in line),
        key=lambda r: r["local_rank"],
    )  # fmt: skip
    print(f"--numa-binding {mode}: CPU sets by local rank:", [r["cpus"] for r in seen])
    assert [r["cpus"] for r in seen] == json.loads(expected.stdout)
    assert not any(r["cuda_before_script"] for r in seen)  # CUDA starts in the user's code
