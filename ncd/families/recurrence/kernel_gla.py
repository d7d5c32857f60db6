"""Chunked gated linear attention with a gate per key dimension (GLA): S_t = diag(exp(g_t)) S_(t-1) + k_t v_t^T,
o_t = scale S_t^T q_t, g [B, T, H, K]. The chunk-boundary states, the output and decoding are kernel_linear.py's
kernels with KEY_GATES set; what differs is the chunk's masked scores, which no longer factor through one product:

    A_ts = sum_d q_td k_sd exp(G_td - G_sd)   (s <= t; G: cumulative gates inside the chunk, per key)

Each chunk is cut into sub-chunks of BC = 16 tokens. A block of sub-chunks i > j is one product with a reference
point r, the first token of sub-chunk i: (q_i o exp(G_i - G_r)) (k_j o exp(G_r - G_j))^T, where both exponents
are sums of gates over tokens in order, never positive for gates <= 0. A diagonal block factors through the same
reference when its gates stay within SPAN of it (one fp32 product, 3xTF32); a steeper one takes its exponents one
key row at a time, masked before the exponential. The same split gives dq (reference: the sub-chunk's first token)
and dk (its last) from dA = scale (do v^T) (_intra_grads).

Backward (kernel_linear.py's docstring, with exp(G) per key): dq = scale exp(G) o (do S_c^T) + intra, dk =
exp(Gc - G) o (v dS_c^T) + intra, dv = (k o exp(Gc - G)) dS_c + scale A^T do, and per key dimension d
dg_td = sum over s >= t of (q_sd dq_sd - k_sd dk_sd), plus sum_v S_T[d, v] dS_T[d, v] at the last token.

forward / backward / recurrent: as kernel_linear.py's, g [B, T, H, K].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ncd.families.recurrence import kernel_linear as _linear
from ncd.families.recurrence.kernel import (
    _INTERPRET,
    _dot,
    _empty,
    _load_rows_raw,
    _pow2,
    _sequence,
    _work,
    chunk_table,
)
from ncd.families.recurrence.kernel_linear import G_FLOOR, _chunk_rows, _operand
from ncd.launch import fast as _fast
from ncd.tuning import autotune


def _warps(options: tuple[int, ...]) -> list:
    """Autotune sets of warps for the sub-chunk kernels ([16, K] tiles); one config on the interpreter."""
    return [triton.Config({}, num_warps=w) for w in ((4,) if _INTERPRET else options)]


BC: tl.constexpr = tl.constexpr(16)  # tokens per sub-chunk
SPAN: tl.constexpr = tl.constexpr(30.0)  # _factors


@triton.jit
def _cumulative_gates(g_ptr, out_ptr, chunk_start_ptr, chunk_end_ptr, H, K, BT: tl.constexpr, BK: tl.constexpr):
    """G [tokens, H, K] fp32: the gates summed inside each chunk, a gate below G_FLOOR taken as G_FLOOR (exp
    underflows there already; -inf then forms no -inf - -inf)."""
    c, h = tl.program_id(0), tl.program_id(1)
    rows, valid = _chunk_rows(chunk_start_ptr, chunk_end_ptr, c, BT)
    ck = tl.arange(0, BK)
    g = _load_rows_raw(g_ptr + h * K, rows, valid, H * K, 0, ck, K).to(tl.float32)
    g = tl.where(g < G_FLOOR, G_FLOOR, g)
    tl.store(out_ptr + rows[:, None] * (H * K) + h * K + ck[None, :], tl.cumsum(g, 0),
             mask=valid[:, None] & (ck[None, :] < K))


@triton.jit
def _row(ptr, row, eos, stride, cols, ncols):
    """Token `row`'s [cols] of a [tokens, H, ncols] tensor (ptr at the head), fp32, zero for row >= eos. (The
    row test is broadcast first: the interpreter rejects a scalar mask combined with a block.)"""
    ok = (cols * 0 + row) < eos
    return tl.load(ptr + row.to(tl.int64) * stride + cols, mask=(cols < ncols) & ok, other=0.0).to(tl.float32)


@triton.jit
def _sub_chunk(bos, eos, i, BC: tl.constexpr):
    rows = bos + i * BC + tl.arange(0, BC)
    return rows, rows < eos


@triton.jit
def _sub_chunk_queries(q_ptr, gc_ptr, rows, valid, first, eos, h, H, K, ck):
    """A sub-chunk's queries and cumulative gates [BC, BK], and the gates of its first token (the reference r)."""
    q = _load_rows_raw(q_ptr + h * K, rows, valid, H * K, 0, ck, K)
    g = _load_rows_raw(gc_ptr + h * K, rows, valid, H * K, 0, ck, K)
    return q, g, _row(gc_ptr + h * K, first, eos, H * K, ck, K)


