"""Cost of NCCL's per-collective timing (``TORCH_NCCL_ENABLE_TIMING=1``), which rallypoint
sets in its workers while straggler detection is on (needs an NVIDIA GPU).

NCCL reads the variable once per process group, so the two variants run in separate
processes, alternating (off, on, off, on, ...): each process makes a one-rank NCCL group,
warms up, then times ``--calls`` all_reduces of ``--numel`` floats ``--repeat`` times and
keeps the best per-call time. The table gives every process's figure and the median of
each variant; the difference is the timing's cost per collective. It also prints the
``duration_ms`` NCCL recorded for the last collective (``None`` without timing).

    python benchmarks/nccl_timing.py               # 3 processes of each variant
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time

CHILD = "--child"


def _child(port: int, numel: int, calls: int, repeat: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    t = torch.ones(numel, device="cuda")
    for _ in range(200):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls)
    time.sleep(1.5)  # the watchdog fills in the last entries' durations
    dump = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace(True, False, False))
    print(f"{best * 1e6:.2f} {dump['entries'][-1].get('duration_ms')}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=3, help="processes of each variant")
    parser.add_argument("--numel", type=int, default=1 << 20, help="floats per all_reduce")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("nccl_timing: needs an NVIDIA GPU", file=sys.stderr)
        return 2
    results: dict[str, list[float]] = {"off": [], "on": []}
    port = 29600
    for i in range(args.processes):
        for variant in ("off", "on"):
            port += 1
            env = dict(os.environ, TORCH_NCCL_ENABLE_TIMING="1" if variant == "on" else "0")
            out = subprocess.run(
                [sys.executable, __file__, CHILD, str(port), str(args.numel), str(args.calls),
                 str(args.repeat)],
                env=env, capture_output=True, text=True, timeout=300, check=True,
            )  # fmt: skip
            us, duration = out.stdout.split()[-2:]
            results[variant].append(float(us))
            print(f"process {i + 1}, timing {variant}: {us} us per all_reduce; last duration_ms "
                  f"{duration}")  # fmt: skip
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"\n{datetime.date.today()}, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{platform.node()}; {args.numel * 4 / 2**20:g} MiB all_reduce, one rank")  # fmt: skip
    print("| variant | us per all_reduce (each process) | median |")
    print("| --- | --- | --- |")
    for variant, values in results.items():
        print(f"| timing {variant} | {', '.join(f'{v:.1f}' for v in values)} | "
              f"{statistics.median(values):.1f} |")  # fmt: skip
    print(f"\ntiming costs {on - off:+.1f} us per collective ({on / off:.3f}x)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        port, numel, calls, repeat = (int(a) for a in sys.argv[2:6])
        _child(port, numel, calls, repeat)
        sys.exit(0)
    sys.exit(main())
