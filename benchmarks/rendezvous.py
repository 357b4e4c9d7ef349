"""Rendezvous time vs node count: rallypoint's dynamic handler vs torch's, same run.

N nodes run as P processes x T threads forked from this warm process (every handler is
its own node), against one TCPStore hosted by a separate process (and, for rallypoint,
also against a real etcd server when ``etcd`` is installed). Each node's handler and
store connection are created before the clock starts; the time is from the start signal
until the last node has its rank. Torch (``DynamicRendezvousHandler`` +
``C10dRendezvousBackend``) runs up to ``--torch-timeout`` per N; once it times out, or
its quadratic extrapolation from the previous N exceeds the timeout, larger N are
skipped for torch (creating 512 TCPStore clients alone takes minutes in some sandboxes).

    .venv/bin/python benchmarks/rendezvous.py                 # N = 8 32 128 512 1024
    .venv/bin/python benchmarks/rendezvous.py --nodes 8 32 --plot rdzv.png
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch

_ctx = mp.get_context("fork")


def _host_store(conn: Connection) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    conn.send(store.port)
    conn.recv()  # until the parent closes the pipe
    os._exit(0)


_PACE: list[float] = []  # [first slot time, seconds between slots, this process's first slot, step]


def _paced() -> None:
    """Wait for this process's next connection slot (a global connect rate across processes)."""
    if not _PACE:
        return
    first, interval, slot, step = _PACE
    delay = first + slot * interval - time.time()
    if delay > 0:
        time.sleep(delay)
    _PACE[2] = slot + step


def _make_handlers(kind: str, endpoint: str, run_id: str, n: int, count: int) -> list[Any]:
    host, port = endpoint.rsplit(":", 1)
    timeout = timedelta(seconds=600)
    handlers: list[Any] = []
    if kind == "torch":
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
            RendezvousTimeout,
        )

        for _ in range(count):
            _paced()
            store = TCPStore(host, int(port), is_master=False, timeout=timeout)
            backend = C10dRendezvousBackend(store, run_id)
            handlers.append(
                DynamicRendezvousHandler.from_backend(
                    run_id, store, backend, n, n, "127.0.0.1",
                    RendezvousTimeout(join=timeout, last_call=timedelta(seconds=1)),
                )
            )  # fmt: skip
        return handlers
    from rallypoint.rendezvous import DynamicRendezvousConfig
    from rallypoint.rendezvous import DynamicRendezvousHandler as Ours

    config = DynamicRendezvousConfig(
        run_id=run_id, min_nodes=n, max_nodes=n, local_addr="127.0.0.1", join_timeout=timeout
    )
    for _ in range(count):
        if kind == "etcd":
            from rallypoint.rendezvous._etcd.kv import EtcdKV, EtcdOptions

            kv: Any = EtcdKV(EtcdOptions(endpoints=[(host, int(port))], prefix=f"/bench/{run_id}/"))
        else:
            from rallypoint.rendezvous._kv_c10d import tcp_kv

            _paced()
            kv = tcp_kv(host, int(port), is_server=False, timeout=timeout)[0]
            kv.clone()  # open the per-process side connection before the clock starts
        handlers.append(Ours(kv, config))
    return handlers


def _node_process(
    kind: str,
    endpoint: str,
    run_id: str,
    n: int,
    count: int,
    start: Any,
    conn: Connection,
    pace: list[float],
) -> None:
    _PACE[:] = pace
    try:
        handlers = _make_handlers(kind, endpoint, run_id, n, count)
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        os._exit(1)
    conn.send(("ready", None))
    start.wait()
    done: list[float] = []
    errors: list[str] = []

    def run(handler: Any) -> None:
        try:
            handler.next_rendezvous()
            done.append(time.time())
        except BaseException as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.send(("error", errors[0]) if errors else ("done", max(done)))
    conn.close()
    os._exit(0)  # skip interpreter teardown of live store threads


def _layout(n: int) -> tuple[int, int]:
    procs = min(n, 16)
    while n % procs:
        procs -= 1
    return procs, n // procs


