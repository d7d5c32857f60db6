"""GPU benchmark of the Gated KalmaNet core compiled from specs/gka.ncd, one run: correctness first, then timings.

Shapes (issue 6): bf16, B = 4, T in {2048, 4096, 8192}, H = 8, D = 128, r in {10, 30} Chebyshev steps.
Side by side: ncd's generated op (forward, forward+backward; default products by dtype (bf16: fp16x3), and TF32 and the
official kernels' bf16 products as forward variants), the chunked PyTorch reference
(ncd.families.recurrence.reference.chunked_gka, autograd backward), the naive per-timestep recurrence with
autograd (T = 2048 only: one timed run each, seconds), and fla's
chunk_gated_delta_rule / chunk_simple_gla forward (fla-core 0.6.0 wheel) at the same shapes.

Correctness, every run (fla issue 640: Triton 3.4-3.7.0 miscompiles some gated chunk backward kernels on
Hopper): ncd's output and all gradients against the float64 naive recurrence at B1 T300 H2 (chunk 64, T not a
multiple of it), and against the float64 chunked reference at the benchmark shape T = 2048 (the fp32
chunked reference's own error beside it) for each product-precision variant (--variants).

Run from outside the repository so the installed ncd is imported:
    cd /tmp && python3 /path/to/repo/bench/gka.py [--ts 2048,4096,8192] [--rs 10,30] [--no-naive]
On a fresh machine, compiling (ncd's kernels for every dtype and precision variant, fla's autotuned ones) takes most
of a 10-minute call, so run `--check-only` first (250-375 s on a fresh machine), then the full benchmark on the
same, now warm, machine (395 s with `--variants default` on a warm H200; 2026-11-21).
Prints a short table last; full numbers go to $OUT/gka.json when OUT is set. Beside do_bench's times the table has
the forward's kernel time (torch.profiler CUDA time per call) for ncd and fla GDN: GDN's forward is host-bound at
these sizes, so its do_bench time moves with the host's speed and its kernel time does not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import ncd
from ncd.families.recurrence.reference import chunked_gka, naive_gka
from ncd.ops import shipped_spec

B, H, D = 4, 8, 128
RESULTS: dict[str, object] = {}


def log(*args):
    print(*args, flush=True)


def configured(op, **changes):
    """The generated module of `op` with product precisions and tiles changed: fields of its config
    (ncd/families/recurrence/config.py), `op.with_config(**changes)`, an op of its own (compiled once, cached);
    the op's own module where nothing changes."""
    if all(getattr(op.config, name) == value for name, value in changes.items()):
        return op.module
    return op.with_config(**changes).module


