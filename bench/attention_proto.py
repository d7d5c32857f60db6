"""GPU correctness check and benchmark of the generated attention kernels against PyTorch SDPA.

Run from the repository root on a CUDA machine (the package need not be installed):

    PYTHONUNBUFFERED=1 python bench/attention_proto.py [--ns 1024,4096,8192,16384] [--out DIR]

bf16, head dim 128, 16 heads, B * N = 32768 tokens; causal and non-causal. Times are medians of
triton.testing.do_bench. FLOPs: forward 4 B H N^2 D (half for causal), backward 2.5x forward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from codegen.attention import load_attention_module, softmax_spec, spherical_spec  # noqa: E402

HEADS, DIM, TOKENS = 16, 128, 32768
DTYPE = torch.bfloat16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def reference(family: str, q, k, v, scale: float, causal: bool):
    """fp32/fp64 eager reference (kv heads equal to query heads here)."""
    s = scale * q @ k.transpose(-1, -2)
    n_q, n_k = s.shape[-2:]
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=s.device)
    if causal:
        visible = torch.tril(visible)
    if family == "softmax":
        s = s.masked_fill(~visible, float("-inf"))
        return torch.softmax(s, -1) @ v
    s = s.masked_fill(~visible, 0.0)
    return (s @ v) / (s * s).sum(-1, keepdim=True).sqrt()


def check_correctness(modules, log) -> bool:
    ok = True
    batch, heads, n = 2, 4, 1008
    for (family, causal), module in modules.items():
        module.POISON_OUTPUTS = True
        q, k, v = (torch.randn(batch, heads, n, DIM, device="cuda", dtype=DTYPE) for _ in range(3))
        scale = DIM**-0.5
        q32, k32, v32 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = reference(family, q32, k32, v32, scale, causal)
        grad = torch.randn_like(ref)
        ref.backward(grad)
        if family == "softmax":  # forward only for the softmax template
            o, _ = module.forward(q, k, v, scale=scale)
            errs = {"o": rel_err(o, ref)}
            sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            errs["o_vs_sdpa"] = rel_err(o, sdpa)
        else:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            o = module.attention(q, k, v, None, scale)
            o.backward(grad.to(DTYPE))
            errs = {"o": rel_err(o, ref), "dq": rel_err(q.grad, q32.grad), "dk": rel_err(k.grad, k32.grad),
                    "dv": rel_err(v.grad, v32.grad)}
        torch.cuda.synchronize()
        outs = [o, *(x.grad for x in (q, k, v) if x.grad is not None)]
        finite = all(torch.isfinite(t).all().item() for t in outs)
        good = finite and all(e < 1e-2 for e in errs.values())
        ok &= good
        line = f"check {family:9s} causal={causal!s:5s} finite={finite} " + " ".join(
            f"{key}={val:.2e}" for key, val in errs.items()) + ("  OK" if good else "  FAIL")
        log(line)
        module.POISON_OUTPUTS = False
    return ok


def _cases(q, k, v, grad, scale, causal, modules):
    """(name, callable, flop multiple of the forward) for one shape."""
    sph, smx = modules[("spherical", causal)], modules[("softmax", causal)]

    def sdpa_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def sdpa_fwdbwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad)

    def spherical_fwd():
        with torch.no_grad():
            return sph.forward(q, k, v, scale=scale)

    def spherical_fwdbwd():
        sph.attention(q, k, v, None, scale).backward(grad)

    def softmax_fwd():
        with torch.no_grad():
            return smx.forward(q, k, v, scale=scale)

    return [
        ("sdpa_fwd", sdpa_fwd, 1.0),
        ("sdpa_fwdbwd", sdpa_fwdbwd, 3.5),
        ("spherical_fwd", spherical_fwd, 1.0),
        ("spherical_fwdbwd", spherical_fwdbwd, 3.5),
        ("softmax_fwd", softmax_fwd, 1.0),
    ]


def bench_all(modules, ns, log, deadline):
    rows = []
    for n in ns:
        batch = TOKENS // n
        q, k, v = (torch.randn(batch, HEADS, n, DIM, device="cuda", dtype=DTYPE, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(batch, HEADS, n, DIM, device="cuda", dtype=DTYPE)
        scale = DIM**-0.5
        for causal in (False, True):
            if time.time() > deadline:
                log(f"skip N={n} causal={causal}: out of time")
                continue
            flops_fwd = 4.0 * batch * HEADS * n * n * DIM * (0.5 if causal else 1.0)
            cases = _cases(q, k, v, grad, scale, causal, modules)
            for name, fn, mult in cases:
                t0 = time.time()
                fn()  # compile + autotune outside the timing
                torch.cuda.synchronize()
                tune_s = time.time() - t0
                ms = do_bench(fn, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median")
                row = {"n": n, "batch": batch, "causal": causal, "kernel": name, "ms": ms,
                       "tflops": flops_fwd * mult / ms * 1e-9, "first_call_s": round(tune_s, 1)}
                rows.append(row)
                log(json.dumps(row))
        del q, k, v, grad
        torch.cuda.empty_cache()
    return rows


def autotune_choices(modules, log):
    for (family, causal), module in modules.items():
        for attr in dir(module):
            kernel = getattr(module, attr)
            cache = getattr(kernel, "cache", None)
            if attr.endswith("_kernel") and isinstance(cache, dict):
                for key, cfg in cache.items():
                    log(f"tuned {family} causal={causal} {attr} key={key} -> {cfg}")


def table(rows, log):
    by = {(r["n"], r["causal"], r["kernel"]): r for r in rows}
    log("")
    log(f"{'N':>6} {'causal':>6} | {'kernel':>17} | {'ms':>8} | {'TFLOP/s':>7} | vs SDPA (same pass)")
    for (n, causal, kernel), r in sorted(by.items()):
        base = by.get((n, causal, "sdpa_fwdbwd" if kernel.endswith("fwdbwd") else "sdpa_fwd"))
        ratio = f"{base['ms'] / r['ms']:.3f}x" if base and not kernel.startswith("sdpa") else ""
        log(f"{n:>6} {causal!s:>6} | {kernel:>17} | {r['ms']:8.3f} | {r['tflops']:7.1f} | {ratio}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ns", default="1024,4096,8192,16384")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new shapes after this")
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    deadline = time.time() + args.budget_s
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_file = (out_dir / "attention_bench.log").open("w")

    def log(line: str) -> None:
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    log(f"device={torch.cuda.get_device_name()} torch={torch.__version__} triton={triton.__version__} "
        f"sdpa_backends: flash={torch.backends.cuda.flash_sdp_enabled()} "
        f"cudnn={torch.backends.cuda.cudnn_sdp_enabled()} date={time.strftime('%Y-%m-%d %H:%M')}")
    modules = {}
    for family, make in (("spherical", spherical_spec), ("softmax", softmax_spec)):
        for causal in (False, True):
            modules[(family, causal)] = load_attention_module(make(causal=causal))
    ok = True
    if not args.skip_check:
        t0 = time.time()
        ok = check_correctness(modules, log)
        log(f"correctness {'OK' if ok else 'FAILED'} ({time.time() - t0:.0f} s incl. compile/autotune)")
    rows = bench_all(modules, [int(x) for x in args.ns.split(",")], log, deadline)
    autotune_choices(modules, log)
    (out_dir / "attention_bench.json").write_text(json.dumps(rows, indent=1))
    table(rows, log)
    return 0 if ok and math.isfinite(sum(r["ms"] for r in rows)) else 1


if __name__ == "__main__":
    sys.exit(main())
