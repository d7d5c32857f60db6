"""Chunked gated outer-product recurrences with a per-token ridge solve (Gated KalmaNet): forward and backward
kernels of the recurrence family, the same for every spec. What a spec decides comes in two objects that its
generated module builds (render.py):

- `RecurrenceHooks`: its per-token key and value scalings of beta and their derivatives, `@triton.jit` device
  functions that the kernels take as `tl.constexpr` arguments (KEY_SCALE, VALUE_SCALE, KEY_SCALE_GRAD,
  VALUE_SCALE_GRAD: each spec's compile as their own variants), and the Chebyshev contraction rate rho(ridge);
- `RecurrenceConfig` (config.py): precisions, chunk size, iterations, ridge, tiles.

forward(config, hooks, q, k, v, g, gk, beta, alpha, h_init, s_init, cu_seqlens, scale, ridge, ridge_offset, num_iter,
        chunk, final)
backward(config, hooks, ...) -> gradients of q, k, v, g, gk, beta, alpha and the initial states.
Shapes follow fla: q, k [B, T, H, K], v [B, T, H, V], g, gk, beta, alpha [B, T, H] (natural-log gates, g <= 0; gk
None: g gates both states);
states (H [N, H, K, K], S [N, H, K, V]) in fp32; `cu_seqlens` packs N sequences into B = 1.
All accumulation is fp32. By default every forward kernel multiplies fp16x3 products (fp32 operands split into
two fp16 halves) for 16-bit inputs and fp32 ones for fp32 inputs (solve_precision says why not one fp16 product),
and the backward fp16x3 ones (config.dot_precision, config.grad_precision). With dot_precision "fp16" the solve,
output and norm kernels multiply scaled fp16 operands, the forward's scans bf16 ones for bf16 inputs (TF32
otherwise), and the chunk states are stored as fp16 tiles over power-of-two scales.

The recurrence, per (sequence, head), t along time (S is the spec's U transposed: [key, value], fla's layout):
    H_t = exp(gk_t) H_(t-1) + kb_t kb_t^T,  S_t = exp(g_t) S_(t-1) + kb_t vb_t^T,  kb = k KEY_SCALE(beta),
    vb = v VALUE_SCALE(beta);  lambda_t = ridge ||H_t||_F + ridge_offset;  x_t = Chebyshev(num_iter steps) of
    (H_t + lambda_t I) x = q_t, mu = lambda_t, L = ||H_t||_F + lambda_t;  qa_t = q_t + alpha_t (x_t - q_t);
    o_t = scale S_t^T qa_t.
Chunked form (chunk C, G = cumulative log gate inside the chunk, D_ts = exp(G_t - G_s) [s <= t]; each state with
its own gate's G and D, written for H below):
    H_t x = exp(G_t) H_0 x + sum_s D_ts (kb_s . x) kb_s      (H_t never materialised)
    ||H_t||^2 = exp(2 G_t) ||H_0||^2 + 2 exp(G_t) sum_s D_ts kb_s^T H_0 kb_s + rowsum(D o (D (Gram o Gram)))
    rho = (L - mu) / (L + mu) depends on the ridge alone (the hooks' rho), so one omega schedule serves all tokens;
    with a ridge offset, rho_t = ||H_t|| / (||H_t|| + 2 lambda_t) per token.
Backward by implicit differentiation: z = CH(H + lambda I, dx), dq += z,
    dH_t = -z_t x_t^T - c_t H_t with c_t = a (x_t . z_t) / ||H_t||, accumulated backwards through the gates.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import triton
import triton.language as tl

from ncd import settings as _settings
from ncd.families.recurrence.carveout import fit_carveout as _fit_carveout
from ncd.families.recurrence.config import RecurrenceConfig
from ncd.launch import fast as _fast
from ncd.tuning import autotune


@dataclass(frozen=True)
class RecurrenceHooks:
    """A spec's pieces of the kernels: per-token scalings of beta (`bt`, fp32 in, fp32 out, broadcast to bt's shape)
    and their derivatives, as @triton.jit device functions, and rho(ridge) for the host."""

    key_scale: Any
    value_scale: Any
    key_scale_grad: Any
    value_scale_grad: Any
    rho: Callable[[float], float]


def solve_precision(config: RecurrenceConfig, dtype: torch.dtype) -> str:
    """The solve's products (and its output epilogue's and the norm's): "fp16x3" for 16-bit inputs (fp32 operands
    split into two scaled fp16 halves, three products: about fp32 accuracy at fp16's tensor-core rate), "ieee" for
    fp32 inputs. config.dot_precision overrides both.
    Why not one fp16 or TF32 product (10-bit mantissas): the solve is unstable under them. The iterate x_t is
    dominated by q's component outside the span of the keys, q_perp / lambda_t, and the output reads only its
    component along them. One rounding of x (relative 2^-11) then moves that component by about 2^-11 / ridge
    relative to |q_perp| / |q_par|: wherever H_t has low effective rank (a sequence's first tokens, fast-forgetting
    gates) the output is far off, while the recurrence itself is not sensitive there (bf16-sized changes of q or k
    move o by <= 3e-2). Measured against the float64 recurrence on the same bf16 inputs (H100, B 1, T 256, D 128,
    bench/log/2026-11-27-issue33-s6.md): g = logsigmoid(N(0, 1)) gave "fp16" 3.2e-2 RMS and a token 102% off,
    "fp16x3" 1.7e-3 RMS and 2.2e-3 at the worst token. "fp16" stays as an option (config dot_precision) for slow
    gates, where its error is 4e-3 RMS with the first tokens up to 10% off. "tf32x3" needs 256 KB of shared memory
    at K = 128, over the H100's 227 KB. "bf16" is the official kernels' operands."""
    if config.dot_precision:
        return config.dot_precision
    return "fp16x3" if dtype in (torch.bfloat16, torch.float16) else "ieee"


def plain_precision(config: RecurrenceConfig, dtype: torch.dtype) -> str:
    """The kernels without operand scaling (scans, norm): TF32 where the solve runs scaled fp16. With "fp16x3" the
    scans split their operands too: a chunk state from bf16-rounded weighted keys, x H_0 with x's large component
    outside the keys' span, put dv and dalpha 4e-2 off at the worst token (TRITON_INTERPRET, fast-forgetting gates)."""
    prec = solve_precision(config, dtype)
    return "tf32" if prec == "fp16" else prec


def scan_precision(config: RecurrenceConfig, dtype: torch.dtype) -> str:
    """The forward's state scans: with the fp16 solve, bf16 products for bf16 inputs (the keys or values exact, the
    weighted keys rounded); else plain_precision (by default fp16x3 for 16-bit inputs, ieee for fp32)."""
    prec = plain_precision(config, dtype)
    return "bf16" if prec == "tf32" and dtype == torch.bfloat16 else prec


def grad_precision(config: RecurrenceConfig, dtype: torch.dtype) -> str:
    """The backward's accumulation kernels (config.grad_precision; None: "fp16x3", or config.dot_precision where
    that names one precision everywhere). Their products feed the gate gradient, a reverse sum over the sequence
    of cancelling terms: at T = 2048 it is 4e-2 from float64 with "tf32" and 4.3e-3 to 4.7e-3 with fp32-accurate
    products (3xTF32 in any subset of these kernels, or TF32 operands rounded to nearest instead of truncated,
    left it at 3.5e-2 to 6e-2). "fp16x3" gets that accuracy from three fp16 products of split operands
    (_fp16_split): fwd+bwd 1.8x-1.9x faster than "tf32x3" (three TF32 products; H100 and H200,
    bench/log/2026-11-20-to-22.md). NCD_GKA_GRAD_PRECISION=tf32 (one TF32 product) trades the gate gradient's
    accuracy for time."""
    dot = config.dot_precision
    return config.grad_precision or ("fp16x3" if dot in (None, "fp16") else dot)


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_EMULATE_BF16_DOT = tl.constexpr(_INTERPRET)
# The per-chunk kernels' autotune key. WORK (chunks x heads, rounded up to a power of two) is in it so that a
# config tuned on a small call is not reused on a large one: tuned on a 300-token call first, the (then separate)
# output kernel kept a config that ran 225 us against 157 at T = 4096 (438 against 316 at 8192; H100,
# bench/log/2026-11-20-to-22.md).
_KEY = ["K", "V", "BT", "PREC", "HAS_BETA", "HAS_ALPHA", "WORK"]


def _configs(maxnreg=None):
    """The per-chunk kernels' autotune set (one config on the interpreter); maxnreg caps registers per thread."""
    if _INTERPRET:
        return [triton.Config({}, num_warps=4)]
    return [triton.Config({}, num_warps=w, num_stages=s, maxnreg=maxnreg) for w in (4, 8) for s in (1, 2)]


@triton.jit
def _dot(a, b, PREC: tl.constexpr, acc=None):
    """acc + a @ b, fp32-accumulated: TF32, 3xTF32 or IEEE fp32 operands, fp32 operands split into fp16 halves
    ("fp16x3", _fp16_split), or operands rounded to bf16 (the official kernels' choice) or to fp16 (callers scale
    them into range first: _fp16_tile, _row_scale)."""
    if PREC == "bf16":
        return _bf16_dot(a, b, acc)
    elif PREC == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    elif PREC == "fp16x3":
        a_hi, a_lo, sa = _fp16_split(a)
        b_hi, b_lo, sb = _fp16_split(b)
        # an operand still in an input's 16-bit dtype (_load_rows_raw) has a zero low half: its products are
        # left out (2 products, or 1 when both are, instead of 3)
        if _is16(a):
            if _is16(b):
                out = tl.dot(a_hi, b_hi) * (sa * sb)
            else:
                out = tl.dot(a_hi, b_hi, tl.dot(a_hi, b_lo) * (1.0 / 2048.0)) * (sa * sb)
        elif _is16(b):
            out = tl.dot(a_hi, b_hi, tl.dot(a_lo, b_hi) * (1.0 / 2048.0)) * (sa * sb)
        else:
            out = _split_product(a_hi, a_lo, b_hi, b_lo) * (sa * sb)
        if acc is not None:
            out += acc
        return out
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PREC)


