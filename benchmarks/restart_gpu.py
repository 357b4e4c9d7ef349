"""Benchmark: in-process vs full restart on one GPU, 8 ranks sharing it, each holding a model
of about 100M parameters and Adam on ``cuda:0`` (a gloo world: NCCL refuses two ranks on
one device). Rank 1 writes the time and SIGKILLs itself after step 5 of the first attempt;
the figure is from then until every rank has finished its first step of the next attempt.
In process, the 7 kept ranks keep their CUDA context and model (the decorated function
re-creates only the process group) and rank 1 gets a new process that builds its model
again; with a spare (``--spare-workers 1``), a spare worker that built its model while the
ranks trained takes rank 1's place (the fault waits for its set-up); a full restart
re-creates every rank. Variants alternate; all with the default flags. The table also
gives, of the recovery, the time until every rank entered the function again (the rest is
the first step). Without a GPU it says so and exits 0.

    python benchmarks/restart_gpu.py                 # 3 repeats
    python benchmarks/restart_gpu.py --repeat 1 --params 20000000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL = 1.5
SPARE_GOAL = 0.5
VARIANTS = ("in process", "in process, a spare", "full restart")

WORKER = """
import os, signal, sys, time
import torch, torch.distributed as dist
import rallypoint

OUT, PARAMS, DECORATED = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
SPARE = sys.argv[4:] == ["spare"]  # with --spare-workers 1
torch.cuda.set_device(0)
width = max(1, int((PARAMS / 4) ** 0.5))
model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4))).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-5)
x = torch.randn(64, width, device="cuda")
torch.cuda.synchronize()
if "RANK" not in os.environ:  # a spare worker (--spare-workers): its set-up is done
    open(os.path.join(OUT, f"spare-ready-{os.getpid()}"), "w").close()


def spare_ready():
    return any(name.startswith("spare-ready-") for name in os.listdir(OUT))

def train():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restart == 1:
        open(os.path.join(OUT, f"entered-{rank}"), "w").write(str(time.time()))
    for step in range(12):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dist.all_reduce(loss.detach().cpu())
        torch.cuda.synchronize()
        if restart == 1 and step == 0:
            open(os.path.join(OUT, f"resumed-{rank}"), "w").write(str(time.time()))
        if restart == 0 and step == 5 and rank == 1:
            while SPARE and not spare_ready():  # the fault once the spare is set up
                time.sleep(0.01)
            open(os.path.join(OUT, "fault"), "w").write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    dist.destroy_process_group()

(rallypoint.restartable(train) if DECORATED else train)()
"""


def _gpu() -> bool:
    code = "import torch; print(int(torch.cuda.is_available()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() == "1"


def run_once(script: Path, variant: str, params: int, nproc: int) -> tuple[float, float] | None:
    """``(recovery, of which until every rank entered the function again)``, in seconds."""
    decorated, spare = variant != "full restart", variant == "in process, a spare"
    with tempfile.TemporaryDirectory(prefix="rp-restart-gpu-") as tmp:
        out = Path(tmp)
        cmd = [
            sys.executable, "-m", "rallypoint", "run", "--nproc-per-node", str(nproc),
            "--max-restarts", "1",
            *(["--spare-workers", "1"] if spare else []), str(script), str(out), str(params),
            "1" if decorated else "0", *(["spare"] if spare else []),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return None
        fault = float((out / "fault").read_text())
        resumed = [float(p.read_text()) for p in out.glob("resumed-*")]
        entered = [float(p.read_text()) for p in out.glob("entered-*")]
        if len(resumed) != nproc:
            return None
        return max(resumed) - fault, (max(entered) - fault if entered else float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--nproc", type=int, default=8)
    args = parser.parse_args()
    if not _gpu():
        print("restart_gpu: no GPU visible to torch here; nothing measured")
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "worker.py"
        script.write_text(WORKER)
        results: dict[str, list[tuple[float, float] | None]] = {v: [] for v in VARIANTS}
        for _ in range(args.repeat):
            for name in VARIANTS:
                results[name].append(run_once(script, name, args.params, args.nproc))
                print(f"  {name}: {results[name][-1]}", file=sys.stderr)
    device = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {os.cpu_count()} CPUs"
    print(
        f"{device}; {args.nproc} ranks on cuda:0, {args.params / 1e6:.0f}M parameters + Adam each"
    )
    print("| variant | recovery (s), median (min-max) | of which until all entered (s) | runs |")
    print("| --- | --- | --- | --- |")
    for name, runs in results.items():
        ok = [r[0] for r in runs if r is not None]
        inside = [r[1] for r in runs if r is not None]
        cell = f"{statistics.median(ok):.2f} ({min(ok):.2f}-{max(ok):.2f})" if ok else "failed"
        enter = f"{statistics.median(inside):.2f}" if inside else "-"
        print(f"| {name} | {cell} | {enter} | {len(ok)} of {len(runs)} |")
    for name in VARIANTS[:2]:
        ok = [r[0] for r in results[name] if r is not None]
        if ok:
            goal = SPARE_GOAL if "spare" in name else GOAL
            verdict = "holds" if statistics.median(ok) <= goal else "missed"
            print(f"goal ({name}: at most {goal} s): {verdict}")


if __name__ == "__main__":
    main()
