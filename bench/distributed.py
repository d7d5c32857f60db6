"""Sequence-parallel recurrences on several GPUs (NCCL) against one GPU running the whole sequence, in one run:
each rank's output and gradients are checked against the single-GPU op on the same rank's GPU, then forward+backward
is timed both ways (CUDA events around a barrier; median of --reps steps). bf16 inputs, B 1, D 128.

    python bench/distributed.py --gpus 2 --ops gka,simple_gla --t 65536 --heads 16
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

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
    if op_name == "gka":
        x["beta"] = torch.sigmoid(torch.randn(1, t, heads, device=device, generator=gen))
        x["alpha"] = torch.sigmoid(torch.randn(1, t, heads, device=device, generator=gen))
    return x


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def step(fn, x: dict, do: torch.Tensor) -> tuple:
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    o = fn(**leaves)[0]
    o.backward(do)
    return o, {n: t.grad for n, t in leaves.items()}


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        dist.barrier()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device docs)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank))
    import ncd
    from ncd.distributed import sequence_parallel_chunk
    from ncd.ops import shipped_spec

    device = torch.device("cuda", rank)
    for op_name in args.ops.split(","):
        if rank == 0:  # compiled once into the shared cache, then loaded by the others
            op = ncd.load(shipped_spec(op_name))
        dist.barrier()
        if rank != 0:
            op = ncd.load(shipped_spec(op_name))
        full = inputs(op_name, args.t, args.heads, device)
        do = torch.randn(full["v"].shape, device=device, generator=torch.Generator(device=device).manual_seed(1))
        shard = args.t // world
        lo, hi = rank * shard, (rank + 1) * shard if rank < world - 1 else args.t
        mine = {n: t[:, lo:hi] for n, t in full.items()}

        def single(op=op, **x):
            return op.module.chunk(**x)

        def parallel(op=op, **x):
            return sequence_parallel_chunk(op, **x)

        o_ref, g_ref = step(single, full, do)
        o, grads = step(parallel, mine, do[:, lo:hi])
        errors = {"o": rel(o, o_ref[:, lo:hi]), **{f"d{n}": rel(grads[n], g_ref[n][:, lo:hi]) for n in grads}}
        ok = max(errors.values()) < 2e-2  # bf16 outputs and gradients; the states are fp32 on both paths
        one = timed(lambda: step(single, full, do), args.reps)  # noqa: B023
        many = timed(lambda: step(parallel, mine, do[:, lo:hi]), args.reps)  # noqa: B023
        report = torch.tensor([one, many, float(ok)], device=device)
        rows = [torch.empty_like(report) for _ in range(world)]
        dist.all_gather(rows, report)
        if rank == 0:
            ones, manys = [r[0].item() for r in rows], [r[1].item() for r in rows]
            print(f"{op_name} T {args.t} H {args.heads} D {D} bf16, {world} GPUs ({torch.cuda.get_device_name()}): "
                  f"fwd+bwd one GPU {statistics.median(ones):.2f} ms, sequence-parallel {max(manys):.2f} ms "
                  f"(slowest rank) -> {statistics.median(ones) / max(manys):.2f}x; rank 0 vs one GPU: "
                  + ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
                  + f"; check {'OK' if all(r[2].item() for r in rows) else 'FAILED'}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--ops", default="gka,simple_gla")
    parser.add_argument("--t", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    mp.spawn(worker, args=(args.gpus, args), nprocs=args.gpus)


if __name__ == "__main__":
    main()