@triton.jit
def _is16(a):
    """a holds bf16 or fp16 values: scaled by a power of two into [-1, 1], they are fp16 values (bf16's 8
    significant bits fit fp16's 11; only entries below 2^-17 of the tile's largest round, by at most 2^-25 of
    it, finer than the split's 2^-23), so _fp16_split's low half is zero."""
    return a.dtype == tl.bfloat16 or a.dtype == tl.float16


@triton.jit
def _split_product(a_hi, a_lo, b_hi, b_lo, acc=None):
    """acc + (a_hi + a_lo / 2048) @ (b_hi + b_lo / 2048), the lo x lo product dropped (_fp16_split's halves)."""
    cross = tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo)) * (1.0 / 2048.0)
    if acc is not None:
        cross += acc
    return tl.dot(a_hi, b_hi, cross)


@triton.jit
def _halves(u):
    """u = hi + lo / 2048 with hi, lo fp16, for |u| well inside fp16's range (the caller scales)."""
    hi = u.to(tl.float16)
    return hi, ((u - hi.to(tl.float32)) * 2048.0).to(tl.float16)


@triton.jit
def _fp16_split(a):
    """a = s (hi + lo / 2048) with hi, lo fp16 and s a power of two >= max|a| (1 for a zero tile): 22 of fp32's 24
    significant bits in two fp16 operands, so three fp16 products (lo x lo dropped) give about fp32 accuracy at
    twice TF32's rate and in half its operand registers ("fp16x3"). One scale per tile: scales per row and column
    ran fwd+bwd 19-21% slower (H100, bench/log/2026-11-20-to-22.md) with the same GPU check errors."""
    a = a.to(tl.float32)
    s = _pow2_at_least(tl.max(tl.max(tl.abs(a), 1), 0))
    u = a * (1.0 / s)
    hi = u.to(tl.float16)
    return hi, ((u - hi.to(tl.float32)) * 2048.0).to(tl.float16), s


@triton.jit
def _bf16_dot(a, b, acc=None):
    """acc + a @ b over operands rounded to bf16 (to nearest). Triton 3.9's interpreter computes bf16 products
    wrongly and truncates fp32 to bf16, so there the operands are rounded by hand and multiplied in fp32."""
    if _EMULATE_BF16_DOT:
        return tl.dot(_bf16_values(a), _bf16_values(b), acc, input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)


@triton.jit
def _bf16_values(a):
    """a rounded to the nearest bf16 values (ties to even), as fp32."""
    if a.dtype == tl.bfloat16:
        return a.to(tl.float32)
    bits = a.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp16_tile(a):
    """a / max|a| rounded to fp16, and max|a| (1 for a zero tile): an fp16 operand that cannot overflow."""
    s = tl.max(tl.max(tl.abs(a), 1), 0)
    s = tl.where(s > 0, s, 1.0)
    return (a * (1.0 / s)).to(tl.float16), s


@triton.jit
def _row_scale(a):
    """max |a_t| per row (1 for a zero row)."""
    m = tl.max(tl.abs(a), 1)
    return tl.where(m > 0, m, 1.0)


@triton.jit
def _pow2_at_least(a):
    """The least power of two >= a > 0 (1 for a = 0), by rounding the exponent up: exact, no log."""
    bits = a.to(tl.uint32, bitcast=True)
    up = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(a > 0, up, 1.0)


