"""GPU benchmark of the group-rational family (KAT / FlashKAT), one run: correctness first, then timings.

X = [1024, 197, 768] fp32, G = 8, version A (KAT's form): ncd's generated op against eager PyTorch autograd, a
KAT-style Triton kernel (Algorithm 1 of papers/flashkat.txt: 1-D grid, one atomic add per element per
coefficient) and a FlashKAT-style kernel (Algorithm 2 as the paper states it: 2-D grid of row blocks x groups,
one tile of S_block x d_g per program, block reduction, one atomic per coefficient per program). The two
baselines are written here by hand from the paper; ncd's kernels come from specs/kat_rational.ncd.

Run from outside the repository so the installed ncd is imported:
    cd /tmp && python3 /path/to/repo/bench/rational.py [--skip-kat] [--json PATH]
--skip-kat leaves out the KAT-style per-element-atomic backward (about 2 s of device time at full shape; its
rounding row and timings are then missing from the table). Prints a short table last; full numbers go to
$OUT/rational.json when OUT is set; --json PATH writes the ratios in bench/results.py's format (when the checks pass).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import ncd
from ncd.kan import GroupRational, KATGroup
from ncd.validate import validate

ROOT = Path(__file__).resolve().parent.parent
SMOKE = os.environ.get("TRITON_INTERPRET") == "1"  # a CPU smoke run of this script at tiny sizes
DEV = "cpu" if SMOKE else "cuda"
B_, L_, D_, G_ = (2, 64, 64, 8) if SMOKE else (1024, 197, 768, 8)
R_ = B_ * L_
W_ = D_ // G_
RESULTS: dict[str, object] = {}
SKIP_KAT = "--skip-kat" in sys.argv[1:]
JSON_PATH = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv[1:-1] else None  # bench/results.py


def log(*args):
    print(*args, flush=True)


def median_ms(fn, warmup=25, rep=200):
    if SMOKE:
        t0 = time.time()
        fn()
        return (time.time() - t0) * 1e3
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# Baselines written from the paper (version A: Q = 1 + sum |b_j| |x|^j, sign(0) = +1), A [G, 6], B [G, 4]
# ------------------------------------------------------------------------------------------------


@triton.jit
def _rational(x, a0, a1, a2, a3, a4, a5, b0, b1, b2, b3):
    ax = tl.abs(x)
    p = a0 + x * (a1 + x * (a2 + x * (a3 + x * (a4 + x * a5))))
    q = 1.0 + ax * (tl.abs(b0) + ax * (tl.abs(b1) + ax * (tl.abs(b2) + ax * tl.abs(b3))))
    return p, q, ax


@triton.jit
def kat_fwd(X, Y, A, B, N, D, W, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + offs, mask=m, other=0.0)
    g = (offs % D) // W
    p, q, _ax = _rational(x, tl.load(A + g * 6), tl.load(A + g * 6 + 1), tl.load(A + g * 6 + 2),
                         tl.load(A + g * 6 + 3), tl.load(A + g * 6 + 4), tl.load(A + g * 6 + 5),
                         tl.load(B + g * 4), tl.load(B + g * 4 + 1), tl.load(B + g * 4 + 2), tl.load(B + g * 4 + 3))
    tl.store(Y + offs, p / q, mask=m)


@triton.jit
def kat_bwd(X, DY, DX, A, B, DA, DB, N, D, W, BLOCK: tl.constexpr):
    """Algorithm 1: every element adds its m + n + 1 coefficient contributions with global atomics."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + offs, mask=m, other=0.0)
    dy = tl.load(DY + offs, mask=m, other=0.0)
    g = (offs % D) // W
    a1 = tl.load(A + g * 6 + 1)
    a2 = tl.load(A + g * 6 + 2)
    a3 = tl.load(A + g * 6 + 3)
    a4 = tl.load(A + g * 6 + 4)
    a5 = tl.load(A + g * 6 + 5)
    b0 = tl.load(B + g * 4)
    b1 = tl.load(B + g * 4 + 1)
    b2 = tl.load(B + g * 4 + 2)
    b3 = tl.load(B + g * 4 + 3)
    p, q, ax = _rational(x, tl.load(A + g * 6), a1, a2, a3, a4, a5, b0, b1, b2, b3)
    sx = tl.where(x >= 0, 1.0, -1.0)
    dp = a1 + x * (2.0 * a2 + x * (3.0 * a3 + x * (4.0 * a4 + x * 5.0 * a5)))
    dq = sx * (tl.abs(b0) + ax * (2.0 * tl.abs(b1) + ax * (3.0 * tl.abs(b2) + ax * 4.0 * tl.abs(b3))))
    rq = 1.0 / q
    tl.store(DX + offs, dy * (dp * rq - p * dq * rq * rq), mask=m)
    xi = dy * rq
    for i in tl.static_range(6):
        tl.atomic_add(DA + g * 6 + i, xi, mask=m)
        xi = xi * x
    c = -dy * p * rq * rq
    axj = ax
    tl.atomic_add(DB + g * 4, c * tl.where(b0 >= 0, 1.0, -1.0) * axj, mask=m)
    axj = axj * ax
    tl.atomic_add(DB + g * 4 + 1, c * tl.where(b1 >= 0, 1.0, -1.0) * axj, mask=m)
    axj = axj * ax
    tl.atomic_add(DB + g * 4 + 2, c * tl.where(b2 >= 0, 1.0, -1.0) * axj, mask=m)
    axj = axj * ax
    tl.atomic_add(DB + g * 4 + 3, c * tl.where(b3 >= 0, 1.0, -1.0) * axj, mask=m)


