"""Weighted products over time for the sequence-parallel recurrences (ncd/distributed.py), one pair of kernels:

    outer_sum(x, y, a)  = sum_t a_t x_t y_t^T    x [B, T, H, K], y [B, T, H, V], a [B, T, H]  ->  [B, H, K, V]
    project(x, m, a)    = a_t x_t m               x [B, T, H, K], m [B, H, K, V], a [B, T, H]  ->  [B, T, H, V]

each a differentiable torch op whose backward is the other's kernel. A shard's end state is an outer sum (Gated
KalmaNet: kb kb^T and kb vb^T under the suffix decays), an incoming state's share of the outputs a projection (gated
linear attention). They read x and y in their own dtype once; products are fp16x3 (16-bit inputs) or IEEE fp32,
accumulation fp32, as the chunk kernels' defaults (kernel.py's _dot). The torch forms they replace built fp32
[B, T, H, K] copies and ran fp32 GEMMs: 13 ms of Gated KalmaNet's 67 ms step at T 32k per rank on an H100."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .kernel import _INTERPRET, _dot

BLOCK_T = 16 if _INTERPRET else 64
SPLIT_TOKENS = 1024  # tokens per program of outer_sum: B H (K/64) (V/64) tiles alone do not fill the GPU


@triton.jit
def _outer_sum_kernel(X, Y, A, OUT, T, H, K, V, span, PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr):
    """OUT[split, b, h, kt, vt] = sum over this split's tokens of a_t x_t^T y_t (one [BK, BV] tile)."""
    bh, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    kt, vt = tile // tl.cdiv(V, BV), tile % tl.cdiv(V, BV)
    ks, vs = kt * BK + tl.arange(0, BK), vt * BV + tl.arange(0, BV)
    first = split * span
    last = tl.minimum(first + span, T)
    acc = tl.zeros((BK, BV), dtype=tl.float32)
    for start in range(first, last, BT):
        ts = start + tl.arange(0, BT)
        live = ts < last
        rows = (b * T + ts) * H + h
        a = tl.load(A + rows, mask=live, other=0.0)
        x = tl.load(X + rows[:, None] * K + ks[None, :], mask=live[:, None] & (ks[None, :] < K), other=0.0)
        y = tl.load(Y + rows[:, None] * V + vs[None, :], mask=live[:, None] & (vs[None, :] < V), other=0.0)
        acc = _dot(tl.trans(x.to(tl.float32) * a[:, None]), y, PREC, acc)
    out = OUT + ((split * tl.num_programs(0) + bh) * K + ks[:, None]) * V + vs[None, :]
    tl.store(out, acc, mask=(ks[:, None] < K) & (vs[None, :] < V))