@triton.jit
def _factors(gi, ref, valid):
    """Whether every cumulative gate of the sub-chunk is within SPAN of the reference row: the diagonal block then
    factors through the reference like the blocks below it (exp(+-SPAN) far from fp32's overflow and underflow);
    a steeper sub-chunk (a gate near G_FLOOR, a reset) takes its exponents one row at a time."""
    return tl.max(tl.max(tl.abs(tl.where(valid[:, None], gi - ref[None, :], 0.0)), 1), 0) < SPAN


@autotune(name="gla", configs=_warps((1, 2, 4, 8)), key=["K", "BT", "PREC"])
@triton.jit
def _intra_scores(q_ptr, k_ptr, gc_ptr, a_ptr, chunk_start_ptr, chunk_end_ptr, H, G, K, BT: tl.constexpr,
                  BK: tl.constexpr, PREC: tl.constexpr):
    """Rows of sub-chunk i of the chunk's masked scores A [BT, BT] (module docstring), zero above the diagonal,
    into a_ptr [tokens, H, BT] fp32."""
    i, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(chunk_start_ptr + c), tl.load(chunk_end_ptr + c)
    rows, valid = _sub_chunk(bos, eos, i, BC)
    if bos + i * BC < eos:
        ck, t = tl.arange(0, BK), tl.arange(0, BC)
        q, gq, ref = _sub_chunk_queries(q_ptr, gc_ptr, rows, valid, bos + i * BC, eos, h, H, K, ck)
        q_ref = tl.where(valid[:, None], q.to(tl.float32) * tl.exp(gq - ref[None, :]), 0.0)
        out = a_ptr + rows[:, None] * (H * BT) + h * BT + t[None, :]
        for j in tl.static_range(BT // BC):
            if j < i:
                rows_j = bos + j * BC + t
                k = _load_rows_raw(k_ptr + (h // G) * K, rows_j, rows_j < eos, (H // G) * K, 0, ck, K)
                gk = _load_rows_raw(gc_ptr + h * K, rows_j, rows_j < eos, H * K, 0, ck, K)
                k_ref = _operand(k.to(tl.float32) * tl.exp(ref[None, :] - gk), k, PREC)
                tl.store(out + j * BC, _dot(_operand(q_ref, q, PREC), tl.trans(k_ref), PREC), mask=valid[:, None])
            elif j > i:
                tl.store(out + j * BC, tl.zeros((BC, BC), tl.float32), mask=valid[:, None])
        k = _load_rows_raw(k_ptr + (h // G) * K, rows, valid, (H // G) * K, 0, ck, K)
        if _factors(gq, ref, valid):  # the diagonal block in fp32 products (fla's is exact per element too)
            k_ref = tl.where(valid[:, None], k.to(tl.float32) * tl.exp(ref[None, :] - gq), 0.0)
            diag = tl.dot(q_ref, tl.trans(k_ref), input_precision="tf32x3")
        else:  # a column at a time; rows t < s are dropped, their exponents first
            qf = q.to(tl.float32)
            diag = tl.zeros((BC, BC), tl.float32)
            for s in range(BC):
                k_s = _row(k_ptr + (h // G) * K, bos + i * BC + s, eos, (H // G) * K, ck, K)
                g_s = _row(gc_ptr + h * K, bos + i * BC + s, eos, H * K, ck, K)
                col = tl.sum(qf * k_s[None, :] * tl.exp(tl.where((t >= s)[:, None], gq - g_s[None, :], 0.0)), 1)
                diag += tl.where(t[None, :] == s, col[:, None], 0.0)
        tl.store(out + i * BC, tl.where(t[:, None] >= t[None, :], diag, 0.0), mask=valid[:, None])


@triton.jit
def _grads_inter(q_ptr, k_ptr, v_ptr, gc_ptr, do_ptr, a_ptr, states_ptr, dstates_ptr, dq_ptr, dk_ptr, dv_ptr, da_ptr,
                 chunk_start_ptr, chunk_end_ptr, scale, H, G, K, V, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, PREC: tl.constexpr):
    """One chunk and head: dv (whole), the state paths of dq and dk (fp32, finished by _intra_grads) and
    dA = scale (do v^T) masked to s <= t (fp32 [tokens, H, BT])."""
    c, h = tl.program_id(0), tl.program_id(1)
    rows, valid = _chunk_rows(chunk_start_ptr, chunk_end_ptr, c, BT)
    bos, eos = tl.load(chunk_start_ptr + c), tl.load(chunk_end_ptr + c)
    ck, t = tl.arange(0, BK), tl.arange(0, BT)
    k = _load_rows_raw(k_ptr + (h // G) * K, rows, valid, (H // G) * K, 0, ck, K)
    gk = _load_rows_raw(gc_ptr + h * K, rows, valid, H * K, 0, ck, K)
    gtot = _row(gc_ptr + h * K, tl.minimum(bos + BT, eos) - 1, eos, H * K, ck, K)
    to_end = tl.where(valid[:, None], tl.exp(gtot[None, :] - gk), 0.0)
    k_end = _operand(k.to(tl.float32) * to_end, k, PREC)
    scores_t = tl.trans(tl.load(a_ptr + rows[:, None] * (H * BT) + h * BT + t[None, :], mask=valid[:, None],
                                other=0.0))
    dq = tl.zeros((BT, BK), tl.float32)
    dk = tl.zeros((BT, BK), tl.float32)
    dp = tl.zeros((BT, BT), tl.float32)
    part = (c * H + h).to(tl.int64) * K * V
    for v0 in range(0, V, BV):
        cv = v0 + tl.arange(0, BV)
        tile_mask = (ck[:, None] < K) & (cv[None, :] < V)
        tile = ck[:, None] * V + cv[None, :]
        do = _load_rows_raw(do_ptr + h * V, rows, valid, H * V, 0, cv, V)
        v = _load_rows_raw(v_ptr + (h // G) * V, rows, valid, (H // G) * V, 0, cv, V)
        s0 = _operand(tl.load(states_ptr + part + tile, mask=tile_mask, other=0.0), k, PREC)
        ds = _operand(tl.load(dstates_ptr + part + tile, mask=tile_mask, other=0.0), k, PREC)
        dq = _dot(do, tl.trans(s0), PREC, dq)
        dk = _dot(v, tl.trans(ds), PREC, dk)
        dp = _dot(do, tl.trans(v), PREC, dp)
        dv = _dot(k_end, ds, PREC)
        dv = _dot(_operand(scores_t * scale, k, PREC), do, PREC, dv)
        tl.store(dv_ptr + rows[:, None] * (H * V) + h * V + cv[None, :], dv.to(dv_ptr.dtype.element_ty),
                 mask=valid[:, None] & (cv[None, :] < V))
    at = rows[:, None] * (H * K) + h * K + ck[None, :]
    mask = valid[:, None] & (ck[None, :] < K)
    tl.store(dq_ptr + at, dq * scale * tl.exp(gk), mask=mask)
    tl.store(dk_ptr + at, dk * to_end, mask=mask)
    dp = tl.where(t[None, :] <= t[:, None], dp * scale, 0.0)
    tl.store(da_ptr + rows[:, None] * (H * BT) + h * BT + t[None, :], dp, mask=valid[:, None])


@autotune(name="gla", configs=_warps((1, 2, 4, 8)), key=["K", "BT", "PREC"])
@triton.jit
def _intra_grads(q_ptr, k_ptr, gc_ptr, da_ptr, dq_ptr, dk_ptr, dq_out_ptr, dk_out_ptr, dgt_ptr, chunk_start_ptr,
                 chunk_end_ptr, H, G, K, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """Sub-chunk i of one chunk and head: dq and dk through the chunk's scores plus their state paths (dq_ptr,
    dk_ptr: fp32, from _grads_inter) into dq_out, dk_out (per query head), and dG = q o dq - k o dk (dgt [tokens,
    H, K] fp32)."""
    i, c, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos = tl.load(chunk_start_ptr + c), tl.load(chunk_end_ptr + c)
    rows, valid = _sub_chunk(bos, eos, i, BC)
    if bos + i * BC < eos:
        ck, t = tl.arange(0, BK), tl.arange(0, BC)
        q, gi, ref = _sub_chunk_queries(q_ptr, gc_ptr, rows, valid, bos + i * BC, eos, h, H, K, ck)  # ref: dq's
        k = _load_rows_raw(k_ptr + (h // G) * K, rows, valid, (H // G) * K, 0, ck, K)
        end = _row(gc_ptr + h * K, tl.minimum(bos + i * BC + BC, eos) - 1, eos, H * K, ck, K)  # dk's: i's last
        at = rows[:, None] * (H * K) + h * K + ck[None, :]
        mask = valid[:, None] & (ck[None, :] < K)
        da_rows = da_ptr + h * BT + t[None, :]
        dq = tl.zeros((BC, BK), tl.float32)  # times exp(G - ref) below
        dk = tl.zeros((BC, BK), tl.float32)  # times exp(end - G) below
        for j in tl.static_range(BT // BC):
            rows_j = bos + j * BC + t
            valid_j = rows_j < eos
            if j < i:  # earlier sub-chunks' keys
                da = tl.load(da_rows + rows[:, None] * (H * BT) + j * BC, mask=valid[:, None], other=0.0)
                kj = _load_rows_raw(k_ptr + (h // G) * K, rows_j, valid_j, (H // G) * K, 0, ck, K)
                gj = _load_rows_raw(gc_ptr + h * K, rows_j, valid_j, H * K, 0, ck, K)
                dq = _dot(_operand(da, kj, PREC), _operand(kj.to(tl.float32) * tl.exp(ref[None, :] - gj), kj,
                                                           PREC), PREC, dq)
            elif j > i and bos + j * BC < eos:  # later sub-chunks' queries
                da = tl.load(da_rows + rows_j[:, None] * (H * BT) + i * BC, mask=valid_j[:, None], other=0.0)
                qj = _load_rows_raw(q_ptr + h * K, rows_j, valid_j, H * K, 0, ck, K)
                gj = _load_rows_raw(gc_ptr + h * K, rows_j, valid_j, H * K, 0, ck, K)
                q_end = tl.where(valid_j[:, None], qj.to(tl.float32) * tl.exp(gj - end[None, :]), 0.0)
                dk = _dot(_operand(tl.trans(da), qj, PREC), _operand(q_end, qj, PREC), PREC, dk)
        qf, kf = q.to(tl.float32), k.to(tl.float32)
        if _factors(gi, ref, valid) & _factors(gi, end, valid):  # the diagonal block in fp32 products
            da = tl.load(da_rows + rows[:, None] * (H * BT) + i * BC, mask=valid[:, None] & (t[:, None] >= t[None, :]),
                         other=0.0)
            k_ref = tl.where(valid[:, None], kf * tl.exp(ref[None, :] - gi), 0.0)
            q_end = tl.where(valid[:, None], qf * tl.exp(gi - end[None, :]), 0.0)
            dq = tl.where(valid[:, None], tl.dot(da, k_ref, dq, input_precision="tf32x3") * tl.exp(gi - ref[None, :]),
                          0.0)
            dk = tl.where(valid[:, None],
                          tl.dot(tl.trans(da), q_end, dk, input_precision="tf32x3") * tl.exp(end[None, :] - gi), 0.0)
        else:  # one token of it at a time
            dq = tl.where(valid[:, None], dq * tl.exp(gi - ref[None, :]), 0.0)
            dk = tl.where(valid[:, None], dk * tl.exp(end[None, :] - gi), 0.0)
            for s in range(BC):
                row = bos + i * BC + s
                k_s = _row(k_ptr + (h // G) * K, row, eos, (H // G) * K, ck, K)
                q_s = _row(q_ptr + h * K, row, eos, H * K, ck, K)
                g_s = _row(gc_ptr + h * K, row, eos, H * K, ck, K)
                da_col = tl.load(da_ptr + rows * (H * BT) + h * BT + i * BC + s, mask=valid & (t >= s), other=0.0)
                da_row = tl.load(da_ptr + row.to(tl.int64) * (H * BT) + h * BT + i * BC + t,
                                 mask=(t <= s) & (t * 0 + row < eos), other=0.0)
                later, earlier = (t >= s)[:, None], (t <= s)[:, None]
                # outside the triangle an exponent could overflow: it is zeroed before the exponential, and the
                # product dropped after it (0 * NaN)
                dq += tl.where(later, da_col[:, None] * k_s[None, :] * tl.exp(tl.where(later, gi - g_s[None, :], 0.0)),
                               0.0)
                dk += tl.where(earlier,
                               da_row[:, None] * q_s[None, :] * tl.exp(tl.where(earlier, g_s[None, :] - gi, 0.0)), 0.0)
        dq += tl.load(dq_ptr + at, mask=mask, other=0.0)
        dk += tl.load(dk_ptr + at, mask=mask, other=0.0)
        tl.store(dq_out_ptr + at, dq.to(dq_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dk_out_ptr + at, dk.to(dk_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dgt_ptr + at, qf * dq - kf * dk, mask=mask)


@triton.jit
def _reverse_gate_sums(dgt_ptr, carry_ptr, dg_ptr, seq_first_ptr, chunk_start_ptr, chunk_end_ptr, H, K,
                       BT: tl.constexpr, BK: tl.constexpr):
    """dg_t = the sum of dG_s over s >= t in t's sequence, plus the final state's term (carry [N, H, K]), for one
    sequence, head and [BK] keys, last chunk first. The running total is compensated (Kahan): the terms cancel, and
    a sequence holds up to ~10^5 of them."""
    n, h, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ck = i_k * BK + tl.arange(0, BK)
    total = tl.load(carry_ptr + (n * H + h) * K + ck, mask=ck < K, other=0.0)
    lost = tl.zeros((BK,), tl.float32)
    first, last, bos, eos = _sequence(seq_first_ptr, chunk_start_ptr, chunk_end_ptr, n)
    for i in range(first, last):
        c = first + last - 1 - i
        rows = bos + (c - first) * BT + tl.arange(0, BT)
        mask = (rows < eos)[:, None] & (ck[None, :] < K)
        at = rows[:, None].to(tl.int64) * (H * K) + h * K + ck[None, :]
        x = tl.load(dgt_ptr + at, mask=mask, other=0.0)
        suffix = tl.cumsum(x, 0, reverse=True)
        tl.store(dg_ptr + at, (suffix + (total - lost)[None, :]).to(dg_ptr.dtype.element_ty), mask=mask)
        y = tl.sum(x, 0) - lost
        t = total + y
        lost = (t - total) - y
        total = t


# --- launchers ---------------------------------------------------------------------------------------------


def _cumulative(g, table, chunk):
    heads, K = g.shape[2], g.shape[3]
    out = torch.empty(g.shape, dtype=torch.float32, device=g.device)
    _fast(_cumulative_gates)[(table[4], heads)](g, out, table[1], table[2], heads, K, BT=chunk, BK=_pow2(K))
    return out


def _scores(q, k, gc, table, chunk, prec, poison):
    B, T, heads, K = q.shape
    scores = _empty((B, T, heads, chunk), torch.float32, q.device, poison)
    _fast(_intra_scores)[(chunk // 16, table[4], heads)](q, k, gc, scores, table[1], table[2], heads,
                                                         heads // k.shape[2], K, BT=chunk, BK=_pow2(K), PREC=prec)
    return scores


def forward(config, q, k, v, g, s_init, cu_seqlens, scale, chunk, final, keep_scores=False):
    """(o, s_fin); with keep_scores ((o, s_fin), scores): the chunks' masked scores, which the backward then
    reads instead of recomputing them (fp32 [B, T, H, chunk], half the size of q in bf16 at K 128)."""
    B, T, heads, _ = q.shape
    K, V, bk = _linear._head_dims(q, v)
    table = chunk_table(B, T, cu_seqlens, chunk, q.device)
    prec = _linear.precision(config, q.dtype)
    gc = _cumulative(g, table, chunk)
    states, s_fin, flags = _linear._run_scan(config, k, v, gc, s_init, table, chunk, 1.0, False, final, prec,
                                             key_gates=True)
    scores = _scores(q, k, gc, table, chunk, prec, config.poison_outputs)
    o = _empty((*q.shape[:3], V), v.dtype, v.device, config.poison_outputs)
    n_chunks = table[4]
    _fast(_linear._output)[lambda meta: (triton.cdiv(V, meta["BV"]), n_chunks, heads)](
        q, k, v, gc, states, flags, o, scores, table[1], table[2], float(scale), heads, heads // k.shape[2], K, V,
        _work(n_chunks, heads), flags.shape[2], BT=chunk, BK=min(bk, 64), PREC=prec,
        FLAGS=max(2, _pow2(flags.shape[2])), KEY_GATES=True)
    return ((o, s_fin), scores) if keep_scores else (o, s_fin)


def backward(config, do, ds_fin, q, k, v, g, s_init, cu_seqlens, scale, chunk, scores=None):
    """(dq, dk, dv, dg, ds_init); ds_init None without s_init. scores: the forward's (keep_scores), else
    recomputed."""
    B, T, heads, K = q.shape
    V, bk = v.shape[3], _pow2(K)
    table = chunk_table(B, T, cu_seqlens, chunk, q.device)
    prec = _linear.grad_precision(config, q.dtype)
    poison, n_chunks = config.poison_outputs, table[4]
    do = do.contiguous()
    gc = _cumulative(g, table, chunk)
    run = _linear._run_scan
    states, s_fin, _ = run(config, k, v, gc, s_init, table, chunk, 1.0, False, ds_fin is not None, prec,
                           key_gates=True)
    dstates, ds_init, _ = run(config, q, do, gc, ds_fin, table, chunk, scale, True, s_init is not None, prec,
                              key_gates=True)
    if scores is None:
        scores = _scores(q, k, gc, table, chunk, prec, poison)
    group = heads // k.shape[2]
    dq_state = _empty(q.shape, torch.float32, q.device, poison)  # the state paths of dq and dk
    dk_state = _empty(q.shape, torch.float32, k.device, poison)
    dv = _empty((*q.shape[:3], V), torch.float32 if group > 1 else v.dtype, v.device, poison)
    da = _empty((B, T, heads, chunk), torch.float32, q.device, poison)
    _fast(_grads_inter)[(n_chunks, heads)](
        q, k, v, gc, do, scores, states, dstates, dq_state, dk_state, dv, da, table[1], table[2], float(scale),
        heads, group, K, V, BT=chunk, BK=bk, BV=min(32, _pow2(V)), PREC=prec, num_warps=8 if bk > 64 else 4)
    dq = _empty(q.shape, q.dtype, q.device, poison)
    dk = _empty(q.shape, torch.float32 if group > 1 else k.dtype, k.device, poison)  # GQA: summed below
    dgt = _empty((B, T, heads, K), torch.float32, g.device, poison)
    _fast(_intra_grads)[(chunk // 16, n_chunks, heads)](q, k, gc, da, dq_state, dk_state, dq, dk, dgt, table[1],
                                                         table[2], heads, group, K, BT=chunk, BK=bk, PREC=prec)
    if group > 1:
        dk = dk.view(B, T, heads // group, group, K).sum(3).to(k.dtype)
        dv = dv.view(B, T, heads // group, group, V).sum(3).to(v.dtype)
    # the final state reads every gate of its sequence, per key row: its term starts each sequence's sum
    carry = (s_fin * ds_fin).sum(-1) if ds_fin is not None else torch.zeros((table[3], heads, K), device=g.device)
    dg = _empty(g.shape, g.dtype, g.device, poison)
    bk_sum = min(bk, 64)
    _fast(_reverse_gate_sums)[(table[3], heads, triton.cdiv(K, bk_sum))](
        dgt, carry.contiguous(), dg, table[0], table[1], table[2], heads, K, BT=chunk, BK=bk_sum)
    return dq, dk, dv, dg, ds_init


def recurrent(config, q, k, v, g, s_init, scale):
    B, T, heads, _ = q.shape
    K, V, bk = _linear._head_dims(q, v)
    q, k, v, g = (t.contiguous() for t in (q, k, v, g))
    o = _empty((B, T, heads, V), v.dtype, v.device, config.poison_outputs)
    s_fin = torch.empty((B, heads, K, V), dtype=torch.float32, device=q.device)
    bv = min(32, max(16, _pow2(V)))
    _fast(_linear._step)[(triton.cdiv(V, bv), B * heads)](
        q, k, v, g, s_init.contiguous() if s_init is not None else s_fin, o, s_fin, float(scale), T, heads,
        heads // k.shape[2], K, V, HAS_INIT=s_init is not None, BK=bk, BV=bv, KEY_GATES=True, num_warps=4)
    return o, s_fin
