"""Where a CUDA tensor's ``rpc_sync`` round trip spends its time, by size and path.

Two workers share ``cuda:0`` (worker0 maps ``{0: 0}`` to worker1, which echoes the tensor
back). For each tensor size it measures, in the same run:

- ``ipc``: rallypoint, every CUDA tensor by CUDA IPC (``cuda_ipc_threshold=0``);
- ``inline``: rallypoint, every CUDA tensor staged through pinned host memory, inline with
  the message (``cuda_ipc=False``);
- ``default``: rallypoint's defaults (inline under ``cuda_ipc_threshold``, else IPC);
- ``tensorpipe``: torch's TensorPipe backend with the same device map.

Each figure is the median round trip (µs) of the runs; the runs alternate the order of
the variants. With ``--phases``, the IPC and inline variants also report what each side spends
per round trip in the pieces of their paths (probes on rallypoint's CUDA helpers and on
torch's sharing functions): making the private copy, exporting its handle, opening it,
collecting torch's IPC limbo, and the stream events; the rest is the message itself.
Without a GPU it says so and exits 0.

    python benchmarks/rpc_cuda_costs.py [--quick] [--phases]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from rallypoint import rpc
from rallypoint.testing import run_workers

SIZES = (8 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
VARIANTS = ("ipc", "inline", "default", "tensorpipe")
_spent: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])


def _probe(owner: Any, attribute: str, label: str) -> None:
    """Add each call's wall time of ``owner.attribute`` to ``_spent[label]``."""
    original: Callable[..., Any] = getattr(owner, attribute)

    def probed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            slot = _spent[label]
            slot[0] += time.perf_counter() - t0
            slot[1] += 1

    setattr(owner, attribute, probed)


def _install_probes() -> None:
    # private modules, on purpose: this script measures their pieces
    from torch.multiprocessing import reductions

    from rallypoint.rpc._transport import _cuda

    _probe(torch.Tensor, "clone", "copy (clone)")
    _probe(reductions, "reduce_tensor", "export handle (reduce_tensor)")
    _probe(reductions, "rebuild_cuda_tensor", "open handle (rebuild_cuda_tensor)")
    _probe(_cuda, "collect", "ipc_collect")
    _probe(_cuda, "to_host", "to pinned host (sender)")
    _probe(_cuda, "to_device", "to device (receiver)")
    _probe(_cuda.StreamSync, "__init__", "record events")
    _probe(_cuda.StreamSync, "wait", "wait events")


def _echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _spent_here() -> dict[str, tuple[float, int]]:
    return {k: (v[0], int(v[1])) for k, v in _spent.items()}


def _reset() -> None:
    _spent.clear()


def _options(variant: str) -> Any:
    if variant == "tensorpipe":
        return rpc.construct_rpc_backend_options(rpc.BackendType.TENSORPIPE, rpc_timeout=120)
    changes: dict[str, Any] = {
        "ipc": {"cuda_ipc_threshold": 0},
        "inline": {"cuda_ipc": False},
        "default": {},
    }[variant]
    return rpc.construct_rpc_backend_options(rpc.BackendType.RALLYPOINT, rpc_timeout=120, **changes)


def _pair(variant: str, rounds: int, phases: bool) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    if phases:
        _install_probes()
    options = _options(variant)
    if rank == 0:
        options.set_device_map("worker1", {0: 0})
    backend = rpc.BackendType.TENSORPIPE if variant == "tensorpipe" else rpc.BackendType.RALLYPOINT
    rpc.init_rpc(
        f"worker{rank}", backend=backend, rank=rank, world_size=2, rpc_backend_options=options
    )
    out: dict[str, Any] = {}
    if rank == 0:
        for size in SIZES if not phases else SIZES[:1]:
            x = torch.rand(size // 4, device="cuda:0")
            times = []
            for i in range(-20, rounds):
                if i == 0 and phases:
                    _reset()
                    rpc.rpc_sync("worker1", _reset)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                y = rpc.rpc_sync("worker1", _echo, args=(x,))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            assert torch.equal(y, x)
            out[f"rtt_{size}"] = statistics.median(times[20:]) * 1e6
            if phases:
                out["phases"] = {
                    "worker0": _spent_here(),
                    "worker1": rpc.rpc_sync("worker1", _spent_here),
                }
    rpc.shutdown()
    return out


def _env(rank: int) -> dict[str, str]:
    return {"RALLYPOINT_RPC_SECRET": "benchmark-secret"}


def _gpu_count() -> int:
    import subprocess
    import sys

    probe = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run of 200 round trips each")
    parser.add_argument("--phases", action="store_true", help="also the IPC path's pieces")
    args = parser.parse_args()
    if torch.version.cuda is None or not _gpu_count():
        print("no GPU: nothing measured")
        return
    runs = 1 if args.quick else 3
    rounds = 200 if args.quick else 500
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(runs):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            done = run_workers(_pair, 2, variant, rounds, False, timeout=600, env=_env)
            results[variant].append(done[0])
    print(f"torch {torch.__version__}; median of {runs} run(s) x {rounds} round trips (µs)\n")
    print("| size | " + " | ".join(VARIANTS) + " | default / tensorpipe |")
    print("|---" * (len(VARIANTS) + 2) + "|")
    for size in SIZES:
        key = f"rtt_{size}"
        med = {v: statistics.median(run[key] for run in results[v]) for v in VARIANTS}
        label = f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        cells = " | ".join(f"{med[v]:,.0f}" for v in VARIANTS)
        print(f"| {label} | {cells} | {med['default'] / med['tensorpipe']:.2f}x |")
    for variant in ("ipc", "inline") if args.phases else ():
        done = run_workers(_pair, 2, variant, rounds, True, timeout=600, env=_env)[0]
        rtt = done[f"rtt_{SIZES[0]}"]
        print(f"\n{variant}, {SIZES[0] >> 10} KiB, round trip {rtt:,.0f} µs; per round trip:")
        print("| piece | worker0 (µs) | worker1 (µs) |\n|---|---|---|")
        sides = done["phases"]
        labels = sorted(set(sides["worker0"]) | set(sides["worker1"]))
        for label in labels:
            cells = [sides[w].get(label, (0.0, 0))[0] / rounds * 1e6 for w in sides]
            print(f"| {label} | {cells[0]:,.1f} | {cells[1]:,.1f} |")


if __name__ == "__main__":
    main()