def _fk_configs():
    if SMOKE:
        return [triton.Config({"S_BLOCK": 8}, num_warps=1)]
    return [triton.Config({"S_BLOCK": s}, num_warps=w) for s in (8, 16, 32, 64) for w in (4, 8)]


@triton.autotune(configs=_fk_configs(), key=["W"])
@triton.jit
def fk_fwd(X, Y, A, B, R, D, W: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    rows = i * S_BLOCK + tl.arange(0, S_BLOCK)
    cols = tl.arange(0, BLOCK_W)
    m = (rows < R)[:, None] & (cols < W)[None, :]
    off = rows.to(tl.int64)[:, None] * D + j * W + cols[None, :]
    x = tl.load(X + off, mask=m, other=0.0)
    p, q, _ax = _rational(x, tl.load(A + j * 6), tl.load(A + j * 6 + 1), tl.load(A + j * 6 + 2),
                         tl.load(A + j * 6 + 3), tl.load(A + j * 6 + 4), tl.load(A + j * 6 + 5),
                         tl.load(B + j * 4), tl.load(B + j * 4 + 1), tl.load(B + j * 4 + 2), tl.load(B + j * 4 + 3))
    tl.store(Y + off, p / q, mask=m)


@triton.autotune(configs=_fk_configs(), key=["W"], reset_to_zero=["DA", "DB"])
@triton.jit
def fk_bwd(X, DY, DX, A, B, DA, DB, R, D, W: tl.constexpr, S_BLOCK: tl.constexpr, BLOCK_W: tl.constexpr):
    """Algorithm 2: program (i, j) owns X_ij [S_block, d_g]; block sums, then one atomic per coefficient."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    rows = i * S_BLOCK + tl.arange(0, S_BLOCK)
    cols = tl.arange(0, BLOCK_W)
    m = (rows < R)[:, None] & (cols < W)[None, :]
    off = rows.to(tl.int64)[:, None] * D + j * W + cols[None, :]
    x = tl.load(X + off, mask=m, other=0.0)
    dy = tl.load(DY + off, mask=m, other=0.0)
    a1 = tl.load(A + j * 6 + 1)
    a2 = tl.load(A + j * 6 + 2)
    a3 = tl.load(A + j * 6 + 3)
    a4 = tl.load(A + j * 6 + 4)
    a5 = tl.load(A + j * 6 + 5)
    b0 = tl.load(B + j * 4)
    b1 = tl.load(B + j * 4 + 1)
    b2 = tl.load(B + j * 4 + 2)
    b3 = tl.load(B + j * 4 + 3)
    p, q, ax = _rational(x, tl.load(A + j * 6), a1, a2, a3, a4, a5, b0, b1, b2, b3)
    sx = tl.where(x >= 0, 1.0, -1.0)
    dp = a1 + x * (2.0 * a2 + x * (3.0 * a3 + x * (4.0 * a4 + x * 5.0 * a5)))
    dq = sx * (tl.abs(b0) + ax * (2.0 * tl.abs(b1) + ax * (3.0 * tl.abs(b2) + ax * 4.0 * tl.abs(b3))))
    rq = 1.0 / q
    tl.store(DX + off, dy * (dp * rq - p * dq * rq * rq), mask=m)
    xi = tl.where(m, dy * rq, 0.0)
    for k in tl.static_range(6):
        tl.atomic_add(DA + j * 6 + k, tl.sum(tl.sum(xi, axis=1), axis=0))
        xi = xi * x
    c = tl.where(m, -dy * p * rq * rq, 0.0)
    axj = ax
    tl.atomic_add(DB + j * 4, tl.sum(tl.sum(c * axj, axis=1), axis=0) * tl.where(b0 >= 0, 1.0, -1.0))
    axj = axj * ax
    tl.atomic_add(DB + j * 4 + 1, tl.sum(tl.sum(c * axj, axis=1), axis=0) * tl.where(b1 >= 0, 1.0, -1.0))
    axj = axj * ax
    tl.atomic_add(DB + j * 4 + 2, tl.sum(tl.sum(c * axj, axis=1), axis=0) * tl.where(b2 >= 0, 1.0, -1.0))
    axj = axj * ax
    tl.atomic_add(DB + j * 4 + 3, tl.sum(tl.sum(c * axj, axis=1), axis=0) * tl.where(b3 >= 0, 1.0, -1.0))


def kat_forward(x, a, b):
    n = x.numel()
    y = torch.empty_like(x)
    kat_fwd[(triton.cdiv(n, 1024),)](x, y, a, b, n, x.shape[1], x.shape[1] // a.shape[0], BLOCK=1024)
    return y


def kat_backward(dy, x, a, b):
    n = x.numel()
    dx = torch.empty_like(x)
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    kat_bwd[(triton.cdiv(n, 1024),)](x, dy, dx, a, b, da, db, n, x.shape[1], x.shape[1] // a.shape[0], BLOCK=1024)
    return dx, da, db


def fk_forward(x, a, b):
    r, d = x.shape
    g = a.shape[0]
    y = torch.empty_like(x)
    grid = lambda meta: (triton.cdiv(r, meta["S_BLOCK"]), g)
    fk_fwd[grid](x, y, a, b, r, d, W=d // g, BLOCK_W=triton.next_power_of_2(d // g))
    return y


def fk_backward(dy, x, a, b):
    r, d = x.shape
    g = a.shape[0]
    dx = torch.empty_like(x)
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    grid = lambda meta: (triton.cdiv(r, meta["S_BLOCK"]), g)
    fk_bwd[grid](x, dy, dx, a, b, da, db, r, d, W=d // g, BLOCK_W=triton.next_power_of_2(d // g))
    return dx, da, db


class AbsPlus(torch.autograd.Function):
    """|u| with d|u|/du = +1 at 0: ncd's convention and the KAT kernels' (randn draws exact zeros at 155M)."""

    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return u.abs()

    @staticmethod
    def backward(ctx, g):
        (u,) = ctx.saved_tensors
        return g * torch.where(u >= 0, 1.0, -1.0).to(g.dtype)


def eager(x, a, b, abs_fn=torch.abs):
    """Version A in eager PyTorch, per group: a [G, 6], b [G, 4]."""
    r, d = x.shape
    g = a.shape[0]
    x3 = x.view(r, g, d // g)
    p = sum(a[:, i].view(1, g, 1) * x3 ** i for i in range(6))
    ax = abs_fn(x3)
    q = 1 + sum(abs_fn(b[:, j]).view(1, g, 1) * ax ** (j + 1) for j in range(4))
    return (p / q).view(r, d)


def rel(v, ref):
    v, ref = v.detach().double(), ref.detach().double()
    return float((v - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------------------------


def main() -> int:
    torch.manual_seed(0)
    if SMOKE:
        RESULTS["device"] = "CPU (Triton interpreter smoke run)"
    else:
        props = torch.cuda.get_device_properties(0)
        RESULTS["device"] = f"{props.name}, {props.multi_processor_count} SMs"
    RESULTS["versions"] = f"torch {torch.__version__}, triton {triton.__version__}"
    RESULTS["date"] = datetime.date.today().isoformat()
    log("device:", RESULTS["device"], "|", RESULTS["versions"])
    t_start = time.time()

    # ---------------- correctness first ----------------
    failed = False
    for spec in ("kat_rational.ncd", "group_rational.ncd"):
        op = ncd.load(ROOT / "specs" / spec)
        for dtype in (torch.float32,) if SMOKE else (torch.float32, torch.bfloat16):
            rows = validate(op, dtype, DEV)  # outputs poisoned with NaN (validate: ncd.settings.poisoned)
            log(f"validate {spec} {dtype}: " + ", ".join(f"{r.quantity} {r.error:.1e}" for r in rows))
            failed |= not all(r.ok for r in rows)

    kat_op = ncd.load(ROOT / "specs" / "kat_rational.ncd")
    per_group = GroupRational(G_, 5, 4, form="kat", shared_numerator=False)  # Table 8: A [8, 6], B [8, 4]
    x = torch.randn(R_, D_, device=DEV)
    dy = torch.randn_like(x)
    a = torch.randn(G_, 6, device=DEV)
    b = torch.randn(G_, 4, device=DEV)
    # full-shape check of every implementation against fp64 eager autograd
    xd, ad, bd = (t.double().requires_grad_() for t in (x, a, b))
    yd = eager(xd, ad, bd, AbsPlus.apply)
    ref = (yd.detach(), *torch.autograd.grad(yd, (xd, ad, bd), dy.double()))
    del yd, xd
    mod = per_group.op.module
    impls = {
        "ncd atomic": (lambda: mod.forward(x, (a, b), G_),
                       lambda: _split(mod.backward(dy, x, (a, b), G_, False))),
        "ncd deterministic": (lambda: mod.forward(x, (a, b), G_),
                              lambda: _split(mod.backward(dy, x, (a, b), G_, True))),
        "FlashKAT-style": (lambda: fk_forward(x, a, b), lambda: fk_backward(dy, x, a, b)),
    }
    for name, (fwd, bwd) in impls.items():
        got = (fwd(), *bwd())
        errs = [rel(g, r) for g, r in zip(got, ref, strict=True)]
        log(f"full shape vs fp64, {name}: y {errs[0]:.1e} dx {errs[1]:.1e} dA {errs[2]:.1e} dB {errs[3]:.1e}")
        failed |= max(errs[:2]) > 1e-4 or max(errs[2:]) > 1e-3
    # KAT-style correctness on a slice (it is slow)
    if not SKIP_KAT:
        xs, dys = x[: R_ // 64], dy[: R_ // 64]
        xsd, asd, bsd = (t.double().requires_grad_() for t in (xs, a, b))
        ysd = eager(xsd, asd, bsd, AbsPlus.apply)
        sref = (ysd.detach(), *torch.autograd.grad(ysd, (xsd, asd, bsd), dys.double()))
        got = (kat_forward(xs, a, b), *kat_backward(dys, xs, a, b))
        errs = [rel(g, r) for g, r in zip(got, sref, strict=True)]
        log(f"1/64 slice vs fp64, KAT-style: y {errs[0]:.1e} dx {errs[1]:.1e} dA {errs[2]:.1e} dB {errs[3]:.1e}")
    if failed:
        log("CORRECTNESS FAILED: timings below are not trustworthy")
    RESULTS["correct"] = not failed

    # ---------------- Table 8 rounding protocol, full shape ----------------
    mae: dict[str, list[float]] = {k: [] for k in ("ncd atomic", "ncd deterministic", "FlashKAT-style", "KAT-style")}
    kat_full_ms = None
    for trial in range(3):
        if trial:
            x.normal_()
            dy.normal_()
            a.normal_()
            b.normal_()
            xd, ad, bd = (t.double().requires_grad_() for t in (x, a, b))
            yd = eager(xd, ad, bd, AbsPlus.apply)
            ref = (yd.detach(), *torch.autograd.grad(yd, (xd, ad, bd), dy.double()))
            del yd, xd
        outs = {"ncd atomic": _split(mod.backward(dy, x, (a, b), G_, False)),
                "ncd deterministic": _split(mod.backward(dy, x, (a, b), G_, True)),
                "FlashKAT-style": fk_backward(dy, x, a, b)}
        if trial == 0 and not SKIP_KAT:  # one full-shape pass of the per-element-atomic kernel (about a second)
            sync()
            t0 = time.time()
            outs["KAT-style"] = kat_backward(dy, x, a, b)
            sync()
            kat_full_ms = (time.time() - t0) * 1e3
        for name, (_, da, db) in outs.items():
            mae[name].append(((da.double() - ref[2]).abs().mean().item(), (db.double() - ref[3]).abs().mean().item()))
    RESULTS["mae"] = {k: [sum(v[0] for v in vals) / len(vals), sum(v[1] for v in vals) / len(vals)]
                      for k, vals in mae.items() if vals}
    log("Table 8 MAE (dA, dB):", json.dumps(RESULTS["mae"]))

    # ---------------- timings, side by side ----------------
    src = torch.randn(R_ * D_, device=DEV)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    nbytes = R_ * D_ * 4
    copy_bw = 2 * nbytes / copy_ms / 1e6  # GB/s
    A1, Bk = torch.randn(6, device=DEV) * 0.1, torch.randn(G_, 4, device=DEV) * 0.1  # KAT spec: A shared [6]
    A1[1] = 1.0
    aG = A1.view(1, 6).repeat(G_, 1).contiguous()  # the baselines take A per group, as KAT_Group repeats it
    kmod = kat_op.module
    t = {}
    t["copy"] = copy_ms
    t["fwd ncd"] = median_ms(lambda: kmod.forward(x, (A1, Bk), G_))
    t["fwd FlashKAT-style"] = median_ms(lambda: fk_forward(x, aG, Bk))
    t["fwd KAT-style"] = median_ms(lambda: kat_forward(x, aG, Bk))
    t["fwd eager"] = median_ms(lambda: eager(x, aG, Bk))
    t["bwd ncd atomic"] = median_ms(lambda: kmod.backward(dy, x, (A1, Bk), G_, False))
    t["bwd ncd deterministic"] = median_ms(lambda: kmod.backward(dy, x, (A1, Bk), G_, True))
    t["bwd FlashKAT-style"] = median_ms(lambda: fk_backward(dy, x, aG, Bk))
    xs64 = x[: R_ // 64].contiguous()
    dys64 = dy[: R_ // 64].contiguous()
    if not SKIP_KAT:
        t["bwd KAT-style (1/64 slice) x64"] = 64 * median_ms(lambda: kat_backward(dys64, xs64, aG, Bk), warmup=1,
                                                             rep=1)
        t["bwd KAT-style full (1 run)"] = kat_full_ms
    for name, kern in (("fwd", _kernel(kmod, "_fwd")), ("bwd", _kernel(kmod, "_bwd"))):
        RESULTS[f"config {name}"] = str(kern.best_config) if hasattr(kern, "best_config") else None
        log(f"autotuned {name} config: {RESULTS[f'config {name}']}")
    RESULTS["bwd grid"] = f"{kmod.row_programs(R_, G_, x.device)} row programs x {G_} groups"
    log("bwd grid:", RESULTS["bwd grid"])

    xg = x.clone().requires_grad_()
    a_p = A1.clone().requires_grad_()
    b_p = Bk.clone().requires_grad_()
    aG_p = aG.clone().requires_grad_()

    def fb_ncd():
        y = kat_op(xg, a_p, b_p)
        torch.autograd.grad(y, (xg, a_p, b_p), dy)

    def fb_eager():
        y = eager(xg, aG_p, b_p)
        torch.autograd.grad(y, (xg, aG_p, b_p), dy)

    t["fwd+bwd ncd (autograd)"] = median_ms(fb_ncd)
    t["fwd+bwd eager (autograd)"] = median_ms(fb_eager)

    # ---------------- MLP block: Linear -> act -> Linear, ViT-S widths, 256 x 197 tokens ----------------
    # "KATGroup": the default (under autocast, upcast in registers: bf16 in memory, fp32 compute, bf16 out);
    # "KATGroup fp32 copy": upcast_under_autocast=True, KAT's in-memory upcast (fp32 out)
    for precision in ("fp32", "bf16 autocast"):
        for act_name in ("KATGroup", "KATGroup fp32 copy", "GELU"):
            if act_name == "KATGroup fp32 copy" and precision == "fp32":
                continue
            act = (torch.nn.GELU() if act_name == "GELU" else
                   KATGroup(8, mode="swish", upcast_under_autocast=act_name == "KATGroup fp32 copy"))
            block = torch.nn.Sequential(torch.nn.Linear(384, 1536), act, torch.nn.Linear(1536, 384)).to(DEV)
            tokens = (2, 16) if SMOKE else (256, 197)
            xin = torch.randn(*tokens, 384, device=DEV, requires_grad=True)
            gout = torch.randn(*tokens, 384, device=DEV)

            def step(block=block, xin=xin, gout=gout, precision=precision):
                with torch.autocast(DEV, dtype=torch.bfloat16, enabled=precision != "fp32"):
                    out = block(xin)
                out.backward(gout)

            t[f"MLP {precision} {act_name}"] = median_ms(step, rep=300)
            del block, xin

    RESULTS["ms"] = t
    RESULTS["copy_GBps"] = copy_bw
    fwd_bytes, bwd_bytes = 2 * nbytes, 3 * nbytes
    bw = {k: (fwd_bytes if k.startswith("fwd ") else bwd_bytes) / v / 1e6 for k, v in t.items()
          if v and (k.startswith("fwd ") or k.startswith("bwd ")) and "+" not in k}
    RESULTS["GBps"] = bw
    out = os.environ.get("OUT")
    if out:
        Path(out, "rational.json").write_text(json.dumps(RESULTS, indent=1))
    if JSON_PATH and RESULTS["correct"]:
        from results import new_run, rational_rows, write_results  # bench/results.py, beside this script

        write_results(JSON_PATH, new_run("rational", str(RESULTS["device"]), rational_rows(
            t, bw, copy_bw, f"X [{B_}, {L_}, {D_}] fp32, G {G_}", f"MLP 384-1536-384, tokens {list(tokens)}"),
            source=f"bench/rational.py {' '.join(sys.argv[1:])}"))
    # ---------------- table ----------------
    log(f"\n== group rational, X = [{B_}, {L_}, {D_}] fp32, G = {G_} | {RESULTS['device']} | "
        f"{RESULTS['versions']} | {RESULTS['date']} | correct: {RESULTS['correct']} | {time.time() - t_start:.0f} s")
    log(f"device copy: {copy_ms:.3f} ms = {copy_bw:.0f} GB/s (read + write)")
    log(f"{'measurement':<34} {'ms':>9} {'GB/s':>7} {'% copy':>7}")
    for k, v in t.items():
        if k == "copy" or v is None:
            continue
        g = bw.get(k)
        extra = f"{g:7.0f} {100 * g / copy_bw:6.1f}%" if g else ""
        log(f"{k:<34} {v:9.3f} {extra}")
    log(f"bwd ncd atomic: {100 * bw['bwd ncd atomic'] / copy_bw:.1f}% of copy (target >= 85%); "
        f"fwd ncd: {100 * bw['fwd ncd'] / copy_bw:.1f}% (target >= 85%)")
    log("speedups: bwd FlashKAT-style / ncd atomic = "
        f"{t['bwd FlashKAT-style'] / t['bwd ncd atomic']:.2f}x; fwd+bwd eager / ncd = "
        f"{t['fwd+bwd eager (autograd)'] / t['fwd+bwd ncd (autograd)']:.2f}x")
    for k in ("fp32 KATGroup", "bf16 autocast KATGroup", "bf16 autocast KATGroup fp32 copy"):
        base = t["MLP fp32 GELU"] if k.startswith("fp32") else t["MLP bf16 autocast GELU"]
        log(f"MLP {k} / GELU = {t[f'MLP {k}'] / base:.3f}")
    for k, (ea, eb) in RESULTS["mae"].items():
        log(f"MAE vs fp64 {k:<18} dA {ea:.2e}  dB {eb:.2e}")
    return 0 if RESULTS["correct"] else 1


def _kernel(module, suffix):
    """The autotuned kernel: the module's `_KERNELS.fwd`/`.bwd` (static kernels), else its `_..._fwd` global (older
    generated modules, which held the kernel text)."""
    kernels = getattr(module, "_KERNELS", None)
    if kernels is not None:
        return getattr(kernels, suffix.lstrip("_"))
    return next(getattr(module, n) for n in dir(module) if n.endswith(suffix) and n.startswith("_"))


def _split(pair):
    """(dx, dc) of a per-group-numerator module -> (dx, dA [G, 6], dB [G, 4])."""
    dx, dc = pair
    per_group = dc[: G_ * 10].view(G_, 10)
    return dx, per_group[:, :6], per_group[:, 6:]


if __name__ == "__main__":
    sys.exit(main())
