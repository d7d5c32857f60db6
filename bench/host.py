"""Host time per call of the generated ops at shapes so small that the GPU never waits (launch overhead, the
Python around the kernels), beside PyTorch's own ops at the same shapes. Prints a table; --profile adds cProfile's
top entries for the attention op's forward and backward.

    python bench/host.py [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ncd

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


def attention_cases():
    op = ncd.load(ROOT / "specs" / "causal_spherical_attention.ncd")
    op.module.FACTORIZE = "never"
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


def _custom_rational(op, x, a, b):
    from torch._library.custom_ops import CustomOpDef

    custom = next(v for n, v in vars(op.module).items() if isinstance(v, CustomOpDef) and n.endswith("_forward"))
    return custom(x, a, b, 8, False)


def _no_grad(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--profile", action="store_true", help="cProfile the attention and rational ops' fwd+bwd")
    parser.add_argument("--sort", default="cumulative", help="cProfile sort key")
    parser.add_argument("--top", type=int, default=40, help="cProfile entries shown")
    args = parser.parse_args()
    cases = attention_cases()
    cases.update(rational_cases())
    rows = [(name, per_call_us(fn)) for name, fn in cases.items()]
    if args.profile:
        for name in ("attention fwd+bwd", "rational fwd+bwd"):
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
