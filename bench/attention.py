"""GPU check and benchmark of the attention ops compiled from the shipped specs (issue 3).

Run on a CUDA machine, with ncd importable (installed, or the repository root on sys.path):

    PYTHONUNBUFFERED=1 python3 bench/attention.py [--quick] [--ns 1024,4096] [--budget-s 480]

1. Correctness first: spherical, causal spherical, softmax and causal softmax (``ncd.load`` of the
   specs), bf16, B=2, H=4, N=1000 (not a multiple of any block), D=128. The output and dQ/dK/dV are
   compared with an fp32 PyTorch reference by ||out - ref|| / ||ref|| (< 1e-2 required), for every
   backward variant the generated module offers. Exits non-zero on failure (after the timings).
2. Timings (``triton.testing.do_bench``, median): bf16, D=128, H=16, B*N=32768 tokens, causal and
   non-causal, N in {1024, 4096, 8192, 16384} (``--quick``: 4096 only). Spherical from the spec (fwd,
   fwd+bwd; as the op picks the form, and each form forced: ``spherical_streamed``,
   ``spherical_factorized``), eager PyTorch spherical, ``torch.compile`` of it, SDPA, softmax from the
   spec. FLOPs: forward 4 B H N^2 D (half when causal), backward 2.5x forward.
   ``--impls`` restricts the timed implementations, ``--families`` the specs loaded and checked.
3. ``--breakdown N,...``: per-kernel CUDA times (torch.profiler) of one spherical fwd+bwd per form.
4. ``--tiles "softmax:1:1024:fwd;spherical:1:1024:bwd+fused"``: forced-tile sweep of the streamed kernels
   (forward with and without TMA, the dK/dV and dQ kernels, the atomic-dQ fused kernel), then the
   correctness check, then exit. The autotune sets in ncd/families/attention/config.py come from it.

5. ``--dim 80``: every shape at another head dim (the specs' ``axis dim = 128`` replaced; SDPA at the same dim).

The table is printed last. With $OUT set, the rows go to $OUT/attention_bench.json and the log to
$OUT/attention_bench.log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

try:
    import ncd
except ImportError:  # not installed: use the checkout this script lives in
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import ncd
import ncd.launch
from ncd.settings import poisoned

SPEC_DIR = Path(__file__).resolve().parent.parent / "specs"
HEADS, DIM, TOKENS = 16, 128, 32768
DTYPE = torch.bfloat16
TOL = 1e-2
SPECS = {
    # (family, causal) -> spec file
    ("spherical", False): "spherical_attention.ncd",
    ("spherical", True): "causal_spherical_attention.ncd",
    ("softmax", False): "softmax_attention.ncd",
    ("softmax", True): "causal_softmax_attention.ncd",
}
# Backward variants of the op, as the fields of its config they set (`Op.with_config`): one fused kernel with fp32
# atomic dQ; dK/dV and dQ kernels, the dQ kernel recomputing S and dP; dK/dV storing dS and dQ = dS K from it.
BWD_VARIANTS = {"atomic": {"deterministic_bwd": False},
                "recompute": {"deterministic_bwd": True, "ds_buffer_bytes": 0},
                "stored-ds": {"deterministic_bwd": True, "ds_buffer_bytes": 1 << 40}}


def load_spec(name: str):
    """ncd.load of a shipped spec, at head dim DIM (the spec's `axis dim = 128` replaced when DIM is another)."""
    if DIM == 128:
        return ncd.load(SPEC_DIR / name)
    text, stem = (SPEC_DIR / name).read_text(), Path(name).stem
    if "axis dim = 128" not in text:
        raise SystemExit(f"{name}: no `axis dim = 128` to replace")
    path = Path(tempfile.mkdtemp()) / f"{stem}_d{DIM}.ncd"
    path.write_text(text.replace("axis dim = 128", f"axis dim = {DIM}").replace(f"spec {stem}", f"spec {stem}_d{DIM}"))
    return ncd.load(path)


def _two_forms(op) -> bool:
    """The op has a factorized form, and it runs at head dim DIM (tiles up to the config's fact_max_head_dim)."""
    return op.config.factorized and op.module.head_tile(DIM) <= op.config.fact_max_head_dim


def _in_form(op, form: str | None, **fields):
    """The op compiled to take one form (factorize = "never": streamed, "always": factorized) at every call, with
    other fields of its config replaced too; `op` itself where nothing changes."""
    fields = {**fields, **({"factorize": form} if form is not None and op.config.factorized else {})}
    return op.with_config(**fields) if fields else op


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return ((out - ref).norm() / ref.norm()).item()


def _mask(n_q: int, n_k: int, device) -> torch.Tensor:
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()


def reference(family: str, q, k, v, scale: float, causal: bool):
    """Plain PyTorch (fp32 when given fp32 inputs)."""
    s = scale * (q @ k.transpose(-1, -2))
    if family == "softmax":
        if causal:
            s = s.masked_fill(~_mask(*s.shape[-2:], s.device), float("-inf"))
        return torch.softmax(s, -1) @ v
    if causal:
        s = s.masked_fill(~_mask(*s.shape[-2:], s.device), 0.0)
    return (s @ v) / (s * s).sum(-1, keepdim=True).sqrt()


def eager_spherical(q, k, v, causal: bool):
    """Eager spherical attention as one would write it: S = QK^T; O = S V / sqrt(rowsum S^2)."""
    s = q @ k.transpose(-1, -2)
    if causal:
        s = s.masked_fill(~_mask(*s.shape[-2:], s.device), 0.0)
    norm = torch.linalg.vector_norm(s, ord=2, dim=-1, keepdim=True, dtype=torch.float32)
    return ((s @ v).float() / norm).to(q.dtype)


def spec_scale(family: str) -> float:
    # the specs' defaults: spherical scale = 1 (cancels), softmax 1/sqrt(dim)
    return 1.0 if family == "spherical" else DIM**-0.5


def check(ops, log, n: int = 1000, variants: bool = True) -> bool:
    ok = True
    batch, heads = 2, 4
    for (family, causal), base in ops.items():
        bwd = dict(BWD_VARIANTS) if variants else {"default": {}}
        forms = {"factorized": "always", "streamed": "never"} if _two_forms(base) else {"": None}
        cases = [(f"{v}{'+' + f if f else ''}", flag, form)
                 for v, flag in bwd.items() for f, form in forms.items()]
        for vname, flags, form in cases:
            op = _in_form(base, form, **flags)
            gen = torch.Generator(device="cuda").manual_seed(hash((family, causal, vname)) % 2**31)
            q, k, v = (torch.randn(batch, heads, n, DIM, device="cuda", dtype=DTYPE, generator=gen)
                       for _ in range(3))
            grad = torch.randn(batch, heads, n, DIM, device="cuda", dtype=DTYPE, generator=gen)
            scale = spec_scale(family)
            q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
            ref = reference(family, q32, k32, v32, scale, causal)
            ref.backward(grad.float())
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            with poisoned():  # every output buffer starts as NaN: anything left unwritten shows
                o = op(q, k, v)
                o.backward(grad)
                torch.cuda.synchronize()
            errs = {"o": rel_err(o, ref), "dq": rel_err(q.grad, q32.grad), "dk": rel_err(k.grad, k32.grad),
                    "dv": rel_err(v.grad, v32.grad)}
            finite = all(bool(torch.isfinite(t).all()) for t in (o, q.grad, k.grad, v.grad))
            good = finite and all(e < TOL for e in errs.values())
            ok &= good
            log(f"check {family:9s} causal={causal!s:5s} bwd={vname:20s} finite={finite} "
                + " ".join(f"{key}={val:.2e}" for key, val in errs.items()) + ("  OK" if good else "  FAIL"))
    return ok


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def bench_shape(n: int, causal: bool, ops, compiled, log, variants: bool, impls=None):
    batch = TOKENS // n
    gen = torch.Generator(device="cuda").manual_seed(n + causal)
    q, k, v = (torch.randn(batch, HEADS, n, DIM, device="cuda", dtype=DTYPE, generator=gen).requires_grad_()
               for _ in range(3))
    grad = torch.randn(batch, HEADS, n, DIM, device="cuda", dtype=DTYPE, generator=gen)
    sph, smx = ops.get(("spherical", causal)), ops.get(("softmax", causal))  # --families may leave either out
    flops = 4.0 * batch * HEADS * n * n * DIM * (0.5 if causal else 1.0)

    def fwd(fn):
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run

    def fwdbwd(fn):
        def run():
            fn(q, k, v).backward(grad)
        return run

    def sdpa(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)

    def eager(q_, k_, v_):
        return eager_spherical(q_, k_, v_, causal)

    def comp(q_, k_, v_):
        return compiled(q_, k_, v_, causal)

    cases = [
        ("sdpa", "fwd", fwd(sdpa)), ("sdpa", "fwdbwd", fwdbwd(sdpa)),
        *([("spherical", "fwd", fwd(sph)), ("spherical", "fwdbwd", fwdbwd(sph))] if sph is not None else []),
        *([("softmax", "fwd", fwd(smx)), ("softmax", "fwdbwd", fwdbwd(smx))] if smx is not None else []),
        ("eager_spherical", "fwd", fwd(eager)), ("eager_spherical", "fwdbwd", fwdbwd(eager)),
        ("compiled_spherical", "fwd", fwd(comp)), ("compiled_spherical", "fwdbwd", fwdbwd(comp)),
    ]
    if sph is not None and _two_forms(sph):  # one form whatever the cost model picks
        streamed, factorized = _in_form(sph, "never"), _in_form(sph, "always")
        cases += [("spherical_streamed", "fwd", fwd(streamed)), ("spherical_streamed", "fwdbwd", fwdbwd(streamed)),
                  ("spherical_factorized", "fwd", fwd(factorized)),
                  ("spherical_factorized", "fwdbwd", fwdbwd(factorized))]
    if impls:
        cases = [c for c in cases if c[0] in impls]
    if variants:
        for name, op in (("spherical", sph), ("softmax", smx)):
            if op is not None:
                for vname, flags in BWD_VARIANTS.items():
                    cases.append((f"{name}[{vname}]", "fwdbwd", fwdbwd(op.with_config(**flags))))
    rows = []
    for name, mode, run in cases:
        row = {"n": n, "batch": batch, "causal": causal, "impl": name, "mode": mode}
        try:
            t0 = time.time()
            run()  # compile and autotune outside the timing
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - t0, 2)
            ms = do_bench(run, warmup=25, rep=100, grad_to_none=[q, k, v], return_mode="median")
            row.update(ms=ms, tflops=flops * (3.5 if mode == "fwdbwd" else 1.0) / ms * 1e-9)
        except Exception as exc:  # OOM for the eager versions at large N
            if not _is_oom(exc):
                raise
            row.update(ms=None, tflops=None, note="OOM")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        q.grad = k.grad = v.grad = None
        rows.append(row)
        log(json.dumps(row))
    return rows


