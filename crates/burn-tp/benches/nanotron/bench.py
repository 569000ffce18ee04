"""nanotron's tensor-parallel linears on PyTorch + gloo, at the shape of burn-tp's section 6.

The same measurement as `cargo bench -p burn-tp --bench tp -- --only=floor`, on the alternative
a user would pick: nanotron's `column_linear` / `row_linear` (vendored unmodified under
`vendor/`, the functions behind its `TensorParallelColumnLinear` / `TensorParallelRowLinear`),
ranks as processes on a gloo group over loopback, one MKL thread per rank.

    x [s, b, d] -> d, tp = 2, REDUCE_SCATTER, no bias, loss = sum(y), column without
    recompute_all_gather; floor = the layer's three GEMMs alone (forward, dgrad, wgrad) on the
    same shapes and threads, both ranks at once; every case once per round, rounds interleaved,
    medians; each time is the slowest rank's median.

Run: `crates/burn-tp/benches/nanotron/run.sh` (makes a venv with torch from PyPI), or
`python bench.py [--quick] [--reps N]` where torch is installed.
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "vendor"))

from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode  # noqa: E402
from nanotron.parallel.tensor_parallel.functional import column_linear, row_linear  # noqa: E402


def timed(reps, f):
    """The slowest rank's median over `reps` of `f`, every rank starting together."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    m = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return m.item()


def layers_rank(rank, world, port, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.group.WORLD
    s, b, d, n = args.s, args.b, args.d, world
    m = s * b
    mode = TensorParallelLinearMode.REDUCE_SCATTER

    def gemm3(x, w, gy):
        # y = x @ w^T; dgrad = gy @ w; wgrad = gy^T @ x (torch's [out, in] weights)
        def run():
            x @ w.t()
            gy @ w
            gy.t() @ x

        return timed(1, run)

    fl_row = (torch.ones(m, d // n), torch.ones(d, d // n), torch.ones(m, d))
    fl_col = (torch.ones(m, d), torch.ones(d // n, d), torch.ones(m, d // n))
    w_row = torch.nn.Parameter(torch.full((d, d // n), 0.01))
    w_col = torch.nn.Parameter(torch.full((d // n, d), 0.01))
    x_row = torch.ones(s, b, d // n, requires_grad=True)
    x_col = torch.ones(s // n, b, d, requires_grad=True)

    def row(asynch):
        return lambda: row_linear(x_row, w_row, None, group, mode, asynch).sum().backward()

    def col(asynch):
        return lambda: column_linear(
            x_col, w_col, None, group, mode, asynch, tp_recompute_allgather=False
        ).sum().backward()

    cases = [
        lambda: gemm3(*fl_row),
        lambda: gemm3(*fl_col),
        lambda: timed(1, row(False)),
        lambda: timed(1, row(True)),
        lambda: timed(1, col(False)),
        lambda: timed(1, col(True)),
    ]
    for c in cases:  # warm-up
        c()
    t = [[] for _ in cases]
    for _ in range(args.reps):
        for i, c in enumerate(cases):
            t[i].append(c())

    # gloo collectives at 64 MiB of output per rank (all-gather) / input (reduce-scatter,
    # all-reduce), warm outputs, against a one-thread copy into a warm buffer.
    numel = (args.coll_mib << 20) // 4
    shard = torch.ones(numel // n)
    full = torch.ones(numel)
    gathered = torch.empty(numel)
    scattered = torch.empty(numel // n)
    coll = {
        "all_gather": timed(args.reps, lambda: dist.all_gather_into_tensor(gathered, shard)),
        "reduce_scatter": timed(args.reps, lambda: dist.reduce_scatter_tensor(scattered, full)),
        "all_reduce": timed(args.reps, lambda: dist.all_reduce(full)),
    }
    if rank == 0:
        src, dst = torch.ones(numel), torch.empty(numel)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        coll["memcpy"] = statistics.median(times)
        out.put({"layers": [statistics.median(v) for v in t], "collectives": coll})
    dist.destroy_process_group()


def plain_linear(args, threads):
    """One torch Linear over the whole batch, forward + backward, `threads` MKL threads."""
    torch.set_num_threads(threads)
    lin = torch.nn.Linear(args.d, args.d)
    x = torch.ones(args.s, args.b, args.d, requires_grad=True)
    lin(x).sum().backward()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        lin(x).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, 3 rounds (smoke test)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    args.s, args.b, args.d = (128, 2, 256) if args.quick else (1024, 4, 1024)
    args.coll_mib = 4 if args.quick else 64
    if args.quick:
        args.reps = 3
    world = 2
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(layers_rank, args=(world, free_port(), args, out), nprocs=world, start_method="spawn")
    res = out.get()
    lt = res["layers"]
    cores = os.cpu_count()
    one, alln = plain_linear(args, 1), plain_linear(args, cores)

    print(f"# nanotron on PyTorch {torch.__version__} + gloo, {cores} logical cores")
    print(f"\n## Layers vs their compute floor: x [{args.s}, {args.b}, {args.d}] -> {args.d}, tp = 2, REDUCE_SCATTER\n")
    print(f"One MKL thread per rank (process), {args.reps} rounds interleaved, medians.\n")
    print("| layer | floor ms | sync ms | async ms | sync / floor | async / floor | async / sync |")
    print("|-------|---------:|--------:|---------:|------:|------:|------:|")
    for i, name in enumerate(["row_linear", "column_linear"]):
        floor, sync, asynch = lt[i], lt[2 + 2 * i], lt[3 + 2 * i]
        print(
            f"| {name} | {floor * 1e3:.1f} | {sync * 1e3:.1f} | {asynch * 1e3:.1f} | "
            f"{sync / floor:.2f} | {asynch / floor:.2f} | {asynch / sync:.3f} |"
        )
    print(f"\nPlain torch `Linear` [{args.s}, {args.b}, {args.d}] -> {args.d}, forward + backward, one process:\n")
    print(f"| 1 thread ms | {cores} threads ms | speed-up |")
    print("|------------:|-------------:|------:|")
    print(f"| {one * 1e3:.1f} | {alln * 1e3:.1f} | {one / alln:.2f} |")
    c = res["collectives"]
    print(f"\n## gloo collectives, 2 ranks, {args.coll_mib} MiB, warm outputs\n")
    print("| op | ms | memcpy ms | x memcpy |")
    print("|----|---:|----------:|---------:|")
    for op in ["all_gather", "reduce_scatter", "all_reduce"]:
        print(f"| {op} | {c[op] * 1e3:.2f} | {c['memcpy'] * 1e3:.2f} | {c['memcpy'] / c[op]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": lt, "plain": [one, alln], "collectives": c}, f, indent=1)


if __name__ == "__main__":
    main()
