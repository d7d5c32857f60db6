"""Context-parallel attention and sequence-parallel recurrences on several GPUs (NCCL) against one GPU running the
whole sequence, in one run: each rank's output and gradients are checked against the single-GPU op on the same rank's
GPU, then forward+backward is timed both ways: each step alone from an idle GPU (CUDA events around a barrier; median
of --reps steps), and --reps steps queued back to back (throughput, as a training loop runs them). bf16 inputs,
B 1, D 128. With --profile, rank 0's exposed communication: the time NCCL kernels run while no other kernel does, as a
share of the parallel step (torch.profiler, one step).

    python bench/distributed.py --gpus 2 --ops causal_softmax_attention,gka --t 65536 --heads 16 --profile
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

D = 128


def inputs(op_name: str, t: int, heads: int, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    x = {"q": F.normalize(torch.randn(1, t, heads, D, device=device, generator=gen), dim=-1).bfloat16(),
         "k": F.normalize(torch.randn(1, t, heads, D, device=device, generator=gen), dim=-1).bfloat16(),
         "v": torch.randn(1, t, heads, D, device=device, generator=gen).bfloat16(),
         "g": F.logsigmoid(torch.randn(1, t, heads, device=device, generator=gen) + 3.0)}
    if op_name == "gka" or op_name.endswith("delta_rule"):
        x["beta"] = torch.sigmoid(torch.randn(1, t, heads, device=device, generator=gen))
    if op_name == "gka":
        x["alpha"] = torch.sigmoid(torch.randn(1, t, heads, device=device, generator=gen))
    if op_name == "delta_rule":  # (no gate)
        del x["g"]
    return x


ATTENTION = ("causal_softmax_attention", "causal_spherical_attention", "softmax_attention", "spherical_attention",
             "sliding_window_softmax")  # (inputs Q, K, V; a window of 256 by default)


def attention_inputs(t: int, heads: int, device: torch.device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    return {n: torch.randn(1, heads, t, D, device=device, generator=gen).bfloat16() for n in ("Q", "K", "V")}


def exposed_communication(fn) -> tuple[float, float]:
    """(ms NCCL kernels run with no other kernel running, ms from the first kernel's start to the last's end) of
    one call of fn, from torch.profiler's kernel records."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower()) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    compute = sorted((a, b) for a, b, comm in kernels if not comm)
    merged: list[list[float]] = []
    for a, b in compute:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    exposed = 0.0
    for a, b, comm in kernels:
        if comm:
            covered = sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)
            exposed += (b - a) - covered
    span = max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)
    return exposed / 1e3, span / 1e3


def top_kernels(fn, count: int = 10) -> str:
    """The `count` kernels of one call of fn with the most GPU time (torch.profiler), one per line."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(e.name[:60], [0.0, 0])
            entry[0] += (e.time_range.end - e.time_range.start) / 1e3
            entry[1] += 1
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]
    return "\n".join(f"    {ms:8.3f} ms {n:4d}x {name}" for name, (ms, n) in rows)


def back_to_back(fn, steps: int) -> float:
    """ms per step with `steps` steps queued back to back, as a training loop runs them (the host may run ahead
    of the GPU: a step's host work hides behind the previous step's kernels)."""
    fn()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    dist.barrier()
    return start.elapsed_time(end) / steps


def host_profile(fn, steps: int = 5) -> None:
    """cProfile of `steps` calls of fn on the host: the functions with the most own time, and the most in all."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler).sort_stats(order).print_stats(22)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def step(fn, x: dict, do: torch.Tensor) -> tuple:
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    o = fn(**leaves)[0]
    o.backward(do)
    return o, {n: t.grad for n, t in leaves.items()}