def breakdown(ops, n: int, causal: bool, log) -> None:
    """Per-kernel CUDA times (torch.profiler) of one spherical forward+backward in each form."""
    from torch.profiler import ProfilerActivity, profile

    op = ops[("spherical", causal)]
    batch = TOKENS // n
    q, k, v = (torch.randn(batch, HEADS, n, DIM, device="cuda", dtype=DTYPE).requires_grad_() for _ in range(3))
    grad = torch.randn(batch, HEADS, n, DIM, device="cuda", dtype=DTYPE)
    base = op
    for mode in ("always", "never") if _two_forms(base) else ("never",):
        op = _in_form(base, mode)
        for _ in range(2):
            op(q, k, v).backward(grad)
            q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                op(q, k, v).backward(grad)
                q.grad = k.grad = v.grad = None  # as do_bench's grad_to_none: no accumulation kernels
            torch.cuda.synchronize()
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        log(f"breakdown N={n} causal={causal} factorize={mode} (per call, us):")
        for e in events[:10]:
            log(f"    {e.device_time_total / 5:9.1f}  {e.key[:90]}")
        q.grad = k.grad = v.grad = None


def autotune_choices(ops, log):
    for (family, causal), op in ops.items():
        for attr in sorted(dir(op.module)):
            cache = getattr(getattr(op.module, attr), "cache", None)
            if attr.endswith("_kernel") and isinstance(cache, dict):
                for key, cfg in cache.items():
                    log(f"tuned {family} causal={causal} {attr} key={key} -> {cfg}")


