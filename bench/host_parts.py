"""Host time of the parts of a context-parallel step (2 GPUs, NCCL): what the host spends per call on the
shard check (gloo), on one NCCL all_gather of the exchange's size, and on a whole step with and without the check,
against the single op's step; and within each, the host time of ncd's functions (wrapped with timers, inclusive).
Each call starts with the ranks aligned and about 5 ms of work queued on the GPU, so a call that waits for the
device shows.

    python bench/host_parts.py [--t 65536] [--heads 16]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMES: dict[str, float] = {}
GPU = torch.cuda.is_available()


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def timer(owner: object, name: str) -> None:
    """Wrap owner.name so that each call adds its host seconds to TIMES (inclusive of what it calls)."""
    inner = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(inner)  # (its signature: ncd.distributed binds the op's arguments)
    def wrapped(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[label] = TIMES.get(label, 0.0) + time.perf_counter() - began

    setattr(owner, name, wrapped)


def per_call(fn, calls: int = 20) -> tuple[float, dict[str, float]]:
    """(median host us of one call of fn, the wrapped functions' mean us a call), each call made with the ranks
    aligned (a barrier) and about 5 ms of work queued on the GPU before it."""
    fn()
    times = []
    busy = torch.randn(4096 if GPU else 64, 4096 if GPU else 64, device="cuda" if GPU else "cpu")
    TIMES.clear()
    for _ in range(calls):
        sync()
        dist.barrier()
        sync()
        for _ in range(2):
            busy = busy @ busy * 1e-3  # (queued work: the host runs ahead of it)
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e6)
    sync()
    dist.barrier()
    return statistics.median(times), {k: v / calls * 1e6 for k, v in TIMES.items()}


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    gpu = torch.cuda.is_available()  # (else gloo and the interpreter: a smoke test of this script)
    if gpu:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300),
                            device_id=device if gpu else None)
    import ncd
    from ncd import distributed as nd
    from ncd.families.attention.ring import gather_into
    from ncd.ops import shipped_spec

    def load():
        if gpu:
            return ncd.load(shipped_spec("causal_spherical_attention"))
        return ncd.load(shipped_spec("causal_spherical_attention"), sizes={"dim": 16}).with_config(factorize="always")

    if rank == 0:  # (compiled once into the shared cache)
        op = load()
    dist.barrier()
    if rank != 0:
        op = load()
    dim, dtype = (128, torch.bfloat16) if gpu else (16, torch.float32)
    full = {n: torch.randn(1, args.heads, args.t, dim, device=device).to(dtype) for n in "QKV"}
    mine = {n: nd.zigzag_shard(t, 2, rank, world) for n, t in full.items()}
    runtime = op.module._OP
    sharding = nd._check_context_shards(runtime, dict(mine), dist.group.WORLD)

    def step(fn, x):
        leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
        o = fn(**leaves)
        o.backward(torch.ones_like(o))

    flat = torch.zeros(2 * args.heads * dim * 258, device=device)  # the exchange's fp32 totals, both segments
    rows = flat.new_empty(world * flat.numel())
    record = list(range(40))
    host = nd._host_group(None)
    parts = {
        "nccl all_gather (exchange size)": lambda: gather_into(rows, flat),
        "gloo record gather": lambda: nd._gather_records(record, host),
        "shard check": lambda: nd._check_context_shards(runtime, dict(mine), dist.group.WORLD),
        "single step": lambda: step(op, full),
        "parallel step": lambda: step(lambda **x: nd.context_parallel_attention(op, **x), mine),
        "parallel step, check skipped": lambda: step(lambda **x: op.fn(**x, _group=sharding), mine),
    }
    from ncd import launch
    from ncd.families.attention import kernel_chunked, ring

    for method in ("key_states", "factorized_output", "factorized_dq", "query_states", "factorized_dkdv",
                   "forward_factorized", "backward_factorized", "factorized_backward_from_saved"):
        timer(kernel_chunked.FactorizedAttentionKernels, method)
    for method in ("exchange", "result", "split", "join"):  # (Segments)
        timer(ring.Segments, method)
    timer(ring, "context_parallel")
    timer(ring, "incoming_sums")
    timer(ring, "gather_into")
    timer(launch.FastKernel, "launch")
    timer(torch.autograd, "backward")
    timer(type(runtime), "_context_parallel")
    timer(op, "fn")
    got = {name: per_call(fn) for name, fn in parts.items()}
    table: list = [None] * world
    dist.all_gather_object(table, got)
    if rank == 0:
        for name in parts:
            print(f"  {name:34s} " + ", ".join(f"{t[name][0]:8.1f} us" for t in table), flush=True)
            for label in table[0][name][1]:
                print(f"      {label:60s} " + ", ".join(f"{t[name][1].get(label, 0):8.1f}" for t in table),
                      flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--t", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--port", type=int, default=29541)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.spawn(worker, args=(2, args), nprocs=2)


if __name__ == "__main__":
    main()