@triton.jit
def _project_kernel(X, Y, A, M, P_OUT, Q_OUT, DA, T, H, K, V, PREC: tl.constexpr, STORE_P: tl.constexpr,
                    HAS_Y: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """For one block of tokens of one (b, h), with P = x m [BT, V] and Q = y m^T [BT, K]: with STORE_P,
    P_OUT = a P; with HAS_Y, Q_OUT = a Q and DA = rowsum(P * y)."""
    bh, block = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    ts = block * BT + tl.arange(0, BT)
    live = ts < T
    rows = (b * T + ts) * H + h
    ks = tl.arange(0, BK)
    a = tl.load(A + rows, mask=live, other=0.0)
    x = tl.load(X + rows[:, None] * K + ks[None, :], mask=live[:, None] & (ks[None, :] < K), other=0.0)
    q = tl.zeros((BT, BK), dtype=tl.float32)
    da = tl.zeros((BT,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        vs = v0 + tl.arange(0, BV)
        m = tl.load(M + (bh * K + ks[:, None]) * V + vs[None, :], mask=(ks[:, None] < K) & (vs[None, :] < V),
                    other=0.0)
        p = _dot(x, m, PREC)
        at = rows[:, None] * V + vs[None, :]
        ok = live[:, None] & (vs[None, :] < V)
        if STORE_P:
            tl.store(P_OUT + at, p * a[:, None], mask=ok)
        if HAS_Y:
            y = tl.load(Y + at, mask=ok, other=0.0)
            q = _dot(y, tl.trans(m), PREC, q)
            da += tl.sum(p * y.to(tl.float32), 1)
    if HAS_Y:
        tl.store(Q_OUT + rows[:, None] * K + ks[None, :], q * a[:, None], mask=live[:, None] & (ks[None, :] < K))
        tl.store(DA + rows, da, mask=live)


def _precision(x: torch.Tensor) -> str:
    """By the token tensor's dtype, as the chunk kernels: fp16x3 splits fp32 operands (the states, the weighted
    rows) into fp16 halves, so 16-bit inputs keep about fp32 accuracy."""
    return "ieee" if x.dtype == torch.float32 else "fp16x3"


def _tile(n: int, most: int | None = 64) -> int:
    """A power-of-two tile side for n, at most `most` (None: all of n); tl.dot's smallest side is 16."""
    side = triton.next_power_of_2(n)
    return max(16, min(most, side) if most else side)


def _outer_sum(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    B, T, H, K = x.shape
    V = y.shape[-1]
    splits = max(1, triton.cdiv(T, SPLIT_TOKENS))
    span = triton.cdiv(T, splits)
    BK, BV = _tile(K), _tile(V)
    out = torch.empty(splits, B, H, K, V, dtype=torch.float32, device=x.device)
    grid = (B * H, triton.cdiv(K, BK) * triton.cdiv(V, BV), splits)
    _outer_sum_kernel[grid](x, y, a, out, T, H, K, V, span, PREC=_precision(x), BT=BLOCK_T, BK=BK, BV=BV,
                            num_warps=4)
    return out.sum(0)


def _project(x: torch.Tensor, m: torch.Tensor, a: torch.Tensor, y: torch.Tensor | None = None,
             store_p: bool = True) -> tuple:
    """(a (x m), a (y m^T), rowsum((x m) * y)), fp32; the last two None without y, the first without store_p."""
    B, T, H, K = x.shape
    V = m.shape[-1]
    p = torch.empty(B, T, H, V, dtype=torch.float32, device=x.device) if store_p else None
    q = torch.empty(B, T, H, K, dtype=torch.float32, device=x.device) if y is not None else None
    da = torch.empty(B, T, H, dtype=torch.float32, device=x.device) if y is not None else None
    grid = (B * H, triton.cdiv(T, BLOCK_T))
    _project_kernel[grid](x, y if y is not None else x, a, m, p if p is not None else a, q if q is not None else a,
                          da if da is not None else a, T, H, K, V, PREC=_precision(x), STORE_P=store_p,
                          HAS_Y=y is not None, BT=BLOCK_T, BK=_tile(K, None), BV=_tile(V), num_warps=4)
    return p, q, da


class OuterSum(torch.autograd.Function):
    """sum_t a_t x_t y_t^T, fp32 [B, H, K, V]; gradients dx = a (y dE^T), dy = a (x dE), da = rowsum((x dE) * y)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, y, a = x.contiguous(), y.contiguous(), a.float().contiguous()
        ctx.save_for_backward(x, y, a)
        return _outer_sum(x, y, a)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple:  # type: ignore[override]
        x, y, a = ctx.saved_tensors
        dy, dx, da = _project(x, d_out.float().contiguous(), a, y)
        return dx.to(x.dtype), dy.to(y.dtype), da


class Project(torch.autograd.Function):
    """a_t x_t m, fp32 [B, T, H, V]; gradients dx = a (do m^T), dm = sum_t a_t x_t do_t^T, da = rowsum((x m) * do)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x, m, a = x.contiguous(), m.float().contiguous(), a.float().contiguous()
        ctx.save_for_backward(x, m, a)
        return _project(x, m, a)[0]

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple:  # type: ignore[override]
        x, m, a = ctx.saved_tensors
        d_out = d_out.float().contiguous()
        _, dx, da = _project(x, m, a, d_out, store_p=False)  # (x m is needed for da only)
        return dx.to(x.dtype), _outer_sum(x, d_out, a), da


def outer_sum(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """sum_t a_t x_t y_t^T over x [B, T, H, K], y [B, T, H, V], a [B, T, H]: [B, H, K, V] fp32, differentiable."""
    return OuterSum.apply(x, y, a)


def project(x: torch.Tensor, m: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """a_t x_t m over x [B, T, H, K], m [B, H, K, V], a [B, T, H]: [B, T, H, V] fp32, differentiable."""
    return Project.apply(x, m, a)