def _fmt(row) -> str:
    if row is None:
        return "-"
    if row.get("ms") is None:
        return row.get("note", "-")
    return f"{row['ms']:.3f} ({row['tflops']:.0f})"


def _ratio(base, row) -> str:
    if not base or not row or base.get("ms") is None or row.get("ms") is None:
        return "-"
    return f"{base['ms'] / row['ms']:.2f}x"


def table(rows, log):
    by = {(r["n"], r["causal"], r["impl"], r["mode"]): r for r in rows}
    shapes = sorted({(r["n"], r["batch"], r["causal"]) for r in rows})
    log("")
    log("ms (TFLOP/s); ratio = other's ms / ours (> 1: the compiled spec is faster)")
    head = ("| N | B | causal | sph fwd | SDPA fwd | sph/SDPA fwd | sph fwd+bwd | SDPA fwd+bwd | sph/SDPA f+b "
            "| compile sph fwd | sph/compile fwd | compile sph f+b | sph/compile f+b | eager sph fwd | eager sph f+b "
            "| softmax fwd | softmax/SDPA fwd | softmax f+b | softmax/SDPA f+b |")
    log(head)
    log("|" + "---|" * head.count(" | ") + "---|")

    def get(impl, mode, n, causal):
        return by.get((n, causal, impl, mode))

    for n, batch, causal in shapes:
        sf, sb = get("spherical", "fwd", n, causal), get("spherical", "fwdbwd", n, causal)
        df, db = get("sdpa", "fwd", n, causal), get("sdpa", "fwdbwd", n, causal)
        cf, cb = get("compiled_spherical", "fwd", n, causal), get("compiled_spherical", "fwdbwd", n, causal)
        ef, eb = get("eager_spherical", "fwd", n, causal), get("eager_spherical", "fwdbwd", n, causal)
        xf, xb = get("softmax", "fwd", n, causal), get("softmax", "fwdbwd", n, causal)
        cells = [str(n), str(batch), "yes" if causal else "no", _fmt(sf), _fmt(df), _ratio(df, sf), _fmt(sb),
                 _fmt(db), _ratio(db, sb), _fmt(cf), _ratio(cf, sf), _fmt(cb), _ratio(cb, sb), _fmt(ef), _fmt(eb),
                 _fmt(xf), _ratio(df, xf), _fmt(xb), _ratio(db, xb)]
        log("| " + " | ".join(cells) + " |")
    form_rows = [r for r in rows if r["impl"] in ("spherical_streamed", "spherical_factorized")]
    if form_rows:
        log("")
        log("spherical by form (factorize = never / always), against SDPA and torch.compile:")
        log("| N | B | causal | streamed fwd | /SDPA | factorized fwd | /SDPA | /compile | streamed f+b | /SDPA "
            "| factorized f+b | /SDPA | /compile |")
        log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n, batch, causal in shapes:
            sf, ff = get("spherical_streamed", "fwd", n, causal), get("spherical_factorized", "fwd", n, causal)
            sb, fb = get("spherical_streamed", "fwdbwd", n, causal), get("spherical_factorized", "fwdbwd", n, causal)
            df, db = get("sdpa", "fwd", n, causal), get("sdpa", "fwdbwd", n, causal)
            cf, cb = get("compiled_spherical", "fwd", n, causal), get("compiled_spherical", "fwdbwd", n, causal)
            cells = [str(n), str(batch), "yes" if causal else "no", _fmt(sf), _ratio(df, sf), _fmt(ff), _ratio(df, ff),
                     _ratio(cf, ff), _fmt(sb), _ratio(db, sb), _fmt(fb), _ratio(db, fb), _ratio(cb, fb)]
            log("| " + " | ".join(cells) + " |")
    variant_rows = [r for r in rows if "[" in r["impl"]]
    if variant_rows:
        log("")
        log("backward variants (fwd+bwd ms (TFLOP/s)):")
        for r in variant_rows:
            log(f"  N={r['n']:>5} causal={r['causal']!s:5s} {r['impl']:22s} {_fmt(r)}")