def ms(fn, rep=100):
    return float(do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def once_ms(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def draw(b, t, h, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, D, device="cuda", generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(b, t, h, D, device="cuda", generator=gen), dim=-1).to(dtype)
    v = torch.randn(b, t, h, D, device="cuda", generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(b, t, h, device="cuda", generator=gen) + 3.0)
    beta = torch.sigmoid(torch.randn(b, t, h, device="cuda", generator=gen))
    alpha = torch.sigmoid(torch.randn(b, t, h, device="cuda", generator=gen))
    return q, k, v, g, beta, alpha


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    if torch.isnan(a).any():
        return float("nan")
    return float((a - b).norm() / b.norm())


def grads_of(fn, inputs, do):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, leaves, do)


def check(op, failures, variants):
    module = op.module
    names = ["o", "dq", "dk", "dv", "dg", "dbeta", "dalpha"]
    # (1) against the float64 naive recurrence (same Chebyshev iteration), T not a multiple of the chunk
    # limits: 10-bit operands (scaled fp16 or TF32) put o within ~5e-3 of fp64 at these slow gates, fp16x3 (the bf16
    # default) within 2e-3
    for dtype, tol_o, tol_g in ((torch.float32, 1e-2, 2e-2), (torch.bfloat16, 1e-2, 3e-2)):
        inputs = draw(1, 300, 2, dtype, seed=1)
        do = torch.randn(1, 300, 2, D, device="cuda", dtype=dtype)
        o, grads = grads_of(lambda *t: module.chunk(*t[:5], alpha=t[5])[0], inputs, do)
        ref, ref_grads = grads_of(lambda *t: naive_gka(*t)[0], [t.double() for t in inputs], do.double())
        for name, a, b in zip(names, (o, *grads), (ref, *ref_grads), strict=True):
            err, tol = rel(a, b), (tol_o if name == "o" else tol_g)
            RESULTS[f"check naive {dtype} {name}"] = err
            log(f"  check vs naive fp64 ({str(dtype)[6:]}) {name:6s} {err:.2e} (limit {tol:g})"
                f" {'OK' if err <= tol else 'FAIL'}")
            if not err <= tol:
                failures.append(f"naive {dtype} {name}")
    if not variants:  # --variants '': the small-shape check alone (a minute of device time, not five)
        return
    # (2) at the benchmark shape against the chunked reference in float64 (autograd through its iterations); the
    # same reference in fp32 is reported beside it as the yardstick of fp32 arithmetic. Each precision variant
    # (products of the solve and output : products of the backward's accumulation kernels) is checked against
    # the same reference; the default decides pass or fail.
    inputs = draw(B, 2048, H, seed=2)
    do = torch.randn(B, 2048, H, D, device="cuda", dtype=torch.bfloat16)
    ref, ref_grads = grads_of(lambda *t: chunked_gka(*t), [x.double() for x in inputs], do.double())
    ref32, ref32_grads = grads_of(lambda *t: chunked_gka(*[x.float() for x in t]).float(), inputs, do.float())
    err32 = [rel(c, b) for c, b in zip((ref32, *ref32_grads), (ref, *ref_grads), strict=True)]
    log("  check vs chunked fp64 reference (bf16, T 2048): " + ", ".join(
        f"{n} {e:.1e}" for n, e in zip(names, err32, strict=True)) + " (the fp32 reference)")
    for variant in variants:
        dot, grad = (None if p in ("", "default") else p for p in [*variant.split(":"), ""][:2])
        variant = configured(op, dot_precision=dot, grad_precision=grad)
        o, grads = grads_of(lambda *t: variant.chunk(*t[:5], alpha=t[5])[0], inputs, do)  # noqa: B023 (called at once)
        errs = [rel(a, b) for a, b in zip((o, *grads), (ref, *ref_grads), strict=True)]
        RESULTS[f"check chunked {variant}"] = dict(zip(names, errs, strict=True))
        bad = [n for n, e in zip(names, errs, strict=True) if not e <= (1e-2 if n == "o" else 3e-2)]
        log(f"  check vs chunked fp64 reference (bf16, T 2048), products {variant:16s}: " + ", ".join(
            f"{n} {e:.1e}" for n, e in zip(names, errs, strict=True))
            + f" (limits 1e-2 for o, 3e-2) {'OK' if not bad else 'FAIL ' + ' '.join(bad)}")
        if bad and variant == "default":
            failures.extend(f"chunked {n}" for n in bad)


def measure(op, inputs, r, naive):
    """ncd (default precision; fwd+bwd with a TF32 backward; forward with TF32 and bf16 products), the chunked
    reference and the naive recurrence at r."""
    cell: dict[str, float] = {}
    do = torch.randn_like(inputs[2])
    leaves = [x.detach().requires_grad_() for x in inputs]

    def ncd_step(module):
        o, _ = module.chunk(*leaves[:5], alpha=leaves[5], num_iter=r)
        torch.autograd.grad(o, leaves, do)

    def chunked_step():
        torch.autograd.grad(chunked_gka(*leaves, num_iter=r), leaves, do)

    def naive_step():
        o, _ = naive_gka(*leaves, num_iter=r)
        torch.autograd.grad(o, leaves, do)

    module = op.module  # the default: by input dtype (bf16: fp16x3 products in the solve)
    cell["fwd"] = ms(lambda: module.chunk(*inputs[:5], alpha=inputs[5], num_iter=r))
    forward = kernel_times(lambda: module.chunk(*inputs[:5], alpha=inputs[5], num_iter=r))
    cell["fwd_kernels"] = sum(us for us, _ in forward.values()) / 1e3
    cell["fb"] = ms(lambda: ncd_step(module))  # the default backward: fp16x3 products (split operands)
    tf32_backward = configured(op, grad_precision="tf32")
    cell["fb_tf32"] = ms(lambda: ncd_step(tf32_backward))
    for prec in ("tf32", "bf16"):
        variant = configured(op, dot_precision=prec)
        cell[f"fwd_{prec}"] = ms(lambda: variant.chunk(*inputs[:5], alpha=inputs[5], num_iter=r))  # noqa: B023 (called at once)
    cell["chunked_fwd"] = ms(lambda: chunked_gka(*inputs, num_iter=r), rep=20)
    cell["chunked_fb"] = ms(chunked_step, rep=20)
    if naive:
        cell["naive_fb"] = once_ms(naive_step)
    return cell


def profile(op, ts, rs, layouts, grads, backward=True):
    """Per-kernel CUDA time (us per call, mean of 10 calls) of fla GDN's forward and ncd's forward and
    forward+backward at each (T, r), for each layout "ROWSxCOLSxWARPS/BV" (the scans' tile and warps, both scans;
    the value columns per block of the solve's output) and each backward product precision (config grad_precision)."""
    for layout in layouts:
        tile, bv = layout.split("/")
        ba, bb, warps = (int(x) for x in tile.split("x"))
        tiled = op.with_config(scan_tiles_fwd=(ba, bb, warps), scan_tiles_bwd=(ba, bb, warps), output_bv=int(bv))
        for grad in grads:
            module = configured(tiled, grad_precision=None if grad == "default" else grad)
            log(f"scan tile {tile}, output BV {bv}, backward products {grad}")
            _profile(module, ts, rs, backward)


def kernel_times(step, calls=10):
    """CUDA time per call (us) of each kernel `step` launches (torch.profiler, mean of `calls` calls): what the
    GPU spends, without the host's launch overhead that do_bench includes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    return {event.key: (event.device_time_total / calls, event.count // calls) for event in prof.key_averages()
            if event.device_time_total > 0}


def _profile(module, ts, rs, backward=True):
    for t in ts:
        inputs = draw(B, t, H, seed=3)
        leaves = [x.detach().requires_grad_() for x in inputs]
        do = torch.randn_like(inputs[2])
        steps = []
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            steps.append(("fla GDN fwd", lambda: chunk_gated_delta_rule(*inputs[:5])))  # noqa: B023
        except ImportError:
            pass
        for r in rs:
            steps.append((f"r {r} fwd", lambda r=r: module.chunk(*inputs[:5], alpha=inputs[5], num_iter=r)))  # noqa: B023
            if backward:
                steps.append((f"r {r} fwd+bwd", lambda r=r: torch.autograd.grad(
                    module.chunk(*leaves[:5], alpha=leaves[5], num_iter=r)[0], leaves, do)))  # noqa: B023
        for label, step in steps:
            times = kernel_times(step)
            log(f"T {t} {label}:")
            for key, (us, count) in sorted(times.items(), key=lambda kv: -kv[1][0]):
                log(f"  {key[:60]:60s} {us:9.1f} us  x{count}")
            log(f"  {'total':60s} {sum(us for us, _ in times.values()):9.1f} us")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ts", default="2048,4096,8192")
    parser.add_argument("--rs", default="10,30")
    parser.add_argument("--no-naive", action="store_true")
    parser.add_argument("--variants", default="default,default:tf32",
                        help="product precisions checked at T 2048: DOT[:GRAD] (config dot_precision, grad_precision)")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--layouts", default="64x64x4/64",
                        help="--profile: layouts to compare, scan tile ROWSxCOLSxWARPS / output BV")
    parser.add_argument("--profile", action="store_true",
                        help="per-kernel times of ncd's forward and backward (and fla GDN's forward), then exit")
    parser.add_argument("--forward-only", action="store_true", help="--profile: the forward alone")
    parser.add_argument("--grads", default="default",
                        help="--profile: backward product precisions to compare (config grad_precision)")
    parser.add_argument("--json", help="write the ratios to this file (bench/results.py; when the checks pass)")
    parser.add_argument("--decode", action="store_true",
                        help="decoding one token at B 32, H 16, D 128 from fp32 states (issue 33's target), then exit")
    parser.add_argument("--variants-of-spec", action="store_true",
                        help="check and time the spec variants (ungated covariance, own covariance gate, ridge "
                        "offset) beside specs/gka.ncd at --ts and the first of --rs, then exit")
    args = parser.parse_args()
    ts = [int(t) for t in args.ts.split(",")]
    rs = [int(r) for r in args.rs.split(",")]
    log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, {datetime.datetime.now():%Y-%m-%d %H:%M}")
    if args.variants_of_spec:
        spec_variants(ts, rs[0])
        return
    if args.decode:
        decode(rs)
        return
    op = ncd.load(shipped_spec("gka"))
    if args.profile:
        profile(op, ts, rs, args.layouts.split(","), args.grads.split(","), backward=not args.forward_only)
        return
    failures: list[str] = []
    check(op, failures, [v for v in args.variants.split(",") if v])
    if args.check_only:
        log(f"correctness: {'all OK' if not failures else 'FAILED: ' + ', '.join(failures)}")
        return
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as err:
        log(f"fla unavailable: {err}")
        chunk_gated_delta_rule = chunk_simple_gla = None

    rows = []
    for t in ts:
        inputs = draw(B, t, H, seed=3)
        base: dict[str, object] = {"T": t}
        if chunk_gated_delta_rule is not None:
            q, k, v, g, beta, _ = inputs
            base["gdn"] = ms(lambda: chunk_gated_delta_rule(q, k, v, g, beta))  # noqa: B023 (called at once)
            base["gla"] = ms(lambda: chunk_simple_gla(q, k, v, g))  # noqa: B023
            base["gdn_kernels"] = sum(us for us, _ in kernel_times(
                lambda: chunk_gated_delta_rule(q, k, v, g, beta)).values()) / 1e3  # noqa: B023
        for r in rs:
            cell = dict(base, r=r, **measure(op, inputs, r, naive=t == 2048 and not args.no_naive))
            log(f"  T {t} r {r}: " + ", ".join(f"{key} {val:.3f}" if isinstance(val, float) else f"{key} {val}"
                                               for key, val in cell.items()))
            rows.append(cell)
            torch.cuda.empty_cache()

    RESULTS["rows"] = rows
    RESULTS["failures"] = failures
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gka.json"), "w") as handle:
            json.dump(RESULTS, handle, indent=1)
    if args.json and not failures:
        from results import gka_rows, new_run, write_results  # bench/results.py, beside this script

        write_results(args.json, new_run("gka", torch.cuda.get_device_name(), gka_rows(rows, f", B {B} H {H} D {D}"),
                                         source=f"bench/gka.py {' '.join(sys.argv[1:])}"))
    log("")
    log(f"GKA, bf16, B {B}, H {H}, D {D}; ms (median of do_bench; 'kernels': CUDA time per call); ratios: ncd fwd / "
        "fla GDN fwd (targets: <= 3 at r 30, <= 1.5 at r 10; by do_bench and by kernel time), naive fwd+bwd / ncd "
        "fwd+bwd (target >= 50 at T 2048)")
    header = ("T", "r", "ncd fwd", "ncd f+b", "ncd f+b tf32-bwd", "ncd fwd tf32-dot", "ncd fwd bf16-dot", "chunked fwd",
              "chunked f+b", "naive f+b", "fla GDN fwd", "fla GLA fwd", "fwd/GDN", "ncd fwd kernels",
              "GDN fwd kernels", "fwd/GDN kernels", "naive/ncd f+b")
    log("| " + " | ".join(header) + " |")
    log("|" + "---|" * len(header))
    for c in rows:
        gdn = c.get("gdn")
        cells = [c["T"], c["r"], f"{c['fwd']:.3f}", f"{c['fb']:.3f}", f"{c['fb_tf32']:.3f}", f"{c['fwd_tf32']:.3f}",
                 f"{c['fwd_bf16']:.3f}", f"{c['chunked_fwd']:.3f}", f"{c['chunked_fb']:.3f}",
                 f"{c['naive_fb']:.0f}" if "naive_fb" in c else "-",
                 f"{gdn:.3f}" if gdn else "-", f"{c['gla']:.3f}" if "gla" in c else "-",
                 f"{c['fwd'] / gdn:.2f}" if gdn else "-", f"{c['fwd_kernels']:.3f}",
                 f"{c['gdn_kernels']:.3f}" if gdn else "-",
                 f"{c['fwd_kernels'] / c['gdn_kernels']:.2f}" if gdn else "-",
                 f"{c['naive_fb'] / c['fb']:.0f}x" if "naive_fb" in c else "-"]
        log("| " + " | ".join(str(x) for x in cells) + " |")
    log(f"correctness: {'all OK' if not failures else 'FAILED: ' + ', '.join(failures)}")



def decode(rs, b=32, heads=16):
    """One token from fp32 states (H [B, H, K, K], S [B, H, K, V]: 64 MB at B 32, H 16, D 128) that a chunked prefill
    of 64 tokens left, device time by CUDA graphs, against a device-to-device copy of the same bytes in the same
    run (the bandwidth bound: read and write each state once); the call time with the host's beside it. Checked
    first: the token and the states equal the chunked op's from the same states."""
    from triton.testing import do_bench_cudagraph

    from ncd.ops import chunk_gka, recurrent_gka

    q, k, v, g, beta, alpha = draw(b, 1, heads)
    with torch.no_grad():
        prefill = draw(b, 64, heads, seed=1)
        _, states = chunk_gka(*prefill[:5], alpha=prefill[5], output_final_state=True)
    copies = tuple(torch.empty_like(s) for s in states)
    mb = sum(s.numel() * 4 for s in states) / 1e6

    def copy():
        for out, s in zip(copies, states, strict=True):
            out.copy_(s)

    failures = []
    with torch.no_grad():
        copy()
        copy_ms = float(do_bench_cudagraph(copy, rep=200, return_mode="median"))
        for r in rs:
            def step(r=r):
                return recurrent_gka(q, k, v, g, beta, alpha=alpha, initial_state=states, num_iter=r)
            o, (h, s) = step()  # compiles outside the graph
            want, (h_want, s_want) = chunk_gka(q, k, v, g, beta, alpha=alpha, initial_state=states,
                                               output_final_state=True, num_iter=r)
            errors = {"o": rel(o, want), "H": rel(h, h_want), "S": rel(s, s_want)}
            if not max(errors.values()) < 2e-3:  # bf16 o; the chunked solve's fp16x3 products against fp32 FMAs
                failures.append(f"decode r {r}")
            graph = float(do_bench_cudagraph(step, rep=200, return_mode="median"))
            call = ms(step)
            log(f"decode B {b} H {heads} D {D}, r {r}, one token, states {mb:.0f} MB: device {graph * 1e3:.1f} us "
                f"({2 * mb / graph:.0f} GB/s; a copy of the same bytes {copy_ms * 1e3:.1f} us: "
                f"{copy_ms / graph:.0%} of it); per call with host time {call * 1e3:.1f} us; against the chunked op: "
                + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    log(f"decode correctness: {'all OK' if not failures else 'FAILED: ' + ', '.join(failures)}")


# --variants-of-spec: the Gated KalmaNet variants beside specs/gka.ncd (tests/test_gka_variants.py covers more)
_H_SCAN = "H[batch time head kdim kcol] = scan(exp(g) * prev"
SPEC_VARIANTS = {
    "ungated covariance": None,  # shipped: specs/gka_ungated_covariance.ncd
    "own covariance gate": [("in  g[batch time head] : f32\n",
                             "in  g[batch time head] : f32\nin  gk[batch time head] : f32\n"),
                            (_H_SCAN, _H_SCAN.replace("exp(g)", "exp(gk)"))],
    "ridge offset 0.3": [("lam[batch time head] = ridge * normH", "lam[batch time head] = ridge * normH + 0.3")],
}


def spec_variants(ts, r):
    """Each variant's op against the float64 naive recurrence (B1 T300 H2, bf16 inputs), then its forward and
    forward+backward beside the default spec's, same run."""
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp())
    ops = {"default": ncd.load(shipped_spec("gka"))}
    for name, changes in SPEC_VARIANTS.items():
        if changes is None:
            ops[name] = ncd.load(shipped_spec("gka_ungated_covariance"))
            continue
        text = shipped_spec("gka").read_text()
        for old, new in changes:
            assert old in text, old
            text = text.replace(old, new)
        path = folder / f"gka_{name.replace(' ', '_').replace('.', '')}.ncd"
        path.write_text(text)
        ops[name] = ncd.load(path)

    def call(name, module, x, **kw):
        q, k, v, g, beta, alpha, gk = x
        extra = {"gk": gk} if name == "own covariance gate" else {}
        return module.chunk(q, k, v, g, beta, alpha=alpha, **extra, **kw)[0]

    def reference(name, x):
        q, k, v, g, beta, alpha, gk = (t.double() for t in x)
        gates = {"ungated covariance": None, "own covariance gate": gk}
        kw = {"gk": gates[name]} if name in gates else {}
        return naive_gka(q, k, v, g, beta, alpha, ridge_offset=0.3 if "offset" in name else 0.0, **kw)[0]

    failures = []
    for dtype, tol_o, tol_g in ((torch.bfloat16, 1e-2, 3e-2),):  # fp32: the interpreter's tests
        x = (*draw(1, 300, 2, dtype, seed=1), F.logsigmoid(torch.randn(1, 300, 2, device="cuda") + 1.0))
        do = torch.randn(1, 300, 2, D, device="cuda", dtype=dtype)
        for name, op in ops.items():
            leaves = [t.detach().clone().requires_grad_() for t in x]
            ref_leaves = [t.detach().double().requires_grad_() for t in x]
            o, ref = call(name, op.module, leaves), reference(name, ref_leaves)
            used = slice(None) if name == "own covariance gate" else slice(0, 6)  # gk is an input of that one alone
            grads = torch.autograd.grad(o, leaves[used], do)
            ref_grads = torch.autograd.grad(ref, ref_leaves[used], do.double())
            errs = [rel(a, b) for a, b in zip((o, *grads), (ref, *ref_grads), strict=True)]
            bad = errs[0] > tol_o or max(errs[1:]) > tol_g
            log(f"  check {name:20s} {str(dtype)[6:]:9s} o {errs[0]:.1e}, worst gradient {max(errs[1:]):.1e} "
                f"{'FAIL' if bad else 'OK'}")
            if bad:
                failures.append(f"{name} {dtype}")
    log("| T | r | variant | fwd ms | fwd+bwd ms | fwd / default | fwd+bwd / default |")
    log("|---|---|---|---|---|---|---|")
    for t in ts:
        x = (*draw(B, t, H, seed=3), F.logsigmoid(torch.randn(B, t, H, device="cuda") + 1.0))
        leaves = [y.detach().requires_grad_() for y in x]
        do = torch.randn_like(x[2])
        base = None
        for name, op in ops.items():
            module = op.module
            fwd = ms(lambda: call(name, module, x, num_iter=r))  # noqa: B023
            used = leaves if name == "own covariance gate" else leaves[:6]
            fb = ms(lambda: torch.autograd.grad(call(name, module, leaves, num_iter=r), used, do))  # noqa: B023
            base = base or (fwd, fb)
            log(f"| {t} | {r} | {name} | {fwd:.3f} | {fb:.3f} | {fwd / base[0]:.2f} | {fb / base[1]:.2f} |")
    log(f"correctness: {'all OK' if not failures else 'FAILED: ' + ', '.join(failures)}")


if __name__ == "__main__":
    main()
