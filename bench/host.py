"""Host time per call of the generated ops at shapes so small that the GPU never waits (launch overhead, the
Python around the kernels), beside PyTorch's (and, where installed, fla's) ops at the same shapes. Prints a table;
--profile adds cProfile's top entries for the attention op's forward and backward.

    python bench/host.py [--profile [CASE,CASE]] [--ab-fast-launch]

--ab-fast-launch times each case with direct launches (ncd/launch.py) on and off, alternating in this process
(one shared host is too noisy for separate processes to compare), and prints the medians and the median of the
paired differences.

Without a GPU: bench/host_cpu.py times the same host path with the launches stubbed out, against an older commit
in the same process.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ncd
import ncd.launch

ROOT = Path(__file__).resolve().parent.parent


def per_call_us(fn, calls=300, rounds=3):
    """Best of `rounds` averages of `calls` back-to-back calls, synchronised at the ends."""
    best = float("inf")
    for _ in range(rounds):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def set_direct_launches(on):
    for launcher in ncd.launch._LAUNCHERS.values():
        launcher.enabled = on


def fast_launch_ab(fn, pairs=9, calls=200):
    """(median us with direct launches, median without, median paired difference) of `fn`."""
    def timed(on):
        set_direct_launches(on)
        return per_call_us(fn, calls=calls, rounds=1)

    timed(True)  # every launcher created and past its first (Triton) launch
    pairs_us = [(timed(True), timed(False)) for _ in range(pairs)]
    on, off = zip(*pairs_us, strict=True)
    return statistics.median(on), statistics.median(off), statistics.median(b - a for a, b in pairs_us)


def direct_launch_matches():
    """Outputs and gradients of the attention, GKA and rational ops at fresh inputs, with direct launches (after
    warm-up) against Triton's path: the same compiled kernels and configs, so they must be equal bit for bit.
    Returns {op: largest absolute difference}."""
    torch.manual_seed(0)
    attention = ncd.load(ROOT / "specs" / "causal_spherical_attention.ncd")
    rational = ncd.load(ROOT / "specs" / "kat_rational.ncd")
    shape = (2, 100, 3, 128)  # B, T, H, D for GKA; [B, H, N, D] = (2, 3, 100, 128) for attention
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    g, beta = -0.1 * torch.rand(shape[:3], device="cuda"), torch.rand(shape[:3], device="cuda")
    x, a, b = (torch.randn(s, device="cuda") for s in ((300, 128), (6,), (8, 4)))
    ops = {
        "attention": (lambda q, k, v: attention(q, k, v), (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))),
        "GKA": (lambda q, k, v, g, beta: ncd.ops.chunk_gka(F.normalize(q.float(), dim=-1).to(q.dtype),
                                                         F.normalize(k.float(), dim=-1).to(k.dtype), v, g, beta,
                                                         num_iter=10)[0], (q, k, v, g, beta)),
        "rational": (lambda x, a, b: rational(x, a, b, accumulate="deterministic"), (x, a, b)),
    }
    diffs = {}
    for name, (fn, inputs) in ops.items():
        results = []
        for on in (True, True, True, False):  # the first call launches through Triton, the next directly
            set_direct_launches(on)
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
            results.append([out, *grads])
        direct, tritons = results[2], results[3]
        diffs[name] = max((d.float() - t.float()).abs().max().item() for d, t in zip(direct, tritons, strict=True))
    set_direct_launches(True)
    return diffs


def attention_cases():
    op = ncd.load(ROOT / "specs" / "causal_spherical_attention.ncd", config={"factorize": "never"})
    q, k, v = (torch.randn(1, 2, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, stats = op.module.forward(qd, kd, vd, None, 1.0)

    def op_fwd():
        with torch.no_grad():
            op(q, k, v)

    return {
        "attention fwd (no grad)": op_fwd,
        "attention fwd+bwd": lambda: op(q, k, v).backward(g),
        "  kernels: forward()": lambda: op.module.forward(qd, kd, vd, None, 1.0),
        "  kernels: backward()": lambda: op.module.backward(g, qd, kd, vd, o, stats, None, 1.0),
        "SDPA causal fwd (no grad)": lambda: _no_grad(F.scaled_dot_product_attention, q, k, v, is_causal=True),
        "SDPA causal fwd+bwd": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g),
    }


def rational_cases():
    op = ncd.load(ROOT / "specs" / "kat_rational.ncd")
    x = torch.randn(64, 8 * 16, device="cuda", requires_grad=True)
    a = torch.randn(6, device="cuda", requires_grad=True)
    b = torch.randn(8, 4, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    return {
        "rational fwd+bwd": lambda: op(x, a, b).backward(dy),
        "  via its custom op": lambda: _custom_rational(op, x, a, b).backward(dy),
        "GELU fwd+bwd": lambda: F.gelu(x).backward(dy),
    }


def gka_cases():
    shape = (1, 64, 2, 128)  # B, T, H, D
    q, k = (F.normalize(torch.randn(shape, device="cuda"), dim=-1).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = (-0.1 * torch.rand(shape[:3], device="cuda")).requires_grad_()
    beta = torch.rand(shape[:3], device="cuda").requires_grad_()
    do = torch.randn_like(v)
    cases = {
        "GKA r 10 fwd (no grad)": lambda: _no_grad(ncd.ops.chunk_gka, q, k, v, g, beta, num_iter=10),
        "GKA r 10 fwd+bwd": lambda: ncd.ops.chunk_gka(q, k, v, g, beta, num_iter=10)[0].backward(do),
    }
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return cases
    # fla refuses its backward on Hopper with Triton < 3.7.1 (fla issue 640): forward only
    cases["fla GDN fwd (no grad)"] = lambda: _no_grad(chunk_gated_delta_rule, q, k, v, g, beta)
    return cases


def polykan_cases():
    from ncd.families.polykan.plan import PolyKANLayer

    layer = PolyKANLayer(64, 64, 5).cuda()
    x = torch.randn(64, 64, device="cuda", requires_grad=True)
    dy = torch.randn(64, 64, device="cuda")
    return {"PolyKAN fwd+bwd": lambda: layer(x).backward(dy)}


def _custom_rational(op, x, a, b):
    from torch._library.custom_ops import CustomOpDef

    custom = next(v for n, v in vars(op.module).items() if isinstance(v, CustomOpDef) and n.endswith("_forward"))
    return custom(x, a, b, 8, False)


def _no_grad(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", nargs="?", const="attention fwd+bwd,rational fwd+bwd", default="",
                        help="cProfile these cases (comma list of names; default the attention and rational fwd+bwd)")
    parser.add_argument("--sort", default="cumulative", help="cProfile sort key")
    parser.add_argument("--top", type=int, default=40, help="cProfile entries shown")
    parser.add_argument("--ab-fast-launch", action="store_true", help="direct launches on against off, paired")
    args = parser.parse_args()
    cases = attention_cases()
    cases.update(rational_cases())
    cases.update(gka_cases())
    cases.update(polykan_cases())
    if args.ab_fast_launch:
        print("direct launches against Triton's path, largest difference:", direct_launch_matches())
        print(f"direct launches on / off, alternating, median of 9 pairs of 200 calls ({torch.cuda.get_device_name()})")
        for name, fn in cases.items():
            on, off, saved = fast_launch_ab(fn)
            print(f"  {name:<28} {on:8.1f} / {off:8.1f} us, paired saving {saved:7.1f} us")
        return
    rows = [(name, per_call_us(fn)) for name, fn in cases.items()]
    if args.profile:
        for name in args.profile.split(","):
            prof = cProfile.Profile()
            with torch.autograd.set_multithreading_enabled(False):  # the backward in this thread, profiled
                prof.enable()
                for _ in range(200):
                    cases[name]()
                prof.disable()
            torch.cuda.synchronize()
            print(f"--- cProfile {name} (200 calls, autograd in the calling thread)")
            pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    print(f"host time per call, best of 3 x 300 ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    for name, us in rows:
        print(f"  {name:<28} {us:8.1f} us")


if __name__ == "__main__":
    main()