def measure(
    kind: str, endpoint: str, n: int, timeout: float, connect_rate: float = 0.0
) -> float | None:
    """Seconds until all ``n`` nodes have a rank, or ``None`` on timeout."""
    procs, threads = _layout(n)
    run_id = f"{kind}-{n}-{time.monotonic_ns()}"
    start = _ctx.Event()
    children: list[tuple[Any, Connection]] = []
    first = time.time() + 0.5
    for p in range(procs):
        pace = [first, 1.0 / connect_rate, p, procs] if connect_rate > 0 else []
        parent, child = _ctx.Pipe(duplex=False)
        proc = _ctx.Process(
            target=_node_process,
            args=(kind, endpoint, run_id, n, threads, start, child, pace),
        )
        proc.start()
        child.close()
        children.append((proc, parent))
    try:
        created = time.monotonic()
        deadline = created + timeout + 300  # creating handlers is not timed
        for _, conn in children:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                return None
            status, payload = conn.recv()
            if status != "ready":
                raise RuntimeError(f"{kind} N={n}: {payload}")
        print(
            f"  {kind} N={n}: {procs}x{threads} handlers created in "
            f"{time.monotonic() - created:.1f} s (not timed)",
            file=sys.stderr,
            flush=True,
        )
        t0 = time.time()
        start.set()
        deadline = time.monotonic() + timeout
        ends = []
        for _, conn in children:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                return None
            status, payload = conn.recv()
            if status != "done":
                raise RuntimeError(f"{kind} N={n}: {payload}")
            ends.append(payload)
        return max(ends) - t0
    finally:
        for proc, conn in children:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            conn.close()


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "timeout"
    if isinstance(value, str):
        return value
    return f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 512, 1024])
    parser.add_argument("--torch-timeout", type=float, default=60.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="per run for rallypoint")
    parser.add_argument("--etcd-max", type=int, default=128, help="largest N run on etcd")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--connect-rate",
        type=float,
        default=20.0,
        help="TCPStore connections per second while creating handlers (untimed; bursts of "
        "connects stall a TCPStore server for 5 s in some sandboxes; 0 = no pacing)",
    )
    parser.add_argument("--plot", metavar="FILE", help="write a log-log plot (matplotlib)")
    args = parser.parse_args(argv)

    parent, child = _ctx.Pipe()
    host = _ctx.Process(target=_host_store, args=(child,), daemon=True)
    host.start()
    endpoint = f"127.0.0.1:{parent.recv()}"

    etcd = None
    from rallypoint.testing._etcd import EtcdServer, etcd_binary

    if etcd_binary() is not None and args.etcd_max > 0:
        etcd = EtcdServer()
        etcd.start()

    rows: list[dict[str, Any]] = []
    torch_gave_up = args.no_torch
    try:
        for n in args.nodes:
            row: dict[str, Any] = {"n": n, "layout": "{}x{}".format(*_layout(n))}
            rate = args.connect_rate
            row["ours"] = measure("ours", endpoint, n, args.timeout, rate)
            if etcd is not None and n <= args.etcd_max:
                row["etcd"] = measure("etcd", etcd.endpoint, n, args.timeout)
            else:
                row["etcd"] = "-"
            last = next((r for r in reversed(rows) if isinstance(r["torch"], float)), None)
            estimate = last["torch"] * (n / last["n"]) ** 2 if last else 0.0
            if torch_gave_up:
                row["torch"] = "skipped"
            elif estimate > args.torch_timeout:
                # torch's round is quadratic in N: do not spend minutes proving it again
                row["torch"] = f"not run (est. {estimate:.0f})"
                torch_gave_up = True
            else:
                row["torch"] = measure("torch", endpoint, n, args.torch_timeout, rate)
                if row["torch"] is None:
                    row["torch"] = f"> {args.torch_timeout:g}"
                    torch_gave_up = True
            rows.append(row)
            print(f"N={n}: {row}", file=sys.stderr, flush=True)
    finally:
        parent.close()
        host.join(5)
        if etcd is not None:
            etcd.close()

    print(
        f"\nRendezvous time (s) until every node has its rank; {os.cpu_count()} cores, "
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}; processes x threads forked from a warm process\n"
    )
    print(
        "| N | layout | rallypoint (TCPStore) | rallypoint (etcd) | torch (c10d) "
        "| torch / rallypoint |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ours, theirs = row["ours"], row["torch"]
        if isinstance(ours, float) and isinstance(theirs, float):
            ratio = f"{theirs / ours:.1f}x"
        elif isinstance(ours, float) and isinstance(theirs, str) and theirs.startswith(">"):
            ratio = f"> {args.torch_timeout / ours:.0f}x"
        else:
            ratio = "-"
        print(
            f"| {row['n']} | {row['layout']} | {_fmt(ours)} | {_fmt(row['etcd'])} | "
            f"{_fmt(theirs)} | {ratio} |"
        )

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (("ours", "rallypoint (TCPStore)"), ("etcd", "rallypoint (etcd)"),
                           ("torch", "torch dynamic (c10d)")):  # fmt: skip
            points = [(r["n"], r[key]) for r in rows if isinstance(r[key], float)]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes (N)")
        ax.set_ylabel("seconds until every node has a rank")
        ax.set_title("Rendezvous time")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
