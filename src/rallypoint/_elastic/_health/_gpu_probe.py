"""``python -m rallypoint._elastic._health._gpu_probe``: the ``builtin:gpu`` health check.

Each visible GPU allocates :data:`ALLOC_MIB` MiB and runs a matmul whose result is
checked against the CPU's; every device says how long it took. Exit status: 0 healthy,
1 a device failed (its line says how), 5 no GPU to check (:data:`NO_GPU`). The caller
bounds the whole run with the check's time limit.

``python -m rallypoint._elastic._health._gpu_probe --gemm``: the burn-in's GEMM
(``_burn_in``): a :data:`GEMM_SIZE` square fp16 GEMM on each visible GPU, best of five; its
last line is the slowest GPU's time in seconds (exit 5 without a GPU). Both run in a child
process, so the agent never holds a CUDA context.
"""

from __future__ import annotations

import sys
import time

__all__ = ["GEMM_SIZE", "NO_GPU", "gemm_main", "main"]

ALLOC_MIB = 256
SIZE = 1024
GEMM_SIZE = 4096
NO_GPU = 5


def _check_device(index: int) -> str:
    """``""`` when device ``index`` is healthy, else what went wrong."""
    import torch as t

    device = t.device("cuda", index)
    started = time.monotonic()
    block = t.empty(ALLOC_MIB * 1024 * 1024, dtype=t.uint8, device=device)
    block.fill_(1)
    gen = t.Generator().manual_seed(index)
    a = t.randn(SIZE, SIZE, generator=gen, dtype=t.float32)
    b = t.randn(SIZE, SIZE, generator=gen, dtype=t.float32)
    expected = a.double() @ b.double()
    got = (a.to(device) @ b.to(device)).cpu().double()
    t.cuda.synchronize(device)
    took = time.monotonic() - started
    del block
    error = float((got - expected).abs().max() / expected.abs().max())
    name = t.cuda.get_device_name(index)
    if not error < 1e-2:
        return f"cuda:{index} ({name}): matmul differs from the CPU's (relative error {error:.2e})"
    print(f"cuda:{index} ({name}): {ALLOC_MIB} MiB and a {SIZE}x{SIZE} matmul in {took:.3f} s")
    return ""


def _no_gpu() -> bool:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return False
    print("no GPU visible to this node", flush=True)
    return True


def gemm_main() -> int:
    """The slowest visible GPU's best-of-five GEMM time, printed in seconds."""
    import torch

    if _no_gpu():
        return NO_GPU
    worst = 0.0
    for index in range(torch.cuda.device_count()):
        a = torch.randn(GEMM_SIZE, GEMM_SIZE, device=f"cuda:{index}", dtype=torch.float16)
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize(index)
            started = time.perf_counter()
            a @ a
            torch.cuda.synchronize(index)
            best = min(best, time.perf_counter() - started)
        worst = max(worst, best)
    print(repr(worst), flush=True)
    return 0


def main() -> int:
    import torch

    if _no_gpu():
        return NO_GPU
    failed = 0
    for index in range(torch.cuda.device_count()):
        try:
            problem = _check_device(index)
        except Exception as exc:  # a broken device: say which and how
            problem = f"cuda:{index}: {type(exc).__name__}: {exc}"
        if problem:
            print(problem, flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(gemm_main() if sys.argv[1:] == ["--gemm"] else main())