# --tiles: forced-config sweep of the streamed kernels (tuning aid; the op itself autotunes over _GPU_CONFIGS)
FWD_TILES = [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 2), (64, 32, 4, 4),
             (128, 32, 4, 4), (128, 32, 4, 3), (128, 32, 4, 5), (64, 128, 8, 3), (128, 64, 8, 5)]
DKDV_TILES = [(64, 64, 4, 2), (32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 4, 2),
              (64, 64, 4, 3), (64, 128, 8, 4), (32, 128, 8, 4), (64, 64, 8, 3)]
FUSED_TILES = [(64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2), (32, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3),
               (128, 64, 8, 2), (128, 128, 8, 2)]
DQ_TILES = [(128, 64, 8, 3), (64, 32, 4, 3), (64, 32, 4, 4), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 4),
            (64, 64, 4, 4), (128, 128, 8, 3)]
DQ_DS_TILES = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4),
               (64, 128, 4, 3), (256, 128, 8, 2)]


def _kernel(module, suffix):
    owner = getattr(module, "KERNELS", module)  # the op's autotuners (families/attention/kernel.py), or (older) globals
    return next(getattr(owner, a) for a in dir(owner) if a.endswith(suffix.lstrip("_")) and "fact" not in a)


def _set_configs(module, suffix, configs):
    """Replace an autotuned kernel's configs; forget its tuned choices and the direct launches made with them."""
    kernel = _kernel(module, suffix)
    kernel.configs = configs
    kernel.cache.clear()
    ncd.launch.forget(kernel)