def timed(fn, reps: int) -> tuple[float, float]:
    """(median ms on the GPU, median ms the host took to queue the step: a step whose host time reaches its GPU
    time is host-bound)."""
    times, host = [], []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        fn()
        host.append((time.perf_counter() - began) * 1e3)
        end.record()
        torch.cuda.synchronize()
        dist.barrier()
        times.append(start.elapsed_time(end))
    return statistics.median(times), statistics.median(host)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device docs)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    import ncd
    from ncd.distributed import context_parallel_attention, sequence_parallel_chunk, zigzag_shard
    from ncd.ops import shipped_spec

    device = torch.device("cuda", rank)
    for op_name in args.ops.split(","):
        if rank == 0:  # compiled once into the shared cache, then loaded by the others
            op = ncd.load(shipped_spec(op_name))
        dist.barrier()
        if rank != 0:
            op = ncd.load(shipped_spec(op_name))
        if op_name in ATTENTION:
            full = attention_inputs(args.t, args.heads, device)
            do = torch.randn(full["V"].shape, device=device, generator=torch.Generator(device=device).manual_seed(1))
            causal = op.module.KERNELS.causal or op.module.KERNELS.mask_hides  # the zigzag layout (ring.py)

            def cut(t, causal=causal):
                if causal:
                    return zigzag_shard(t, 2, rank, world)
                n = args.t // world
                return t[:, :, rank * n:(rank + 1) * n]

            mine = {n: cut(t) for n, t in full.items()}
            do_mine = cut(do)

            def single(op=op, **x):
                return (op(**x),)

            def parallel(op=op, **x):
                return (context_parallel_attention(op, **x),)

            streamed = None
            if args.ring and op.module._OP.factorized is not None:  # both sides in the streamed form: the ring runs
                op = op.with_config(factorize="never")

                def single(op=op, **x):
                    return (op(**x),)

                def parallel(op=op, **x):
                    return (context_parallel_attention(op, **x),)
            elif op.module._OP.factorized is not None:  # the form the ring runs, on one GPU, for comparison
                streamed_op = op.with_config(factorize="never")

                def streamed(op=streamed_op, **x):
                    return (op(**x),)
        else:
            full = inputs(op_name, args.t, args.heads, device)
            do = torch.randn(full["v"].shape, device=device, generator=torch.Generator(device=device).manual_seed(1))
            # rank 0 runs its shard as it is, the others wider (delta rules): --first-share evens them, whole chunks
            first = 64 * round(args.t * args.first_share / 64) if args.first_share else args.t // world
            rest = (args.t - first) // max(world - 1, 1)
            lo = 0 if rank == 0 else first + (rank - 1) * rest
            hi = first if rank == 0 else (first + rank * rest if rank < world - 1 else args.t)
            mine = {n: t[:, lo:hi] for n, t in full.items()}
            do_mine = do[:, lo:hi]

            def cut(t, lo=lo, hi=hi):
                return t[:, lo:hi]

            def single(op=op, **x):
                return op.module.chunk(**x)

            def parallel(op=op, **x):
                return sequence_parallel_chunk(op, **x)

            streamed = None

        o_ref, g_ref = step(single, full, do)
        o, grads = step(parallel, mine, do_mine)
        errors = {"o": rel(o, cut(o_ref)), **{f"d{n}": rel(grads[n], cut(g_ref[n])) for n in grads}}
        ok = max(errors.values()) < 2e-2  # bf16 outputs and gradients; the states are fp32 on both paths
        one, one_host = timed(lambda: step(single, full, do), args.reps)  # noqa: B023
        many, many_host = timed(lambda: step(parallel, mine, do_mine), args.reps)  # noqa: B023
        other = timed(lambda: step(streamed, full, do), args.reps)[0] if streamed is not None else 0.0  # noqa: B023
        one_run = back_to_back(lambda: step(single, full, do), args.reps)  # noqa: B023
        many_run = back_to_back(lambda: step(parallel, mine, do_mine), args.reps)  # noqa: B023
        exposed = span = 0.0
        if args.profile:
            exposed, span = exposed_communication(lambda: step(parallel, mine, do_mine))  # noqa: B023
        if args.host_profile and rank == 0:  # (every rank runs the steps: their collectives)
            host_profile(lambda: step(parallel, mine, do_mine))  # noqa: B023
        elif args.host_profile:
            for _ in range(5):
                step(parallel, mine, do_mine)
        if args.kernels:  # every rank runs the parallel step (its collectives), then prints in turn
            listing = (f"{op_name}: rank {rank}'s kernels, one GPU\n" + top_kernels(lambda: step(single, full, do))  # noqa: B023
                       + "\n  parallel\n" + top_kernels(lambda: step(parallel, mine, do_mine)))  # noqa: B023
            for turn in range(world):
                if rank == turn:
                    print(listing, flush=True)
                dist.barrier()
        report = torch.tensor([one, many, float(ok), other, exposed, span, max(errors.values()), one_host, many_host,
                               one_run, many_run], device=device)
        rows = [torch.empty_like(report) for _ in range(world)]
        dist.all_gather(rows, report)
        if rank == 0:
            ones, manys = [r[0].item() for r in rows], [r[1].item() for r in rows]
            print(f"{op_name} T {args.t} H {args.heads} D {D} bf16, {world} GPUs ({torch.cuda.get_device_name()}): "
                  f"fwd+bwd one GPU {statistics.median(ones):.2f} ms, sequence-parallel {max(manys):.2f} ms "
                  f"(slowest rank) -> {statistics.median(ones) / max(manys):.2f}x; rank 0 vs one GPU: "
                  + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
                  + "; largest per rank: " + ", ".join(f"{r[6].item():.1e}" for r in rows)
                  + f"; check {'OK' if all(r[2].item() for r in rows) else 'FAILED'}", flush=True)
            one_run, many_run = statistics.median([r[9].item() for r in rows]), max(r[10].item() for r in rows)
            print(f"  {args.reps} steps back to back: one GPU {one_run:.2f} ms a step, parallel {many_run:.2f} ms "
                  f"(slowest rank) -> {one_run / many_run:.2f}x", flush=True)
            print("  host time to queue a step (median): one GPU " + ", ".join(f"{r[7].item():.2f}" for r in rows)
                  + " ms; parallel " + ", ".join(f"{r[8].item():.2f}" for r in rows) + " ms (per rank)", flush=True)
            if streamed is not None:
                other = statistics.median([r[3].item() for r in rows])
                print(f"  one GPU in the streamed form the ring runs: {other:.2f} ms -> {other / max(manys):.2f}x",
                      flush=True)
            if args.profile:
                print("  exposed communication (NCCL kernels alone), per rank: " + ", ".join(
                    f"{r[4].item():.2f} of {r[5].item():.2f} ms ({100 * r[4].item() / max(r[5].item(), 1e-9):.1f}%)"
                    for r in rows), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--ops", default="causal_softmax_attention,causal_spherical_attention,gka,simple_gla")
    parser.add_argument("--t", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--first-share", type=float, default=0.0,
                        help="recurrences: rank 0's share of T (the others split the rest); default an even split")
    parser.add_argument("--host-profile", action="store_true", help="cProfile of 5 parallel steps on rank 0")
    parser.add_argument("--profile", action="store_true", help="exposed communication from the profiler")
    parser.add_argument("--kernels", action="store_true", help="each rank's top kernels, one GPU and parallel")
    parser.add_argument("--ring", action="store_true", help="factorizable specs (spherical) in the streamed form on "
                        "one GPU and on the ring (factorize='never')")
    args = parser.parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus)


if __name__ == "__main__":
    main()