@triton.jit
def _state_operand(ptr, scale_ptr, part, ri, cj, NL, NR, col0, PREC: tl.constexpr, FP16_STATES: tl.constexpr,
                   SA: tl.constexpr, SB: tl.constexpr):
    """Block [ri, cj] (cj starting at col0) of chunk state `part` ([NL, NR] at ptr) as the products take it, and
    its scale. FP16_STATES (the scan stored [SA, SB] fp16 tiles over power-of-two scales): fp16 over the largest
    tile scale, each tile multiplied by its own scale's ratio to that (powers of two: exact). Else PREC "fp16":
    the block over its largest entry (_fp16_tile); otherwise the fp32 block and 1."""
    mask = (ri[:, None] < NL) & (cj[None, :] < NR)
    block = tl.load(ptr + ri[:, None] * NR + cj[None, :], mask=mask, other=0.0)
    if FP16_STATES:
        n_b = tl.cdiv(NR, SB)
        NI: tl.constexpr = (ri.shape[0] + SA - 1) // SA
        NJ: tl.constexpr = (cj.shape[0] + SB - 1) // SB
        scales = scale_ptr + part * tl.cdiv(NL, SA) * n_b + col0 // SB
        top = 0.0
        for a in tl.static_range(NI):
            for b in tl.static_range(NJ):
                inside = (a * SA < NL) & (col0 + b * SB < NR)
                top = tl.maximum(top, tl.load(scales + a * n_b + b, mask=inside, other=0.0))
        top = tl.where(top > 0, top, 1.0)
        ratio = tl.zeros(block.shape, tl.float16)
        for a in tl.static_range(NI):
            cols = tl.zeros(cj.shape, tl.float16)
            for b in tl.static_range(NJ):
                inside = (a * SA < NL) & (col0 + b * SB < NR)
                s_ab = tl.load(scales + a * n_b + b, mask=inside, other=0.0)
                cols = tl.where((cj - col0) // SB == b, (s_ab / top).to(tl.float16), cols)
            ratio = tl.where((ri // SA == a)[:, None], cols[None, :], ratio)
        return block * ratio, top
    elif PREC == "fp16":
        return _fp16_tile(block)
    else:
        return block, 1.0


@triton.jit
def _load_rows(ptr, rows, valid, stride, col0, cols, ncols):
    """[BT, BC] fp32 block of a [tokens, H, ncols] tensor (ptr already at the head), zero outside."""
    return _load_rows_raw(ptr, rows, valid, stride, col0, cols, ncols).to(tl.float32)


@triton.jit
def _load_rows_raw(ptr, rows, valid, stride, col0, cols, ncols):
    """_load_rows in the tensor's dtype: an input's 16-bit values enter fp16x3 products unsplit (_dot)."""
    c = col0 + cols
    mask = valid[:, None] & (c[None, :] < ncols)
    return tl.load(ptr + rows[:, None] * stride + c[None, :], mask=mask, other=0.0)


@triton.jit
def _load_cols(ptr, rows, valid, stride, cols, ncols):
    """[BC, BT] block of a [tokens, H, ncols] tensor, transposed (ptr already at the head), zero outside, in the
    tensor's dtype: the scans' left operands, loaded this way straight into the product so that the compiler
    pipelines the load across chunks."""
    mask = valid[None, :] & (cols[:, None] < ncols)
    return tl.load(ptr + rows[None, :] * stride + cols[:, None], mask=mask, other=0.0)


@triton.jit
def _chunk_gates(g_ptr, rows, valid, H):
    """Cumulative log gates inside the chunk (padding rows add 0), and the chunk's total."""
    g = tl.load(g_ptr + rows * H, mask=valid, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, 0)
    return gc, tl.sum(g, 0)


@triton.jit
def _decay_mask(gc, BT: tl.constexpr):
    """D[t, s] = exp(G_t - G_s) for s <= t, else 0 (the exponent is never positive where it is kept)."""
    t = tl.arange(0, BT)
    keep = t[None, :] <= t[:, None]
    return tl.where(keep, tl.exp(tl.where(keep, gc[:, None] - gc[None, :], 0.0)), 0.0)


@triton.jit
def _scales(beta_ptr, rows, valid, H, HAS_BETA: tl.constexpr, KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """The key and value scalings of the chunk's tokens (the spec's hooks, KEY_SCALE and VALUE_SCALE, of beta; of
    1 without a beta input: the spec's constant scalings, or the unit ones when the spec's beta is not passed)."""
    if HAS_BETA:
        bt = tl.load(beta_ptr + rows * H, mask=valid, other=0.0).to(tl.float32)
        return KEY_SCALE(bt), VALUE_SCALE(bt), bt
    else:
        one = tl.full(rows.shape, 1.0, tl.float32)
        return KEY_SCALE(one), VALUE_SCALE(one), one


@triton.jit
def _chunk_prologue(c, h, chunk_start_ptr, chunk_end_ptr, g_ptr, beta_ptr, H, BT: tl.constexpr,
                    HAS_BETA: tl.constexpr, KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """What every per-chunk kernel starts from, for chunk c of head h: the token rows and which are real, the
    cumulative log gates G and their total, exp(G_t), the decay mask, the key and value scalings and beta (what a
    kernel leaves unused is not computed)."""
    t0, t1 = tl.load(chunk_start_ptr + c), tl.load(chunk_end_ptr + c)
    rows = t0 + tl.arange(0, BT)
    valid = rows < t1
    gc, gtot = _chunk_gates(g_ptr + h, rows, valid, H)
    ks, vs, bt = _scales(beta_ptr + h, rows, valid, H, HAS_BETA, KEY_SCALE, VALUE_SCALE)
    return rows, valid, gc, gtot, tl.exp(gc), _decay_mask(gc, BT), ks, vs, bt


@triton.jit
def _matvec(x, kb, h0, eg, dm, PREC: tl.constexpr):
    """Rows of H_t x_t for every token t of the chunk, from the chunk's initial state and its keys."""
    p = _dot(x, tl.trans(kb), PREC) * dm
    inter = _dot(x, h0, PREC) * eg[:, None]  # H_0 is symmetric: x H_0 = (H_0 x)^T
    return _dot(p, kb, PREC, inter)  # one accumulator for both terms: no layout change between them


@triton.jit
def _matvec_scales(rhs, lam, eg, dm, h0_s, kb_s):
    """The scales of the 16-bit matvec of x * row against kb / kb_s (twice) and H_0 / h0_s: the factors h0_s and
    kb_s^2 go into eg and dm over the larger of them, so both terms share one accumulator and neither leaves fp16's
    range; the scores are then (x * row) . (kb / kb_s), at most 2 K. Returns eg, dm, row and the rows' unscale."""
    common = tl.maximum(h0_s, kb_s * kb_s)
    eg = eg * (h0_s / common)
    dm = dm * (kb_s * kb_s / common)
    row = lam / _row_scale(rhs)
    row = tl.where(row > 0, row, 1.0)
    return eg, dm, row, common / row


@triton.jit
def _chebyshev(rhs, kb, h0, h0_s, eg, dm, lam, step0, rho2, n_iter, PREC: tl.constexpr):
    """n_iter Chebyshev steps on (H_t + lam_t I) x = rhs_t for all tokens at once (papers/gated-kalmanet.txt,
    Algorithm 1 with omega_0 = 2); rows are independent, rho2 [BT] is each row's squared rate. Written as
    x_(i+1) = x_i + d_i, d_i = (omega - 1) d_(i-1) - step0 omega (H_t x_i + lam_t x_i - rhs_t), d_(-1) = x_0: the
    three-term recurrence's iterates, holding the step d instead of x_(i-1).
    PREC "fp16": the products see rows of x scaled by row_t = lam_t / max|rhs_t|. Every iterate obeys
    |x_t| <= 2 |rhs_t| / lam_t (a Chebyshev polynomial on [mu, L] with mu = lam_t), so their entries stay below
    2 sqrt(K). d is held as fp16 at the same scale: its rounding error shrinks with it as the iteration converges,
    and the solve, which spills at 255 registers, keeps half a tile fewer live (norm + solve 3-6% faster on an
    H200, bench/log/2026-11-20-to-22.md). With PREC "fp16", h0 comes as the fp16 operand H_0 / h0_s (_state_operand).
    PREC "fp16x3": the same scales, every operand as two fp16 halves (three products each); splitting them once
    here instead of per product (_dot) took the forward from 11.1 to 8.8 ms (T 8192, r 30; fp16 2.5; H100,
    bench/log/2026-11-27-issue33-s6.md)."""
    if PREC == "fp16":
        kb, kb_s = _fp16_tile(kb)
        eg, dm, row, unscale = _matvec_scales(rhs, lam, eg, dm, h0_s, kb_s)
        inv_row = 1.0 / row
    elif PREC == "fp16x3":
        # the operands split into fp16 halves once (keys, H_0) or once per step (x, the scores), at the fp16 path's
        # scales: x * row has entries below 2 sqrt(K), the scores below 2 K, so no reduction per step
        kb_hi, kb_lo, kb_s = _fp16_split(kb)
        kbt_hi, kbt_lo = tl.trans(kb_hi), tl.trans(kb_lo)
        h0_hi, h0_lo, h0_s = _fp16_split(h0)
        eg, dm, row, unscale = _matvec_scales(rhs, lam, eg, dm, h0_s, kb_s)
    x = step0[:, None] * rhs
    if PREC == "fp16":  # noqa: SIM108
        d = (x * row[:, None]).to(tl.float16)
    else:
        d = x
    omega = rho2 * 0.0 + 2.0
    for _ in range(n_iter):
        omega = 4.0 / (4.0 - rho2 * omega)  # [BT]
        if PREC == "fp16":
            hx = _matvec(x * row[:, None], kb, h0, eg, dm, PREC) * unscale[:, None]
            d_prev = d.to(tl.float32) * inv_row[:, None]
        elif PREC == "fp16x3":
            x_hi, x_lo = _halves(x * row[:, None])
            p_hi, p_lo = _halves(_split_product(x_hi, x_lo, kbt_hi, kbt_lo) * dm)
            inter = _split_product(x_hi, x_lo, h0_hi, h0_lo) * eg[:, None]
            hx = _split_product(p_hi, p_lo, kb_hi, kb_lo, inter) * unscale[:, None]
            d_prev = d
        else:
            hx = _matvec(x, kb, h0, eg, dm, PREC)
            d_prev = d
        step = (omega - 1.0)[:, None] * d_prev - (step0 * omega)[:, None] * (hx + lam[:, None] * x - rhs)
        x = x + step
        if PREC == "fp16":  # noqa: SIM108
            d = (step * row[:, None]).to(tl.float16)
        else:
            d = step
    return x


@triton.jit
def _sequence(seq_first_ptr, chunk_start_ptr, chunk_end_ptr, n):
    """Chunks [first, last) and tokens [bos, eos) of sequence n. The scans derive each chunk's rows from these
    instead of loading them per chunk: a load in the loop's address chain stops its loads being pipelined."""
    first, last = tl.load(seq_first_ptr + n), tl.load(seq_first_ptr + n + 1)
    bos = tl.load(chunk_start_ptr + first, mask=last > first, other=0)
    eos = tl.load(chunk_end_ptr + last - 1, mask=last > first, other=0)
    return first, last, bos, eos


@triton.jit
def _scan_tile(left_ptr, right_ptr, beta_ptr, g_ptr, init_ptr, states_ptr, final_ptr, khk_ptr, hsq_ptr,
               seq_first_ptr, scale_ptr, chunk_start_ptr, chunk_end_ptr, i_tile, n, h, H, NL, NR,
               HAS_BETA: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
               RIGHT_IS_VALUE: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
               PREC: tl.constexpr, NORM_PARTS: tl.constexpr, FP16_STATES: tl.constexpr,
               KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """Chunk-start states of `state_t = exp(g_t) state_(t-1) + l_t r_t^T` for one [BA, BB] tile, sequential over
    the chunks of one sequence (the only sequential part of the forward). The left operand is loaded transposed,
    which lets the compiler pipeline its load across chunks, as this latency-bound loop needs; every per-token weight
    goes on it, in registers, so that the right operand goes from its pipelined load straight into the product
    (weighted in registers, it went back to shared memory behind a fence every chunk: H200, T = 8192, 274-276 ->
    230-233 us). PREC "bf16" (bf16 inputs): the right operand exactly, the weighted left one rounded. H200,
    T = 8192: 492 -> 256 us with bf16 products (TF32: 483 -> 366 in a copy of this loop; bench/log/2026-11-20-to-22.md).
    NORM_PARTS (the forward's H scan): also this tile's share of what ||H_t|| needs from each chunk's initial
    state, kb_t . H_0 kb_t for every token and ||H_0||^2, while the state is in registers: the norm kernel then
    never reads H_0. The products are the scan's: H_0 rounded to bf16 moves ||H_t|| by about 1e-5 (relative) at
    the benchmark's statistics, since ||H_t||^2 is mostly exp(2 G_t) ||H_0||^2, summed exactly.
    FP16_STATES (the forward with scaled-fp16 products): the states are stored as fp16, each tile divided by a
    power of two >= its Frobenius norm (stored at scale_ptr): half the bytes for the solve to read (_state_operand reads
    them back)."""
    n_b = tl.cdiv(NR, BB)
    n_tiles = tl.cdiv(NL, BA) * n_b
    a0, b0 = (i_tile // n_b) * BA, (i_tile % n_b) * BB
    ra, rb = a0 + tl.arange(0, BA), b0 + tl.arange(0, BB)
    tile_mask = (ra[:, None] < NL) & (rb[None, :] < NR)
    tile = ra[:, None] * NR + rb[None, :]
    if HAS_INIT:
        state = tl.load(init_ptr + (n * H + h) * NL * NR + tile, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BA, BB), tl.float32)
    first, last, bos, eos = _sequence(seq_first_ptr, chunk_start_ptr, chunk_end_ptr, n)
    for c in range(first, last):
        part = c * H + h
        if FP16_STATES or NORM_PARTS:
            sq = tl.sum(tl.sum(state * state, 1), 0)
        if FP16_STATES:
            s = _pow2_at_least(tl.sqrt(sq))
            tl.store(scale_ptr + part * n_tiles + i_tile, s)
            tl.store(states_ptr + part * NL * NR + tile, (state * (1.0 / s)).to(tl.float16), mask=tile_mask)
        else:
            tl.store(states_ptr + part * NL * NR + tile, state, mask=tile_mask)
        t0 = bos + (c - first) * BT
        rows = t0 + tl.arange(0, BT)
        valid = rows < tl.minimum(t0 + BT, eos)
        gc, gtot = _chunk_gates(g_ptr + h, rows, valid, H)
        ks, vs, _ = _scales(beta_ptr + h, rows, valid, H, HAS_BETA, KEY_SCALE, VALUE_SCALE)
        lt = _load_cols(left_ptr + h * NL, rows, valid, H * NL, ra, NL)
        rgt = _load_rows(right_ptr + h * NR, rows, valid, H * NR, b0, tl.arange(0, BB), NR)
        lt = lt if PREC == "bf16" else lt.to(tl.float32)
        if NORM_PARTS:
            khk = tl.sum(_dot(tl.trans(lt), state, PREC) * rgt, 1) * (ks * ks)
            tl.store(khk_ptr + (part * n_tiles + i_tile) * BT + tl.arange(0, BT), khk)
            tl.store(hsq_ptr + part * n_tiles + i_tile, sq)
        weight = ks * (vs if RIGHT_IS_VALUE else ks) * tl.exp(gtot - gc)
        update = _dot(lt * weight[None, :], rgt, PREC)
        state = state * tl.exp(gtot) + update
    if STORE_FINAL:
        tl.store(final_ptr + (n * H + h) * NL * NR + tile, state, mask=tile_mask)


@triton.jit
def _state_scan_fwd(k_ptr, v_ptr, beta_ptr, g_ptr, gk_ptr, h_init_ptr, s_init_ptr, hstates_ptr, sstates_ptr,
                    h_final_ptr, s_final_ptr, khk_ptr, hsq_ptr, hscale_ptr, sscale_ptr, seq_first_ptr, chunk_start_ptr,
                    chunk_end_ptr, H, K, V, HAS_BETA: tl.constexpr, HAS_INIT: tl.constexpr,
                    STORE_FINAL: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr,
                    PREC: tl.constexpr, NORM_PARTS: tl.constexpr, FP16_STATES: tl.constexpr,
                    KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """Both scans in one launch (program_id(2): 0 for H = sum k k^T under gk, 1 for S = sum k v^T under g), so the
    two share the machine instead of running one after the other."""
    i_tile, i_nh = tl.program_id(0), tl.program_id(1)
    n, h = i_nh // H, i_nh % H
    if tl.program_id(2) == 0:
        if i_tile < tl.cdiv(K, BA) * tl.cdiv(K, BB):
            _scan_tile(k_ptr, k_ptr, beta_ptr, gk_ptr, h_init_ptr, hstates_ptr, h_final_ptr, khk_ptr, hsq_ptr,
                       seq_first_ptr, hscale_ptr, chunk_start_ptr, chunk_end_ptr, i_tile, n, h, H, K, K, HAS_BETA,
                       HAS_INIT, STORE_FINAL, False, BT, BA, BB, PREC, NORM_PARTS, FP16_STATES, KEY_SCALE,
                       VALUE_SCALE)
    else:
        if i_tile < tl.cdiv(K, BA) * tl.cdiv(V, BB):
            _scan_tile(k_ptr, v_ptr, beta_ptr, g_ptr, s_init_ptr, sstates_ptr, s_final_ptr, khk_ptr, hsq_ptr,
                       seq_first_ptr, sscale_ptr, chunk_start_ptr, chunk_end_ptr, i_tile, n, h, H, K, V, HAS_BETA,
                       HAS_INIT, STORE_FINAL, True, BT, BA, BB, PREC, False, FP16_STATES, KEY_SCALE, VALUE_SCALE)


@triton.jit
def _gram_term(kb, dm, PREC: tl.constexpr):
    """rowsum(D o (D (Gram o Gram))), Gram = kb kb^T: the intra-chunk term of ||H_t||^2, most of it late in a
    chunk. PREC "fp16": from kb / max|kb| and (Gram o Gram) / its max, rounded to fp16; at the benchmark's
    statistics ||H_t|| is then 1.8e-4 (relative) from float64, against 1.1e-3 from TF32 products, which truncate
    to 10 bits (bf16 inputs: TF32)."""
    if PREC == "fp16":
        k16, k_s = _fp16_tile(kb)
        g2 = tl.dot(k16, tl.trans(k16))
        g2_16, g2_s = _fp16_tile(g2 * g2)
        return tl.sum(tl.dot(dm.to(tl.float16), g2_16) * dm, 1) * (g2_s * (k_s * k_s) * (k_s * k_s))
    else:
        prec: tl.constexpr = "tf32" if PREC == "bf16" else PREC
        gram = _dot(kb, tl.trans(kb), prec)
        return tl.sum(_dot(dm, gram * gram, prec) * dm, 1)


@triton.jit
def _h0_terms(khk_ptr, hsq_ptr, part, BT: tl.constexpr, NT: tl.constexpr):
    """The initial state's terms of ||H_t||^2 for the tokens of chunk state `part`, kb_t . H_0 kb_t and ||H_0||^2,
    summed from the H scan's NT parts (_scan_tile's NORM_PARTS): H_0 is not read."""
    khk = tl.zeros((BT,), tl.float32)
    h0_sq = 0.0
    for i in tl.static_range(NT):  # unrolled: every part's load is issued up front
        khk += tl.load(khk_ptr + (part * NT + i) * BT + tl.arange(0, BT))
        h0_sq += tl.load(hsq_ptr + part * NT + i)
    return khk, h0_sq


@triton.jit
def _norm_rows(kb, eg, dm, khk, h0_sq, PREC: tl.constexpr):
    """||H_t||_F for every token of a chunk by the Gram-matrix formula (papers/gated-kalmanet.txt, section 4.2.1),
    the initial state's terms from _h0_terms."""
    norm2 = eg * eg * h0_sq + 2.0 * eg * tl.sum(dm * khk[None, :], 1) + _gram_term(kb, dm, PREC)
    return tl.sqrt(tl.maximum(norm2, 0.0))


# at most 168 registers: three programs per SM instead of two, for this short latency-bound kernel (H100, T = 8192:
# 82 us capped, with 300 bytes of spills, against 96; 8 warps 103; bench/log/2026-11-20-to-22.md)
@autotune(name="recurrence", configs=_configs(maxnreg=168), key=_KEY)
@triton.jit
def _norm_fwd(k_ptr, g_ptr, beta_ptr, khk_ptr, hsq_ptr, norm_ptr, chunk_start_ptr, chunk_end_ptr, H, K, V, WORK,
              HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
              NT: tl.constexpr, PREC: tl.constexpr,
              KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """||H_t||_F for every token of one chunk of one head (_norm_rows). The H scan's parts are loaded first, before
    the prologue's dependent loads (H100, T = 8192: 76 us against 81 loaded last)."""
    c, h = tl.program_id(0), tl.program_id(1)
    khk, h0_sq = _h0_terms(khk_ptr, hsq_ptr, c * H + h, BT, NT)
    rows, valid, _gc, _, eg, dm, ks, _, _ = _chunk_prologue(
        c, h, chunk_start_ptr, chunk_end_ptr, g_ptr, beta_ptr, H, BT, HAS_BETA, KEY_SCALE, VALUE_SCALE)
    kb = _load_rows(k_ptr + h * K, rows, valid, H * K, 0, tl.arange(0, BK), K) * ks[:, None]
    tl.store(norm_ptr + rows * H + h, _norm_rows(kb, eg, dm, khk, h0_sq, PREC), mask=valid)


# best warps depend on the steps
@autotune(name="recurrence", configs=_configs(), key=[*_KEY, "OUTPUT", "STORE_OUT", "n_iter"])
@triton.jit
def _solve(rhs_ptr, k_ptr, g_ptr, gs_ptr, beta_ptr, alpha_ptr, hstates_ptr, hscale_ptr, norm_ptr, out_ptr, v_ptr,
           sstates_ptr, sscale_ptr, o_ptr, scale, chunk_start_ptr, chunk_end_ptr, ridge, ridge_offset, rho2, n_iter, H,
           K, V, WORK, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr, SPLIT_GATES: tl.constexpr,
           TOKEN_RHO: tl.constexpr, OUTPUT: tl.constexpr, STORE_OUT: tl.constexpr,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, PREC: tl.constexpr,
           FP16_STATES: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr,
           KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """out_t = CH(H_t + lambda_t I, rhs_t) for every token of one chunk of one head (the forward's x = CH(., q)
    and the backward's z = CH(., dx)), H_t never formed: only the chunk's initial state and keys are held.
    OUTPUT (the forward): also the output rows y_t = scale S_t qa_t (_qa_operand, _chunk_output), while q = rhs
    and x are in registers. In a kernel of its own, which read qa back, the output took 1-2% more forward time
    (H100, T = 8192, bench/log/2026-11-20-to-22.md).
    STORE_OUT False (a forward that no gradient will follow): x is not stored.
    g_ptr: H's log gates; gs_ptr: S's, read for the output when SPLIT_GATES (the states have gates of their own).
    lambda_t = ridge ||H_t|| + ridge_offset; TOKEN_RHO (an offset): the rate (L - mu) / (L + mu) per token, else
    the one rate rho2 of the ridge alone.
  """
    c, h = tl.program_id(0), tl.program_id(1)
    ck = tl.arange(0, BK)
    rows, valid, _gc, _, eg, dm, ks, vs, _ = _chunk_prologue(
        c, h, chunk_start_ptr, chunk_end_ptr, g_ptr, beta_ptr, H, BT, HAS_BETA, KEY_SCALE, VALUE_SCALE)
    kb = _load_rows(k_ptr + h * K, rows, valid, H * K, 0, ck, K) * ks[:, None]
    h0, h0_s = _state_operand(hstates_ptr + (c * H + h) * K * K, hscale_ptr, c * H + h, ck, ck, K, K, 0, PREC,
                              FP16_STATES, SA, SB)
    norm = tl.load(norm_ptr + rows * H + h, mask=valid, other=1.0)
    if TOKEN_RHO:  # mu = lam > 0 on every row
        lam = ridge * norm + ridge_offset
        step0 = 2.0 / (norm + 2.0 * lam)  # 2 / (L + mu)
        rate = norm * (0.5 * step0)
        rates = rate * rate
    else:
        safe = tl.where(norm > 0, norm, 1.0)
        lam = ridge * norm
        step0 = 2.0 / (safe * (1.0 + 2.0 * ridge))  # 2 / (L + mu)
        rates = tl.zeros_like(norm) + rho2
    rhs = _load_rows(rhs_ptr + h * K, rows, valid, H * K, 0, ck, K)
    x = _chebyshev(rhs, kb, h0, h0_s, eg, dm, lam, step0, rates, n_iter, PREC)
    if STORE_OUT:
        tl.store(out_ptr + rows[:, None] * (H * K) + h * K + ck[None, :], x, mask=valid[:, None] & (ck[None, :] < K))
    if OUTPUT:
        if SPLIT_GATES:
            gs, _ = _chunk_gates(gs_ptr + h, rows, valid, H)
            eg = tl.exp(gs)
            dm = _decay_mask(gs, BT)
        qa, qa_s = _qa_operand(rhs, x, alpha_ptr + h, rows, valid, H, HAS_ALPHA, PREC)
        _chunk_output(qa, qa_s * scale, rows, valid, eg, dm, ks, vs, c, h, k_ptr, v_ptr, sstates_ptr, sscale_ptr,
                      o_ptr, H, K, V, BK, BV, NV, PREC, FP16_STATES, SA, SB)


@triton.jit
def _qa_operand(q, x, alpha_ptr, rows, valid, H, HAS_ALPHA: tl.constexpr, PREC: tl.constexpr):
    """The alpha-connection qa_t = q_t + alpha_t (x_t - q_t) as the output's products take it, and its row scale:
    with PREC "fp16" qa_t / max|qa_t| and max|qa_t|, else qa_t and 1."""
    if HAS_ALPHA:
        al = tl.load(alpha_ptr + rows * H, mask=valid, other=0.0).to(tl.float32)
        qa = q + al[:, None] * (x - q)
    else:
        qa = x
    qa_s = tl.full((qa.shape[0],), 1.0, tl.float32)
    if PREC == "fp16":
        qa_s = _row_scale(qa)
        qa = qa * (1.0 / qa_s)[:, None]
    return qa, qa_s


@triton.jit
def _chunk_output(qa, row_scale, rows, valid, eg, dm, ks, vs, c, h, k_ptr, v_ptr, sstates_ptr, sscale_ptr, o_ptr, H,
                  K, V, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr, PREC: tl.constexpr,
                  FP16_STATES: tl.constexpr, SA: tl.constexpr, SB: tl.constexpr):
    """Stores the output rows y_t = row_scale_t S_t qa_t of one chunk of one head (qa rows as the products take
    them, the rest of each row's factor in row_scale), S_t from the chunk's initial state. The keys are read and
    qa kb^T formed once; then the value columns in NV blocks of BV (a smaller footprint than one block of all)."""
    ck = tl.arange(0, BK)
    # read again rather than passed in by the solve: held across the Chebyshev loop, the fp32 keys would add 64
    # registers to a loop whose time follows its register count (bench/log/2026-11-20-to-22.md)
    kb = _load_rows(k_ptr + h * K, rows, valid, H * K, 0, ck, K) * ks[:, None]
    kb_s = 1.0
    if PREC == "fp16":
        kb, kb_s = _fp16_tile(kb)
    p = _dot(qa, tl.trans(kb), PREC) * dm
    if PREC == "fp16":
        p = p.to(tl.float16)
        qa = qa.to(tl.float16)
    for j in tl.static_range(NV):
        cv = j * BV + tl.arange(0, BV)
        vb = _load_rows(v_ptr + h * V, rows, valid, H * V, j * BV, tl.arange(0, BV), V) * vs[:, None]
        s0, s0_s = _state_operand(sstates_ptr + (c * H + h) * K * V, sscale_ptr, c * H + h, ck, cv, K, V,
                                  j * BV, PREC, FP16_STATES, SA, SB)
        eg_j = eg
        sc = row_scale
        if PREC == "fp16":
            vb, vb_s = _fp16_tile(vb)
            eg_j = eg * (s0_s / (kb_s * vb_s))
            sc = row_scale * (kb_s * vb_s)
        o = sc[:, None] * _dot(p, vb, PREC, _dot(qa, s0, PREC) * eg_j[:, None])
        tl.store(o_ptr + rows[:, None] * (H * V) + h * V + cv[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=valid[:, None] & (cv[None, :] < V))


@autotune(name="recurrence", configs=_configs(), key=_KEY)
@triton.jit
def _solve_bwd_rhs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alpha_ptr, sstates_ptr, x_ptr, do_ptr, dx_ptr, dqd_ptr,
                   dalpha_ptr, r_ptr, chunk_start_ptr, chunk_end_ptr, scale, H, K, V, WORK,
                   HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr,
                   KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """Backward, part 1a (per chunk): dqa = scale S_t do_t, the alpha-connection's gradients (dalpha, the direct
    share of dq, dx = alpha dqa: the right-hand side of the implicit solve) and the gate term qa . dqa.
  """
    c, h = tl.program_id(0), tl.program_id(1)
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    rows, valid, _gc, _, eg, dm, ks, vs, _ = _chunk_prologue(
        c, h, chunk_start_ptr, chunk_end_ptr, g_ptr, beta_ptr, H, BT, HAS_BETA, KEY_SCALE, VALUE_SCALE)
    # keys, values and dO enter the products raw (fewer fp16x3 products, _dot), their scales on the other side
    kr = _load_rows_raw(k_ptr + h * K, rows, valid, H * K, 0, ck, K)
    vr = _load_rows_raw(v_ptr + h * V, rows, valid, H * V, 0, cv, V)
    do = _load_rows_raw(do_ptr + h * V, rows, valid, H * V, 0, cv, V)
    smask = (ck[:, None] < K) & (cv[None, :] < V)
    s0 = tl.load(sstates_ptr + (c * H + h) * K * V + ck[:, None] * V + cv[None, :], mask=smask, other=0.0)
    p = _dot(do, tl.trans(vr), PREC) * (dm * (vs * ks)[None, :])  # (do vb^T)_ts ks_s
    dqa = scale * _dot(p, kr, PREC, _dot(do, tl.trans(s0), PREC) * eg[:, None])
    x = _load_rows(x_ptr + h * K, rows, valid, H * K, 0, ck, K)
    kmask = valid[:, None] & (ck[None, :] < K)
    if HAS_ALPHA:
        q = _load_rows(q_ptr + h * K, rows, valid, H * K, 0, ck, K)
        al = tl.load(alpha_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
        tl.store(dalpha_ptr + rows * H + h, tl.sum(dqa * (x - q), 1), mask=valid)
        qa = q + al[:, None] * (x - q)
        tl.store(dqd_ptr + rows[:, None] * (H * K) + h * K + ck[None, :], (1.0 - al)[:, None] * dqa, mask=kmask)
        dx = al[:, None] * dqa
    else:
        qa = x
        dx = dqa
    tl.store(dx_ptr + rows[:, None] * (H * K) + h * K + ck[None, :], dx, mask=kmask)
    tl.store(r_ptr + rows * H + h, tl.sum(qa * dqa, 1), mask=valid)


@autotune(name="recurrence", configs=_configs(), key=_KEY)
@triton.jit
def _solve_bwd_terms(k_ptr, g_ptr, beta_ptr, hstates_ptr, x_ptr, norm_ptr, z_ptr, dqd_ptr, dq_ptr, c_ptr, rh_ptr,
                     chunk_start_ptr, chunk_end_ptr, ridge, H, K, V, WORK, HAS_BETA: tl.constexpr,
                     HAS_ALPHA: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                     KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """Backward, part 1c (per chunk), after z = CH(H_t + lambda_t I, dx_t): dq, c_t = a (x_t . z_t) / ||H_t||
    and H's gate terms -z_t . H_t x_t - c_t ||H_t||^2 (stored as r_H; g_ptr: H's log gates)."""
    c, h = tl.program_id(0), tl.program_id(1)
    ck = tl.arange(0, BK)
    rows, valid, _gc, _, eg, dm, ks, _, _ = _chunk_prologue(
        c, h, chunk_start_ptr, chunk_end_ptr, g_ptr, beta_ptr, H, BT, HAS_BETA, KEY_SCALE, VALUE_SCALE)
    kr = _load_rows_raw(k_ptr + h * K, rows, valid, H * K, 0, ck, K)
    hmask = (ck[:, None] < K) & (ck[None, :] < K)
    h0 = tl.load(hstates_ptr + (c * H + h) * K * K + ck[:, None] * K + ck[None, :], mask=hmask, other=0.0)
    x = _load_rows(x_ptr + h * K, rows, valid, H * K, 0, ck, K)
    z = _load_rows(z_ptr + h * K, rows, valid, H * K, 0, ck, K)
    norm = tl.load(norm_ptr + rows * H + h, mask=valid, other=1.0)
    safe = tl.where(norm > 0, norm, 1.0)
    # kb = ks k: the raw keys (fewer fp16x3 products, _dot) and both their scales in the mask
    hx = _matvec(x, kr, h0, eg, dm * (ks * ks)[None, :], PREC)
    cz = ridge * tl.sum(x * z, 1) / safe
    gate_terms = -tl.sum(z * hx, 1) - cz * norm * norm
    if HAS_ALPHA:
        z += _load_rows(dqd_ptr + h * K, rows, valid, H * K, 0, ck, K)
    tl.store(dq_ptr + rows[:, None] * (H * K) + h * K + ck[None, :], z.to(dq_ptr.dtype.element_ty),
             mask=valid[:, None] & (ck[None, :] < K))
    tl.store(c_ptr + rows * H + h, cz, mask=valid)
    tl.store(rh_ptr + rows * H + h, gate_terms, mask=valid)


@triton.jit
def _state_scan_bwd(q_ptr, k_ptr, do_ptr, g_ptr, gk_ptr, beta_ptr, alpha_ptr, x_ptr, z_ptr, c_ptr, hstates_ptr,
                    dh_final_ptr, ds_final_ptr, dh_ptr, ds_ptr, dh_init_ptr, ds_init_ptr, seq_first_ptr,
                    chunk_start_ptr, chunk_end_ptr, scale, H, K, V, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr,
                    HAS_DH_FINAL: tl.constexpr, HAS_DS_FINAL: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr,
                    BB: tl.constexpr, PREC: tl.constexpr,
                    KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """Backward, part 2: both reverse scans in one launch (program_id(2): 0 for dL/dH under gk, 1 for dL/dS
    under g).
  """
    i_tile, i_nh = tl.program_id(0), tl.program_id(1)
    n, h = i_nh // H, i_nh % H
    if tl.program_id(2) == 0:
        if i_tile < tl.cdiv(K, BA) * tl.cdiv(K, BB):
            _dscan_tile(q_ptr, k_ptr, do_ptr, gk_ptr, beta_ptr, alpha_ptr, x_ptr, z_ptr, c_ptr, hstates_ptr,
                        dh_final_ptr, dh_ptr, dh_init_ptr, seq_first_ptr, chunk_start_ptr, chunk_end_ptr, scale,
                        i_tile, n, h, H, K, K, False, HAS_BETA, HAS_ALPHA, HAS_DH_FINAL, BT, BA, BB, PREC,
                        KEY_SCALE, VALUE_SCALE)
    else:
        if i_tile < tl.cdiv(K, BA) * tl.cdiv(V, BB):
            _dscan_tile(q_ptr, k_ptr, do_ptr, g_ptr, beta_ptr, alpha_ptr, x_ptr, z_ptr, c_ptr, hstates_ptr,
                        ds_final_ptr, ds_ptr, ds_init_ptr, seq_first_ptr, chunk_start_ptr, chunk_end_ptr, scale,
                        i_tile, n, h, H, K, V, True, HAS_BETA, HAS_ALPHA, HAS_DS_FINAL, BT, BA, BB, PREC,
                        KEY_SCALE, VALUE_SCALE)


@triton.jit
def _dscan_tile(q_ptr, k_ptr, do_ptr, g_ptr, beta_ptr, alpha_ptr, x_ptr, z_ptr, c_ptr, hstates_ptr,
                dfinal_ptr, dstates_ptr, dinit_ptr, seq_first_ptr, chunk_start_ptr, chunk_end_ptr,
                scale, i_tile, n, h, H, K, NR, MODE_S: tl.constexpr, HAS_BETA: tl.constexpr,
                HAS_ALPHA: tl.constexpr, HAS_DFINAL: tl.constexpr, BT: tl.constexpr, BA: tl.constexpr,
                BB: tl.constexpr, PREC: tl.constexpr,
                KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """The gradient flowing into each chunk from later chunks, by a reverse scan, for one [BA, BB] tile.
    MODE_S = False: dL/dH (NR = K), chunk term -sum_t e^G_t z_t x_t^T - b0 H_0 - Kb^T diag(beta) Kb;
    MODE_S = True: dL/dS (NR = V), chunk term scale sum_t e^G_t qa_t do_t^T."""
    n_b = tl.cdiv(NR, BB)
    a0, b0 = (i_tile // n_b) * BA, (i_tile % n_b) * BB
    ca, cb = tl.arange(0, BA), tl.arange(0, BB)
    ra, rb = a0 + ca, b0 + cb
    tile_mask = (ra[:, None] < K) & (rb[None, :] < NR)
    tile = ra[:, None] * NR + rb[None, :]
    if HAS_DFINAL:
        adj = tl.load(dfinal_ptr + (n * H + h) * K * NR + tile, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        adj = tl.zeros((BA, BB), tl.float32)
    first, last, bos, eos = _sequence(seq_first_ptr, chunk_start_ptr, chunk_end_ptr, n)
    for i in range(last - first):
        c = last - 1 - i
        tl.store(dstates_ptr + (c * H + h) * K * NR + tile, adj, mask=tile_mask)
        t0 = bos + (c - first) * BT
        t1 = tl.minimum(t0 + BT, eos)
        rows = t0 + tl.arange(0, BT)
        valid = rows < t1
        gc, gtot = _chunk_gates(g_ptr + h, rows, valid, H)
        eg = tl.exp(gc)
        # the left operands loaded transposed (H100, T = 8192: 1,675-1,698 -> 1,383 us); the per-token weights on
        # the operand that is not raw keys or dO, which enter fp16x3 products unsplit (_dot)
        if MODE_S:
            qa_t = _load_cols(x_ptr + h * K, rows, valid, H * K, ra, K)
            if HAS_ALPHA:
                q_t = _load_cols(q_ptr + h * K, rows, valid, H * K, ra, K).to(tl.float32)
                al = tl.load(alpha_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
                qa_t = q_t + al[None, :] * (qa_t - q_t)
            do = _load_rows_raw(do_ptr + h * NR, rows, valid, H * NR, b0, cb, NR)
            term = scale * _dot(qa_t * eg[None, :], do, PREC)
        else:
            ks, _, _ = _scales(beta_ptr + h, rows, valid, H, HAS_BETA, KEY_SCALE, VALUE_SCALE)
            cz = tl.load(c_ptr + rows * H + h, mask=valid, other=0.0)
            dm = _decay_mask(gc, BT)
            wts = tl.sum(dm * (cz * eg)[:, None], 0)  # beta_s = sum_(t >= s) c_t e^G_t e^(G_t - G_s)
            z_t = _load_cols(z_ptr + h * K, rows, valid, H * K, ra, K)
            k_t = _load_cols(k_ptr + h * K, rows, valid, H * K, ra, K)
            xb = _load_rows(x_ptr + h * K, rows, valid, H * K, b0, cb, K) * eg[:, None]
            kbb = _load_rows(k_ptr + h * K, rows, valid, H * K, b0, cb, K) * (ks * ks * wts)[:, None]
            h0 = tl.load(hstates_ptr + (c * H + h) * K * K + tile, mask=tile_mask, other=0.0)
            term = -_dot(z_t, xb, PREC) - tl.sum(cz * eg * eg, 0) * h0 - _dot(k_t, kbb, PREC)
        adj = adj * tl.exp(gtot) + term
    tl.store(dinit_ptr + (n * H + h) * K * NR + tile, adj, mask=tile_mask)


@autotune(name="recurrence", configs=_configs(), key=_KEY)
@triton.jit
def _grads_h(k_ptr, g_ptr, beta_ptr, hstates_ptr, x_ptr, z_ptr, c_ptr, dh_ptr, dkbh_ptr, chunk_start_ptr,
             chunk_end_ptr, H, K, V, WORK, HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr, BT: tl.constexpr,
             BK: tl.constexpr, PREC: tl.constexpr,
             KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """Backward, part 3a (per chunk): dkb through H, (L_j + L_j^T) kb_j with L_j the accumulated gradient of H at
    token j: this chunk's rank-one terms -z x^T, its ridge terms -c_t H_t (H_t unrolled to H_0 and the chunk's
    keys, paper eq. 10) and the decayed gradient from later chunks (one state matrix per kernel: shared memory).
  """
    c, h = tl.program_id(0), tl.program_id(1)
    ck = tl.arange(0, BK)
    rows, valid, gc, gtot, eg, dm, ks, _, _ = _chunk_prologue(
        c, h, chunk_start_ptr, chunk_end_ptr, g_ptr, beta_ptr, H, BT, HAS_BETA, KEY_SCALE, VALUE_SCALE)
    mt = tl.trans(dm)  # mt[j, t] = exp(G_t - G_j) for t >= j
    to_end = tl.where(valid, tl.exp(gtot - gc), 0.0)
    # kb = ks k: every product takes the raw keys (fewer fp16x3 products, _dot) and ks goes on the other side
    kr = _load_rows_raw(k_ptr + h * K, rows, valid, H * K, 0, ck, K)
    x = _load_rows(x_ptr + h * K, rows, valid, H * K, 0, ck, K)
    z = _load_rows(z_ptr + h * K, rows, valid, H * K, 0, ck, K)
    cz = tl.load(c_ptr + rows * H + h, mask=valid, other=0.0)
    hmask = (ck[:, None] < K) & (ck[None, :] < K)
    mtk = mt * ks[:, None]
    a1 = _dot(kr, tl.trans(x), PREC) * mtk
    a2 = _dot(kr, tl.trans(z), PREC) * mtk
    dkb_h = -_dot(a1, z, PREC) - _dot(a2, x, PREC)
    wts = tl.sum(dm * (cz * eg)[:, None], 0)
    mw = _dot(mt * cz[None, :], dm, PREC)  # M diag(c) M^T
    gram = _dot(kr, tl.trans(kr), PREC) * (ks[:, None] * (ks * ks)[None, :])  # (kb kb^T)_ij ks_j
    dkb_h -= 2.0 * _dot(mw * gram, kr, PREC)
    # the state terms: -2 beta_j H_0 kb_j + to_end_j (L + L^T) kb_j
    dh = tl.load(dh_ptr + (c * H + h) * K * K + ck[:, None] * K + ck[None, :], mask=hmask, other=0.0)
    h0 = tl.load(hstates_ptr + (c * H + h) * K * K + ck[:, None] * K + ck[None, :], mask=hmask, other=0.0)
    dkb_h += ((ks * to_end)[:, None] * _dot(kr, dh + tl.trans(dh), PREC)
              - (ks * 2.0 * wts)[:, None] * _dot(kr, h0, PREC))
    tl.store(dkbh_ptr + rows[:, None] * (H * K) + h * K + ck[None, :], dkb_h, mask=valid[:, None] & (ck[None, :] < K))


@autotune(name="recurrence", configs=_configs(), key=_KEY)
@triton.jit
def _grads_s_inter(v_ptr, g_ptr, beta_ptr, ds_ptr, dkbs_ptr, chunk_start_ptr, chunk_end_ptr, H, K, V, WORK,
                   HAS_BETA: tl.constexpr, HAS_ALPHA: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr,
                   KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr):
    """Backward, part 3b: the later chunks' share of dkb through S, exp(G_end - G_j) dS vb_j, on its own so that
    the state matrix is held in one layout per kernel (shared memory)."""
    c, h = tl.program_id(0), tl.program_id(1)
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    rows, valid, gc, gtot, _, _, _, vs, _ = _chunk_prologue(
        c, h, chunk_start_ptr, chunk_end_ptr, g_ptr, beta_ptr, H, BT, HAS_BETA, KEY_SCALE, VALUE_SCALE)
    to_end = tl.where(valid, tl.exp(gtot - gc), 0.0)
    vb = _load_rows(v_ptr + h * V, rows, valid, H * V, 0, cv, V) * (vs * to_end)[:, None]
    smask = (ck[:, None] < K) & (cv[None, :] < V)
    ds = tl.load(ds_ptr + (c * H + h) * K * V + ck[:, None] * V + cv[None, :], mask=smask, other=0.0)
    tl.store(dkbs_ptr + rows[:, None] * (H * K) + h * K + ck[None, :], _dot(vb, tl.trans(ds), PREC),
             mask=valid[:, None] & (ck[None, :] < K))


@autotune(name="recurrence", configs=_configs(), key=_KEY, restore_value=["r_ptr", "rh_ptr"])
@triton.jit
def _grads_s(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alpha_ptr, x_ptr, do_ptr, ds_ptr, dkbh_ptr, dkbs_ptr, dk_ptr, dv_ptr,
             dbeta_ptr, r_ptr, rh_ptr, chunk_start_ptr, chunk_end_ptr, scale, H, K, V, WORK, HAS_BETA: tl.constexpr,
             HAS_ALPHA: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
             KEY_SCALE: tl.constexpr, VALUE_SCALE: tl.constexpr, KEY_SCALE_GRAD: tl.constexpr,
             VALUE_SCALE_GRAD: tl.constexpr):
    """Backward, part 3c (per chunk): dkb through S (P_j vb_j) and dvb = P_j^T kb_j with P_j the accumulated
    gradient of S at token j; then dk, dv, dbeta and the gate terms, - kb^T P vb added to r (S's, g_ptr's) and
    - kb^T L kb to rh (H's)."""
    c, h = tl.program_id(0), tl.program_id(1)
    ck, cv = tl.arange(0, BK), tl.arange(0, BV)
    rows, valid, gc, gtot, _, dm, ks, vs, bt = _chunk_prologue(
        c, h, chunk_start_ptr, chunk_end_ptr, g_ptr, beta_ptr, H, BT, HAS_BETA, KEY_SCALE, VALUE_SCALE)
    mt = tl.trans(dm)
    to_end = tl.where(valid, tl.exp(gtot - gc), 0.0)
    # the products take keys, values and dO raw (fewer fp16x3 products, _dot), their scales on the other side
    kr = _load_rows_raw(k_ptr + h * K, rows, valid, H * K, 0, ck, K)
    vr = _load_rows_raw(v_ptr + h * V, rows, valid, H * V, 0, cv, V)
    do = _load_rows_raw(do_ptr + h * V, rows, valid, H * V, 0, cv, V)
    kraw, vraw = kr.to(tl.float32), vr.to(tl.float32)
    kb = kraw * ks[:, None]
    vb = vraw * vs[:, None]
    x = _load_rows(x_ptr + h * K, rows, valid, H * K, 0, ck, K)
    if HAS_ALPHA:
        q = _load_rows(q_ptr + h * K, rows, valid, H * K, 0, ck, K)
        al = tl.load(alpha_ptr + rows * H + h, mask=valid, other=0.0).to(tl.float32)
        qa = q + al[:, None] * (x - q)
    else:
        qa = x
    smask = (ck[:, None] < K) & (cv[None, :] < V)
    ds = tl.load(ds_ptr + (c * H + h) * K * V + ck[:, None] * V + cv[None, :], mask=smask, other=0.0)
    b1 = _dot(vr, tl.trans(do), PREC) * (mt * vs[:, None])
    dkb_s = scale * _dot(b1, qa, PREC) + _load_rows(dkbs_ptr + h * K, rows, valid, H * K, 0, ck, K)
    b2 = _dot(kr, tl.trans(qa), PREC) * (mt * ks[:, None])
    dvb = scale * _dot(b2, do, PREC) + (ks * to_end)[:, None] * _dot(kr, ds, PREC)
    dkb_h = _load_rows(dkbh_ptr + h * K, rows, valid, H * K, 0, ck, K)
    dkb = dkb_h + dkb_s
    s_terms = tl.load(r_ptr + rows * H + h, mask=valid, other=0.0) - tl.sum(vb * dvb, 1)
    h_terms = tl.load(rh_ptr + rows * H + h, mask=valid, other=0.0) - 0.5 * tl.sum(kb * dkb_h, 1)
    tl.store(r_ptr + rows * H + h, s_terms, mask=valid)
    tl.store(rh_ptr + rows * H + h, h_terms, mask=valid)
    tl.store(dk_ptr + rows[:, None] * (H * K) + h * K + ck[None, :], (dkb * ks[:, None]).to(dk_ptr.dtype.element_ty),
             mask=valid[:, None] & (ck[None, :] < K))
    tl.store(dv_ptr + rows[:, None] * (H * V) + h * V + cv[None, :], (dvb * vs[:, None]).to(dv_ptr.dtype.element_ty),
             mask=valid[:, None] & (cv[None, :] < V))
    if HAS_BETA:
        dbt = KEY_SCALE_GRAD(bt) * tl.sum(dkb * kraw, 1) + VALUE_SCALE_GRAD(bt) * tl.sum(dvb * vraw, 1)
        tl.store(dbeta_ptr + rows * H + h, dbt, mask=valid)


# ---------------------------------------------------------------------------------------------------------------
# Host side: chunk tables, launches.
# ---------------------------------------------------------------------------------------------------------------
_TABLES: dict[tuple, tuple] = {}  # (batch, length, chunk, device) -> chunk_table's table, for every op
# The packed layout last seen: (cu_seqlens weakref, its version counter, chunk, device, table). Reading the
# boundaries syncs with the device; the call check, the forward and the backward of one step share one read.
_PACKED: list[Any] = [None]


def _pow2(n):
    return max(16, triton.next_power_of_2(int(n)))


def _work(n_chunks, heads):
    """The autotune key's problem size (_KEY): chunks x heads, rounded up to a power of two."""
    return _pow2(n_chunks * heads)


def _untuned(options):
    """`options` less WORK, for a kernel that is not autotuned (a compiled GPU launch rejects an unknown keyword,
    the interpreter does not)."""
    return {key: value for key, value in options.items() if key != "WORK"}


# The scans are sequential over a sequence's chunks, so their parallelism is the number of state tiles
# (config.scan_tiles_*) times sequences times heads. Value columns per block of the solve's output epilogue
# (config.output_bv; H100, T = 8192, when it was a kernel of its own: one block of 128 took 185 us against 182).
# Four blocks of 32 (V = 128) stopped an H100 run on an illegal memory access, unexplained (the interpreter runs
# them right; one block of 32, V = 32, runs right on the H100).


def _scan_tiles(tiles, K, V):
    ba, bb, warps = tiles
    ba, bb = min(ba, _pow2(K)), min(bb, _pow2(max(K, V)))
    return ba, bb, triton.cdiv(K, ba) * triton.cdiv(max(K, V), bb), warps


def _empty(shape, dtype, device, poison):
    """An output buffer; filled with NaN when `poison` (config.poison_outputs) or NCD_POISON_OUTPUTS
    (ncd.settings.POISON_OUTPUTS: tests) so that an unwritten entry shows."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if poison or _settings.POISON_OUTPUTS:
        out.fill_(float("nan"))
    return out


@triton.jit
def _unit_scale(bt):
    """The scaling of a spec whose beta input is not passed (fla's use_beta=False): kb = k, vb = v."""
    return tl.full(bt.shape, 1.0, tl.float32)


def _scalings(config, hooks, beta):
    """(KEY_SCALE, VALUE_SCALE) constexprs of a call: the spec's, or the unit ones when its beta is not passed."""
    if beta is None and config.scaling_input:
        return dict(KEY_SCALE=_unit_scale, VALUE_SCALE=_unit_scale)
    return dict(KEY_SCALE=hooks.key_scale, VALUE_SCALE=hooks.value_scale)


def chunk_table(batch, length, cu_seqlens, chunk, device):
    """(seq_first [N + 1], chunk_start [NC], chunk_end [NC]) as int32 on `device`: the chunks of each sequence,
    never straddling a sequence boundary; with cu_seqlens, B = 1 holds N packed sequences."""
    key = None
    if cu_seqlens is None:
        key = (batch, length, chunk, str(device))
        if key in _TABLES:
            return _TABLES[key]
        bounds = [n * length for n in range(batch + 1)]
    else:
        last = _PACKED[0]
        if last is not None and last[0]() is cu_seqlens and last[1:4] == (cu_seqlens._version, chunk, str(device)):
            return last[4]
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != length or any(b < a for a, b in pairwise(bounds)):
            return None, None, None, len(bounds) - 1, 0, bounds  # no chunks: the call check reports the layout
    first, starts, ends = [0], [], []
    for lo, hi in pairwise(bounds):
        for s in range(lo, hi, chunk):
            starts.append(s)
            ends.append(min(s + chunk, hi))
        first.append(len(starts))
    packed = torch.tensor(first + starts + ends, dtype=torch.int32).to(device)
    n_seq, n_chunks = len(bounds) - 1, len(starts)
    table = (packed[: n_seq + 1], packed[n_seq + 1: n_seq + 1 + n_chunks], packed[n_seq + 1 + n_chunks:], n_seq,
             n_chunks, bounds)
    if key is not None:
        _TABLES[key] = table
    else:
        _PACKED[0] = (weakref.ref(cu_seqlens), cu_seqlens._version, chunk, str(device), table)
    return table


def _states(config, scalings, k, v, g, gk, beta, h_init, s_init, table, chunk, final, prec, fp16_fwd=None):
    """Chunk-start states H [NC, H, K, K] (gated by gk) and S [NC, H, K, V] (by g) from `prec` products (fp32), the
    final ones when
    asked, and a dict of what the forward's kernels read besides (None for the backward, fp16_fwd None): the norm's
    parts of each H_0 (khk [NC, H, tiles, chunk], hsq [NC, H, tiles]; _scan_tile's NORM_PARTS) and, with fp16_fwd,
    the states as fp16 tiles with their power-of-two scales (hscale, sscale [NC, H, tiles]; FP16_STATES)."""
    poison = config.poison_outputs
    first, start, end, n_seq, n_chunks, _ = table
    heads, K, V = k.shape[2], k.shape[3], v.shape[3]
    dev = k.device
    fwd = fp16_fwd is not None
    fp16 = bool(fp16_fwd)
    ba, bb, tiles, warps = _scan_tiles(config.scan_tiles_fwd, K, V)
    h_tiles, s_tiles = triton.cdiv(K, ba) * triton.cdiv(K, bb), triton.cdiv(K, ba) * triton.cdiv(V, bb)
    dtype = torch.float16 if fp16 else torch.float32
    hst = _empty((n_chunks, heads, K, K), dtype, dev, poison)
    sst = _empty((n_chunks, heads, K, V), dtype, dev, poison)
    h_fin = _empty((n_seq, heads, K, K), torch.float32, dev, poison) if final else None
    s_fin = _empty((n_seq, heads, K, V), torch.float32, dev, poison) if final else None
    aux = {}
    if fwd:
        aux = dict(khk=_empty((n_chunks, heads, h_tiles, chunk), torch.float32, dev, poison),
                   hsq=_empty((n_chunks, heads, h_tiles), torch.float32, dev, poison), h_tiles=h_tiles, SA=ba, SB=bb,
                   fp16=fp16, hscale=_empty((n_chunks, heads, h_tiles), torch.float32, dev, poison) if fp16 else hst,
                   sscale=_empty((n_chunks, heads, s_tiles), torch.float32, dev, poison) if fp16 else hst)
    has_init = h_init is not None
    _fit_carveout(_fast(_state_scan_fwd)[(tiles, n_seq * heads, 2)](
        k, v, beta if beta is not None else g, g, gk, h_init if has_init else hst, s_init if has_init else sst,
        hst, sst, h_fin if final else hst, s_fin if final else sst, aux.get("khk", hst), aux.get("hsq", hst),
        aux.get("hscale", hst), aux.get("sscale", hst), first, start, end, heads, K, V, HAS_BETA=beta is not None,
        HAS_INIT=has_init, STORE_FINAL=final, BT=chunk, BA=ba, BB=bb, PREC=prec, NORM_PARTS=fwd,
        FP16_STATES=fp16, **scalings, num_warps=warps, num_stages=config.scan_stages))
    return hst, sst, h_fin, s_fin, aux if fwd else None


def forward(config, hooks, q, k, v, g, gk, beta, alpha, h_init, s_init, cu_seqlens, scale, ridge, ridge_offset,
            num_iter, chunk, final, save=True):
    """Returns o [B, T, H, V] (v's dtype), final states (or None), and x, ||H|| saved for the backward (save
    False: no backward follows, x is not written and comes back empty). g gates S; gk gates H (None: g gates
    both)."""
    poison = config.poison_outputs
    scalings = _scalings(config, hooks, beta)
    B, T, heads, K = q.shape
    V = v.shape[3]
    table = chunk_table(B, T, cu_seqlens, chunk, q.device)
    prec = solve_precision(config, q.dtype)
    split = gk is not None
    gk = gk if split else g
    hst, sst, h_fin, s_fin, aux = _states(config, scalings, k, v, g, gk, beta, h_init, s_init, table, chunk, final,
                                          scan_precision(config, k.dtype), fp16_fwd=prec == "fp16")
    o = _empty(v.shape, v.dtype, q.device, poison)
    x = _empty(q.shape if save else (0,), torch.float32, q.device, poison)
    norm = _empty(g.shape, torch.float32, q.device, poison)
    grid = (table[4], heads)
    opt = dict(HAS_BETA=beta is not None, HAS_ALPHA=alpha is not None, BT=chunk, BK=_pow2(K), PREC=prec,
               WORK=_work(table[4], heads), **scalings)
    beta_arg, alpha_arg = (beta if beta is not None else g), (alpha if alpha is not None else g)
    # in a kernel of its own: in the solve's prologue it cost the solve 162-167 us at T = 8192, more than the norm
    # kernel's 75-77 (H100, bench/log/2026-11-20-to-22.md)
    _fit_carveout(_fast(_norm_fwd)[grid](k, gk, beta_arg, aux["khk"], aux["hsq"], norm, table[1], table[2], heads, K, V,
                                  NT=aux["h_tiles"], **opt))
    states = dict(FP16_STATES=aux["fp16"], SA=aux["SA"], SB=aux["SB"])
    bv = min(config.output_bv, _pow2(V))
    _fit_carveout(_fast(_solve)[grid](
        q, k, gk, g, beta_arg, alpha_arg, hst, aux["hscale"], norm, x, v, sst, aux["sscale"], o, float(scale),
        table[1], table[2], float(ridge), float(ridge_offset), _rate2(hooks, ridge, ridge_offset), int(num_iter), heads,
        K, V, SPLIT_GATES=split, TOKEN_RHO=ridge_offset > 0, OUTPUT=True, STORE_OUT=save, BV=bv, NV=_pow2(V) // bv,
        **states, **opt))
    return o, h_fin, s_fin, x, norm


def _rate2(hooks, ridge, ridge_offset):
    """The squared Chebyshev rate shared by every token: without a ridge offset, the spec's rho of the ridge alone;
    with one the kernels compute each token's (TOKEN_RHO) and this is unused."""
    return float(hooks.rho(float(ridge))) ** 2 if ridge_offset == 0 else 0.0


def _reverse_cumsum(r, table, B, T):
    """dL/dg_t = sum of dL/dG_j over j >= t inside t's sequence. Summed in float64 (the terms cancel) along the
    contiguous axis (torch's scan over an outer axis of [B, T, H] is ~100x slower)."""
    rows = r.transpose(1, 2).to(torch.float64).contiguous()
    suffix = rows.flip(2).cumsum(2).flip(2)
    if B > 1 or table[3] == 1:
        return suffix.transpose(1, 2).to(r.dtype)
    bounds = table[5]
    suffix = torch.cat([suffix[0], suffix.new_zeros((suffix.shape[1], 1))], 1)  # [H, T + 1]
    lengths = torch.tensor([hi - lo for lo, hi in pairwise(bounds)], device=r.device)
    ends = torch.repeat_interleave(torch.tensor(bounds[1:], device=r.device), lengths)
    return (suffix[:, :-1] - suffix[:, ends]).t().unsqueeze(0).to(r.dtype)


def backward(config, hooks, do, dh_fin, ds_fin, q, k, v, g, gk, beta, alpha, h_init, s_init, cu_seqlens, x, norm,
             h_fin, s_fin, scale, ridge, ridge_offset, num_iter, chunk):
    """Gradients (dq, dk, dv, dg, dgk, dbeta, dalpha, dh_init, ds_init); None where the input was None (gk None: g
    gates both states and dg has both states' terms)."""
    poison = config.poison_outputs
    scalings = _scalings(config, hooks, beta)
    B, T, heads, K = q.shape
    V = v.shape[3]
    dev = q.device
    table = chunk_table(B, T, cu_seqlens, chunk, dev)
    first, start, end, n_seq, n_chunks, bounds = table
    # TF32 states (plain_precision) whatever the forward's: the gate gradient needs them (grad_precision)
    split = gk is not None
    gk = gk if split else g
    hst, sst, _, _, _ = _states(config, scalings, k, v, g, gk, beta, h_init, s_init, table, chunk, False,
                                plain_precision(config, k.dtype))
    do = do.contiguous()
    gb = beta if beta is not None else g
    ga = alpha if alpha is not None else g
    dq = _empty(q.shape, q.dtype, dev, poison)
    dalpha = _empty(g.shape, torch.float32, dev, poison) if alpha is not None else None
    z = _empty(q.shape, torch.float32, dev, poison)
    cz = _empty(g.shape, torch.float32, dev, poison)
    r = _empty(g.shape, torch.float32, dev, poison)  # dL/dG of S's cumulative gates, per token
    rh = _empty(g.shape, torch.float32, dev, poison)  # and of H's
    common = dict(HAS_BETA=beta is not None, HAS_ALPHA=alpha is not None, BT=chunk,
                  PREC=grad_precision(config, q.dtype), WORK=_work(n_chunks, heads), **scalings)
    grid = (n_chunks, heads)
    dx = _empty(q.shape, torch.float32, dev, poison)
    dqd = _empty(q.shape, torch.float32, dev, poison) if alpha is not None else dx  # the direct share of dq
    _fit_carveout(_fast(_solve_bwd_rhs)[grid](
        q, k, v, g, gb, ga, sst, x, do, dx, dqd, dalpha if dalpha is not None else cz, r, start, end, float(scale),
        heads, K, V, BK=_pow2(K), BV=_pow2(V), **common))
    _fit_carveout(_fast(_solve)[grid](
        dx, k, gk, gk, gb, ga, hst, hst, norm, z, z, z, z, z, 1.0, start, end, float(ridge), float(ridge_offset),
        _rate2(hooks, ridge, ridge_offset), int(num_iter), heads, K, V, SPLIT_GATES=False, TOKEN_RHO=ridge_offset > 0,
        OUTPUT=False, STORE_OUT=True, BK=_pow2(K), BV=1, NV=1, FP16_STATES=False, SA=1, SB=1,
        **dict(common, PREC=solve_precision(config, q.dtype))))
    _fit_carveout(_fast(_solve_bwd_terms)[grid](k, gk, gb, hst, x, norm, z, dqd, dq, cz, rh, start, end, float(ridge),
                                                heads, K, V, BK=_pow2(K), **common))
    dh = _empty((n_chunks, heads, K, K), torch.float32, dev, poison)
    ds = _empty((n_chunks, heads, K, V), torch.float32, dev, poison)
    dh_init = _empty((n_seq, heads, K, K), torch.float32, dev, poison)
    ds_init = _empty((n_seq, heads, K, V), torch.float32, dev, poison)
    ba, bb, tiles, warps = _scan_tiles(config.scan_tiles_bwd, K, V)
    _fit_carveout(_fast(_state_scan_bwd)[(tiles, n_seq * heads, 2)](
        q, k, do, g, gk, gb, ga, x, z, cz, hst, dh_fin if dh_fin is not None else dh,
        ds_fin if ds_fin is not None else ds, dh, ds, dh_init, ds_init, first, start, end, float(scale), heads, K,
        V, HAS_DH_FINAL=dh_fin is not None, HAS_DS_FINAL=ds_fin is not None, BA=ba, BB=bb, num_warps=warps,
        **_untuned(common)))
    dk = _empty(k.shape, k.dtype, dev, poison)
    dv = _empty(v.shape, v.dtype, dev, poison)
    dbeta = _empty(g.shape, torch.float32, dev, poison) if beta is not None else None
    dkb_h = _empty(q.shape, torch.float32, dev, poison)
    _fit_carveout(_fast(_grads_h)[(n_chunks, heads)](k, gk, gb, hst, x, z, cz, dh, dkb_h, start, end, heads, K, V,
                                              BK=_pow2(K), **common))
    dkb_s = _empty(q.shape, torch.float32, dev, poison)
    _fit_carveout(_fast(_grads_s_inter)[(n_chunks, heads)](v, g, gb, ds, dkb_s, start, end, heads, K, V, BK=_pow2(K),
                                                    BV=_pow2(V), **common))
    _fit_carveout(_fast(_grads_s)[(n_chunks, heads)](
        q, k, v, g, gb, ga, x, do, ds, dkb_h, dkb_s, dk, dv, dbeta if dbeta is not None else cz, r, rh, start, end,
        float(scale), heads, K, V, BK=_pow2(K), BV=_pow2(V), **common, KEY_SCALE_GRAD=hooks.key_scale_grad,
        VALUE_SCALE_GRAD=hooks.value_scale_grad))
    if dh_fin is not None or ds_fin is not None:
        # the final states' own terms <dH_T, H_T>, <dS_T, S_T> belong to each sequence's last token
        nonempty = [n for n in range(n_seq) if bounds[n + 1] > bounds[n]]
        last = torch.tensor([bounds[n + 1] - 1 for n in nonempty], device=dev, dtype=torch.long)
        for terms, d_fin, fin in ((rh, dh_fin, h_fin), (r, ds_fin, s_fin)):
            if d_fin is not None:
                terms.view(-1, heads).index_add_(0, last, (d_fin.float() * fin).sum((-1, -2))[nonempty])
    dg = _reverse_cumsum(r if split else r + rh, table, B, T).to(g.dtype)
    dgk = _reverse_cumsum(rh, table, B, T).to(gk.dtype) if split else None
    return (dq, dk, dv, dg, dgk, dbeta.to(beta.dtype) if beta is not None else None,
            dalpha.to(alpha.dtype) if alpha is not None else None,
            dh_init if h_init is not None else None, ds_init if s_init is not None else None)