def _force(module, suffix, tile):
    meta = {"BLOCK_M": tile[0], "BLOCK_N": tile[1], "HEADS_FAST": 0}
    hook = _kernel(module, suffix).configs[0].pre_hook
    _set_configs(module, suffix, [triton.Config(meta, num_warps=tile[2], num_stages=tile[3], pre_hook=hook)])


def tile_sweep(ops, cases, log, budget_s):
    """Time each forced tile of the streamed forward (TMA on/off, warp-specialised loop on/off) and of the two
    deterministic backward kernels; prints the best of each next to SDPA."""
    deadline = time.time() + budget_s
    for family, causal, n, kinds in cases:
        _sweep_case(ops[(family, causal)], family, causal, n, kinds, log, deadline)


_SUFFIXES = ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel", "_bwd_dq_ds_kernel", "_bwd_fused_kernel")


def _sweep_case(op, family, causal, n, kinds, log, deadline):
    """The streamed form's kernels, each variant (TMA, dS buffer, atomic dQ) an op of its own config
    (`Op.with_config`); the forced tiles are undone on every module touched, which later sections reuse."""
    saved: dict = {}

    def variant(**fields):
        module = _in_form(op, "never", **fields).module
        if module not in saved:
            saved[module] = {suffix: list(_kernel(module, suffix).configs) for suffix in _SUFFIXES}
        return module

    batch = TOKENS // n
    q, k, v, do = (torch.randn(batch, HEADS, n, DIM, device="cuda", dtype=DTYPE) for _ in range(4))
    flops = 4.0 * batch * HEADS * n * n * DIM * (0.5 if causal else 1.0)
    sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), return_mode="median")
    log(f"tiles {family} causal={causal} N={n}: SDPA fwd {sdpa_ms:.3f} ms ({flops / sdpa_ms / 1e9:.0f} TFLOP/s)")
    try:
        if "fwd" in kinds:
            best = None
            for tma in (False, True):
                module = variant(use_tma=tma)
                for tile in FWD_TILES if tma else FWD_TILES[:1]:
                    if time.time() > deadline:
                        break
                    _force(module, "_fwd_kernel", tile)
                    try:
                        ms = do_bench(lambda: module.forward(q, k, v), return_mode="median")  # noqa: B023
                    except Exception as exc:  # a tile that does not compile is a result
                        log(f"  fwd tma={int(tma)} {tile}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    log(f"  fwd tma={int(tma)} {tile}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
                        f"{sdpa_ms / ms:.2f}x SDPA")
                    if best is None or ms < best[0]:
                        best = (ms, tma, tile)
                _set_configs(module, "_fwd_kernel", saved[module]["_fwd_kernel"])
            log(f"  best fwd: {best}")
        if "bwd" in kinds:
            for suffix, tiles, ds_bytes in (("_bwd_dkdv_kernel", DKDV_TILES, 0), ("_bwd_dq_kernel", DQ_TILES, 0),
                                            ("_bwd_dkdv_kernel", DKDV_TILES, 1 << 40),
                                            ("_bwd_dq_ds_kernel", DQ_DS_TILES, 1 << 40)):
                # 0: the dQ kernel recomputes S and dP; else dQ = dS K
                module = variant(ds_buffer_bytes=ds_bytes)
                o, stats = module.forward(q, k, v)
                best = None
                for tile in tiles:
                    if time.time() > deadline:
                        break
                    _force(module, suffix, tile)
                    try:
                        ms = do_bench(lambda: module.backward(do, q, k, v, o, stats),  # noqa: B023
                                      return_mode="median")
                    except Exception as exc:
                        log(f"  bwd {suffix} {tile}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    log(f"  bwd (all kernels) with {suffix} {tile}: {ms:.3f} ms")
                    if best is None or ms < best[0]:
                        best = (ms, tile)
                _set_configs(module, suffix, saved[module][suffix])
                log(f"  best {suffix} ({'stored dS' if ds_bytes else 'recompute'}): {best}")
        if "fused" in kinds:  # the atomic-dQ backward (5 products per block pair instead of 7)
            module = variant(deterministic_bwd=False)
            o, stats = module.forward(q, k, v)
            best = None
            for tile in FUSED_TILES:
                if time.time() > deadline:
                    break
                _force(module, "_bwd_fused_kernel", tile)
                try:
                    ms = do_bench(lambda: module.backward(do, q, k, v, o, stats), return_mode="median")
                except Exception as exc:  # a tile that does not compile is a result
                    log(f"  bwd fused {tile}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                log(f"  bwd fused (delta, fused, cast) {tile}: {ms:.3f} ms")
                if best is None or ms < best[0]:
                    best = (ms, tile)
            log(f"  best fused: {best}")
            module = variant()
            o, stats = module.forward(q, k, v)
            ms = do_bench(lambda: module.backward(do, q, k, v, o, stats), return_mode="median")
            log(f"  bwd deterministic (delta, dK/dV, dQ; autotuned) for comparison: {ms:.3f} ms")
        if "bwd" in kinds:
            # the op's own autotuned fwd+bwd against SDPA's, as the table times them
            module = variant()
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

            def ours():
                module.attention(qg, kg, vg).backward(do)

            def sdpa():
                F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(do)
            ours_ms, sdpa_ms = (do_bench(f, return_mode="median") for f in (ours, sdpa))
            log(f"  fwd+bwd autotuned {ours_ms:.3f} ms, SDPA {sdpa_ms:.3f} ms: {sdpa_ms / ours_ms:.2f}x")
    finally:
        for module, configs in saved.items():
            for suffix, tiles in configs.items():
                _set_configs(module, suffix, tiles)


def main() -> int:
    global DIM
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="N=4096 only")
    parser.add_argument("--ns", default="1024,4096,8192,16384")
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no new shape after this")
    parser.add_argument("--no-variants", action="store_true", help="skip timing both backward variants")
    parser.add_argument("--impls", default="", help="comma list of implementations to time (default: all)")
    parser.add_argument("--families", default="spherical,softmax", help="spec families to load and check")
    parser.add_argument("--breakdown", default="", help="comma list of N: per-kernel times of both forms")
    parser.add_argument("--dim", type=int, default=DIM, help="head dim of every shape (default 128)")
    parser.add_argument("--tiles", default="", help="forced-tile sweep, e.g. softmax:1:4096:fwd+bwd;... then exit")
    parser.add_argument("--json", help="write the ratios to this file (bench/results.py; when the checks pass)")
    args = parser.parse_args()
    DIM = args.dim
    t_start = time.time()
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    log_file = (out_dir / "attention_bench.log").open("w") if out_dir else None

    def log(line: str) -> None:
        print(line, flush=True)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    log(f"device={torch.cuda.get_device_name()} torch={torch.__version__} triton={triton.__version__} head_dim={DIM} "
        f"ncd={Path(ncd.__file__).parent} date={time.strftime('%Y-%m-%d %H:%M')} "
        f"sdpa flash={torch.backends.cuda.flash_sdp_enabled()} cudnn={torch.backends.cuda.cudnn_sdp_enabled()}")
    families = set(args.families.split(","))
    ops = {key: load_spec(name) for key, name in SPECS.items() if key[0] in families}
    if args.tiles:
        cases = [(f, c == "1", int(n), set(kinds.split("+"))) for f, c, n, kinds in
                 (case.split(":") for case in args.tiles.split(";"))]
        tile_sweep(ops, cases, log, args.budget_s)
    t0 = time.time()
    ok = check(ops, log, variants=not args.no_variants)
    log(f"correctness {'OK' if ok else 'FAILED'} ({time.time() - t0:.0f} s incl. compile and autotune)")
    if args.tiles:
        return 0 if ok else 1

    for attr in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, attr):
            setattr(torch._dynamo.config, attr, 64)
    compiled = torch.compile(eager_spherical, dynamic=True)

    ns = [4096] if args.quick else [int(x) for x in args.ns.split(",")]
    rows = []
    for n in ns:
        for causal in (False, True):
            if time.time() - t_start > args.budget_s:
                log(f"skip N={n} causal={causal}: over the time budget")
                continue
            rows += bench_shape(n, causal, ops, compiled, log, variants=not args.no_variants,
                                impls=set(args.impls.split(",")) - {""})
    for n in [int(x) for x in args.breakdown.split(",") if x]:
        for causal in (False, True):
            breakdown(ops, n, causal, log)
    autotune_choices(ops, log)
    if out_dir:
        (out_dir / "attention_bench.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
             "correct": ok, "rows": rows}, indent=1))
    if args.json and ok:
        from results import attention_rows, new_run, write_results  # bench/results.py, beside this script

        write_results(args.json, new_run("attention", torch.cuda.get_device_name(), attention_rows(rows),
                                         source=f"bench/attention.py {' '.join(sys.argv[1:])}"))
    log(f"total {time.time() - t_start:.0f} s; correctness {'OK' if ok else 'FAILED'}")
    table(rows, log)
    finite = all(r["ms"] is None or math.isfinite(r["ms"]) for r in rows)
    return 0 if ok and finite else 1


if __name__ == "__main__":
    sys.exit(main())
